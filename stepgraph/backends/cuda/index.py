"""Launchers of index.cu (concat, gather, gather_grad, triangle) and their cuda op
table.

concat launches one copy per input into its place along the axis, in units of 16, 8, 4, 2 or 1
bytes as slice does (shape.py), so it serves every dtype; triangle masks raw elements of any
dtype; gather and gather_grad take float32 / float64 with int32 / int64 indices. Launchers
check their preconditions and launch on ctx.stream: no host sync, no allocation.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ...errors import ShapeError
from .runtime.compiler import FLOAT_CTYPES
from .runtime.launch import BLOCK, LABEL_CTYPES, _check, _grid, _launch
from .shape import UNIT_CTYPES, runs_in_units

SOURCE = "index.cu"
# Ops whose launchers here take bf16 (they move its bits; compile/autocast.py keeps or promotes
# their bf16 inputs); gather runs in float32 under autocast.
BF16_OPS = frozenset({"concat", "triangle"})
FP16_OPS = BF16_OPS       # float16's bits move the same way (+0.0 is all zero bits too)
# triangle's element types by item size
ELEMENT_UNITS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int",
                 8: "unsigned long long"}


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    names = {f"concat_forward_kernel<{u}>" for u in UNIT_CTYPES.values()}
    names |= {f"triangle_forward_kernel<{u}>" for u in ELEMENT_UNITS.values()}
    names |= {f"gather_{d}_kernel<{t}, {i}>" for d in ("forward", "backward")
              for t in FLOAT_CTYPES.values() for i in LABEL_CTYPES.values()}
    return {SOURCE: names}


def _around(shape: tuple, dim: int) -> tuple[int, int]:
    """(outer, inner): the products of the axes before and after `dim`."""
    return math.prod(shape[:dim]), math.prod(shape[dim + 1:])


def concat_forward(ctx, xs: list, y, dim: int) -> None:
    """y = the arrays `xs` joined along `dim`; any dtype, one launch per non-empty input."""
    _check("concat output", y, dtype=None)
    if not 0 <= dim < y.ndim:
        raise ShapeError(f"concat: dim {dim} out of range for {tuple(y.shape)}")
    offset = 0
    for i, x in enumerate(xs):
        want = tuple(y.shape[:dim]) + (x.shape[dim] if x.ndim == y.ndim else -1,) + \
            tuple(y.shape[dim + 1:])
        _check(f"concat input {i}", x, dtype=str(y.dtype), shape=want)
        if x.size:
            _launch_concat(ctx, x, y, dim, offset)
        offset += x.shape[dim]
    if offset != y.shape[dim]:
        raise ShapeError(f"concat: the inputs fill {offset} of the {y.shape[dim]} elements of "
                         f"axis {dim} of the output")


def _launch_concat(ctx, x, y, dim: int, offset: int) -> None:
    _, inner = _around(tuple(x.shape), dim)
    unit, (length, extent, offset) = runs_in_units(x.itemsize, inner,
                                                   (x.shape[dim], y.shape[dim], offset), x, y)
    total = x.nbytes // unit
    _launch(ctx, SOURCE, f"concat_forward_kernel<{UNIT_CTYPES[unit]}>", _grid(total),
            (BLOCK,), (x, y, np.int64(total), np.int32(length), np.int64(1),
                       np.int32(extent), np.int32(offset)))


def _gather_types(what: str, data, index) -> str:
    _check(f"{what} index", index, dtype=None)
    if data.dtype.name not in FLOAT_CTYPES or index.dtype not in LABEL_CTYPES:
        raise ShapeError(f"{what}: the cuda kernels take float32 / float64 values and int32 / "
                         f"int64 indices, got {data.dtype} and {index.dtype}")
    return f"{FLOAT_CTYPES[data.dtype.name]}, {LABEL_CTYPES[index.dtype]}"


def _gather_shapes(what: str, full: tuple, index, dim: int) -> None:
    if not 0 <= dim < len(full):
        raise ShapeError(f"{what}: dim {dim} out of range for {full}")
    off = tuple(d for i, d in enumerate(full) if i != dim)
    if index.ndim != len(full) or tuple(d for i, d in enumerate(index.shape) if i != dim) != off:
        raise ShapeError(f"{what}: index {tuple(index.shape)} must have the shape of {full} "
                         f"off axis {dim}")


def gather_forward(ctx, x, index, y, dim: int) -> None:
    """y = x gathered along `dim` by `index` (y of index's shape); out of range reads 0."""
    _check("gather x", x, dtype=None)
    types = _gather_types("gather", x, index)
    _gather_shapes("gather", tuple(x.shape), index, dim)
    _check("gather output", y, dtype=str(x.dtype), shape=tuple(index.shape))
    _, inner = _around(tuple(x.shape), dim)
    if y.size:
        _launch(ctx, SOURCE, f"gather_forward_kernel<{types}>", _grid(y.size), (BLOCK,),
                (x, index, y, np.int64(y.size), np.int32(index.shape[dim]), np.int64(inner),
                 np.int32(x.shape[dim])))


def gather_backward(ctx, dy, index, dx, dim: int) -> None:
    """dx = zeros with dy added at the gathered positions (each element sums its own terms
    in index order)."""
    _check("gather_grad dx", dx, dtype=None)
    types = _gather_types("gather_grad", dx, index)
    _gather_shapes("gather_grad", tuple(dx.shape), index, dim)
    _check("gather_grad dy", dy, dtype=str(dx.dtype), shape=tuple(index.shape))
    _, inner = _around(tuple(dx.shape), dim)
    if dx.size:
        _launch(ctx, SOURCE, f"gather_backward_kernel<{types}>", _grid(dx.size), (BLOCK,),
                (dy, index, dx, np.int64(dx.size), np.int32(index.shape[dim]), np.int64(inner),
                 np.int32(dx.shape[dim])))


def triangle_forward(ctx, x, y, diagonal: int, upper: bool) -> None:
    """y = tril(x, diagonal) or triu (upper) over the last two axes; any dtype."""
    _check("triangle input", x, dtype=None)
    _check("triangle output", y, dtype=str(x.dtype), shape=tuple(x.shape))
    if x.ndim < 2 or x.itemsize not in ELEMENT_UNITS:
        raise ShapeError(f"triangle: expected at least 2 axes of 1, 2, 4 or 8-byte elements, "
                         f"got {x.dtype}{list(x.shape)}")
    if y.size:
        _launch(ctx, SOURCE, f"triangle_forward_kernel<{ELEMENT_UNITS[x.itemsize]}>",
                _grid(y.size), (BLOCK,), (x, y, np.int64(y.size), np.int32(x.shape[-2]),
                                          np.int32(x.shape[-1]), np.int32(diagonal),
                                          np.int32(bool(upper))))


IMPLS: dict[str, Callable] = {
    "concat": lambda node, ins, outs, ctx: concat_forward(ctx, ins, outs[0],
                                                          int(node.attrs["dim"])),
    "gather": lambda node, ins, outs, ctx: gather_forward(ctx, ins[0], ins[1], outs[0],
                                                          int(node.attrs["dim"])),
    "gather_grad": lambda node, ins, outs, ctx: gather_backward(ctx, ins[0], ins[1], outs[0],
                                                                int(node.attrs["dim"])),
    "triangle": lambda node, ins, outs, ctx: triangle_forward(
        ctx, ins[0], outs[0], int(node.attrs["diagonal"]), bool(node.attrs["upper"])),
}
