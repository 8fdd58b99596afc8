"""The fused `pointwise` op: a straight-line program of elementwise ops over one output shape.

Made only by the fusion pass (compile/pointwise.py), after autodiff, so it has no VJP. Its
program reads the node's inputs (broadcast to attrs shape) as registers 0..k-1; instruction j
writes register k + j; attrs results name the registers the node's outputs hold. An input may
be read through a strided view of its elements (attrs views: per input None or (shape,
strides, offset)), as a slice or permute of it would hold them (compile/pointwise_views.py).
An output may be made of parts (a `Joined` entry of attrs results), as a concat of the
program's results and of values it reads would be (compile/pointwise_joins.py): each part's
register is stored through the strided view that part is of the output, so the concat's copy
goes.
The NumPy reference runs each instruction through the op's own reference implementation, so a
fused graph computes exactly what the unfused one did.

A dropout node becomes two instructions: `dropout_mask` (program-only: the uint8 keep mask of
the step counter register, drawn from Philox at each element's flat index in attrs shape,
exactly as the dropout op draws it, rng.py) and `dropout_grad` (x * mask / (1 - p), the
dropout op's own product). Registers hold their instruction's dtype: uint8 for a dropout mask,
bool for a comparison, int64 for the step counter input, a cast's attrs dtype, a where's
second argument's, else the first argument's.

bfloat16 (precision="bf16"): a bf16 register holds a float32 value that is exactly a bf16 value.
The unfused graph rounds every bf16 node's output once, when the node stores it; a program
keeps that: each instruction whose register is bf16 rounds its float32 result to bf16 (nearest
even, backends/numpy/bf16.py), so a fused program gives the unfused graph's bits. A cast
between float32 and bf16 is such an instruction too (a copy, then that rounding when it
narrows; widening is exact): a program may mix the two, e.g. a bf16 dropout, its cast and a
float32 residual add. Inputs are
widened exactly, and outputs stored as bits, by the backend (NumpyBackend.run_node).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..backends.numpy import bf16
from ..ir.graph import HALF_DTYPES, Node, Value
from ..ir.ops import IMPLS, _need, defop, impl
from .dropout import keep_mask
from .shape import contiguous_strides, view_fits, viewed

# Elementwise ops a program may hold: one output, the output's shape is the broadcast shape
# of the inputs, every element depends only on the same (broadcast) element of each input.
PROGRAM_OPS = ("add", "binary", "scalar", "act", "act_grad", "expand", "dropout_grad",
               "dropout_mask", "cast", "unary", "compare", "compare_scalar", "logical",
               "logical_not", "where", "masked_fill")
# Instructions whose register is not of their first argument's dtype.
_RESULT_DTYPES = {"dropout_mask": "uint8", "compare": "bool", "compare_scalar": "bool"}


@dataclass(frozen=True)
class Instr:
    op: str                        # one of PROGRAM_OPS
    args: tuple[int, ...]          # registers read
    attrs: tuple[tuple[str, Any], ...] = ()   # the original node's attrs, sorted

    @property
    def attr(self) -> dict:
        return dict(self.attrs)


@dataclass(frozen=True)
class Joined:
    """An attrs results entry: one output of `shape` made of parts, register registers[p]
    stored through views[p] = (strides, offset) over the output's elements, indexed as the
    program's shape (compile/pointwise_joins.py). The parts tile the output."""
    shape: tuple[int, ...]
    registers: tuple[int, ...]
    views: tuple[tuple[tuple[int, ...], int], ...]


def concat_joined(shape: tuple, dim: int, registers: tuple[int, ...]) -> Joined:
    """The Joined entry of `registers`, each of the program's `shape`, concatenated along
    `dim`: part p is the slice p of the output along dim."""
    joined = tuple(d * len(registers) if i == dim else d for i, d in enumerate(shape))
    strides = contiguous_strides(joined)
    return Joined(joined, tuple(registers),
                  tuple((strides, p * shape[dim] * strides[dim]) for p in range(len(registers))))


class Store(NamedTuple):
    """One register stored into output `out`: at the output's own index (view None) or
    through view (shape, strides, offset), the part of a Joined output it fills."""
    out: int
    register: int
    view: tuple | None


