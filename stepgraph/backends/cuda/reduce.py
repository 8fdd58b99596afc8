"""Launchers of reduce.cu: reduce_sum over any axes (column sums, batched or not, sums over
planes, a warp per row for many short rows (the last axes of a contiguous array), a strided
fallback), the activation gradient fused with the bias gradient's column sum (act_bias_grad),
and global_norm over many tensors in one launch.

Device memory kept per node (runtime/launch.py `_node_memory`): reduce_sum and act_bias_grad
split over rows keep the splits' float64 partial sums; global_norm a table of tensor pointers
and sizes, per-block work items, a float64 partial per block and an arrival counter.
reduce_sum, act_bias_grad and global_norm take float32, bf16 (uint16 bits) or float16 operands
(a float16 sum is accumulated as the float32 one and rounded once).
"""
from __future__ import annotations

import math
from typing import Callable

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ...errors import ShapeError
from ...ir.graph import Node
from ...ops.shape import contiguous_strides
from .elementwise import fill_forward
from .runtime.launch import (BLOCK, ELEMENT_CTYPES, FLOAT_KINDS, _act_code, _aligned,
                             _buffers_key, _check, _check_int32, _check_scalar, _chunk_jobs,
                             _element_ctype, _grid, _launch, _node_memory, _row_grid, _slope,
                             _typed, current_sm_count, update_chunk)

PLANE_TARGET_BLOCKS = 512     # reduce_sum over planes: split each plane's rows to about this
# Column sums (bias gradients) split tall inputs' rows to about this many blocks an SM: on an
# H200, gpt's act_bias_grad at (16384, 1536) bf16 took 67 us with 2 an SM, 72 with 5.8 (768
# blocks, the earlier 1024-block target) and 104 with 1; reduce_sum at (16384, 1152) bf16 12.0
# against 13.9.
COLUMN_BLOCKS_PER_SM = 2
COLUMN_SPLIT_ROWS = 256       # rows per split at least
SPLIT_WARPS = 16              # reduce.cu SPLIT_WARPS: the split sums' warps a block (32 outputs)
REDUCE_DIMS = 4               # reduce_sum_strided_kernel: kept and reduced dims, 4 runs each
COLUMN_BLOCK = (32, 16)       # reduce.cu COLUMN_TILE x COLUMN_ROWS
ROW_SUM_ROWS = 8              # reduce_sum_rows_kernel: rows (warps) per (32, 8) block
ROW_SUM_MAX_COLS = 1024       # a warp per row up to here: at most 32 elements a lane
ROW_SUM_MIN_ROWS = PLANE_TARGET_BLOCKS   # fewer rows keep the planes path (_sums_rows)
# Sums over a middle run of axes (kept axes before and after it) are batched column sums when
# the kept run after it is this long: a warp's lanes then read adjacent columns. The strided
# fallback, a thread per output walking its rows alone, took 21 us a call for the squeeze-
# excitation gradients' sums of a MobileNet file at bf16 on an H200 (compat-bench trace).
BATCHED_COLUMNS_MIN = 16
BF16_OPS = frozenset({"reduce_sum", "act_bias_grad", "global_norm"})
FP16_OPS = BF16_OPS


