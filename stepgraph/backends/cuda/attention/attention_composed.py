"""sdpa and sdpa_grad as cuBLASLt GEMMs over a (bh, L, S) scores buffer, with attention.cu's
two row kernels between them: the candidate the launcher (attention.py) times against the
fused kernels for float32 problems.

The fused kernels never hold the scores in memory, but their tiles are whole multiples of 32
rows and keys: at 65 tokens (a ViT's 64 patches and its class token) three 32-key tiles
compute 96 x 96 scores for 65 x 65, each product three TF32 ones at precision="fp32". The
GEMMs take the problem as it is (exact FP32 or TF32 as ctx.precision says, as every GEMM):
on an H200, a ViT file's fp32 step took 5,361 µs with its attention left as written (cuBLAS
batched GEMMs and softmax kernels, the rewrite off) and 5,566 with the fused kernels
(docs/perf-notes.md, 2026-11-30). Which wins depends on the shape, so neither is a rule:
attention.py times both per problem (runtime/autotune.py).

Forward: S = q k^T (GEMM); the row kernel turns each row into dropout(softmax(scale S +
masks)) in place and writes its lse; out = P v (GEMM). Backward, from q, k, v, out, dout and
lse: S = q k^T and dP = dout v^T (GEMMs, S recomputed rather than kept from the forward, as
the fused backward does); the row kernel turns S into the dropped P and dP into
scale * P * (dP - rowsum(dout * out)); dv = P^T dout, dq = dS k, dk = dS^T q (GEMMs). The
lse each direction writes or reads is the fused kernels' own, so a composed forward and a
fused backward (or the reverse) fit together. No atomics: the bits are the same on every
run.

Operands are read in place through their (batch, head, row) strides: one strided-batched
GEMM over all bh problems where those strides collapse into one, else one GEMM per head (or
per batch entry, whichever is fewer), as for the heads of a packed (..., T, 3C) projection.
The scores buffers are the node's own memory (made at its first eager call): problems whose
scores exceed SCORES_LIMIT bytes, grouped heads and bf16 / float16 storage keep the fused
path alone.
"""
from __future__ import annotations

import cupy as cp  # imports without a GPU
import numpy as np

from ....ir.graph import Node
from ..matmul import gemm
from ..runtime.launch import _kernel, _node_memory
from .operands import SOURCE, THREADS, Heads, Problem

NAME = "composed"
CTYPE = "float"
SCORES_LIMIT = 256 << 20          # bytes of one (bh, L, S) float32 scores buffer at most
ROWS_PER_BLOCK = THREADS // 32    # attention.cu SDPA_ROWS_PER_BLOCK: one warp a row
FORWARD = f"sdpa_rows_forward_kernel<{CTYPE}>"
BACKWARD = f"sdpa_rows_backward_kernel<{CTYPE}>"


