"""Cast family: conversion between dtypes, as the autocast pass (compile/autocast.py) inserts
it for precision="bf16" and as a model's `.to(dtype)`, `.float()`, `.long()`, `.bool()` ask.

float32 -> bfloat16 rounds to nearest even (backends/numpy/bf16.py states the rule; NaN stays
NaN, overflow gives inf); bfloat16 -> float32 is exact. The gradient of a cast is the cast back
(PyTorch's `.to(dtype)` backward): a weight's bf16 gradient reaches the optimizer as float32.
Casts to and from int32, int64 and bool follow NumPy's astype: float -> int truncates toward
zero, nonzero -> True, True -> 1; they carry no gradient (an integer or bool value has none).
"""
from __future__ import annotations

from ..ir.graph import FLOAT_DTYPES
from ..ir.ops import _need, defop, impl, vjp


CAST_DTYPES = (*FLOAT_DTYPES, "int32", "int64", "bool")


@defop("cast")
def _cast(ins, attrs):
    """y = x converted to attrs dtype (x of any shape; both dtypes in CAST_DTYPES):
    float32 -> bfloat16 rounds to nearest, ties to even; bfloat16 -> float32 and float32 ->
    float64 are exact; float64 -> float32 rounds to nearest; to an int dtype truncates toward
    zero; to bool gives x != 0; from bool gives 1 or 0."""
    x, dtype = ins[0], attrs["dtype"]
    _need(x.dtype in CAST_DTYPES and dtype in CAST_DTYPES, "cast",
          f"dtypes {CAST_DTYPES} only, got {x.dtype} -> {dtype}")
    return [(x.shape, dtype)]


@vjp("cast")
def _cast_vjp(emit, node, dy, wants) -> list:
    if node.inputs[0].dtype not in FLOAT_DTYPES:
        return [None]
    return [emit("cast", [dy[0]], dtype=node.inputs[0].dtype)[0]]


@impl("cast")
def _cast_impl(node, ins, outs, ctx):
    # A bf16 output is a float32 scratch here that the backend rounds when the node finishes
    # (NumpyBackend.run_node); a bf16 input arrives widened. So this is a copy, converting
    # as astype does.
    outs[0][...] = ins[0]
