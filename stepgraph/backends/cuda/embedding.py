"""Launchers of embedding.cu (embedding, embedding_grad) and their cuda op table.

embedding: out[i, :] = weight[idx[i], :] over the flattened indices, float4 copies where
C % 4 == 0 and the pointers are 16-byte aligned; an index outside [0, V) gives a NaN row.

embedding_grad sums the rows of dy per index, deterministically (no float atomics), one of
two ways (`PATH` forces one, for tests):
- "scan" for small problems (V <= SCAN_MAX_VOCAB and V * n <= SCAN_MAX_WORK): a block per
  (vocabulary row, 32 column groups, position segment) scanning the segment's indices; the
  cost grows as V * n. Segments are added until the launch gives every SM SCAN_BLOCKS_PER_SM
  blocks (a small vocabulary's few long scans were latency-bound: GPT's 65 characters over
  16,384 positions took 29.5 us); their partial sums (node scratch) are then added in order by
  a second launch.
- "sorted" otherwise: a stable LSD radix sort of the positions by index, 8 bits a pass
  (ceil(bits(V) / 8) passes of histogram, scan and scatter kernels; 2 passes for a GPT-2
  vocabulary), then a warp per (vocabulary row, 32 column groups) summing its dy rows in
  position order: numpy's np.add.at order, so float32 results match the reference's bits.
  Its scratch (two key and two position buffers of n ints, the digit histograms) is device
  memory made once per node at the first eager call (runtime/launch.py _node_memory): a capture may
  not allocate, and Executable warms up eagerly before capture.
Launchers check their preconditions and launch on ctx.stream: no host sync.

float16 (a model.half()'s table): the same kernels with the storage T = fp16_bits (the
float32 ones keep their names: T defaults to float); the gradient sums in float32, in the same
order, rounding each sum once: `FP16_OPS`.
"""
from __future__ import annotations

from typing import Callable

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ...errors import ShapeError
from ...ir.graph import Node
from .elementwise import fill_forward
from .runtime.launch import (BLOCK, LABEL_CTYPES, MAX_INT, _aligned, _check, _check_int32,
                             _grid, _launch, _node_memory, current_sm_count)

SOURCE = "embedding.cu"
PATH = "auto"                 # "auto", "scan" or "sorted" (tests force one)
SCAN_MAX_VOCAB = 1024         # the scan path's limits: it reads every index V times per chunk
SCAN_MAX_WORK = 1 << 23       # V * n
RADIX_BITS = 8                # embedding.cu RADIX_BITS
RADIX = 1 << RADIX_BITS       # threads of a histogram / scatter block: one per digit
SORT_TILE = 1024              # embedding.cu SORT_TILE: positions per sort block
SCAN_WARPS = 8                # embedding.cu SCAN_WARPS
SCAN_BLOCKS_PER_SM = 8        # the scan launch's blocks an SM, position segments permitting
MAX_GRID_Z = 65535
SUM_ROWS = 8                  # vocabulary rows (warps) per block of the sorted sums
MAX_GRID_Y = 65535
FP16_OPS = frozenset({"embedding", "embedding_grad"})
VALUE_CTYPES = {np.dtype("float32"): "float", np.dtype("float16"): "fp16_bits"}


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    names = {"embedding_sort_scan_kernel"}
    for ctype in LABEL_CTYPES.values():
        names |= {f"embedding_sort_histogram_kernel<{ctype}>",
                  f"embedding_sort_scatter_kernel<{ctype}>"}
        for vtype in VALUE_CTYPES.values():
            names |= {_valued(f"embedding_forward_kernel<{ctype}", vtype),
                      _valued(f"embedding_backward_scan_kernel<{ctype}", vtype)}
    names |= {_scan_sum_name(vtype) for vtype in VALUE_CTYPES.values()}
    names |= {f"embedding_backward_sorted_kernel<{vtype}>" for vtype in VALUE_CTYPES.values()}
    names |= {"embedding_sort_histogram_kernel<int>", "embedding_sort_scatter_kernel<int>"}
    return {SOURCE: names}


