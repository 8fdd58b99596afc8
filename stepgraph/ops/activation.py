"""Activation family: act (relu, leaky_relu, sigmoid, tanh, gelu, gelu_tanh, silu), its
gradient, and the fused gradient + bias gradient a backward GEMM's epilogue takes.
`act_forward` / `act_derivative` are the NumPy formulas the linear and pool families reuse.
"""
from __future__ import annotations

import math

import numpy as np

from ..ir.graph import Node
from ..ir.ops import _need, defop, impl, vjp
from .erf import erf

ACTIVATIONS = ("relu", "leaky_relu", "sigmoid", "tanh", "gelu", "gelu_tanh", "silu")
# Activations whose derivative is computed from the output y; the others need the input z.
GRAD_FROM_OUTPUT = ("relu", "sigmoid", "tanh")


@defop("act")
def _act(ins, attrs):
    """y = kind(x) elementwise; kind in ACTIVATIONS, leaky_relu uses attrs["slope"];
    gelu is the exact erf form, gelu_tanh the tanh approximation, silu x * sigmoid(x)."""
    _need(attrs["kind"] in ACTIVATIONS, "act", f"unknown activation {attrs['kind']}")
    return [(ins[0].shape, ins[0].dtype)]


@defop("act_grad")
def _act_grad(ins, attrs):
    """dx = dy * kind'(.) where saved = y for GRAD_FROM_OUTPUT kinds, else the input z."""
    dy, saved = ins
    _need(dy.shape == saved.shape, "act_grad", f"{dy.shape} vs {saved.shape}")
    return [(dy.shape, dy.dtype)]


@defop("act_bias_grad")
def _act_bias_grad(ins, attrs):
    """Fused: dz = act_grad(dy, saved) (kind "none": dz = dy); db = dz.sum(axis 0).
    (N,M)->(N,M),(M,)"""
    dy = ins[0]
    return [(dy.shape, dy.dtype), ((dy.shape[1],), dy.dtype)]


@vjp("act")
def _act_vjp(emit, node: Node, dy: list, wants) -> list:
    kind = node.attrs["kind"]
    saved = node.outputs[0] if kind in GRAD_FROM_OUTPUT else node.inputs[0]
    return [emit("act_grad", [dy[0], saved], kind=kind, slope=node.attrs["slope"])[0]]


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def act_forward(z: np.ndarray, kind: str, slope: float = 0.01) -> np.ndarray:
    if kind == "relu":
        return np.maximum(z, 0)
    if kind == "leaky_relu":
        return np.where(z > 0, z, z * z.dtype.type(slope))
    if kind == "sigmoid":
        return 1 / (1 + np.exp(-z))
    if kind == "tanh":
        return np.tanh(z)
    if kind == "gelu":
        return (0.5 * z * (1 + erf(z / math.sqrt(2.0), z.dtype))).astype(z.dtype)
    if kind == "gelu_tanh":
        return 0.5 * z * (1 + np.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z**3)))
    if kind == "silu":
        return z / (1 + np.exp(-z))
    raise ValueError(f"unknown activation {kind!r}")


def act_derivative(saved: np.ndarray, kind: str, slope: float = 0.01) -> np.ndarray:
    """d act / d z, from y for relu/sigmoid/tanh and from z otherwise (GRAD_FROM_OUTPUT)."""
    one = saved.dtype.type(1)
    if kind == "relu":
        return (saved > 0).astype(saved.dtype)
    if kind == "leaky_relu":
        return np.where(saved > 0, one, saved.dtype.type(slope))
    if kind == "sigmoid":
        return saved * (1 - saved)
    if kind == "tanh":
        return 1 - saved * saved
    if kind == "gelu":
        z = saved.astype(np.float64)
        cdf = 0.5 * (1 + erf(z / math.sqrt(2.0), saved.dtype))
        pdf = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
        return (cdf + z * pdf).astype(saved.dtype)
    if kind == "gelu_tanh":
        z = saved
        inner = _SQRT_2_OVER_PI * (z + 0.044715 * z**3)
        t = np.tanh(inner)
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * z * z)
    if kind == "silu":                      # d/dz z s(z) = s(z) (1 + z (1 - s(z)))
        s = 1 / (1 + np.exp(-saved))
        return s * (1 + saved * (1 - s))
    raise ValueError(f"unknown activation {kind!r}")


@impl("act")
def act(node: Node, ins, outs, ctx):
    outs[0][...] = act_forward(ins[0], node.attrs["kind"], node.attrs.get("slope", 0.01))


@impl("act_grad")
def act_grad(node: Node, ins, outs, ctx):
    dy, saved = ins
    outs[0][...] = dy * act_derivative(saved, node.attrs["kind"], node.attrs.get("slope", 0.01))


@impl("act_bias_grad")
def act_bias_grad(node: Node, ins, outs, ctx):
    dy, saved = ins
    kind = node.attrs["kind"]
    dz = dy if kind == "none" else dy * act_derivative(saved, kind, node.attrs.get("slope", 0.01))
    outs[0][...] = dz
    outs[1][...] = dz.sum(axis=0)
