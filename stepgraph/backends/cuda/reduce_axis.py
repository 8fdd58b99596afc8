"""Launchers of reduce_axis.cu (reduce_max, reduce_max_grad, topk, cumsum) and their
cuda op table.

Each views x as (outer, N, inner) around the op's axis and runs one thread per line (o, b);
along the last axis max / min and the top 1 run a warp per row (ROW_THREADS) instead.
float32 / float64 only. Launchers check their preconditions and launch on ctx.stream: no
host sync, no allocation.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ...errors import ShapeError
from .runtime.compiler import FLOAT_CTYPES
from .runtime.launch import BLOCK, _check, _grid, _launch

SOURCE = "reduce_axis.cu"
ROW_THREADS = 32          # a warp per row in the _rows_ kernels


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    names = set()
    for t in FLOAT_CTYPES.values():
        names |= {f"reduce_max_{walk}_kernel<{t}, {m}>" for walk in ("forward", "rows")
                  for m in ("true", "false")}
        names |= {f"reduce_max_backward_kernel<{t}>", f"topk_forward_kernel<{t}>",
                  f"top1_rows_kernel<{t}>", f"cumsum_forward_kernel<{t}>"}
    return {SOURCE: names}


def _lines(what: str, x, dim: int) -> tuple[str, int, int, int]:
    """(C type, lines, N, inner) of x around axis `dim`, after checking x."""
    _check(f"{what} input", x, dtype=None)
    if x.dtype.name not in FLOAT_CTYPES:
        raise ShapeError(f"{what}: the cuda kernels take float32 or float64, got {x.dtype}")
    if not 0 <= dim < x.ndim:
        raise ShapeError(f"{what}: dim {dim} out of range for {tuple(x.shape)}")
    n, inner = x.shape[dim], math.prod(x.shape[dim + 1:])
    return FLOAT_CTYPES[x.dtype.name], x.size // max(n, 1), n, inner


def _without(shape: tuple, dim: int, keep: int | None = None) -> tuple:
    return shape[:dim] + (() if keep is None else (keep,)) + shape[dim + 1:]


def reduce_max_forward(ctx, x, y, dim: int, kind: str) -> None:
    """y = x.max(dim) (kind "max") or x.min(dim) ("min")."""
    ctype, lines, n, inner = _lines("reduce_max", x, dim)
    if kind not in ("max", "min") or n == 0:
        raise ShapeError(f"reduce_max: kind {kind!r} over axis {dim} of {tuple(x.shape)}")
    _check("reduce_max output", y, dtype=str(x.dtype), shape=_without(tuple(x.shape), dim))
    template = f"{ctype}, {'true' if kind == 'max' else 'false'}"
    if lines and inner == 1:
        _launch(ctx, SOURCE, f"reduce_max_rows_kernel<{template}>", _grid(lines * ROW_THREADS),
                (BLOCK,), (x, y, np.int64(lines), np.int32(n)))
    elif lines:
        _launch(ctx, SOURCE, f"reduce_max_forward_kernel<{template}>", _grid(lines), (BLOCK,),
                (x, y, np.int64(lines), np.int32(n), np.int64(inner)))


def reduce_max_backward(ctx, dy, x, y, dx, dim: int) -> None:
    """dx = dy shared evenly between the elements of each line equal to its extremum y."""
    ctype, lines, n, inner = _lines("reduce_max_grad", x, dim)
    reduced = _without(tuple(x.shape), dim)
    _check("reduce_max_grad dy", dy, dtype=str(x.dtype), shape=reduced)
    _check("reduce_max_grad y", y, dtype=str(x.dtype), shape=reduced)
    _check("reduce_max_grad dx", dx, dtype=str(x.dtype), shape=tuple(x.shape))
    if lines and n:
        _launch(ctx, SOURCE, f"reduce_max_backward_kernel<{ctype}>", _grid(lines), (BLOCK,),
                (dy, x, y, dx, np.int64(lines), np.int32(n), np.int64(inner)))


def topk_forward(ctx, x, values, indices, dim: int, k: int, largest: bool) -> None:
    """(values, indices) of the k largest (smallest) elements along dim, in order, ties by the
    lower index first; indices int64."""
    ctype, lines, n, inner = _lines("topk", x, dim)
    if not 0 <= k <= n:
        raise ShapeError(f"topk: k = {k} out of range for axis {dim} of {tuple(x.shape)}")
    shape = _without(tuple(x.shape), dim, k)
    _check("topk values", values, dtype=str(x.dtype), shape=shape)
    _check("topk indices", indices, dtype="int64", shape=shape)
    if lines and k == 1 and inner == 1:
        _launch(ctx, SOURCE, f"top1_rows_kernel<{ctype}>", _grid(lines * ROW_THREADS), (BLOCK,),
                (x, values, indices, np.int64(lines), np.int32(n), np.int32(bool(largest))))
    elif lines and k:
        _launch(ctx, SOURCE, f"topk_forward_kernel<{ctype}>", _grid(lines), (BLOCK,),
                (x, values, indices, np.int64(lines), np.int32(n), np.int64(inner),
                 np.int32(k), np.int32(bool(largest))))


def cumsum_forward(ctx, x, y, dim: int, reverse: bool) -> None:
    """y = running sums of x along dim (reverse: from the end)."""
    ctype, lines, n, inner = _lines("cumsum", x, dim)
    _check("cumsum output", y, dtype=str(x.dtype), shape=tuple(x.shape))
    if x.size:
        _launch(ctx, SOURCE, f"cumsum_forward_kernel<{ctype}>", _grid(lines), (BLOCK,),
                (x, y, np.int64(lines), np.int32(n), np.int64(inner), np.int32(bool(reverse))))


IMPLS: dict[str, Callable] = {
    "reduce_max": lambda node, ins, outs, ctx: reduce_max_forward(
        ctx, ins[0], outs[0], int(node.attrs["dim"]), node.attrs["kind"]),
    "reduce_max_grad": lambda node, ins, outs, ctx: reduce_max_backward(
        ctx, *ins, outs[0], int(node.attrs["dim"])),
    "topk": lambda node, ins, outs, ctx: topk_forward(
        ctx, ins[0], outs[0], outs[1], int(node.attrs["dim"]), int(node.attrs["k"]),
        bool(node.attrs["largest"])),
    "cumsum": lambda node, ins, outs, ctx: cumsum_forward(
        ctx, ins[0], outs[0], int(node.attrs["dim"]), bool(node.attrs.get("reverse", False))),
}
