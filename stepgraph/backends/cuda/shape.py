"""Launchers of shape.cu (slice, slice_grad, arange), constant, and their cuda op table.

slice views x as (outer, D, inner) around the sliced dim and copies x[:, start:stop:step, :] into
a contiguous output; slice_grad writes zeros with dy placed at [:, start:stop:step, :]. Both move
units of 16, 8, 4, 2 or 1 bytes (the widest dividing the copied runs in bytes and both
pointers), so they serve every dtype. arange writes 0..n-1. Launchers check their
preconditions and launch on ctx.stream: no host sync, no allocation. constant copies its
values from a device copy of them uploaded at the node's first (eager) run.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ...errors import ShapeError
from .runtime.launch import BLOCK, _aligned, _check, _grid, _launch, _node_memory

SOURCE = "shape.cu"
# slice and slice_grad move bits, so bf16 values (compile/autocast.py keeps slices in bf16)
# take the same kernels.
BF16_OPS = frozenset({"slice", "slice_grad"})
# float16 too; and constant, whose upload holds the node's float16 values as they are stored
FP16_OPS = BF16_OPS | {"constant"}
UNIT_CTYPES = {16: "uint4", 8: "unsigned long long", 4: "unsigned int", 2: "unsigned short",
               1: "unsigned char"}
ARANGE_CTYPES = {np.dtype("int64"): "long long", np.dtype("int32"): "int",
                 np.dtype("float32"): "float", np.dtype("float64"): "double"}


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    names = {f"slice_{d}_kernel<{u}>" for u in UNIT_CTYPES.values()
             for d in ("forward", "backward")}
    names |= {f"arange_forward_kernel<{t}>" for t in ARANGE_CTYPES.values()}
    return {SOURCE: names}


def _unit(inner_bytes: int, *arrays) -> int:
    for unit in UNIT_CTYPES:
        if inner_bytes % unit == 0 and _aligned(*arrays, to=unit):
            return unit
    return 1


def _slice_args(what: str, shape: tuple, dim: int, start: int, stop: int | None = None,
                step: int = 1):
    """(dim, start, length, D, inner) of a slice along dim of an array of `shape`, start and
    stop normalised as Python slices do."""
    if not shape:
        raise ShapeError(f"{what}: cannot slice a scalar")
    if not -len(shape) <= dim < len(shape):
        raise ShapeError(f"{what}: dim {dim} out of range for shape {shape}")
    dim %= len(shape)
    d = shape[dim]
    if step < 1:
        raise ShapeError(f"{what}: step must be positive, got {step}")
    start, stop, _ = slice(start, stop).indices(d)
    return dim, start, len(range(start, stop, step)), d, math.prod(shape[dim + 1:])


def runs_in_units(itemsize: int, inner: int, counts: tuple[int, ...], *arrays
                  ) -> tuple[int, tuple[int, ...]]:
    """(unit, counts in units) of a step-1 slice or concat along an axis of `inner` elements
    after it: each outer row's part is one run, so lengths, extents and offsets along the axis
    (`counts`) become counts of units with an inner extent of one unit, in the widest unit
    that divides them all and the pointers. A last-axis copy of bf16 channels (inner 1) then
    moves 16 bytes a thread where the axis's extents allow, not one unit of 2 bytes."""
    run_bytes = [n * inner * itemsize for n in counts]
    unit = _unit(math.gcd(*run_bytes), *arrays)
    return unit, tuple(n // unit for n in run_bytes)


def _launch_slice(ctx, direction: str, src, dst, length: int, d: int, inner: int,
                  start: int, step: int) -> None:
    if step == 1:
        unit, (length, d, start) = runs_in_units(dst.itemsize, inner, (length, d, start),
                                                 src, dst)
        inner_units = 1
    else:
        unit = _unit(inner * dst.itemsize, src, dst)
        inner_units = inner * dst.itemsize // unit
    total = dst.nbytes // unit
    _launch(ctx, SOURCE, f"slice_{direction}_kernel<{UNIT_CTYPES[unit]}>", _grid(total),
            (BLOCK,), (src, dst, np.int64(total), np.int32(length), np.int64(inner_units),
                       np.int32(d), np.int32(start), np.int32(step)))


def slice_forward(ctx, x, y, dim: int, start: int, stop: int | None, step: int = 1) -> None:
    """y = x[..., start:stop:step, ...] along dim, contiguous; any dtype."""
    _check("slice input", x, dtype=None)
    dim, start, length, d, inner = _slice_args("slice", tuple(x.shape), dim, start, stop, step)
    want = tuple(x.shape[:dim]) + (length,) + tuple(x.shape[dim + 1:])
    _check("slice output", y, dtype=str(x.dtype), shape=want)
    if y.size:
        _launch_slice(ctx, "forward", x, y, length, d, inner, start, step)


def slice_backward(ctx, dy, dx, dim: int, start: int, step: int = 1) -> None:
    """dx = zeros of its shape with dy placed at [..., start:start + L * step:step, ...] along
    dim."""
    _check("slice_grad dx", dx, dtype=None)
    dim, start, _, d, inner = _slice_args("slice_grad", tuple(dx.shape), dim, start, step=step)
    length = dy.shape[dim] if dy.ndim == dx.ndim else -1
    want = tuple(dx.shape[:dim]) + (length,) + tuple(dx.shape[dim + 1:])
    _check("slice_grad dy", dy, dtype=str(dx.dtype), shape=want)
    if length > 0 and start + (length - 1) * step >= d:
        raise ShapeError(f"slice_grad: dy {tuple(dy.shape)} at start {start} step {step} "
                         f"overruns dim {dim} of {tuple(dx.shape)}")
    if dx.size:
        _launch_slice(ctx, "backward", dy, dx, length, d, inner, start, step)


def arange_forward(ctx, y) -> None:
    """y = 0, 1, ..., n - 1 (y (n,) int64, int32, float32 or float64)."""
    _check("arange output", y, dtype=None)
    if y.ndim != 1 or y.dtype not in ARANGE_CTYPES:
        raise ShapeError(f"arange: expected a 1-D {sorted(map(str, ARANGE_CTYPES))} output, "
                         f"got {y.dtype}{list(y.shape)}")
    if y.size:
        _launch(ctx, SOURCE, f"arange_forward_kernel<{ARANGE_CTYPES[y.dtype]}>", _grid(y.size),
                (BLOCK,), (y, np.int64(y.size)))


def constant_forward(ctx, node, y) -> None:
    """y = the node's constant values (attrs data): a device-to-device copy from the upload
    made at the node's first eager run, so a captured graph replays no host transfer."""
    import cupy as cp

    host = node.attrs["data"].array
    _check("constant output", y, dtype=str(host.dtype), shape=tuple(host.shape))
    source = _node_memory(node, ("constant",), ctx, lambda: cp.asarray(host))
    if y.nbytes:
        cp.cuda.runtime.memcpyAsync(y.data.ptr, source.data.ptr, y.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToDevice, ctx.stream.ptr)


IMPLS: dict[str, Callable] = {
    "slice": lambda node, ins, outs, ctx: slice_forward(
        ctx, ins[0], outs[0], node.attrs["dim"], node.attrs["start"], node.attrs.get("stop"),
        int(node.attrs.get("step") or 1)),
    "slice_grad": lambda node, ins, outs, ctx: slice_backward(
        ctx, ins[0], outs[0], node.attrs["dim"], node.attrs["start"],
        int(node.attrs.get("step") or 1)),
    "arange": lambda node, ins, outs, ctx: arange_forward(ctx, outs[0]),
    "constant": lambda node, ins, outs, ctx: constant_forward(ctx, node, outs[0]),
}
