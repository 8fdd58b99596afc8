"""Shape family: reshape (a view: the planner aliases it, no reference runs), permute
(materialised transpose), slice along one axis and its gradient, arange."""
from __future__ import annotations

import numpy as np

from ..ir.ops import _need, defop, impl, vjp


@defop("reshape")
def _reshape(ins, attrs):
    """y = x viewed with attrs["shape"] (same element count, contiguous: no copy)."""
    x = ins[0]
    shape = tuple(attrs["shape"])
    n = 1
    for d in shape:
        n *= d
    _need(n == x.size, "reshape", f"cannot view {x.shape} as {shape}")
    return [(shape, x.dtype)]


@vjp("reshape")
def _reshape_vjp(emit, node, dy, wants) -> list:
    return [emit("reshape", [dy[0]], shape=node.inputs[0].shape)[0]]


@defop("permute")
def _permute(ins, attrs):
    """y = x.transpose(attrs dims) materialised (contiguous); dims is a permutation."""
    x, dims = ins[0], tuple(attrs["dims"])
    _need(sorted(dims) == list(range(len(x.shape))), "permute",
          f"dims {dims} is not a permutation of the {len(x.shape)} axes of {x.shape}")
    return [(tuple(x.shape[d] for d in dims), x.dtype)]


@vjp("permute")
def _permute_vjp(emit, node, dy, wants) -> list:
    inverse = tuple(int(i) for i in np.argsort(node.attrs["dims"]))
    return [emit("permute", [dy[0]], dims=inverse)[0]]


@impl("permute")
def _permute_impl(node, ins, outs, ctx):
    outs[0][...] = ins[0].transpose(tuple(node.attrs["dims"]))


# ---- slice and arange ----------------------------------------------------------------------

def _slice_bounds(op: str, shape, attrs) -> tuple[int, int, int]:
    """(dim, start, stop) of a slice node, checked against the input `shape`; stop None is
    the end of the axis."""
    dim, start = int(attrs["dim"]), int(attrs["start"])
    _need(0 <= dim < len(shape), op, f"dim {dim} out of range for {tuple(shape)}")
    stop = shape[dim] if attrs.get("stop") is None else int(attrs["stop"])
    _need(0 <= start <= stop <= shape[dim], op,
          f"[{start}:{stop}] out of range for axis {dim} of {tuple(shape)}")
    return dim, start, stop


@defop("slice")
def _slice(ins, attrs):
    """y = x[..., start:stop, ...] along axis attrs dim (non-negative), a contiguous copy;
    attrs start, stop (0 <= start <= stop <= x.shape[dim]; stop None: the end)."""
    x = ins[0]
    dim, start, stop = _slice_bounds("slice", x.shape, attrs)
    return [(x.shape[:dim] + (stop - start,) + x.shape[dim + 1:], x.dtype)]


@defop("slice_grad")
def _slice_grad(ins, attrs):
    """dx (attrs input_shape) = zeros with dy placed at [start:start + dy.shape[dim]] along
    axis attrs dim; ins (dy,)."""
    dy, shape = ins[0], tuple(attrs["input_shape"])
    dim, start, _ = _slice_bounds("slice_grad", shape, dict(attrs, stop=None))
    fits = len(dy.shape) == len(shape) and start + dy.shape[dim] <= shape[dim] and \
        dy.shape[:dim] + dy.shape[dim + 1:] == shape[:dim] + shape[dim + 1:]
    _need(fits, "slice_grad", f"dy {dy.shape} at {start} along axis {dim} does not fit input "
          f"{shape}")
    return [(shape, dy.dtype)]


@vjp("slice")
def _slice_vjp(emit, node, dy, wants) -> list:
    a = node.attrs
    return [emit("slice_grad", [dy[0]], input_shape=tuple(node.inputs[0].shape),
                 dim=int(a["dim"]), start=int(a["start"]))[0]]


@impl("slice")
def _slice_impl(node, ins, outs, ctx):
    x = ins[0]
    dim, start, stop = _slice_bounds("slice", x.shape, node.attrs)
    outs[0][...] = x[(slice(None),) * dim + (slice(start, stop),)]


@impl("slice_grad")
def _slice_grad_impl(node, ins, outs, ctx):
    dy, dx = ins[0], outs[0]
    dim, start = int(node.attrs["dim"]), int(node.attrs["start"])
    dx[...] = 0
    dx[(slice(None),) * dim + (slice(start, start + dy.shape[dim]),)] = dy


ARANGE_DTYPES = ("int64", "int32", "float32", "float64")


@defop("arange")
def _arange(ins, attrs):
    """y = 0, 1, ..., n - 1 (attrs n); attrs dtype (default int64; int32, float32, float64).
    No inputs."""
    n, dtype = int(attrs["n"]), attrs.get("dtype", "int64")
    _need(not ins, "arange", f"takes no inputs, got {len(ins)}")
    _need(n >= 0, "arange", f"n must be >= 0, got {n}")
    _need(dtype in ARANGE_DTYPES, "arange", f"dtype must be one of {ARANGE_DTYPES}, got {dtype}")
    return [((n,), dtype)]


@impl("arange")
def _arange_impl(node, ins, outs, ctx):
    outs[0][...] = np.arange(outs[0].shape[0], dtype=outs[0].dtype)
