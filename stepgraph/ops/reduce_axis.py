"""Reduce-along-an-axis family: max / min (reduce_max, its gradient split evenly
between tied maxima as PyTorch's amax), topk (values and int64 indices; sort and max / min
with a dim are topk too) and cumsum (forward or reversed).

Every op views x as (outer, n, inner) around its axis attrs dim (non-negative), so no axis
has to be moved first. topk orders ties by the lower index first, so both backends pick the
same elements. topk's gradient scatters dy through its indices (gather_grad); cumsum's is
the cumsum of dy the other way.
"""
from __future__ import annotations

import numpy as np

from ..ir.ops import _need, defop, impl, vjp

FLOATS = ("float32", "float64")
EXTREMA = ("max", "min")


def _axis(op: str, x, attrs) -> int:
    dim = int(attrs["dim"])
    _need(0 <= dim < len(x.shape), op, f"dim {dim} out of range for {x.shape}")
    _need(x.dtype in FLOATS, op, f"x must be float32 or float64, got {x.dtype}")
    return dim


# ---- max / min -----------------------------------------------------------------------------

@defop("reduce_max")
def _reduce_max(ins, attrs):
    """y = x.max(axis attrs dim) (attrs kind "max") or x.min (kind "min"), the axis removed;
    x float32/float64 with a non-empty axis."""
    x = ins[0]
    dim = _axis("reduce_max", x, attrs)
    _need(attrs["kind"] in EXTREMA, "reduce_max", f"kind must be one of {EXTREMA}, got "
          f"{attrs['kind']!r}")
    _need(x.shape[dim] > 0, "reduce_max", f"axis {dim} of {x.shape} is empty")
    return [(x.shape[:dim] + x.shape[dim + 1:], x.dtype)]


@defop("reduce_max_grad")
def _reduce_max_grad(ins, attrs):
    """dx = dy / count where x equals y (the extremum of its line along axis attrs dim), zero
    elsewhere; count = how many elements of the line equal y. ins (dy, x, y)."""
    dy, x, y = ins
    dim = _axis("reduce_max_grad", x, attrs)
    want = x.shape[:dim] + x.shape[dim + 1:]
    _need(tuple(dy.shape) == want and tuple(y.shape) == want, "reduce_max_grad",
          f"dy {dy.shape} and y {y.shape} must be x {x.shape} without axis {dim}")
    return [(tuple(x.shape), x.dtype)]


@vjp("reduce_max")
def _reduce_max_vjp(emit, node, dy, wants) -> list:
    return [emit("reduce_max_grad", [dy[0], node.inputs[0], node.outputs[0]],
                 dim=int(node.attrs["dim"]))[0]]


@impl("reduce_max")
def _reduce_max_impl(node, ins, outs, ctx):
    fn = np.max if node.attrs["kind"] == "max" else np.min
    fn(ins[0], axis=int(node.attrs["dim"]), out=outs[0])


@impl("reduce_max_grad")
def _reduce_max_grad_impl(node, ins, outs, ctx):
    dy, x, y = ins
    dim = int(node.attrs["dim"])
    hit = x == np.expand_dims(y, dim)
    count = hit.sum(axis=dim, keepdims=True)
    outs[0][...] = np.where(hit, np.expand_dims(dy, dim) / count, 0)


# ---- topk ----------------------------------------------------------------------------------

@defop("topk")
def _topk(ins, attrs):
    """(values, indices) of the attrs k largest (attrs largest true) or smallest elements
    along axis attrs dim, in order (largest first, or smallest first), ties by the lower index
    first; both of x's shape with the axis k long; indices int64. 0 <= k <= x.shape[dim]."""
    x = ins[0]
    dim, k = _axis("topk", x, attrs), int(attrs["k"])
    _need(0 <= k <= x.shape[dim], "topk", f"k = {k} out of range for axis {dim} of {x.shape}")
    shape = x.shape[:dim] + (k,) + x.shape[dim + 1:]
    return [(shape, x.dtype), (shape, "int64")]


@vjp("topk")
def _topk_vjp(emit, node, dy, wants) -> list:
    x, indices = node.inputs[0], node.outputs[1]
    return [emit("gather_grad", [dy[0], indices], input_shape=tuple(x.shape),
                 dim=int(node.attrs["dim"]))[0]]


@impl("topk")
def _topk_impl(node, ins, outs, ctx):
    x, dim, k = ins[0], int(node.attrs["dim"]), int(node.attrs["k"])
    # A stable sort of -x keeps tied elements in index order, as for x ascending.
    keys = -x if node.attrs["largest"] else x
    order = np.argsort(keys, axis=dim, kind="stable")
    order = np.take(order, np.arange(k), axis=dim)
    outs[1][...] = order
    outs[0][...] = np.take_along_axis(x, order, axis=dim)


# ---- cumsum --------------------------------------------------------------------------------

@defop("cumsum")
def _cumsum(ins, attrs):
    """y[..., i, ...] = sum of x[..., j, ...] over j <= i along axis attrs dim (attrs reverse
    true: over j >= i); x float32/float64."""
    x = ins[0]
    _axis("cumsum", x, attrs)
    return [(tuple(x.shape), x.dtype)]


@vjp("cumsum")
def _cumsum_vjp(emit, node, dy, wants) -> list:
    return [emit("cumsum", [dy[0]], dim=int(node.attrs["dim"]),
                 reverse=not node.attrs.get("reverse", False))[0]]


@impl("cumsum")
def _cumsum_impl(node, ins, outs, ctx):
    x, dim = ins[0], int(node.attrs["dim"])
    if node.attrs.get("reverse", False):
        outs[0][...] = np.flip(np.cumsum(np.flip(x, dim), axis=dim), dim)
    else:
        np.cumsum(x, axis=dim, out=outs[0])
