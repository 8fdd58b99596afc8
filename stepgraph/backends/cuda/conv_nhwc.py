"""Launchers of kernels/conv_nhwc.cu: the weight gradient of channels-last convolutions with
few input taps (a vision network's stem), the "small" candidate path of conv.py's
conv2d_grad_weight.

A problem qualifies (`unsupported` is None) when it is channels-last, groups 1 and dilation 1,
with C * kh * kw <= MAX_TAPS taps and O a multiple of 4 up to MAX_OUT output channels, float32
or bfloat16 (uint16 bits). The autotuner times the path against cuDNN's plans like any other
candidate. Each of GRAD_WEIGHT_BLOCKS blocks (fixed: the same bits on every GPU) sums its
pixels into a float32 partial; a second launch adds the blocks in order, rounding once to dw's
dtype. (A forward kernel for such convolutions was tried too: instruction-bound at 266 µs
against cuDNN's 78 µs on the resnet stem, H200; it is not kept.)
"""
from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from . import compiler

SOURCE = "conv_nhwc.cu"
MAX_TAPS = 32                  # conv_nhwc.cu SMALL_MAX_TAPS
MAX_OUT = 256                  # SMALL_MAX_OUT
BLOCK = 256
GRAD_WEIGHT_BLOCKS = 512       # pixel splits of the weight gradient (its partial sums)
SUM_BLOCK = 256
CTYPES = {"float32": "float", "uint16": "unsigned short"}    # storage -> the kernels' T
MAX_INT = 2**31 - 1
KERNELS = ("conv2d_nhwc_small_grad_weight_kernel", "conv2d_nhwc_small_grad_weight_sum_kernel")


def unsupported(g, layout: str, dtype) -> str | None:
    """Why the small channels-last kernel cannot run this problem, or None if it can."""
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


def grad_weight_split(g) -> tuple[int, int]:
    """(blocks, pixels per block) of the weight gradient."""
    pixels = g.n * g.ho * g.wo
    per = max(1, -(-pixels // GRAD_WEIGHT_BLOCKS))
    return max(1, -(-pixels // per)), per


def conv2d_small_grad_weight(ctx, g, dy, x, dw, partial) -> None:
    """dw (O, kh, kw, C) of conv2d given dy (N, Ho, Wo, O) and x (N, H, W, C); `partial` is
    float32 scratch of (grad_weight_split blocks, O * CK)."""
    why = unsupported(g, "NHWC", x.dtype)
    if why is not None:
        raise ShapeError(f"conv2d small grad_weight: cannot run {g}: {why}")
    for what, a in (("dy", dy), ("x", x), ("dw", dw)):
        if a.dtype != x.dtype or a.data.ptr % 16:
            raise ShapeError(f"conv2d small grad_weight: {what} must be 16-byte aligned "
                             f"{x.dtype}, got {a.dtype}")
    blocks, per = grad_weight_split(g)
    elements = g.o * g.ck
    if partial.dtype != np.float32 or partial.size < blocks * elements:
        raise ShapeError(f"conv2d small grad_weight: partial must be float32 of at least "
                         f"{blocks * elements} elements, got {partial.dtype} {partial.size}")
    if elements == 0:
        return
    _kernel(KERNELS[0], x.dtype)((blocks,), (BLOCK,), (dy, x, partial, np.int32(per)) + _args(g),
                                 stream=ctx.stream)
    _kernel(KERNELS[1], dw.dtype)((-(-elements // SUM_BLOCK),), (SUM_BLOCK,),
                                  (partial, dw, np.int32(elements), np.int32(blocks)),
                                  stream=ctx.stream)


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    return {SOURCE: {f"{k}<{t}>" for t in CTYPES.values() for k in KERNELS}}
