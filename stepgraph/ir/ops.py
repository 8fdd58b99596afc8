"""The op registry: every op's shape rule, VJP rule and NumPy reference, by op name.

Ops are defined in family modules under `stepgraph/ops/`, each registering, side by side, its
shape rule (`defop`; the docstring is the op's contract), its VJP (`vjp`) and its NumPy
reference (`impl`). Nothing here knows any op: this module only holds the three tables, so
that the IR, autodiff and the NumPy backend read them without importing a family (and the
families import nothing of theirs). Importing `stepgraph` imports every family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ShapeError
from .graph import Node, Value

Shape = tuple[int, ...]
OutSpec = tuple[Shape, str]
Emit = Callable[..., list[Value]]   # emit(op, inputs, **attrs) -> outputs (a VJP's node maker)
# A NumPy reference: impl(node, ins, outs, ctx) writes into the preallocated outs.
Impl = Callable[[Node, list, list, Any], None]


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: Callable[[list[Value], dict], list[OutSpec]]
    doc: str
    # Input positions written in place, as a function of attrs (multi-tensor updates).
    mutates: Callable[[dict], tuple[int, ...]] = lambda attrs: ()


OPS: dict[str, OpDef] = {}
# rule(emit, node, dy, wants) -> one gradient per input (None where the input needs none);
# wants(i) says whether input i needs one, so no node is emitted for gradients nobody reads.
VJPS: dict[str, Callable] = {}
IMPLS: dict[str, Impl] = {}


def defop(name: str, mutates=None):
    """Register the decorated function as op `name`'s shape rule: infer(ins, attrs) -> one
    (shape, dtype) per output. `mutates(attrs)` gives the input positions written in place."""
    def register(infer):
        OPS[name] = OpDef(name, infer, (infer.__doc__ or "").strip(),
                          mutates or (lambda attrs: ()))
        return infer
    return register


def vjp(op: str):
    """Register the decorated rule as op `op`'s VJP: it emits ordinary nodes, never closures."""
    def register(rule):
        VJPS[op] = rule
        return rule
    return register


def impl(op: str):
    """Register the decorated function as op `op`'s NumPy reference."""
    def register(fn):
        IMPLS[op] = fn
        return fn
    return register


def infer_outputs(op: str, inputs: list[Value], attrs: dict) -> list[OutSpec]:
    """The (shape, dtype) of each output of op `op` on `inputs`; ShapeError where they don't fit."""
    if op not in OPS:
        raise KeyError(f"unknown op {op!r}")
    return OPS[op].infer(inputs, attrs)


def _need(cond: bool, op: str, what: str):
    if not cond:
        raise ShapeError(f"{op}: {what}")
