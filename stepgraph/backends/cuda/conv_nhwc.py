"""Launchers of kernels/conv_nhwc.cu: channels-last convolutions with few input taps (a vision
network's stem), the "small" candidate path of conv.py's forward and weight gradient.

A problem qualifies (`unsupported` is None) when it is channels-last, groups 1 and dilation 1,
with C * kh * kw <= MAX_TAPS taps and O a multiple of 4 up to MAX_OUT output channels, float32
or bfloat16 (uint16 bits), with the kernels' alignment. The autotuner times the path against
cuDNN's plans like any other candidate. The forward writes y in one pass (conv.py adds a bias
and ReLU with its epilogue kernel); the weight gradient sums each block's pixels into a float32
partial (GRAD_WEIGHT_BLOCKS blocks, fixed: the same bits on every GPU) and a second launch
adds the blocks in order, rounding once to dw's dtype.
"""
from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from . import compiler

SOURCE = "conv_nhwc.cu"
MAX_TAPS = 32                  # conv_nhwc.cu SMALL_MAX_TAPS
MAX_OUT = 256                  # SMALL_MAX_OUT
TILE_FLOATS = 8192             # SMALL_TILE_FLOATS
PATCH_FLOATS = 4096            # SMALL_PATCH_FLOATS
BLOCK = 256
FORWARD_MAX_BLOCKS = 4096      # grid-stride loops cover the rest
GRAD_WEIGHT_BLOCKS = 512       # pixel splits of the weight gradient (its partial sums)
SUM_BLOCK = 256
CTYPES = {"float32": "float", "uint16": "unsigned short"}    # storage -> the kernels' T
MAX_INT = 2**31 - 1


def unsupported(g, layout: str, dtype) -> str | None:
    """Why the small channels-last kernels cannot run this problem, or None if they can."""
    if layout != "NHWC":
        return "not channels-last"
    if not g.plain:
        return "groups or dilation"
    if g.ck > MAX_TAPS:
        return f"{g.ck} taps (C * kh * kw) > {MAX_TAPS}"
    if g.o % 4 or g.o > MAX_OUT:
        return f"{g.o} output channels (a multiple of 4 up to {MAX_OUT} needed)"
    if str(dtype) not in CTYPES:
        return f"dtype {dtype}"
    if max(g.n * g.h * g.w * g.c, g.n * g.ho * g.wo * g.o) > MAX_INT:
        return "more than 2^31 elements"
    return None


def _args(g) -> tuple:
    """SMALL_SHAPE_ARGS of conv_nhwc.cu."""
    return tuple(np.int32(v) for v in (g.n, g.h, g.w, g.c, g.o, g.ho, g.wo, g.kh, g.kw, g.sh,
                                       g.sw, g.ph, g.pw))


def _kernel(name: str, dtype):
    return compiler.kernel(SOURCE, f"{name}<{CTYPES[str(dtype)]}>")


def _check(g, layout: str, arrays: dict) -> None:
    why = unsupported(g, layout, next(iter(arrays.values())).dtype)
    if why is not None:
        raise ShapeError(f"conv2d small channels-last kernels: cannot run {g}: {why}")
    for what, a in arrays.items():
        if a.data.ptr % 16:
            raise ShapeError(f"conv2d small channels-last kernels: {what} is not 16-byte "
                             f"aligned")


def conv2d_small_forward(ctx, g, x, w, y) -> None:
    """y (N, Ho, Wo, O) = conv2d(x (N, H, W, C), w (O, kh, kw, C)): a thread per pixel and 4
    output channels."""
    _check(g, "NHWC", {"x": x, "w": w, "y": y})
    work = g.n * g.ho * g.wo * (g.o // 4)
    if work == 0:
        return
    _kernel("conv2d_nhwc_small_forward_kernel", x.dtype)(
        (max(1, min(-(-work // BLOCK), FORWARD_MAX_BLOCKS)),), (BLOCK,), (x, w, y) + _args(g),
        stream=ctx.stream)


def grad_weight_split(g) -> tuple[int, int]:
    """(blocks, pixels per block) of the weight gradient."""
    pixels = g.n * g.ho * g.wo
    per = max(1, -(-pixels // GRAD_WEIGHT_BLOCKS))
    return max(1, -(-pixels // per)), per


def conv2d_small_grad_weight(ctx, g, dy, x, dw, partial) -> None:
    """dw (O, kh, kw, C) of conv2d given dy (N, Ho, Wo, O) and x (N, H, W, C); `partial` is
    float32 scratch of (grad_weight_split blocks, O * CK)."""
    _check(g, "NHWC", {"dy": dy, "x": x, "dw": dw})
    blocks, per = grad_weight_split(g)
    elements = g.o * g.ck
    if partial.dtype != np.float32 or partial.size < blocks * elements:
        raise ShapeError(f"conv2d small grad_weight: partial must be float32 of at least "
                         f"{blocks * elements} elements, got {partial.dtype} {partial.size}")
    if elements == 0:
        return
    _kernel("conv2d_nhwc_small_grad_weight_kernel", x.dtype)(
        (blocks,), (BLOCK,), (dy, x, partial, np.int32(per)) + _args(g), stream=ctx.stream)
    _kernel("conv2d_nhwc_small_grad_weight_sum_kernel", dw.dtype)(
        (-(-elements // SUM_BLOCK),), (SUM_BLOCK,),
        (partial, dw, np.int32(elements), np.int32(blocks)), stream=ctx.stream)


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    return {SOURCE: {f"{k}<{t}>" for t in CTYPES.values() for k in (
        "conv2d_nhwc_small_forward_kernel", "conv2d_nhwc_small_grad_weight_kernel",
        "conv2d_nhwc_small_grad_weight_sum_kernel")}}
