"""Cast family: conversion between float dtypes, as the autocast pass (compile/autocast.py)
inserts it for precision="bf16".

float32 -> bfloat16 rounds to nearest even (backends/numpy/bf16.py states the rule; NaN stays
NaN, overflow gives inf); bfloat16 -> float32 is exact. The gradient of a cast is the cast back
(PyTorch's `.to(dtype)` backward): a weight's bf16 gradient reaches the optimizer as float32.
"""
from __future__ import annotations

from ..ir.graph import FLOAT_DTYPES
from ..ir.ops import _need, defop, impl, vjp


@defop("cast")
def _cast(ins, attrs):
    """y = x converted to attrs dtype (a float dtype; x a float value of any shape):
    float32 -> bfloat16 rounds to nearest, ties to even; bfloat16 -> float32 and float32 ->
    float64 are exact; float64 -> float32 rounds to nearest."""
    x, dtype = ins[0], attrs["dtype"]
    _need(x.dtype in FLOAT_DTYPES and dtype in FLOAT_DTYPES, "cast",
          f"float dtypes only, got {x.dtype} -> {dtype}")
    return [(x.shape, dtype)]


@vjp("cast")
def _cast_vjp(emit, node, dy, wants) -> list:
    return [emit("cast", [dy[0]], dtype=node.inputs[0].dtype)[0]]


@impl("cast")
def _cast_impl(node, ins, outs, ctx):
    # A bf16 output is a float32 scratch here that the backend rounds when the node finishes
    # (NumpyBackend.run_node); a bf16 input arrives widened. So this is a copy.
    outs[0][...] = ins[0]
