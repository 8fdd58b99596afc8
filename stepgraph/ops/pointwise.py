"""The fused `pointwise` op: a straight-line program of elementwise ops over one output shape.

Made only by the fusion pass (compile/pointwise.py), after autodiff, so it has no VJP. Its
program reads the node's inputs (broadcast to attrs shape) as registers 0..k-1; instruction j
writes register k + j; attrs results name the registers the node's outputs hold. The NumPy
reference runs each instruction through the op's own reference implementation, so a fused
graph computes exactly what the unfused one did.

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

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends.numpy import bf16
from ..ir.graph import HALF_DTYPES, Node, Value
from ..ir.ops import IMPLS, _need, defop, impl
from .dropout import keep_mask

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


@defop("pointwise")
def _pointwise(ins, attrs):
    """outs = the registers attrs results of attrs program run elementwise over attrs shape,
    every input broadcast to that shape (see ops/pointwise.py)."""
    shape = tuple(attrs["shape"])
    for v in ins:
        _need(len(v.shape) <= len(shape) and all(
            d in (1, s) for d, s in zip(v.shape[::-1], shape[::-1])),
            "pointwise", f"input {v.shape} does not broadcast to {shape}")
    dtypes = register_dtypes(attrs["program"], tuple(v.dtype for v in ins))
    return [(shape, dtypes[r]) for r in attrs["results"]]


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
    regs = list(ins)
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
    for out, r in zip(outs, node.attrs["results"]):
        out[...] = regs[r]
