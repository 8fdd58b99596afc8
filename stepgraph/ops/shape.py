"""Shape family: reshape (a view: the planner aliases it, no reference runs), permute
(materialised transpose) and permute_group (several at once, compile/permute_groups.py), slice
along one axis (with a step) and its gradient, layout_copy (a chain of those as one strided
copy) and layout_concat (a concat of such chains), arange, constant, and stop_gradient (a view
the backward does not cross)."""
from __future__ import annotations

import math

import numpy as np

from ..ir.graph import storage_dtype
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


@defop("permute_group")
def _permute_group(ins, attrs):
    """y_i = x_i.transpose(attrs dims[i]) materialised, for every input: the permutes of one
    program point (a step's conv weights to channels-last, their gradients back) as one node,
    so that a backend runs them in one launch."""
    dims = [tuple(d) for d in attrs["dims"]]
    _need(len(dims) == len(ins) > 0, "permute_group",
          f"{len(ins)} inputs but {len(dims)} permutations")
    return [_permute([x], {"dims": d})[0] for x, d in zip(ins, dims)]


@vjp("permute_group")
def _permute_group_vjp(emit, node, dy, wants) -> list:
    return [emit("permute", [g], dims=tuple(int(i) for i in np.argsort(d)))[0]
            if wants(i) and g is not None else None
            for i, (g, d) in enumerate(zip(dy, node.attrs["dims"]))]


@impl("permute_group")
def _permute_group_impl(node, ins, outs, ctx):
    for x, y, dims in zip(ins, outs, node.attrs["dims"]):
        y[...] = x.transpose(tuple(dims))


# ---- slice and arange ----------------------------------------------------------------------

def _slice_bounds(op: str, shape, attrs) -> tuple[int, int, int, int]:
    """(dim, start, stop, step) of a slice node, checked against the input `shape`; stop None
    is the end of the axis, step None is 1."""
    dim, start, step = int(attrs["dim"]), int(attrs["start"]), int(attrs.get("step") or 1)
    _need(0 <= dim < len(shape), op, f"dim {dim} out of range for {tuple(shape)}")
    stop = shape[dim] if attrs.get("stop") is None else int(attrs["stop"])
    _need(0 <= start <= stop <= shape[dim], op,
          f"[{start}:{stop}] out of range for axis {dim} of {tuple(shape)}")
    _need(step >= 1, op, f"step must be positive, got {step}")
    return dim, start, stop, step


def slice_length(start: int, stop: int, step: int) -> int:
    """Elements of x[start:stop:step] along an axis (0 <= start <= stop, step >= 1)."""
    return -(-(stop - start) // step)


@defop("slice")
def _slice(ins, attrs):
    """y = x[..., start:stop:step, ...] along axis attrs dim (non-negative), a contiguous
    copy; attrs start, stop (0 <= start <= stop <= x.shape[dim]; stop None: the end), step
    (>= 1; absent or None: 1)."""
    x = ins[0]
    dim, start, stop, step = _slice_bounds("slice", x.shape, attrs)
    return [(x.shape[:dim] + (slice_length(start, stop, step),) + x.shape[dim + 1:], x.dtype)]


@defop("slice_grad")
def _slice_grad(ins, attrs):
    """dx (attrs input_shape) = zeros with dy placed at [start:start + L * step:step] along
    axis attrs dim, L = dy.shape[dim]; ins (dy,); attrs step absent or None: 1."""
    dy, shape = ins[0], tuple(attrs["input_shape"])
    dim, start, _, step = _slice_bounds("slice_grad", shape, dict(attrs, stop=None))
    fits = len(dy.shape) == len(shape) and \
        (dy.shape[dim] == 0 or start + (dy.shape[dim] - 1) * step < shape[dim]) and \
        dy.shape[:dim] + dy.shape[dim + 1:] == shape[:dim] + shape[dim + 1:]
    _need(fits, "slice_grad", f"dy {dy.shape} at {start} along axis {dim} does not fit input "
          f"{shape}")
    return [(shape, dy.dtype)]


@vjp("slice")
def _slice_vjp(emit, node, dy, wants) -> list:
    a = node.attrs
    return [emit("slice_grad", [dy[0]], input_shape=tuple(node.inputs[0].shape),
                 dim=int(a["dim"]), start=int(a["start"]), step=int(a.get("step") or 1))[0]]


@impl("slice")
def _slice_impl(node, ins, outs, ctx):
    x = ins[0]
    dim, start, stop, step = _slice_bounds("slice", x.shape, node.attrs)
    outs[0][...] = x[(slice(None),) * dim + (slice(start, stop, step),)]


@impl("slice_grad")
def _slice_grad_impl(node, ins, outs, ctx):
    dy, dx = ins[0], outs[0]
    dim, start = int(node.attrs["dim"]), int(node.attrs["start"])
    step = int(node.attrs.get("step") or 1)
    dx[...] = 0
    dx[(slice(None),) * dim + (slice(start, start + dy.shape[dim] * step, step),)] = dy


@defop("layout_copy")
def _layout_copy(ins, attrs):
    """y (attrs shape, contiguous) = x's elements, in x's row-major order, read at attrs
    offset + sum(i_k * strides_k) (elements, strides non-negative): a chain of slices,
    reshapes and permutes as one copy (compile/layout_chains.py emits it after autodiff, so
    it has no VJP)."""
    shape = tuple(attrs["shape"])
    _check_view("layout_copy", ins[0], shape, tuple(attrs["strides"]), int(attrs["offset"]))
    return [(shape, ins[0].dtype)]


def _well_formed(shape, strides, offset) -> bool:
    return len(shape) == len(strides) and min(strides, default=0) >= 0 and offset >= 0


def _inside(size: int, shape, strides, offset) -> bool:
    last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
    return 0 in shape or last < size


def view_fits(view, size: int) -> bool:
    """Whether view (shape, strides, offset in elements) reads only elements of a value of
    `size` elements (layout_copy's and layout_concat's views, pointwise and sdpa's attrs
    views)."""
    return _well_formed(*view) and _inside(size, *view)


def _check_view(op: str, x, shape, strides, offset) -> None:
    _need(_well_formed(shape, strides, offset),
          op, f"shape {shape}, strides {strides}, offset {offset}")
    _need(_inside(x.size, shape, strides, offset), op,
          f"shape {shape} at strides {strides} from {offset} reads past {x.size} elements")


def viewed(x: np.ndarray, shape, strides, offset, writeable: bool = False) -> np.ndarray:
    """Array x (C-contiguous) as the view (shape, strides, offset in elements) of its
    elements: read only, or written where writeable (a pointwise program's joined parts)."""
    flat = x.reshape(-1)[int(offset):]
    return np.lib.stride_tricks.as_strided(flat, tuple(shape),
                                           tuple(s * flat.itemsize for s in strides),
                                           writeable=writeable)


def contiguous_strides(shape) -> tuple[int, ...]:
    """The element strides of a C-contiguous array of `shape`."""
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))


