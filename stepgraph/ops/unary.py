"""Unary family: elementwise math of one float tensor (exp, log, sqrt, sin, ...).

One op, `unary`, whose attrs kind names the function; every kind is an instruction of the
generated pointwise kernels (ops/pointwise.py PROGRAM_OPS, backends/cuda/pointwise.py), so a
lone node and a fused group run the same code. Negation, reciprocal and square are the
`scalar` op's mul -1, rdiv 1 and pow 2; relu, sigmoid and tanh are `act` kinds.

The VJPs emit `unary`, `scalar` and `binary` nodes, PyTorch's derivatives: at points where
the function has none (abs and sign at 0), abs' gradient is g * sign(x) (0 at 0) and the
piecewise constant kinds' (sign, floor, ceil, round, trunc) is 0, as PyTorch's.
"""
from __future__ import annotations

import math

import numpy as np

from ..ir.graph import FLOAT_DTYPES
from ..ir.ops import _need, defop, impl, vjp
from .erf import erf

UNARY_KINDS = ("exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "abs", "sign", "sin", "cos",
               "erf", "floor", "ceil", "round", "trunc")
# Piecewise constant: zero gradient (PyTorch's).
_FLAT = ("sign", "floor", "ceil", "round", "trunc")


@defop("unary")
def _unary(ins, attrs):
    """y = kind(x) elementwise, kind in UNARY_KINDS (rsqrt = 1 / sqrt(x); round: half to
    even); x a float value, y of its shape and dtype."""
    x = ins[0]
    _need(attrs["kind"] in UNARY_KINDS, "unary", f"unknown kind {attrs['kind']!r}")
    _need(x.dtype in FLOAT_DTYPES, "unary", f"{attrs['kind']} of a {x.dtype} tensor "
          "(float dtypes only)")
    return [(x.shape, x.dtype)]


def _mul(emit, a, b):
    return emit("binary", [a, b], kind="mul")[0]


def _div(emit, a, b):
    return emit("binary", [a, b], kind="div")[0]


def _scalar(emit, x, kind: str, value: float):
    return emit("scalar", [x], kind=kind, value=float(value))[0]


def _unary_call(emit, x, kind: str):
    return emit("unary", [x], kind=kind)[0]


@vjp("unary")
def _unary_vjp(emit, node, dy, wants) -> list:
    (g,), x, y, kind = dy, node.inputs[0], node.outputs[0], node.attrs["kind"]
    if kind == "exp":                           # y' = y
        return [_mul(emit, g, y)]
    if kind == "log":                           # 1 / x
        return [_div(emit, g, x)]
    if kind == "log1p":                         # 1 / (1 + x)
        return [_div(emit, g, _scalar(emit, x, "add", 1.0))]
    if kind == "expm1":     # exp(x), not y + 1: that cancels to eps where y is near -1 (elu)
        return [_mul(emit, g, _unary_call(emit, x, "exp"))]
    if kind == "sqrt":                          # 1 / (2 y)
        return [_div(emit, g, _scalar(emit, y, "mul", 2.0))]
    if kind == "rsqrt":                         # -y^3 / 2 = -0.5 * y / x
        return [_mul(emit, g, _scalar(emit, _div(emit, y, x), "mul", -0.5))]
    if kind == "abs":
        return [_mul(emit, g, _unary_call(emit, x, "sign"))]
    if kind in _FLAT:
        return [_scalar(emit, g, "mul", 0.0)]
    if kind == "sin":
        return [_mul(emit, g, _unary_call(emit, x, "cos"))]
    if kind == "cos":
        return [_scalar(emit, _mul(emit, g, _unary_call(emit, x, "sin")), "mul", -1.0)]
    # erf: 2 / sqrt(pi) * exp(-x^2)
    gauss = _unary_call(emit, _scalar(emit, _mul(emit, x, x), "mul", -1.0), "exp")
    return [_mul(emit, g, _scalar(emit, gauss, "mul", 2.0 / math.sqrt(math.pi)))]


_UFUNCS = {"exp": np.exp, "log": np.log, "log1p": np.log1p, "expm1": np.expm1,
           "sqrt": np.sqrt, "abs": np.abs, "sign": np.sign, "sin": np.sin, "cos": np.cos,
           "floor": np.floor, "ceil": np.ceil, "round": np.rint, "trunc": np.trunc}


@impl("unary")
def _unary_impl(node, ins, outs, ctx):
    kind, x = node.attrs["kind"], ins[0]
    if kind == "rsqrt":                          # two roundings, as 1 / sqrt(x) in the kernel
        np.divide(x.dtype.type(1), np.sqrt(x), out=outs[0])
    elif kind == "erf":
        outs[0][...] = erf(x, outs[0].dtype)     # in float64, rounded once to the output's
    else:
        _UFUNCS[kind](x, out=outs[0])