def _valued(head: str, vtype: str) -> str:
    """head ("kernel<index type") closed for value storage vtype (float: the default)."""
    return head + (">" if vtype == "float" else f", {vtype}>")


def _value_ctype(what: str, a, dtype=None) -> str:
    """The C type of a float32 or float16 table (or rows of one), of `dtype` when given."""
    _check(what, a, dtype=dtype)
    if a.dtype not in VALUE_CTYPES:
        raise ShapeError(f"{what}: the cuda kernels take float32 or float16, got {a.dtype}")
    return VALUE_CTYPES[a.dtype]


def _check_idx(what: str, idx) -> str:
    _check(what, idx, dtype=None)
    if idx.dtype not in LABEL_CTYPES:
        raise ShapeError(f"{what}: expected int32 or int64 indices, got {idx.dtype}")
    _check_int32(what, idx.size)
    return LABEL_CTYPES[idx.dtype]


def _vec(c: int, *arrays) -> int:
    return 4 if c % 4 == 0 and _aligned(*arrays) else 1


def embedding_forward(ctx, weight, idx, out) -> None:
    """out (idx.shape + (C,)) = weight[idx] for weight (V, C)."""
    vtype = _value_ctype("embedding weight", weight)
    if weight.ndim != 2:
        raise ShapeError(f"embedding weight: expected (V, C), got {tuple(weight.shape)}")
    ctype = _check_idx("embedding indices", idx)
    v, c = weight.shape
    _check("embedding output", out, weight.dtype, shape=tuple(idx.shape) + (c,))
    _check_int32("embedding weight", v)
    if not out.size:
        return
    vec = _vec(c, weight, out)
    _launch(ctx, SOURCE, _valued(f"embedding_forward_kernel<{ctype}", vtype),
            _grid(out.size // vec), (BLOCK,),
            (weight, idx, out, np.int64(idx.size), np.int32(v), np.int32(c), np.int32(vec)))


def _column_chunks(c: int, vec: int) -> int:
    """Grid rows over the column groups: 32 groups (one a lane) per chunk."""
    return max(1, min(-(-(c // vec) // 32), MAX_GRID_Y))


def _sort_passes(v: int) -> int:
    """Radix passes over keys 0..v (v: the bucket of invalid indices)."""
    return max(1, -(-v.bit_length() // RADIX_BITS))


def _sort_scratch(n: int) -> dict:
    blocks = -(-n // SORT_TILE)
    return dict(keys=(cp.empty(n, np.int32), cp.empty(n, np.int32)),
                positions=(cp.empty(n, np.int32), cp.empty(n, np.int32)),
                hist=cp.empty(RADIX * blocks, np.int32), blocks=blocks)


def sort_indices(ctx, node: Node, idx, v: int):
    """(keys, positions): the flattened indices sorted ascending (invalid ones as v, last) and
    their positions, stable (positions ascending within a key). Device scratch of the node."""
    ctype = LABEL_CTYPES[idx.dtype]
    n = idx.size
    scratch = _node_memory(node, ("embedding_sort", n), ctx, lambda: _sort_scratch(n))
    blocks, hist = scratch["blocks"], scratch["hist"]
    keys_in, vals_in, name_type = idx, np.uint64(0), ctype
    for p in range(_sort_passes(v)):
        keys_out, vals_out = scratch["keys"][p % 2], scratch["positions"][p % 2]
        shift = np.int32(p * RADIX_BITS)
        _launch(ctx, SOURCE, f"embedding_sort_histogram_kernel<{name_type}>", (blocks,),
                (RADIX,), (keys_in, hist, np.int32(n), np.int32(v), shift))
        _launch(ctx, SOURCE, "embedding_sort_scan_kernel", (1,), (1024,),
                (hist, np.int32(hist.size)))
        _launch(ctx, SOURCE, f"embedding_sort_scatter_kernel<{name_type}>", (blocks,), (RADIX,),
                (keys_in, vals_in, keys_out, vals_out, hist, np.int32(n), np.int32(v), shift))
        keys_in, vals_in, name_type = keys_out, vals_out, "int"
    return keys_in, vals_in


def _path(v: int, n: int) -> str:
    if PATH != "auto":
        if PATH not in ("scan", "sorted"):
            raise ValueError(f"embedding.PATH must be 'auto', 'scan' or 'sorted', got {PATH!r}")
        return PATH
    return "scan" if v <= SCAN_MAX_VOCAB and v * n <= SCAN_MAX_WORK else "sorted"


def _scan_sum_name(vtype: str) -> str:
    return f"embedding_scan_sum_kernel<{vtype}>"


def _scan_segment(v: int, chunks: int, n: int) -> int:
    """Positions a segment of the scan path covers: a multiple of a block's round of tiles
    (32 * SCAN_WARPS), short enough that (v, chunks, segments) blocks give every SM
    SCAN_BLOCKS_PER_SM blocks where n allows; all n for one segment."""
    tile = 32 * SCAN_WARPS
    want = -(-SCAN_BLOCKS_PER_SM * current_sm_count() // (v * chunks))
    segments = max(1, min(want, -(-n // tile), MAX_GRID_Z))
    return tile * -(-n // (tile * segments))


def _scan(ctx, node: Node, dy, idx, dweight, ctype: str, vtype: str, vec: int,
          chunks: int) -> None:
    v, c = dweight.shape
    n = idx.size
    seg = _scan_segment(v, chunks, n)
    segments = -(-n // seg)
    sums = np.uint64(0)
    if segments > 1:
        sums = _node_memory(node, ("embedding_scan", segments, v * c), ctx,
                            lambda: cp.empty(segments * v * c, np.float32))
    _launch(ctx, SOURCE, _valued(f"embedding_backward_scan_kernel<{ctype}", vtype),
            (min(v, MAX_INT), chunks, segments), (32, SCAN_WARPS),
            (dy, idx, dweight, sums, np.int32(n), np.int32(v), np.int32(c), np.int32(vec),
             np.int32(seg)))
    if segments > 1:
        _launch(ctx, SOURCE, _scan_sum_name(vtype), _grid(v * c), (BLOCK,),
                (sums, dweight, np.int32(v * c), np.int32(segments)))


def embedding_backward(ctx, node: Node, dy, idx, dweight) -> None:
    """dweight (V, C) = the rows of dy (idx.shape + (C,)) summed per index (module docstring)."""
    vtype = _value_ctype("embedding_grad dweight", dweight)
    if dweight.ndim != 2:
        raise ShapeError(f"embedding_grad dweight: expected (V, C), got {tuple(dweight.shape)}")
    v, c = dweight.shape
    ctype = _check_idx("embedding_grad indices", idx)
    _check("embedding_grad dy", dy, dweight.dtype, shape=tuple(idx.shape) + (c,))
    if v >= MAX_INT:
        raise ShapeError(f"embedding_grad: {v} rows exceed the kernels' 32-bit keys")
    _check_int32("embedding_grad dy", dy.size)
    n = idx.size
    if not dweight.size:
        return
    if n == 0:
        fill_forward(ctx, dweight, 0.0)
        return
    vec = _vec(c, dy, dweight)
    chunks = _column_chunks(c, vec)
    if _path(v, n) == "scan":
        _scan(ctx, node, dy, idx, dweight, ctype, vtype, vec, chunks)
        return
    keys, positions = sort_indices(ctx, node, idx, v)
    grid = (max(1, min(-(-v // SUM_ROWS), MAX_INT)), chunks)
    _launch(ctx, SOURCE, f"embedding_backward_sorted_kernel<{vtype}>", grid, (32, SUM_ROWS),
            (dy, keys, positions, dweight, np.int32(n), np.int32(v), np.int32(c), np.int32(vec)))


IMPLS: dict[str, Callable] = {
    "embedding": lambda node, ins, outs, ctx: embedding_forward(ctx, ins[0], ins[1], outs[0]),
    "embedding_grad": lambda node, ins, outs, ctx: embedding_backward(
        ctx, node, ins[0], ins[1], outs[0]),
}