def result_stores(results, shape: tuple) -> list[Store]:
    """The stores of attrs results over the program's `shape`, output by output."""
    stores = []
    for j, r in enumerate(results):
        if isinstance(r, Joined):
            stores += [Store(j, reg, (tuple(shape), tuple(strides), int(offset)))
                       for reg, (strides, offset) in zip(r.registers, r.views)]
        else:
            stores.append(Store(j, int(r), None))
    return stores


def renumbered(program: tuple[Instr, ...], results, fix) -> tuple[tuple[Instr, ...], tuple]:
    """program and its results (attrs results, Joined entries too) with every register r
    read as fix(r): a program's inputs reordered, loads moved first, or an input added."""
    return (tuple(Instr(i.op, tuple(map(fix, i.args)), i.attrs) for i in program),
            tuple(Joined(r.shape, tuple(map(fix, r.registers)), r.views)
                  if isinstance(r, Joined) else fix(r) for r in results))


def _result_dtype(instr: Instr, dtypes: list[str]) -> str:
    """The dtype of instr's register, given the dtypes of the registers before it."""
    if instr.op == "cast":
        return instr.attr["dtype"]
    if instr.op == "where":                 # (cond, a, b): a's dtype
        return dtypes[instr.args[1]]
    return _RESULT_DTYPES.get(instr.op) or dtypes[instr.args[0]]


def register_dtypes(program: tuple[Instr, ...], input_dtypes: tuple[str, ...]) -> list[str]:
    """The dtype of every register of `program`: the inputs', then each instruction's."""
    dtypes = list(input_dtypes)
    for instr in program:
        dtypes.append(_result_dtype(instr, dtypes))
    return dtypes


def as_program(node: Node) -> Node:
    """A lone elementwise node (an op of PROGRAM_OPS) as the one-instruction `pointwise` node
    computing it: for the ops without a kernel of their own, and for a lone node that reads a
    view (compile/pointwise_views.py)."""
    k = len(node.inputs)
    program = (Instr(node.op, tuple(range(k)), tuple(sorted(node.attrs.items()))),)
    return Node("pointwise", list(node.inputs), list(node.outputs),
                dict(program=program, results=(k,), shape=tuple(node.outputs[0].shape)),
                (), node.label)


def input_views(attrs: dict, n: int) -> tuple:
    """attrs views, one entry an input: None (the input as it is) or (shape, strides, offset),
    the input read as that strided view of its elements (compile/pointwise_views.py)."""
    return tuple(attrs.get("views") or (None,) * n)


def read_through(view, a: np.ndarray) -> np.ndarray:
    """Array a (C-contiguous) read as view (shape, strides, offset in elements), or as it is
    where view is None."""
    return a if view is None else viewed(a, *view)


@defop("pointwise")
def _pointwise(ins, attrs):
    """outs = the registers attrs results of attrs program run elementwise over attrs shape,
    every input (or its attrs views entry) broadcast to that shape (see ops/pointwise.py)."""
    shape = tuple(attrs["shape"])
    for v, view in zip(ins, input_views(attrs, len(ins))):
        _need(view is None or view_fits(view, v.size), "pointwise",
              f"view {view} reads past input {v.shape}")
        seen = tuple(view[0]) if view is not None else v.shape
        _need(len(seen) <= len(shape) and all(
            d in (1, s) for d, s in zip(seen[::-1], shape[::-1])),
            "pointwise", f"input {seen} does not broadcast to {shape}")
    dtypes = register_dtypes(attrs["program"], tuple(v.dtype for v in ins))
    specs = []
    for r in attrs["results"]:
        if not isinstance(r, Joined):
            specs.append((shape, dtypes[r]))
            continue
        size = math.prod(r.shape)
        _need(len(r.registers) == len(r.views) >= 1 and
              len(r.registers) * math.prod(shape) == size and
              all(view_fits((shape, strides, offset), size) for strides, offset in r.views) and
              len({dtypes[x] for x in r.registers}) == 1, "pointwise",
              f"{r} does not tile an output with parts of {shape} in registers of one dtype")
        specs.append((tuple(r.shape), dtypes[r.registers[0]]))
    return specs