def matched_axes(view_shape, view_strides, shape) -> dict[int, int] | None:
    """{view axis: array axis} for each axis of extent > 1 of a view of a C-contiguous array
    of `shape` (as many elements): the array axis of the same extent and stride, which makes
    the view a transpose of the array with extent-1 axes added or dropped; None where an axis
    has no such twin, or shares one with another (the view slices, merges, splits or repeats
    axes)."""
    own, axes = contiguous_strides(shape), {}
    for d, (n, s) in enumerate(zip(view_shape, view_strides)):
        if n == 1:
            continue
        found = [a for a in range(len(shape)) if shape[a] == n and own[a] == s]
        if not found or found[0] in axes.values():  # one at most: axes of extent > 1 have
            return None                              # distinct strides
        axes[d] = found[0]
    return axes


@impl("layout_copy")
def _layout_copy_impl(node, ins, outs, ctx):
    a = node.attrs
    outs[0][...] = viewed(ins[0], a["shape"], a["strides"], a["offset"])


@defop("layout_concat")
def _layout_concat(ins, attrs):
    """y = concat along attrs dim of each input read at its view, attrs views one (shape,
    strides, offset) per input as layout_copy's: a concat whose inputs are chains of slices,
    reshapes and permutes reads their roots (compile/layout_chains.py; no VJP)."""
    views, dim = attrs["views"], int(attrs["dim"])
    _need(len(views) == len(ins) >= 1, "layout_concat", f"{len(views)} views, {len(ins)} inputs")
    for x, (shape, strides, offset) in zip(ins, views):
        _check_view("layout_concat", x, shape, strides, offset)
    first = tuple(views[0][0])
    _need(0 <= dim < len(first) and all(
        len(s) == len(first) and tuple(s[:dim]) + tuple(s[dim + 1:]) == first[:dim] + first[dim + 1:]
        for s, _, _ in views) and len({x.dtype for x in ins}) == 1, "layout_concat",
        f"views {[tuple(s) for s, _, _ in views]} of {[x.dtype for x in ins]} do not concat "
        f"along {dim}")
    size = sum(s[dim] for s, _, _ in views)
    return [(first[:dim] + (size,) + first[dim + 1:], ins[0].dtype)]


@impl("layout_concat")
def _layout_concat_impl(node, ins, outs, ctx):
    parts = [viewed(x, *view) for x, view in zip(ins, node.attrs["views"])]
    outs[0][...] = np.concatenate(parts, axis=int(node.attrs["dim"]))


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


@defop("constant")
def _constant(ins, attrs):
    """y = attrs data (a trace.Constant: values fixed at trace time, e.g. a tensor a model
    made in its constructor and used in forward); attrs dtype (y's IR dtype; data holds it in
    storage dtype). No inputs, no gradient."""
    _need(not ins, "constant", f"takes no inputs, got {len(ins)}")
    array = attrs["data"].array
    _need(str(array.dtype) == storage_dtype(attrs["dtype"]), "constant",
          f"data of {array.dtype} does not hold {attrs['dtype']} values")
    return [(tuple(array.shape), attrs["dtype"])]


@impl("constant")
def _constant_impl(node, ins, outs, ctx):
    outs[0][...] = node.attrs["data"].array


@defop("stop_gradient")
def _stop_gradient(ins, attrs):
    """y = x (a view: plans alias it, compile/plan.py VIEW_OPS) through which no gradient
    flows back: what no_grad and Tensor.detach record. It has no VJP rule: autodiff treats
    y as depending on nothing (autodiff/vjp.py _needs_grad)."""
    return [(ins[0].shape, ins[0].dtype)]
