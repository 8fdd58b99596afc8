"""Launchers of small_matmul.cu and tile_matmul.cu: GEMMs cuBLASLt serves poorly.

- small_matmul_forward: products of at most SMALL_MACS multiply-adds, one owner thread (or
  warp) per output: the 10-class output layers of the benchmark models and their gradients
  (128x10x512: cuBLASLt 5-10 µs, 2 kernels). linear.py always routes these here, float32 or
  bfloat16.
- tile_matmul_forward: mid-size products with few rows (a batch), 64 x 64 tiles with the k
  range split over blocks (cuBLASLt's fp32 tiles are 128 x 128 or larger: a 128 x 512 output
  keeps 4 SMs busy). linear.py times it against cuBLASLt once per problem. float32 only.
Arithmetic in float32, every sum in a fixed order, so results are deterministic; float32
operands give exact float32. bfloat16 operands (precision="bf16", uint16 bits; the small
kernels only) are widened exactly, their products accumulated in float32, bias and activation
applied in float32, and each bf16 output rounded once as it is stored: the numpy emulation's
arithmetic but for the order of the sums. float16 operands (precision="fp16", model.half()) the
same.
"""
from __future__ import annotations

import numpy as np

from ....errors import ShapeError
from ....ir.graph import ir_dtype, storage_dtype
from ..runtime import compiler
from ..runtime.launch import ELEMENT_CTYPES

SMALL_MACS = 1 << 21        # multiply-adds under which the direct kernel wins (H200)
THREAD_K = 48               # dot products up to this long: one thread each, else one warp,
WARP_MAX_OUTPUTS = 8192     # but only for few outputs: with many, a thread per output keeps
                            # the loads of neighbouring outputs coalesced (a warp's lanes stride
                            # over k, which is uncoalesced for a transposed operand)
BLOCK = 256
MAX_BLOCKS = 4096
ACT_CODES = {None: -1, "relu": 0, "leaky_relu": 1, "sigmoid": 2, "tanh": 3, "gelu": 4,
             "gelu_tanh": 5}
# (operands' IR dtype, outputs' IR dtype) the small kernels are instantiated for: those of the
# linear and matmul nodes (an IR product writes its operands' dtype).
SMALL_DTYPES = (("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"))
SMALL_KERNELS = ("small_matmul_thread_kernel", "small_matmul_warp_kernel")


def _small_kernel(name: str, dtypes: tuple[str, str]) -> str:
    s, d = (ELEMENT_CTYPES[np.dtype(storage_dtype(t))] for t in dtypes)
    return f"{name}<{s}, {d}>"


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name the launchers here may launch} (linear.py's family
    declares them; the NVRTC compile test instantiates each)."""
    small = {_small_kernel(name, d) for name in SMALL_KERNELS for d in SMALL_DTYPES}
    return {"small_matmul.cu": small,
            "tile_matmul.cu": {"tile_matmul_kernel", "tile_matmul_finish_kernel"}}


def is_small(m: int, n: int, k: int) -> bool:
    return m * n * k <= SMALL_MACS


def has_small_kernel(a, b, c) -> bool:
    """Whether small_matmul_forward has a kernel for c = a @ b's storages (SMALL_DTYPES)."""
    return a.dtype == b.dtype and (ir_dtype(a.dtype), ir_dtype(c.dtype)) in SMALL_DTYPES


