"""Launchers of pool3d.cu (maxpool3d, maxpool3d_grad, avgpool3d, avgpool3d_grad) and their cuda
op table: NCDHW tensors, every argument of torch's max_pool3d / avg_pool3d (ceil_mode,
dilation, count_include_pad, divisor_override). Launchers check their preconditions and launch
on ctx.stream: no host sync, no allocation.

Every kernel is a template over the element storage: float32, or bfloat16 (precision="bf16":
uint16 raw bits), widened on load, summed (and divided) in float32, each output rounded once
on store, as the NumPy emulation rounds; max pooling and its gradient match it bit for bit
(the gradient sums in the reference's order). The indices stay int32.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ...ops.pool import pool3d_sizes
from .cast import CAST_CTYPES, shared_ctype
from .runtime.launch import BLOCK, _check, _check_int32, _grid, _launch

SOURCE = "pool3d.cu"
KERNELS = ("maxpool3d_forward_kernel", "maxpool3d_backward_kernel",
           "avgpool3d_forward_kernel", "avgpool3d_backward_kernel")
BF16_OPS = frozenset({"maxpool3d", "maxpool3d_grad", "avgpool3d", "avgpool3d_grad"})
FP16_OPS = BF16_OPS          # float16: the fp16_bits instantiations (CAST_CTYPES)


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    return {SOURCE: {f"{k}<{ctype}>" for k in KERNELS for _, ctype in CAST_CTYPES.values()}}


def _shapes(op: str, x_shape, attrs) -> tuple[tuple, tuple]:
    """(x, y) shapes (N, C, D, H, W) and (N, C, Do, Ho, Wo) of a 3-d pool, attrs checked."""
    x_shape = tuple(x_shape)
    return x_shape, (*x_shape[:2], *pool3d_sizes(op, x_shape, attrs))


def _shape_args(x_shape, y_shape, attrs) -> tuple:
    """POOL3D_SHAPE_ARGS of pool3d.cu."""
    n, c, *size = x_shape
    return tuple(np.int32(v) for v in (
        n * c, *size, *y_shape[2:], *attrs["kernel"], *attrs["stride"], *attrs["padding"],
        *attrs.get("dilation", (1, 1, 1))))


def maxpool3d_forward(ctx, x, y, idx, attrs) -> None:
    """y = window maxima of x (N, C, D, H, W), idx (int32) = volume-local (d * H + h) * W + w
    of each window's first maximum (ops/pool.py maxpool3d)."""
    ctype = shared_ctype("maxpool3d", {"input": x, "output": y})
    xs, ys = _shapes("maxpool3d", x.shape, attrs)
    _check("maxpool3d output", y, None, ys)
    _check("maxpool3d indices", idx, "int32", ys)
    _check_int32("maxpool3d", max(x.size, y.size))
    if y.size:
        _launch(ctx, SOURCE, f"maxpool3d_forward_kernel<{ctype}>", _grid(y.size), (BLOCK,),
                (x, y, idx) + _shape_args(xs, ys, attrs))


def maxpool3d_backward(ctx, dy, idx, dx, attrs) -> None:
    """dx = each dy added at its idx, gathered per input element in window order."""
    ctype = shared_ctype("maxpool3d_grad", {"dx": dx, "dy": dy})
    xs, ys = _shapes("maxpool3d_grad", dx.shape, attrs)
    _check("maxpool3d_grad dy", dy, None, ys)
    _check("maxpool3d_grad indices", idx, "int32", ys)
    _check_int32("maxpool3d_grad", max(dx.size, dy.size))
    if dx.size:
        _launch(ctx, SOURCE, f"maxpool3d_backward_kernel<{ctype}>", _grid(dx.size), (BLOCK,),
                (dy, idx, dx) + _shape_args(xs, ys, attrs))


def _avg_args(attrs) -> tuple:
    """(count_include_pad, divisor_override; 0: none) as the kernels take them."""
    return (np.int32(bool(attrs.get("count_include_pad", True))),
            np.int32(attrs.get("divisor_override") or 0))


def avgpool3d_forward(ctx, x, y, attrs) -> None:
    """y = window means of x (N, C, D, H, W), torch's divisors (ops/pool.py avgpool3d)."""
    ctype = shared_ctype("avgpool3d", {"input": x, "output": y})
    xs, ys = _shapes("avgpool3d", x.shape, attrs)
    _check("avgpool3d output", y, None, ys)
    _check_int32("avgpool3d", max(x.size, y.size))
    if y.size:
        _launch(ctx, SOURCE, f"avgpool3d_forward_kernel<{ctype}>", _grid(y.size), (BLOCK,),
                (x, y) + _avg_args(attrs) + _shape_args(xs, ys, attrs))


def avgpool3d_backward(ctx, dy, dx, attrs) -> None:
    """dx = each dy / its divisor spread over its window's real elements, gathered per input
    element in window order."""
    ctype = shared_ctype("avgpool3d_grad", {"dx": dx, "dy": dy})
    xs, ys = _shapes("avgpool3d_grad", dx.shape, attrs)
    _check("avgpool3d_grad dy", dy, None, ys)
    _check_int32("avgpool3d_grad", max(dx.size, dy.size))
    if dx.size:
        _launch(ctx, SOURCE, f"avgpool3d_backward_kernel<{ctype}>", _grid(dx.size), (BLOCK,),
                (dy, dx) + _avg_args(attrs) + _shape_args(xs, ys, attrs))


IMPLS: dict[str, Callable] = {
    "maxpool3d": lambda node, ins, outs, ctx: maxpool3d_forward(
        ctx, ins[0], outs[0], outs[1], node.attrs),
    "maxpool3d_grad": lambda node, ins, outs, ctx: maxpool3d_backward(
        ctx, ins[0], ins[1], outs[0], node.attrs),
    "avgpool3d": lambda node, ins, outs, ctx: avgpool3d_forward(ctx, ins[0], outs[0],
                                                                node.attrs),
    "avgpool3d_grad": lambda node, ins, outs, ctx: avgpool3d_backward(ctx, ins[0], outs[0],
                                                                      node.attrs),
}
