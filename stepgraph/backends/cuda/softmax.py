"""Launchers of softmax.cu: softmax and softmax_grad over the last axis of any rank,
and the cuda op table `IMPLS` of those ops. (log_softmax, whose kernels share loss.cu with the
cross-entropy kernels, is launched from loss.py.) Inputs are viewed as (rows, cols): a warp
per row up to 1024 columns, 128 or 256 threads for longer rows, a power of two of lanes for rows
of at most 16 (runtime/launch.py _row_block).
attrs scale (default 1.0) and causal (default False) take the scaled kernels; nodes without
them run the plain kernels, unchanged. The kernels are templates on the storage of x, y, dy
and dx (one a launch): float32, or float16 (a model.half(); float32 arithmetic, each output
rounded once on store): `FP16_OPS`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ...errors import ShapeError
from .runtime.launch import (BLOCK, _check, _check_int32, _launch, _row_block, _row_grid,
                             _typed)

FP16_OPS = frozenset({"softmax", "softmax_grad"})
CTYPES = {np.dtype("float32"): "float", np.dtype("float16"): "fp16_bits"}


def _scaled_args(what: str, x, scale, causal: bool) -> tuple | None:
    """(rows of the last two dims, float32 scale, causal flag) for the scaled kernels, or None
    when the plain kernel applies (scale 1, no mask). Causal needs rank >= 2 and at most as
    many rows as columns (else whole rows would be masked)."""
    scale = 1.0 if scale is None else float(scale)
    causal = bool(causal)
    if scale == 1.0 and not causal:
        return None
    rows = 1
    if causal:
        if x.ndim < 2 or x.shape[-2] > x.shape[-1]:
            raise ShapeError(f"{what}: causal needs (..., rows, cols) with rows <= cols, got "
                             f"{tuple(x.shape)}")
        rows = x.shape[-2]
    return np.int32(max(rows, 1)), np.float32(scale), np.int32(causal)


def _rows(what: str, x) -> tuple[str, int, int]:
    """(C type, rows, cols) of x (rank >= 1, float32 or float16) as rows of its last axis."""
    _check(what, x, dtype=None)
    if x.dtype not in CTYPES:
        raise ShapeError(f"{what}: the cuda kernels take float32 or float16, got {x.dtype}")
    if x.ndim < 1:
        raise ShapeError(f"{what}: expected rank >= 1 (rows of the last axis), got a scalar")
    _check_int32(what, x.size)
    return CTYPES[x.dtype], x.size // max(x.shape[-1], 1), x.shape[-1]


def _launch_rows(ctx, direction: str, ctype: str, n: int, c: int, arrays: tuple,
                 scaled) -> None:
    """softmax_<direction>_kernel<ctype> over n rows of c columns, or its scaled twin when
    `scaled` holds the scaled kernels' arguments (_scaled_args)."""
    kind = direction if scaled is None else f"scaled_{direction}"
    block = _row_block(c, BLOCK, narrow=True)
    _launch(ctx, "softmax.cu", _typed(f"softmax_{kind}_kernel", ctype), _row_grid(n, block[1]),
            block, arrays + (np.int32(n), np.int32(c)) + (scaled or ()))


def softmax_forward(ctx, x, y, scale: float = 1.0, causal: bool = False) -> None:
    """y = softmax(scale * x + mask) over the last axis (x any rank >= 1); the causal mask
    hides column c of row r (last two dims, R rows, C columns) when c > r + (C - R), and
    masked entries of y are 0."""
    ctype, n, c = _rows("softmax input", x)
    _check("softmax output", y, x.dtype, shape=x.shape)
    scaled = _scaled_args("softmax", x, scale, causal)
    if x.size:
        _launch_rows(ctx, "forward", ctype, n, c, (x, y), scaled)


def softmax_backward(ctx, dy, y, dx, scale: float = 1.0, causal: bool = False) -> None:
    """dx = scale * y * (dy - sum(dy * y, last axis, keepdims)); 0 where causal masks."""
    ctype, n, c = _rows("softmax_grad dy", dy)
    _check("softmax_grad y", y, dy.dtype, shape=dy.shape)
    _check("softmax_grad dx", dx, dy.dtype, shape=dy.shape)
    scaled = _scaled_args("softmax_grad", dy, scale, causal)
    if dy.size:
        _launch_rows(ctx, "backward", ctype, n, c, (dy, y, dx), scaled)


def kernel_names() -> dict[str, set[str]]:
    """{file: every kernel name these launchers may launch} (the NVRTC CI test)."""
    return {"softmax.cu": {_typed(f"softmax_{kind}_kernel", ctype) for ctype in CTYPES.values()
                           for kind in ("forward", "backward", "scaled_forward",
                                        "scaled_backward")}}


def _attrs(node) -> tuple:
    return node.attrs.get("scale", 1.0), node.attrs.get("causal", False)


IMPLS: dict[str, Callable] = {
    "softmax": lambda node, ins, outs, ctx: softmax_forward(ctx, ins[0], outs[0], *_attrs(node)),
    "softmax_grad": lambda node, ins, outs, ctx: softmax_backward(
        ctx, ins[0], ins[1], outs[0], *_attrs(node)),
}
