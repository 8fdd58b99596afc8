"""Index family: concat along one axis, gather along one axis and its scatter-add gradient,
and the triangular masks of tril / triu.

concat's gradient is one slice of dy per input; triangle's is the same mask applied to dy;
gather_grad adds dy into zeros at the gathered positions. Indices outside [0, n) read zero
and scatter nothing (PyTorch raises; a device kernel cannot).
"""
from __future__ import annotations

import numpy as np

from ..ir.ops import _need, defop, impl, vjp

INDEX_DTYPES = ("int32", "int64")
GATHER_DTYPES = ("float32", "float64")


# ---- concat --------------------------------------------------------------------------------

@defop("concat")
def _concat(ins, attrs):
    """y = the inputs joined along axis attrs dim (non-negative); the inputs share rank, dtype
    and every other axis."""
    _need(len(ins) >= 1, "concat", "needs at least one input")
    first, dim = ins[0], int(attrs["dim"])
    _need(0 <= dim < len(first.shape), "concat", f"dim {dim} out of range for {first.shape}")
    rest = first.shape[:dim] + first.shape[dim + 1:]
    for i, v in enumerate(ins):
        _need(v.dtype == first.dtype, "concat", f"input {i} is {v.dtype}, input 0 "
              f"{first.dtype}")
        _need(len(v.shape) == len(first.shape) and v.shape[:dim] + v.shape[dim + 1:] == rest,
              "concat", f"input {i} {v.shape} differs from input 0 {first.shape} off axis {dim}")
    total = sum(v.shape[dim] for v in ins)
    return [(first.shape[:dim] + (total,) + first.shape[dim + 1:], first.dtype)]


@vjp("concat")
def _concat_vjp(emit, node, dy, wants) -> list:
    dim, start, grads = int(node.attrs["dim"]), 0, []
    for i, v in enumerate(node.inputs):
        stop = start + v.shape[dim]
        grads.append(emit("slice", [dy[0]], dim=dim, start=start, stop=stop)[0]
                     if wants(i) else None)
        start = stop
    return grads


@impl("concat")
def _concat_impl(node, ins, outs, ctx):
    np.concatenate(ins, axis=int(node.attrs["dim"]), out=outs[0])


# ---- gather --------------------------------------------------------------------------------

def _check_gather(op: str, index, shape, dim: int):
    _need(index.dtype in INDEX_DTYPES, op, f"index must be int32 or int64, got {index.dtype}")
    _need(0 <= dim < len(shape), op, f"dim {dim} out of range for {tuple(shape)}")
    fits = len(index.shape) == len(shape) and all(
        i == s for d, (i, s) in enumerate(zip(index.shape, shape)) if d != dim)
    _need(fits, op, f"index {index.shape} must have the shape of {tuple(shape)} off axis {dim}")


@defop("gather")
def _gather(ins, attrs):
    """y[p] = x[p with axis attrs dim replaced by index[p]] for every position p of index;
    ins (x float32/float64, index int32/int64 of x's shape off dim) -> y of index's shape.
    An index outside [0, x.shape[dim]) reads 0. (torch.gather's smaller index is x sliced
    first.)"""
    x, index = ins
    dim = int(attrs["dim"])
    _need(x.dtype in GATHER_DTYPES, "gather", f"x must be float32 or float64, got {x.dtype}")
    _check_gather("gather", index, x.shape, dim)
    return [(tuple(index.shape), x.dtype)]


@defop("gather_grad")
def _gather_grad(ins, attrs):
    """dx (attrs input_shape) = zeros, then dx[p with axis dim = index[p]] += dy[p] for every
    p of index (indices outside the axis add nothing); ins (dy, index), dy of index's shape."""
    dy, index = ins
    shape, dim = tuple(attrs["input_shape"]), int(attrs["dim"])
    _check_gather("gather_grad", index, shape, dim)
    _need(tuple(dy.shape) == tuple(index.shape), "gather_grad",
          f"dy {dy.shape} must have index's shape {index.shape}")
    return [(shape, dy.dtype)]


@vjp("gather")
def _gather_vjp(emit, node, dy, wants) -> list:
    x, index = node.inputs
    dx = emit("gather_grad", [dy[0], index], input_shape=tuple(x.shape),
              dim=int(node.attrs["dim"]))[0] if wants(0) else None
    return [dx, None]                       # indices have no gradient


@vjp("gather_grad")
def _gather_grad_vjp(emit, node, dy, wants) -> list:
    # each dy[p] was added at one place of the output: its gradient is read back from there
    # (scatter_add's gradient to src)
    src, index = node.inputs
    dsrc = emit("gather", [dy[0], index], dim=int(node.attrs["dim"]))[0] if wants(0) else None
    return [dsrc, None]


def _positions(index: np.ndarray, dim: int, n: int):
    """(full index tuple of the valid entries, their mask): index's own coordinates with axis
    `dim` replaced by the index values, for the entries inside [0, n)."""
    valid = (index >= 0) & (index < n)
    coords = list(np.nonzero(valid))
    coords[dim] = index[valid]
    return tuple(coords), valid


@impl("gather")
def _gather_impl(node, ins, outs, ctx):
    x, index = ins
    dim = int(node.attrs["dim"])
    where, valid = _positions(index, dim, x.shape[dim])
    outs[0][...] = 0
    outs[0][valid] = x[where]


@impl("gather_grad")
def _gather_grad_impl(node, ins, outs, ctx):
    dy, index = ins
    dim = int(node.attrs["dim"])
    where, valid = _positions(index, dim, outs[0].shape[dim])
    outs[0][...] = 0
    np.add.at(outs[0], where, dy[valid])


# ---- tril / triu ---------------------------------------------------------------------------

@defop("triangle")
def _triangle(ins, attrs):
    """y = x over its last two axes (rows i, columns j) where j - i <= attrs diagonal (attrs
    upper false: tril) or j - i >= diagonal (upper true: triu), zero elsewhere; x of rank
    >= 2, any dtype."""
    x = ins[0]
    _need(len(x.shape) >= 2, "triangle", f"x must have at least 2 axes, got {x.shape}")
    return [(tuple(x.shape), x.dtype)]


@vjp("triangle")
def _triangle_vjp(emit, node, dy, wants) -> list:
    return [emit("triangle", [dy[0]], **node.attrs)[0]]


@impl("triangle")
def _triangle_impl(node, ins, outs, ctx):
    mask = np.triu if node.attrs["upper"] else np.tril
    outs[0][...] = mask(ins[0], int(node.attrs["diagonal"]))