def _column_splits(rows: int, column_blocks: int) -> int:
    """Row splits of a column kernel of `column_blocks` blocks across: about
    COLUMN_BLOCKS_PER_SM blocks an SM for tall inputs, none below COLUMN_SPLIT_ROWS rows per
    split (a second launch would cost more). A fixed number per GPU: reruns are bit-identical."""
    target = COLUMN_BLOCKS_PER_SM * current_sm_count()
    return max(1, min(target // column_blocks, rows // COLUMN_SPLIT_ROWS))


def _column_partials(node: Node, ctx, cols: int, splits: int):
    """The node's float64 (cols, splits) partial sums, or a dummy pointer for one split."""
    if splits == 1:
        return np.uint64(0)
    return _node_memory(node, ("columns", cols, splits), ctx,
                        lambda: cp.empty(cols * splits, np.float64))


def _launch_columns(ctx, node: Node, name: str, rows: int, cols: int, out, arrays: tuple,
                    scalars: tuple, vec: int, batches: int = 1) -> None:
    """A column kernel (rows summed per column into `out`), args = arrays, the partials,
    scalars; with row splits, then the fixed-order sum of the splits' partials. `name` is the
    template's name; its template arguments are out's element type and `vec` (columns per
    thread). batches: that many (rows, cols) inputs one after another, each summed into its
    own `cols` outputs (grid z)."""
    ctype = ELEMENT_CTYPES[out.dtype]
    column_blocks = -(-cols // (32 * vec))
    splits = _column_splits(rows, column_blocks * batches)
    partial = _column_partials(node, ctx, cols * batches, splits)
    kernel = f"{name}<{ctype}, {vec}>"
    _launch(ctx, "reduce.cu", kernel, (column_blocks, splits, batches), COLUMN_BLOCK,
            arrays + (partial,) + scalars)
    if splits > 1:
        _add_splits(ctx, ctype, partial, out, cols * batches, splits)


def _add_splits(ctx, ctype: str, partial, out, mid: int, splits: int) -> None:
    """out (mid,) = the (splits, mid) float64 partials added over the splits in a fixed order
    (reduce.cu reduce_sum_splits_kernel: SPLIT_WARPS warps a block of 32 outputs)."""
    _launch(ctx, "reduce.cu", _typed("reduce_sum_splits_kernel", ctype), (-(-mid // 32),),
            (32, SPLIT_WARPS), (partial, out, np.int32(mid), np.int32(splits)))


def _column_vec(cols: int, *arrays) -> int:
    """Columns a thread of a column kernel owns: four where rows stay aligned to four
    elements (reduce.cu), else one."""
    return 4 if cols % 4 == 0 and _aligned(*arrays, to=4 * arrays[0].itemsize) else 1


def reduce_sum_columns(ctx, node: Node, x, y, rows: int, cols: int, batches: int = 1) -> None:
    """y (batches, cols) = x viewed as (batches, rows, cols) summed over rows; several
    columns a thread where rows allow (_column_vec)."""
    _launch_columns(ctx, node, "reduce_sum_columns_kernel", rows, cols, y, (x, y),
                    (np.int32(rows), np.int32(cols)), _column_vec(cols, x), batches)


def reduce_sum_planes(ctx, node: Node, x, y, outer: int, mid: int, inner: int) -> None:
    """y (mid,) = x viewed as (outer, mid, inner) summed over outer and inner: blocks per
    plane and split of the outer rows, then (several splits) one launch adding the splits'
    float64 partial sums in a fixed order, from the node's own memory."""
    splits = max(1, min(PLANE_TARGET_BLOCKS // max(mid, 1), outer))
    ctype = ELEMENT_CTYPES[y.dtype]
    partial = np.uint64(0)
    if splits > 1:
        partial = _node_memory(node, ("reduce_sum", mid, splits), ctx,
                               lambda: cp.empty(mid * splits, np.float64))
    _launch(ctx, "reduce.cu", _typed("reduce_sum_planes_kernel", ctype), (mid, splits),
            (BLOCK,), (x, y, partial, np.int32(outer), np.int32(mid), np.int32(inner)))
    if splits > 1:
        _add_splits(ctx, ctype, partial, y, mid, splits)


def reduce_sum_rows(ctx, x, y, rows: int, cols: int) -> None:
    """y (rows,) = x viewed as (rows, cols) summed over cols: a warp per row."""
    _launch(ctx, "reduce.cu", _typed("reduce_sum_rows_kernel", ELEMENT_CTYPES[y.dtype]),
            _row_grid(rows, ROW_SUM_ROWS), (32, ROW_SUM_ROWS),
            (x, y, np.int32(rows), np.int32(cols)))


def _sums_rows(outer: int, mid: int, inner: int) -> bool:
    """Whether a sum over (outer, inner) of x viewed as (outer, mid, inner) takes the warp per
    row path: only the trailing axes reduced (outer 1), rows of at most ROW_SUM_MAX_COLS
    elements, and at least ROW_SUM_MIN_ROWS of them. The planes path gives each row a block of
    BLOCK threads: with that many blocks already (PLANE_TARGET_BLOCKS, its own target) it
    cannot split further, and a short row leaves most of each block's time to its barriers
    (e.g. (32768, 96): 32768 blocks adding 96 numbers each). Few rows, or long ones, keep the
    planes path, whose BLOCK threads a row then read it sooner than one warp (conv bias
    gradients, outer > 1, always do)."""
    return outer == 1 and 1 < inner <= ROW_SUM_MAX_COLS and mid >= ROW_SUM_MIN_ROWS


def _reduced_axes(shape: tuple, axes) -> list[int]:
    nd = len(shape)
    return sorted({a % nd for a in axes}) if nd else []


def _run_block(shape: tuple, run: list[int]) -> tuple[int, int, int] | None:
    """(before, run, after) sizes of `shape` around the axes `run` when they are one
    contiguous run (none: the sizes around the end), else None."""
    if run and run != list(range(run[0], run[-1] + 1)):
        return None
    lo, hi = (run[0], run[-1] + 1) if run else (len(shape), len(shape))
    return math.prod(shape[:lo]), math.prod(shape[lo:hi]), math.prod(shape[hi:])


def _kept_block(shape: tuple, axes) -> tuple[int, int, int] | None:
    """(outer, kept, inner) sizes when the axes NOT reduced are one contiguous run, else None."""
    reduced = _reduced_axes(shape, axes)
    return _run_block(shape, [i for i in range(len(shape)) if i not in reduced])


def _reduced_block(shape: tuple, axes) -> tuple[int, int, int] | None:
    """(outer, reduced, inner) sizes when the reduced axes are one contiguous run (with kept
    axes on both sides where _kept_block found none: a channels-last (N, H, W, C) over H and
    W), else None."""
    reduced = _reduced_axes(shape, axes)
    return _run_block(shape, reduced) if reduced else None


def _strided_reduction(shape: tuple, axes) -> tuple[list[int], list[int], list[int], list[int]]:
    """(kept sizes, kept strides, reduced sizes, reduced strides) in elements of contiguous x,
    outermost first: size-1 axes dropped, neighbours of the same kind merged (x is contiguous,
    so they always can be), each list padded in front to REDUCE_DIMS entries."""
    axes = set(_reduced_axes(shape, axes))
    strides = contiguous_strides(shape)
    groups: dict[bool, list[list[int]]] = {False: [], True: []}   # reduced? -> [size, stride]
    last = None
    for i, (size, stride) in enumerate(zip(shape, strides)):
        if size == 1:
            continue
        reduced = i in axes
        if last is reduced:      # the previous kept dim is this one's outer neighbour
            groups[reduced][-1] = [groups[reduced][-1][0] * size, stride]
        else:
            groups[reduced].append([size, stride])
        last = reduced
    for reduced, dims in groups.items():
        if len(dims) > REDUCE_DIMS:
            raise ShapeError(f"reduce_sum over axes {sorted(axes)} of {shape}: more than "
                             f"{REDUCE_DIMS} alternating runs of kept and reduced axes")
        dims[:0] = [[1, 0]] * (REDUCE_DIMS - len(dims))
    kept, red = groups[False], groups[True]
    return [d[0] for d in kept], [d[1] for d in kept], [d[0] for d in red], [d[1] for d in red]


def reduce_sum_strided(ctx, x, y, axes) -> None:
    """y = x.sum(axis=axes) for any axes: a thread per output element walking the reduced
    elements in order (the fallback when the kept axes are not contiguous)."""
    args = [np.int32(v) for part in _strided_reduction(tuple(x.shape), axes) for v in part]
    name = _typed("reduce_sum_strided_kernel", ELEMENT_CTYPES[y.dtype])
    _launch(ctx, "reduce.cu", name, _grid(y.size), (BLOCK,), (x, y, np.int32(y.size), *args))


def reduce_sum_forward(ctx, node: Node, x, y, axes) -> None:
    """y = x.sum(axis=axes): column sums (bias grads), many short rows (the last axes of a
    contiguous array: a channels-last mean over C), sums over (outer, inner) per kept index
    (axes (0, 2, 3) of NCHW: conv bias grads), batched column sums over a middle run of axes
    (H and W of channels-last maps), or any other axes (strided fallback)."""
    _element_ctype("reduce_sum input", x)
    block = _kept_block(tuple(x.shape), axes)
    _check("reduce_sum output", y, x.dtype)
    kept = math.prod(d for i, d in enumerate(x.shape)
                     if i not in _reduced_axes(tuple(x.shape), axes))
    if y.size != kept:
        raise ShapeError(f"reduce_sum output: expected {kept} elements, got shape {y.shape}")
    _check_int32("reduce_sum", x.size)
    if x.size == 0:               # nothing to add up: zeros (also keeps inner > 0 below)
        fill_forward(ctx, y, 0.0)
        return
    if block is None:
        batched = _reduced_block(tuple(x.shape), axes)
        if batched is not None and batched[2] >= BATCHED_COLUMNS_MIN:
            outer, mid, inner = batched     # column sums of each outer index's (mid, inner)
            reduce_sum_columns(ctx, node, x, y, mid, inner, batches=outer)
        else:
            reduce_sum_strided(ctx, x, y, axes)
        return
    outer, mid, inner = block
    if inner == 1 and mid > 1:    # one block per 32 columns; a full sum takes the planes path
        reduce_sum_columns(ctx, node, x, y, outer, mid)
    elif _sums_rows(outer, mid, inner):
        reduce_sum_rows(ctx, x, y, mid, inner)
    else:
        reduce_sum_planes(ctx, node, x, y, outer, mid, inner)


def act_bias_backward(ctx, node: Node, dy, saved, dz, db, kind: str,
                      slope: float = 0.01) -> None:
    """dz = dy * kind'(saved) (kind "none": dz = dy) and db = dz.sum(axis 0), in one pass."""
    code = _act_code(kind, allow_none=True)
    _element_ctype("act_bias_grad dy", dy)
    if dy.ndim != 2:
        raise ShapeError(f"act_bias_grad dy: expected (N, M), got {tuple(dy.shape)}")
    _check("act_bias_grad saved", saved, dy.dtype, dy.shape)
    _check("act_bias_grad dz", dz, dy.dtype, dy.shape)
    _check("act_bias_grad db", db, dy.dtype, (dy.shape[1],))
    _check_int32("act_bias_grad", dy.size)
    rows, cols = dy.shape
    if cols:
        _launch_columns(ctx, node, "act_bias_backward_kernel", rows, cols, db,
                        (dy, saved, dz, db), (np.int32(rows), np.int32(cols), np.int32(code),
                                              np.float32(slope)), _column_vec(cols, dy, saved, dz))


def _build_norm_tables(tensors) -> dict:
    entries = np.array([(t.data.ptr, t.size, _aligned(t), FLOAT_KINDS[t.dtype])
                        for t in tensors], dtype=np.int64)
    chunk = update_chunk(sum(t.size for t in tensors))
    jobs = _chunk_jobs([t.size for t in tensors], chunk)
    return dict(entries=cp.asarray(entries), jobs=cp.asarray(jobs), chunk=chunk,
                partials=cp.zeros(len(jobs), np.float64), counter=cp.zeros(1, np.uint32))


def global_norm_forward(ctx, node: Node, tensors, out) -> None:
    """out = sqrt(sum over tensors of sum(t^2)), float64 accumulation, deterministic."""
    if not tensors:
        raise ShapeError("global_norm: needs at least one tensor")
    _check_scalar("global_norm output", out, "float32")
    key = ("global_norm",) + _buffers_key(tensors)
    tables = _node_memory(node, key, ctx, lambda: _checked_norm_tables(tensors))
    _launch(ctx, "reduce.cu", "global_norm_forward_kernel", (len(tables["partials"]),), (BLOCK,),
            (tables["entries"], tables["jobs"], tables["partials"], tables["counter"], out,
             np.int32(tables["chunk"])))


def _checked_norm_tables(tensors) -> dict:
    for i, t in enumerate(tensors):
        # float32, a bf16 gradient whose cast fuse_gradient_casts dropped, or float16
        _element_ctype(f"global_norm input {i}", t)
    return _build_norm_tables(tensors)


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name these launchers may launch} (as elementwise.py's)."""
    reduce = ("reduce_sum_planes_kernel", "reduce_sum_splits_kernel",
              "reduce_sum_strided_kernel", "reduce_sum_rows_kernel")
    elements = ELEMENT_CTYPES.values()
    return {"reduce.cu": {"global_norm_forward_kernel"}
            | {_typed(k, ctype) for k in reduce for ctype in elements}
            | {f"{k}<{ctype}, {vec}>" for k in ("act_bias_backward_kernel",
                                                  "reduce_sum_columns_kernel")
               for ctype in elements for vec in (1, 4)}}


IMPLS: dict[str, Callable] = {
    "act_bias_grad": lambda node, ins, outs, ctx: act_bias_backward(
        ctx, node, ins[0], ins[1] if len(ins) > 1 else ins[0], outs[0], outs[1],
        node.attrs.get("kind") or "none", _slope(node.attrs)),
    "reduce_sum": lambda node, ins, outs, ctx: reduce_sum_forward(
        ctx, node, ins[0], outs[0], node.attrs["axes"]),
    "global_norm": lambda node, ins, outs, ctx: global_norm_forward(ctx, node, ins, outs[0]),
}
