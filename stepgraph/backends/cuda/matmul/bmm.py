"""The batched GEMM op `bmm` on cuBLASLt: c (B, M, N) = op(a) @ op(b) per batch item, one
strided-batched call (gemm.matmul with 3-D operands: each operand's batch stride is read from
its strides, as conv.py's batched GEMMs do). attrs trans_a / trans_b as matmul's: a is
(B, K, M) when trans_a, b is (B, N, K) when trans_b; nothing is transposed in memory.
ctx.precision picks exact FP32 or TF32, as for every GEMM. bfloat16 operands (precision="bf16",
uint16 bits: the products of attention written out by hand, q @ k^T and att @ v) accumulate in
float32 and round once, as gemm.py's bf16 GEMMs do. No host sync, no allocation.
"""
from __future__ import annotations

from typing import Callable

from ....errors import ShapeError
from . import gemm
from ..elementwise import fill_forward
from ..runtime.launch import _check

BF16_OPS = frozenset({"bmm"})
FP16_OPS = BF16_OPS      # float16 operands: CUDA_R_16F, float32 accumulation (gemm.py)


def _check_bmm(a, b, c, trans_a: bool, trans_b: bool) -> int:
    """K of the product; ShapeError unless (B, M, K) @ (B, K, N) -> (B, M, N) after the flags."""
    for name, t in (("a", a), ("b", b), ("output", c)):
        _check(f"bmm {name}", t, dtype=None)
        if t.ndim != 3:
            raise ShapeError(f"bmm {name}: expected a 3-D (batch, rows, cols) array, got "
                             f"{tuple(t.shape)}")
    dtypes = [gemm.ir_dtype(t) for t in (a, b, c)]
    if len(set(dtypes)) != 1 or dtypes[0] not in gemm.DTYPES:
        raise ShapeError(f"bmm: dtypes {dtypes[0]}, {dtypes[1]} -> {dtypes[2]}; expected one "
                         f"of {gemm.DTYPES} throughout")
    batch = a.shape[0]
    m, k = (a.shape[2], a.shape[1]) if trans_a else (a.shape[1], a.shape[2])
    k2, n = (b.shape[2], b.shape[1]) if trans_b else (b.shape[1], b.shape[2])
    if b.shape[0] != batch or k != k2 or tuple(c.shape) != (batch, m, n):
        raise ShapeError(f"bmm: op(a) {(batch, m, k)} @ op(b) {(b.shape[0], k2, n)} does not "
                         f"give the output {tuple(c.shape)}")
    return k


def bmm_forward(ctx, a, b, c, trans_a: bool = False, trans_b: bool = False) -> None:
    """c = op(a) @ op(b) per batch item (strided-batched cuBLASLt; zeros when K is 0)."""
    k = _check_bmm(a, b, c, trans_a, trans_b)
    if not c.size:
        return
    if k == 0:
        fill_forward(ctx, c, 0.0)
        return
    gemm.matmul(ctx, a, b, c, trans_a=trans_a, trans_b=trans_b)


IMPLS: dict[str, Callable] = {
    "bmm": lambda node, ins, outs, ctx: bmm_forward(
        ctx, ins[0], ins[1], outs[0], bool(node.attrs.get("trans_a")),
        bool(node.attrs.get("trans_b"))),
}
