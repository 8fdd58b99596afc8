"""Launchers of kernels/avgpool.cu (avgpool2d, avgpool2d_grad) and their cuda op table.

Max pooling (maxpool2d, maxpool2d_grad) is older and lives in launchers.py / pool.cu; both
families share its shape helpers. Launchers check their preconditions and launch on
ctx.stream: no host sync, no allocation.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .launchers import BLOCK, _check, _check_int32, _grid, _launch, _pool_args, _pool_out_shape

SOURCE = "avgpool.cu"
WARP = 32
WARP_WINDOW = 64      # windows of at least this many elements: a warp per output
KERNELS = ("avgpool2d_forward_kernel", "avgpool2d_forward_warp_kernel",
           "avgpool2d_backward_kernel")


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    return {SOURCE: set(KERNELS)}


def avgpool2d_forward(ctx, x, y, kernel, stride, padding=(0, 0),
                      count_include_pad: bool = True) -> None:
    """y = window means of x (N, C, H, W), zero padding; the divisor counts the padding only
    with count_include_pad (PyTorch avg_pool2d, floor mode)."""
    _check("avgpool2d input", x)
    y_shape = _pool_out_shape(tuple(x.shape), kernel, stride, padding, "avgpool2d")
    _check("avgpool2d output", y, shape=y_shape)
    _check_int32("avgpool2d", max(x.size, y.size))
    if not y.size:
        return
    args = (x, y, np.int32(bool(count_include_pad))) \
        + _pool_args(tuple(x.shape), y_shape, kernel, stride, padding)
    if kernel[0] * kernel[1] >= WARP_WINDOW:
        _launch(ctx, SOURCE, "avgpool2d_forward_warp_kernel", _grid(y.size * WARP),
                (BLOCK,), args)
    else:
        _launch(ctx, SOURCE, "avgpool2d_forward_kernel", _grid(y.size), (BLOCK,), args)


def avgpool2d_backward(ctx, dy, dx, kernel, stride, padding=(0, 0),
                       count_include_pad: bool = True) -> None:
    """dx = avgpool2d's gradient: each dy / its divisor spread over its window, gathered per
    input element (fixed order, no atomics)."""
    _check("avgpool2d_grad dx", dx)
    y_shape = _pool_out_shape(tuple(dx.shape), kernel, stride, padding, "avgpool2d_grad")
    _check("avgpool2d_grad dy", dy, shape=y_shape)
    _check_int32("avgpool2d_grad", max(dx.size, dy.size))
    if dx.size:
        _launch(ctx, SOURCE, "avgpool2d_backward_kernel", _grid(dx.size), (BLOCK,),
                (dy, dx, np.int32(bool(count_include_pad)))
                + _pool_args(tuple(dx.shape), y_shape, kernel, stride, padding))


def _geometry(attrs: dict) -> tuple:
    return (tuple(attrs["kernel"]), tuple(attrs["stride"]), tuple(attrs.get("padding", (0, 0))),
            bool(attrs.get("count_include_pad", True)))


IMPLS: dict[str, Callable] = {
    "avgpool2d": lambda node, ins, outs, ctx: avgpool2d_forward(
        ctx, ins[0], outs[0], *_geometry(node.attrs)),
    "avgpool2d_grad": lambda node, ins, outs, ctx: avgpool2d_backward(
        ctx, ins[0], outs[0], *_geometry(node.attrs)),
}
