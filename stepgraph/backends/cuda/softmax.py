"""Launchers of kernels/softmax.cu: softmax and softmax_grad over the last axis of any rank,
and the cuda op table `IMPLS` of those ops. (log_softmax, whose kernels share loss.cu with the
cross-entropy kernels, is launched from launchers.py.) Inputs are viewed as (rows, cols):
a warp per row up to 1024 columns, 128 or 256 threads for longer rows (launchers._row_block).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .launchers import BLOCK, _check, _check_rows, _launch, _row_block, _row_grid


def softmax_forward(ctx, x, y) -> None:
    """y = softmax(x) over the last axis (x any rank >= 1)."""
    n, c = _check_rows("softmax input", x)
    _check("softmax output", y, shape=x.shape)
    if x.size:
        block = _row_block(c, BLOCK)
        _launch(ctx, "softmax.cu", "softmax_forward_kernel", _row_grid(n, block[1]), block,
                (x, y, np.int32(n), np.int32(c)))


def softmax_backward(ctx, dy, y, dx) -> None:
    """dx = y * (dy - sum(dy * y, last axis, keepdims))."""
    n, c = _check_rows("softmax_grad dy", dy)
    _check("softmax_grad y", y, shape=dy.shape)
    _check("softmax_grad dx", dx, shape=dy.shape)
    if dy.size:
        block = _row_block(c, BLOCK)
        _launch(ctx, "softmax.cu", "softmax_backward_kernel", _row_grid(n, block[1]), block,
                (dy, y, dx, np.int32(n), np.int32(c)))


def kernel_names() -> dict[str, set[str]]:
    """{file: every kernel name these launchers may launch} (the NVRTC CI test)."""
    return {"softmax.cu": {"softmax_forward_kernel", "softmax_backward_kernel"}}


IMPLS: dict[str, Callable] = {
    "softmax": lambda node, ins, outs, ctx: softmax_forward(ctx, ins[0], outs[0]),
    "softmax_grad": lambda node, ins, outs, ctx: softmax_backward(ctx, ins[0], ins[1], outs[0]),
}
