"""Softmax family: softmax and its gradient over the last axis, any rank >= 1.
(log_softmax / log_softmax_grad live in ir/ops.py with the losses.)"""
from __future__ import annotations

import numpy as np

from ..autodiff.rules import vjp
from ..backends.numpy.kernels import impl
from ..ir.ops import _need, defop


@defop("softmax")
def _softmax(ins, attrs):
    """y = softmax(x) over the last axis; x any rank >= 1."""
    _need(len(ins[0].shape) >= 1, "softmax", f"input must have rank >= 1, got {ins[0].shape}")
    return [(ins[0].shape, ins[0].dtype)]


@defop("softmax_grad")
def _softmax_grad(ins, attrs):
    """dx = y * (dy - sum(dy * y, last axis, keepdims)); ins (dy, y)."""
    dy, y = ins
    _need(dy.shape == y.shape, "softmax_grad", f"dy {dy.shape} vs y {y.shape}")
    return [(dy.shape, dy.dtype)]


@vjp("softmax")
def _softmax_vjp(emit, node, dy, wants) -> list:
    return [emit("softmax_grad", [dy[0], node.outputs[0]])[0]]


@impl("softmax")
def _softmax_impl(node, ins, outs, ctx):
    x = ins[0]
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    outs[0][...] = e / e.sum(axis=-1, keepdims=True)


@impl("softmax_grad")
def _softmax_grad_impl(node, ins, outs, ctx):
    dy, y = ins
    outs[0][...] = y * (dy - (dy * y).sum(axis=-1, keepdims=True))