def _dropout_mask(node: Node, ins, outs, ctx):
    """The dropout op's keep mask over the whole output (flat index = element index)."""
    outs[0][...] = keep_mask(outs[0].shape, node.attrs["p"], node.attrs, ins[0])


_PROGRAM_IMPLS = {"dropout_mask": _dropout_mask}


@impl("pointwise")
def _pointwise_impl(node: Node, ins, outs, ctx):
    shape = tuple(node.attrs["shape"])
    program = node.attrs["program"]
    # IR dtypes of the registers; the arrays themselves are float32 for bf16 (run_node widens).
    ir_dtypes = register_dtypes(program, tuple(v.dtype for v in node.inputs))
    regs = [read_through(view, a) for view, a in
            zip(input_views(node.attrs, len(ins)), ins)]
    for instr in program:
        args = [regs[r] for r in instr.args]
        ir_dtype = ir_dtypes[len(regs)]
        dtype = "float32" if ir_dtype in HALF_DTYPES else ir_dtype
        step = Node(instr.op, [Value(np.shape(a), str(a.dtype)) for a in args],
                    [Value(shape, dtype)], instr.attr)
        out = np.empty(shape, dtype=dtype)
        (_PROGRAM_IMPLS.get(instr.op) or IMPLS[instr.op])(step, args, [out], ctx)
        if ir_dtype in HALF_DTYPES:     # the store of the unfused bf16 or float16 node
            out = bf16.round_to(out, ir_dtype)
        regs.append(out)
    for store in result_stores(node.attrs["results"], shape):
        out = outs[store.out]
        if store.view is not None:
            out = viewed(out, *store.view, writeable=True)
        out[...] = regs[store.register]


# ---- pointwise_sum: a program summed over the last axis, then a program over the sums -----

def _parts(attrs: dict) -> tuple[dict, dict | None, int]:
    """pointwise_sum's two programs as `pointwise` attrs: the prologue's (its result the
    summed register, on the first attrs n_prologue inputs) and the epilogue's (None where
    attrs epilogue is empty; its input 0 is the sums, then the remaining inputs)."""
    k = int(attrs["n_prologue"])
    shape = tuple(attrs["shape"])
    prologue = dict(program=attrs["program"], results=(int(attrs["summed"]),), shape=shape,
                    views=input_views(attrs, k))
    if not attrs["epilogue"]:
        return prologue, None, k
    return prologue, dict(program=attrs["epilogue"], results=tuple(attrs["epilogue_results"]),
                          shape=shape[:-1]), k


@defop("pointwise_sum")
def _pointwise_sum(ins, attrs):
    """The register attrs summed of attrs program (a pointwise program over attrs shape on the
    first attrs n_prologue inputs, read through attrs views) summed over the last axis, then,
    where attrs epilogue is a program, that program over the sums' shape: its register 0 is
    the sums, registers 1.. the remaining inputs; outs its attrs epilogue_results, or the sums
    alone (compile/pointwise_sums.py)."""
    prologue, epilogue, k = _parts(attrs)
    ((shape, dtype),) = _pointwise(ins[:k], prologue)
    _need(len(shape) >= 1, "pointwise_sum", "the program's shape has no axis to sum")
    _need(dtype == "float32", "pointwise_sum", f"sums float32 values, got {dtype}")
    sums = Value(shape[:-1], dtype)
    if epilogue is None:
        return [(sums.shape, dtype)]
    return _pointwise([sums, *ins[k:]], epilogue)


@impl("pointwise_sum")
def _pointwise_sum_impl(node: Node, ins, outs, ctx):
    prologue, epilogue, k = _parts(node.attrs)
    shape = tuple(prologue["shape"])
    values = np.empty(shape, np.float32)
    _pointwise_impl(Node("pointwise", node.inputs[:k], [Value(shape, "float32")], prologue),
                    ins[:k], [values], ctx)
    sums = values.sum(axis=-1)            # as reduce_sum's reference sums the stored values
    if epilogue is None:
        outs[0][...] = sums
        return
    first = Value(sums.shape, "float32")
    _pointwise_impl(Node("pointwise", [first, *node.inputs[k:]], node.outputs, epilogue),
                    [sums, *ins[k:]], outs, ctx)