def takes(pb: Problem, ctype: str) -> bool:
    """Whether the composed path is a candidate for this problem."""
    return ctype == CTYPE and pb.group == 1 and pb.bh * pb.L * pb.S * 4 <= SCORES_LIMIT


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: the kernels this module launches} (the NVRTC compile test)."""
    return {SOURCE: {FORWARD, BACKWARD}}


def kernels(forward: bool) -> list[tuple[str, str]]:
    """(file, kernel) of the row kernel the forward or the backward launches."""
    return [(SOURCE, FORWARD if forward else BACKWARD)]


# ---- batched views ---------------------------------------------------------------------------

def _split(pb: Problem, layouts: list[Heads]) -> tuple[int, int, bool]:
    """(outer, heads, collapsed): bh = outer x heads problems; collapsed when every operand's
    batch stride is heads x its head stride (or either count is 1), so that one stride walks
    all bh of them."""
    heads = pb.heads
    outer = pb.bh // heads
    collapsed = heads == 1 or outer == 1 or all(h.batch == heads * h.head for h in layouts)
    return outer, heads, collapsed


def _four_d(a, h: Heads, outer: int, heads: int, rows: int, cols: int):
    """a as an (outer, heads, rows, cols) view through its layout (no copy)."""
    item = a.itemsize
    return cp.lib.stride_tricks.as_strided(
        a, (outer, heads, rows, cols), (h.batch * item, h.head * item, h.row * item, item))


def gemm_launches(pb: Problem, layouts: list[Heads]) -> int:
    """GEMM launches a product of these operands takes (batches'): 1, heads or batch
    entries. The composed path's cost depends on it, so the path choice's key holds it."""
    outer, heads, collapsed = _split(pb, layouts)
    return 1 if collapsed else min(outer, heads)


def batches(pb: Problem, operands: list[tuple[object, Heads, int, int]]) -> list[list]:
    """Each operand (array, layout, rows, cols) as 3-D views, one list per GEMM launch: all
    bh problems in one where the strides collapse, else per head or per batch entry (the
    fewer launches)."""
    outer, heads, collapsed = _split(pb, [h for _, h, _, _ in operands])
    views = [_four_d(a, h, outer, heads, rows, cols) for a, h, rows, cols in operands]
    if collapsed:
        flat = []
        for (a, h, rows, cols), v in zip(operands, views):
            stride = h.head if heads > 1 else h.batch
            flat.append(cp.lib.stride_tricks.as_strided(
                a, (pb.bh, rows, cols), (stride * a.itemsize, h.row * a.itemsize, a.itemsize)))
        return [flat]
    if heads <= outer:
        return [[v[:, i] for v in views] for i in range(heads)]
    return [[v[i] for v in views] for i in range(outer)]


def row_stride(pb: Problem) -> int:
    """Floats from one row of scores to the next: S rounded up to a multiple of 4, so that
    every row starts 16-byte aligned for the row kernels' four-key accesses."""
    return -(-pb.S // 4) * 4


def _scores(pb: Problem) -> Heads:
    """The layout of a (bh, L, row_stride) scores buffer seen as (outer, heads, L, S)."""
    ld = row_stride(pb)
    return Heads(pb.heads * pb.L * ld, pb.L * ld, ld)


def _buffer(node: Node, name: str, pb: Problem, ctx):
    shape = (pb.bh, pb.L, row_stride(pb))
    return _node_memory(node, (name, shape), ctx, lambda: cp.empty(shape, np.float32))


def _blocks(pb: Problem) -> tuple[int]:
    return (-(-pb.bh * pb.L // ROWS_PER_BLOCK),)


# ---- launchers -------------------------------------------------------------------------------

def forward(ctx, node: Node, pb: Problem, layouts: list[Heads], q, k, v, out, lse, step,
            tail: tuple) -> None:
    """out and lse of sdpa (layouts: q, k, v, out), through the node's scores buffer; step
    the device step counter (or 0 without dropout), tail the row kernel's last arguments
    (attention.py: the Attn's, then the mask's)."""
    scores = _buffer(node, "sdpa_scores", pb, ctx)
    lq, lk, lv, lo = layouts
    s = (scores, _scores(pb), pb.L, pb.S)
    for qb, kb, sb in batches(pb, [(q, lq, pb.L, pb.E), (k, lk, pb.S, pb.E), s]):
        gemm.matmul(ctx, qb, kb, sb, trans_b=True)
    args = (scores, lse, step, np.int32(pb.heads), np.int32(pb.bh), np.int32(pb.L),
            np.int32(pb.S), np.int32(row_stride(pb))) + tail
    _kernel(SOURCE, FORWARD)(_blocks(pb), (THREADS,), args, stream=ctx.stream)
    for sb, vb, ob in batches(pb, [s, (v, lv, pb.S, pb.Ev), (out, lo, pb.L, pb.Ev)]):
        gemm.matmul(ctx, sb, vb, ob)


def backward(ctx, node: Node, pb: Problem, layouts: list[Heads], q, k, v, out, dout, lse,
             step, dq, dk, dv, tail: tuple) -> None:
    """dq, dk, dv of sdpa (layouts: q, k, v, out, dout, dq, dk, dv), through the node's two
    scores buffers; step and tail as forward's (the Attn's backward arguments)."""
    scores = _buffer(node, "sdpa_scores", pb, ctx)
    dscores = _buffer(node, "sdpa_dscores", pb, ctx)
    lq, lk, lv, lo, ldo, ldq, ldk, ldv = layouts
    s, ds = (scores, _scores(pb), pb.L, pb.S), (dscores, _scores(pb), pb.L, pb.S)
    q_, k_ = (q, lq, pb.L, pb.E), (k, lk, pb.S, pb.E)
    v_, do_ = (v, lv, pb.S, pb.Ev), (dout, ldo, pb.L, pb.Ev)
    for qb, kb, vb, dob, sb, dsb in batches(pb, [q_, k_, v_, do_, s, ds]):
        gemm.matmul(ctx, qb, kb, sb, trans_b=True)
        gemm.matmul(ctx, dob, vb, dsb, trans_b=True)
    args = (scores, dscores, lse, out, dout, step, np.int32(pb.heads), np.int32(pb.bh),
            np.int32(pb.L), np.int32(pb.S), np.int32(row_stride(pb)), np.int32(pb.Ev)) \
        + lo.args() + ldo.args() + tail
    _kernel(SOURCE, BACKWARD)(_blocks(pb), (THREADS,), args, stream=ctx.stream)
    for sb, dsb, qb, kb, dob, dqb, dkb, dvb in batches(pb, [
            s, ds, q_, k_, do_, (dq, ldq, pb.L, pb.E), (dk, ldk, pb.S, pb.E),
            (dv, ldv, pb.S, pb.Ev)]):
        gemm.matmul(ctx, sb, dob, dvb, trans_a=True)
        gemm.matmul(ctx, dsb, kb, dqb)
        gemm.matmul(ctx, dsb, qb, dkb, trans_a=True)