def _operand(x, transposed: bool) -> tuple[int, int, int, int]:
    """(rows, cols, row stride, col stride) in elements of op(x) for a 2-D strided x."""
    rows, cols = x.shape
    s0, s1 = (st // x.itemsize for st in x.strides)
    return (cols, rows, s1, s0) if transposed else (rows, cols, s0, s1)


def _check_operands(a, b, c, bias, z, m, n, k, k2, trans_a, trans_b,
                    dtypes: tuple[tuple[str, str], ...], addend=None) -> tuple[str, str]:
    """The (operands', outputs') IR dtypes, one of `dtypes`: a and b share one, c, bias, z
    and addend the other; ShapeError when they do not, or when a shape does not fit."""
    outs = (("c", c), ("bias", bias), ("z", z), ("addend", addend))
    got = (ir_dtype(a.dtype), ir_dtype(c.dtype))
    if a.dtype != b.dtype or got not in dtypes or any(
            x is not None and x.dtype != c.dtype for _, x in outs):
        found = ", ".join(f"{name} {ir_dtype(x.dtype)}" for name, x in (("a", a), ("b", b))
                          + outs if x is not None)
        raise ShapeError(f"small_matmul: {found}; (operands, outputs) must be one of {dtypes}")
    if k != k2 or tuple(c.shape) != (m, n) or not c.flags.c_contiguous:
        raise ShapeError(f"small_matmul: {a.shape}{'T' if trans_a else ''} @ "
                         f"{b.shape}{'T' if trans_b else ''} -> {c.shape}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ShapeError(f"small_matmul bias: expected ({n},), got {bias.shape}")
    for name, x in (("z", z), ("addend", addend)):
        if x is not None and (tuple(x.shape) != (m, n) or not x.flags.c_contiguous):
            raise ShapeError(f"small_matmul {name}: expected contiguous ({m}, {n}), "
                             f"got {x.shape}")
    return got


def small_matmul_forward(ctx, a, b, c, *, trans_a=False, trans_b=False, bias=None, z=None,
                         act=None, slope=0.01, addend=None) -> None:
    """c = act(op(a) @ op(b) [+ addend] + bias), z = the pre-activation when given; one
    launch. a and b float32, bfloat16 or float16, c, bias, z and addend (matmul's add_c,
    shaped as c) the same (SMALL_DTYPES)."""
    m, k, a_i, a_k = _operand(a, trans_a)
    k2, n, b_k, b_j = _operand(b, trans_b)
    dtypes = _check_operands(a, b, c, bias, z, m, n, k, k2, trans_a, trans_b, SMALL_DTYPES,
                             addend)
    if m * n >= 2**31:
        raise ShapeError(f"small_matmul: {m} x {n} outputs exceed the kernels' 32-bit indices")
    per_thread = k <= THREAD_K or m * n > WARP_MAX_OUTPUTS
    threads = m * n if per_thread else m * n * 32
    grid = (max(1, min(-(-threads // BLOCK), MAX_BLOCKS)),)
    name = _small_kernel(SMALL_KERNELS[0] if per_thread else SMALL_KERNELS[1], dtypes)
    null = np.uint64(0)     # a null pointer argument
    compiler.kernel("small_matmul.cu", name)(
        grid, (BLOCK,),
        (a, b, bias if bias is not None else null, addend if addend is not None else null, c,
         z if z is not None else null, np.int32(m), np.int32(n), np.int32(k), np.int64(a_i),
         np.int64(a_k), np.int64(b_k), np.int64(b_j), np.int32(ACT_CODES[act]),
         np.float32(slope)),
        stream=ctx.stream)


TILE = 64                   # tile_matmul.cu TILE_M = TILE_N
TILE_K = 16
TILE_THREADS = 256
TILE_SPLITS = (1, 2, 4, 8, 16)   # k ranges over blocks: candidates, timed per problem
TILE_MAX_MACS = 1 << 28     # above this cuBLASLt's large tiles fill the GPU: no candidates
TILE_DTYPES = (("float32", "float32"),)


def tile_splits(m: int, n: int, k: int) -> list[int]:
    """The candidate k splits of an (m, n, k) product (none for large products, or more row
    tiles than a grid's y extent): each split keeps at least two TILE_K steps, and the
    partial sums fit 32-bit indices."""
    if m * n * k > TILE_MAX_MACS or -(-m // TILE) > 65535:
        return []
    return [s for s in TILE_SPLITS
            if (s == 1 or -(-k // s) >= 2 * TILE_K) and s * m * n < 2**31]


def tile_matmul_forward(ctx, a, b, c, *, splits: int, partial=None, trans_a=False,
                        trans_b=False, bias=None, z=None, act=None, slope=0.01,
                        addend=None) -> None:
    """c = act(op(a) @ op(b) [+ addend] + bias), z = the pre-activation when given, through
    64 x 64 tiles with k split `splits` ways; splits > 1 needs `partial`, a float32 buffer of
    at least splits * m * n (the second launch adds the splits in order, then the addend)."""
    m, k, a_i, a_k = _operand(a, trans_a)
    k2, n, b_k, b_j = _operand(b, trans_b)
    _check_operands(a, b, c, bias, z, m, n, k, k2, trans_a, trans_b, TILE_DTYPES, addend)
    if splits * m * n >= 2**31:
        raise ShapeError(f"tile_matmul: {splits} x {m} x {n} partial sums exceed 32-bit indices")
    if splits > 1 and (partial is None or partial.size < splits * m * n):
        raise ShapeError(f"tile_matmul: {splits} splits need a buffer of {splits * m * n} floats")
    null = np.uint64(0)
    epilogue = (bias if bias is not None else null, addend if addend is not None else null, c,
                z if z is not None else null)
    grid = (-(-n // TILE), -(-m // TILE), splits)
    compiler.kernel("tile_matmul.cu", "tile_matmul_kernel")(
        grid, (TILE_THREADS,),
        (a, b, *epilogue, partial if splits > 1 else null, np.int32(m), np.int32(n),
         np.int32(k), np.int32(-(-k // splits)), np.int64(a_i), np.int64(a_k), np.int64(b_k),
         np.int64(b_j), np.int32(ACT_CODES[act]), np.float32(slope)),
        stream=ctx.stream)
    if splits > 1:
        compiler.kernel("tile_matmul.cu", "tile_matmul_finish_kernel")(
            (max(1, min(-(-m * n // BLOCK), MAX_BLOCKS)),), (BLOCK,),
            (partial, np.int32(splits), *epilogue, np.int32(m), np.int32(n),
             np.int32(ACT_CODES[act]), np.float32(slope)),
            stream=ctx.stream)
