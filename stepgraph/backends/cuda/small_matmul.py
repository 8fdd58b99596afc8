"""Launcher of kernels/small_matmul.cu: GEMMs too small for cuBLASLt to fill the GPU.

linear.py routes a product here when it has at most SMALL_MACS multiply-adds: the 10-class
output layers of the benchmark models and their gradients (128x10x512: cuBLASLt 5-10 µs,
2 kernels). Exact float32 with one owner per output, so results are deterministic.
"""
from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from . import compiler

SMALL_MACS = 1 << 21        # multiply-adds under which the direct kernel wins (H200)
THREAD_K = 48               # dot products up to this long: one thread each, else one warp,
WARP_MAX_OUTPUTS = 8192     # but only for few outputs: with many, a thread per output keeps
                            # the loads of neighbouring outputs coalesced (a warp's lanes stride
                            # over k, which is uncoalesced for a transposed operand)
BLOCK = 256
MAX_BLOCKS = 4096
ACT_CODES = {None: -1, "relu": 0, "leaky_relu": 1, "sigmoid": 2, "tanh": 3, "gelu": 4,
             "gelu_tanh": 5}


def is_small(m: int, n: int, k: int) -> bool:
    return m * n * k <= SMALL_MACS


def _operand(x, transposed: bool) -> tuple[int, int, int, int]:
    """(rows, cols, row stride, col stride) in elements of op(x) for a 2-D strided x."""
    rows, cols = x.shape
    s0, s1 = (st // x.itemsize for st in x.strides)
    return (cols, rows, s1, s0) if transposed else (rows, cols, s0, s1)


def small_matmul_forward(ctx, a, b, c, *, trans_a=False, trans_b=False, bias=None, z=None,
                         act=None, slope=0.01) -> None:
    """c = act(op(a) @ op(b) + bias), z = the pre-activation when given; one launch."""
    for name, x in (("a", a), ("b", b), ("c", c)) + ((("bias", bias),) if bias is not None else ()):
        if x.dtype != np.float32:
            raise ShapeError(f"small_matmul {name}: float32 only, got {x.dtype}")
    m, k, a_i, a_k = _operand(a, trans_a)
    k2, n, b_k, b_j = _operand(b, trans_b)
    if k != k2 or tuple(c.shape) != (m, n) or not c.flags.c_contiguous:
        raise ShapeError(f"small_matmul: {a.shape}{'T' if trans_a else ''} @ "
                         f"{b.shape}{'T' if trans_b else ''} -> {c.shape}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ShapeError(f"small_matmul bias: expected ({n},), got {bias.shape}")
    if z is not None and (tuple(z.shape) != (m, n) or not z.flags.c_contiguous):
        raise ShapeError(f"small_matmul z: expected contiguous ({m}, {n}), got {z.shape}")
    if m * n >= 2**31:
        raise ShapeError(f"small_matmul: {m} x {n} outputs exceed the kernels' 32-bit indices")
    per_thread = k <= THREAD_K or m * n > WARP_MAX_OUTPUTS
    threads = m * n if per_thread else m * n * 32
    grid = (max(1, min(-(-threads // BLOCK), MAX_BLOCKS)),)
    name = "small_matmul_thread_kernel" if per_thread else "small_matmul_warp_kernel"
    null = np.uint64(0)     # a null pointer argument
    compiler.kernel("small_matmul.cu", name)(
        grid, (BLOCK,),
        (a, b, bias if bias is not None else null, c, z if z is not None else null,
         np.int32(m), np.int32(n), np.int32(k), np.int64(a_i), np.int64(a_k), np.int64(b_k),
         np.int64(b_j), np.int32(ACT_CODES[act]), np.float32(slope)),
        stream=ctx.stream)
