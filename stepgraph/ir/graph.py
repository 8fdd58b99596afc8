"""The IR: values, nodes and graphs.

A `Graph` is a straight-line program. Every `Value` is written by exactly one node (or is an
external: an input, a parameter or a piece of optimizer state). Nodes that update state in
place list the inputs they write in `mutates`; the planner schedules them after every reader.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Roles of external values (DESIGN.md, "Roles and the graph cache").
INPUT, PARAM, STATE = "input", "param", "state"
EXTERNAL_ROLES = (INPUT, PARAM, STATE)
# Intermediates computed inside the step.
TEMP = "temp"

# bfloat16 (precision="bf16", compile/autocast.py): 1 sign, 8 exponent, 7 mantissa bits, two
# bytes an element in the planner's arena. NumPy and CuPy have no bfloat16, so backends hold it
# as its raw bits in uint16 arrays (`storage_dtype`); kernels widen to float32 on load and
# round to nearest even on store (backends/numpy/bf16.py has the reference conversions).
BF16 = "bfloat16"
# float16 (torch.half: autocast(dtype=torch.float16), precision="fp16", model.half()): 1 sign,
# 5 exponent, 10 mantissa bits; NumPy has it natively, so it is its own storage. Kernels widen
# to float32 on load and round on store, as for bf16 (backends/numpy/backend.py).
FP16 = "float16"
# The 16-bit float dtypes: computed in float32, rounded once where a node stores them.
HALF_DTYPES = (BF16, FP16)
# bool: comparison results and masks (torch.bool), one byte an element as NumPy's and CuPy's.
DTYPES = ("float32", "float64", "int32", "int64", "uint8", "bool", BF16, FP16)
FLOAT_DTYPES = ("float32", "float64", BF16, FP16)


def storage_dtype(dtype: str) -> str:
    """The NumPy/CuPy dtype a backend holds values of IR dtype `dtype` in."""
    return "uint16" if dtype == BF16 else dtype


def ir_dtype(storage) -> str:
    """The IR dtype of values a backend holds in `storage` (a NumPy/CuPy dtype or its name):
    uint16 storage is bfloat16 (no IR dtype is uint16); the others are their own names."""
    name = str(storage)
    return BF16 if name == "uint16" else name


def itemsize(dtype: str) -> int:
    """Bytes per element of IR dtype `dtype` (bfloat16: 2)."""
    return np.dtype(storage_dtype(dtype)).itemsize

_ids = itertools.count()


@dataclass(eq=False)
class Value:
    """A typed tensor slot in a graph. Identity is the object itself."""

    shape: tuple[int, ...]
    dtype: str
    role: str = TEMP
    name: str = ""
    id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self):
        self.shape = tuple(int(d) for d in self.shape)
        if self.dtype not in DTYPES:
            raise TypeError(f"unsupported dtype {self.dtype!r} for value {self.name or self.id}")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * itemsize(self.dtype)

    @property
    def is_external(self) -> bool:
        return self.role in EXTERNAL_ROLES

    def __repr__(self):
        label = self.name or f"v{self.id}"
        return f"%{label}:{self.dtype}{list(self.shape)}"


@dataclass(eq=False)
class Node:
    op: str
    inputs: list[Value]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    # Indices into `inputs` that this node writes in place (optimizer updates, step counter).
    mutates: tuple[int, ...] = ()
    # Where the node came from, for profiles: e.g. "Linear(784,512)+ReLU fwd".
    label: str = ""

    def __repr__(self):
        outs = ", ".join(map(repr, self.outputs))
        ins = ", ".join(map(repr, self.inputs))
        attrs = "".join(f" {k}={v}" for k, v in self.attrs.items() if not k.startswith("_"))
        return f"{outs} = {self.op}({ins}){attrs}"


@dataclass
class Graph:
    """A straight-line program over values. `outputs` name what a step returns."""

    nodes: list[Node] = field(default_factory=list)
    inputs: list[Value] = field(default_factory=list)
    params: list[Value] = field(default_factory=list)
    state: list[Value] = field(default_factory=list)
    outputs: dict[str, Value] = field(default_factory=dict)

    @property
    def externals(self) -> list[Value]:
        return self.inputs + self.params + self.state

    def producers(self) -> dict[Value, Node]:
        return {v: n for n in self.nodes for v in n.outputs}

    def consumers(self) -> dict[Value, list[Node]]:
        users: dict[Value, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                users.setdefault(v, []).append(n)
        return users

    def __str__(self):
        lines = [f"graph(inputs={self.inputs}, params={len(self.params)}, state={len(self.state)})"]
        lines += [f"  {n!r}" for n in self.nodes]
        lines += [f"  return {k} = {v!r}" for k, v in self.outputs.items()]
        return "\n".join(lines)
