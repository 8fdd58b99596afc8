"""LayerNorm family: normalisation over the last axis and its gradient (PyTorch's
F.layer_norm with normalized_shape = the last dim).

x (any rank >= 1) is viewed as (rows, C). The statistics are saved for the backward. The
NumPy reference computes in float64 and casts once.
"""
from __future__ import annotations

import math

import numpy as np

from ..ir.ops import _need, defop, impl, vjp


def _rows(shape) -> int:
    return math.prod(shape[:-1])


def stats_dtype(dtype: str) -> str:
    """The dtype of the saved statistics: float32, or float64 for a float64 input (the NumPy
    reference's exact mode)."""
    return "float64" if dtype == "float64" else "float32"


@defop("layer_norm")
def _layer_norm(ins, attrs):
    """y = (x - mean) * rstd * weight + bias over the last axis of x (any rank >= 1; rows =
    the product of the leading dims); ins (x, [weight (C,) when attrs weight], [bias (C,)
    when attrs bias]); attrs eps. mean = the row mean, rstd = 1 / sqrt(biased var + eps).
    Outputs y (x.shape, x.dtype), mean (rows,), rstd (rows,) (float32; float64 for a float64
    x). Statistics in float32 with two passes (the NumPy reference in float64)."""
    x = ins[0]
    _need(len(x.shape) >= 1, "layer_norm", f"input must have rank >= 1, got {x.shape}")
    want = 1 + bool(attrs.get("weight")) + bool(attrs.get("bias"))
    _need(len(ins) == want, "layer_norm", f"{want} inputs for weight={attrs.get('weight')}, "
          f"bias={attrs.get('bias')}, got {len(ins)}")
    for v in ins[1:]:
        _need(v.shape == (x.shape[-1],) and v.dtype == x.dtype, "layer_norm",
              f"{v!r} must be ({x.shape[-1]},) {x.dtype} for input {x.shape}")
    stats = ((_rows(x.shape),), stats_dtype(x.dtype))
    return [(x.shape, x.dtype), stats, stats]


@defop("layer_norm_grad")
def _layer_norm_grad(ins, attrs):
    """Gradient of layer_norm. ins (dy, x, [weight when attrs weight], mean, rstd); attrs
    weight, bias as the forward's. xhat = (x - mean) * rstd, g = dy * weight (dy without
    weight); per row dx = rstd * (g - mean(g) - xhat * mean(g * xhat)). Outputs dx, then
    dweight = sum over rows of dy * xhat when attrs weight, dbias = sum over rows of dy when
    attrs bias."""
    dy, x = ins[0], ins[1]
    weight, bias = bool(attrs.get("weight")), bool(attrs.get("bias"))
    _need(len(ins) == 4 + weight, "layer_norm_grad",
          f"{4 + weight} inputs for weight={weight}, got {len(ins)}")
    _need(dy.shape == x.shape, "layer_norm_grad", f"dy {dy.shape} vs x {x.shape}")
    c = (x.shape[-1],)
    return [(x.shape, x.dtype)] + [(c, x.dtype)] * (weight + bias)


@vjp("layer_norm")
def _layer_norm_vjp(emit, node, dy, wants) -> list:
    weight, bias = bool(node.attrs.get("weight")), bool(node.attrs.get("bias"))
    x, (_, mean, rstd) = node.inputs[0], node.outputs
    ins = [dy[0], x] + ([node.inputs[1]] if weight else []) + [mean, rstd]
    return emit("layer_norm_grad", ins, weight=weight, bias=bias)


@impl("layer_norm")
def _layer_norm_impl(node, ins, outs, ctx):
    a, x = node.attrs, ins[0].astype(np.float64)
    rest = list(ins[1:])
    mean = x.mean(axis=-1, keepdims=True)
    var = np.square(x - mean).mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + a["eps"])
    y = (x - mean) * rstd
    if a.get("weight"):
        y = y * rest.pop(0)
    if a.get("bias"):
        y = y + rest.pop(0)
    outs[0][...] = y
    outs[1][...] = mean.reshape(-1)
    outs[2][...] = rstd.reshape(-1)


@impl("layer_norm_grad")
def _layer_norm_grad_impl(node, ins, outs, ctx):
    a = node.attrs
    weight, bias = bool(a.get("weight")), bool(a.get("bias"))
    dy, x = ins[0].astype(np.float64), ins[1].astype(np.float64)
    c = x.shape[-1]
    mean = ins[-2].astype(np.float64).reshape(x.shape[:-1] + (1,))
    rstd = ins[-1].astype(np.float64).reshape(x.shape[:-1] + (1,))
    xhat = (x - mean) * rstd
    g = dy * ins[2].astype(np.float64) if weight else dy
    outs[0][...] = rstd * (g - g.mean(axis=-1, keepdims=True)
                           - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    rest = list(outs[1:])
    if weight:
        rest.pop(0)[...] = (dy * xhat).reshape(-1, c).sum(axis=0)
    if bias:
        rest.pop(0)[...] = dy.reshape(-1, c).sum(axis=0)
