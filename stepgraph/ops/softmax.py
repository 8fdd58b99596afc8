"""Softmax family: softmax and its gradient over the last axis, any rank >= 1, with an
optional scale and causal mask (attention scores); log_softmax and its gradient.

Nodes without the attrs scale / causal mean scale 1.0 and no mask."""
from __future__ import annotations

import numpy as np

from ..ir.graph import Node
from ..ir.ops import _need, defop, impl, vjp


def _check_causal(op: str, shape, attrs) -> None:
    if attrs.get("causal"):
        _need(len(shape) >= 2 and shape[-2] <= shape[-1], op,
              f"causal needs (..., rows, cols) with rows <= cols (else whole rows are "
              f"masked), got {shape}")


@defop("softmax")
def _softmax(ins, attrs):
    """y = softmax(scale * x + M) over the last axis; x any rank >= 1; attrs scale (float,
    default 1.0), causal (bool, default False): M = -inf where column > row + (cols - rows)
    over the last two dims (R rows <= C columns; with R == C PyTorch's is_causal mask, tril
    of ones(R, C)), else 0. Masked entries of y are 0; no mask tensor exists."""
    _need(len(ins[0].shape) >= 1, "softmax", f"input must have rank >= 1, got {ins[0].shape}")
    _check_causal("softmax", ins[0].shape, attrs)
    return [(ins[0].shape, ins[0].dtype)]


@defop("softmax_grad")
def _softmax_grad(ins, attrs):
    """dx = scale * y * (dy - sum(dy * y, last axis, keepdims)); ins (dy, y); attrs scale,
    causal as the forward's (masked entries get 0, which y = 0 there gives)."""
    dy, y = ins
    _need(dy.shape == y.shape, "softmax_grad", f"dy {dy.shape} vs y {y.shape}")
    _check_causal("softmax_grad", dy.shape, attrs)
    return [(dy.shape, dy.dtype)]


@vjp("softmax")
def _softmax_vjp(emit, node, dy, wants) -> list:
    extra = {k: node.attrs[k] for k in ("scale", "causal") if k in node.attrs}
    return [emit("softmax_grad", [dy[0], node.outputs[0]], **extra)[0]]


def causal_mask(rows: int, cols: int) -> np.ndarray:
    """(rows, cols) bool, True where the causal softmax masks: column > row + (cols - rows)."""
    return np.arange(cols)[None, :] > np.arange(rows)[:, None] + (cols - rows)


@impl("softmax")
def _softmax_impl(node, ins, outs, ctx):
    x = ins[0]
    scale = node.attrs.get("scale", 1.0)
    if scale != 1.0:
        x = x * x.dtype.type(scale)
    if node.attrs.get("causal"):
        x = np.where(causal_mask(*x.shape[-2:]), x.dtype.type(-np.inf), x)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    outs[0][...] = e / e.sum(axis=-1, keepdims=True)


@impl("softmax_grad")
def _softmax_grad_impl(node, ins, outs, ctx):
    dy, y = ins
    dx = y * (dy - (dy * y).sum(axis=-1, keepdims=True))
    scale = node.attrs.get("scale", 1.0)
    outs[0][...] = dx * dx.dtype.type(scale) if scale != 1.0 else dx


# ---- log_softmax ---------------------------------------------------------------------------

@defop("log_softmax")
def _log_softmax(ins, attrs):
    """y = x - logsumexp(x, last axis, keepdims); x any rank >= 1 (rows = product of the
    leading dims)."""
    _need(len(ins[0].shape) >= 1, "log_softmax", f"input must have rank >= 1, got {ins[0].shape}")
    return [(ins[0].shape, ins[0].dtype)]


@defop("log_softmax_grad")
def _log_softmax_grad(ins, attrs):
    """dx = dy - exp(y) * dy.sum(last axis, keepdims)."""
    return [(ins[0].shape, ins[0].dtype)]


@vjp("log_softmax")
def _log_softmax_vjp(emit, node: Node, dy: list, wants) -> list:
    return [emit("log_softmax_grad", [dy[0], node.outputs[0]])[0]]


def logsumexp(x: np.ndarray) -> np.ndarray:
    """logsumexp over the last axis, kept as an axis of 1."""
    m = x.max(axis=-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@impl("log_softmax")
def log_softmax(node: Node, ins, outs, ctx):
    x = ins[0]
    outs[0][...] = x - logsumexp(x)


@impl("log_softmax_grad")
def log_softmax_grad(node: Node, ins, outs, ctx):
    dy, y = ins
    outs[0][...] = dy - np.exp(y) * dy.sum(axis=-1, keepdims=True)
