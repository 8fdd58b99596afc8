"""Launchers of the NVRTC kernels in kernels/*.cu, and the cuda op table `IMPLS` of every op
that is not a GEMM (those are in linear.py and conv.py).

Each launcher checks its preconditions (CuPy arrays, float32 unless stated, C-contiguous,
shapes), computes the grid and launches one kernel on ctx.stream: no host sync, no allocation.
Some nodes keep device memory that is made once, at the first EAGER call on a set of buffers,
and reused by every later call and by a captured graph (Executable warms up eagerly before
capture):
- sgd_update / adam_update / global_norm: a table of tensor pointers and sizes (the updates'
  also holds each parameter's group hyperparameters), and per-block work items (global_norm
  also a float64 partial per block and an arrival counter);
- cross_entropy / cross_entropy_train over more than one block: an arrival counter, the kept
  rows' count (ignore_index) and N floats of per-row losses for the train kernel and the
  label-smoothed forward. Without it a capture falls back to one block;
- cross_entropy_grad: the kept rows' count (without it, each block counts the labels);
- reduce_sum and act_bias_grad split over rows: the splits' float64 partial sums.

precision="bf16": the act, act_grad, add, dropout, reduce_sum and act_bias_grad kernels are
templates on the element storage (ELEMENT_CTYPES: float32, or bfloat16 as uint16 raw bits),
computing in float32 and rounding each bf16 output once; the optimizer updates write the bf16
weight copies (attrs copies). `BF16_OPS` lists the ops of this module that take bf16 operands
(compile/autocast.py check_bf16_support).
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ... import rng
from ...errors import CaptureError, ShapeError
from ...ir.graph import Node
from ...ops.optim import update_weight_copies
from . import compiler

BLOCK = 256                   # threads of a 1-D elementwise block
MAX_BLOCKS = 8192             # grid-stride loops cover the rest
MAX_INT = 2**31 - 1           # kernels index (N, C) and NCHW shapes with 32-bit ints
UPDATE_CHUNK = 1024           # elements per block of a multi-tensor kernel: one float4 per thread
SINGLE_BLOCK_ELEMENTS = 1 << 15   # cross-entropy over at most this many logits: one block
SHORT_ROW = 32                    # cross_entropy_train in one block: a thread per row up to here
PLANE_TARGET_BLOCKS = 512     # reduce_sum over planes: split each plane's rows to about this
COLUMN_TARGET_BLOCKS = 1024   # column sums (bias gradients): split tall inputs' rows to this
COLUMN_SPLIT_ROWS = 256       # rows per split at least
REDUCE_DIMS = 4               # reduce_sum_strided_kernel: kept and reduced dims, 4 runs each
ACT_CODES = {"none": -1, "relu": 0, "leaky_relu": 1, "sigmoid": 2, "tanh": 3, "gelu": 4,
             "gelu_tanh": 5, "silu": 6}      # the ACT_* codes of kernels/elementwise.cuh
LABEL_CTYPES = {np.dtype("int32"): "int", np.dtype("int64"): "long long"}
FILL_CTYPES = {np.dtype("float32"): "float", np.dtype("float64"): "double",
               np.dtype("int32"): "int", np.dtype("int64"): "long long",
               np.dtype("uint8"): "unsigned char", np.dtype("uint16"): "unsigned short"}
# Storage -> C type of the kernels templated on their element type; uint16 is the storage of
# IR dtype bfloat16 only (ir/graph.py storage_dtype), so it always means bf16 bits here.
ELEMENT_CTYPES = {np.dtype("float32"): "float", np.dtype("uint16"): "unsigned short"}
BF16_OPS = frozenset({"act", "act_grad", "add", "dropout", "dropout_grad", "reduce_sum",
                      "act_bias_grad", "sgd_update", "adam_update", "cross_entropy_train",
                      "global_norm"})


# ---- shared helpers ------------------------------------------------------------------------

@functools.cache
def _kernel(filename: str, name: str):
    return compiler.kernel(filename, name)


def _launch(ctx, filename: str, name: str, grid: tuple, block: tuple, args: tuple) -> None:
    _kernel(filename, name)(grid, block, args, stream=ctx.stream)


def _check(what: str, a, dtype: str | None = "float32", shape: tuple | None = None) -> None:
    if not isinstance(a, cp.ndarray):
        raise ShapeError(f"{what}: expected a CuPy array, got {type(a).__name__}")
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise ShapeError(f"{what}: the cuda kernels take {dtype}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ShapeError(f"{what}: must be C-contiguous (strides {a.strides})")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ShapeError(f"{what}: expected shape {tuple(shape)}, got {tuple(a.shape)}")


def _check_scalar(what: str, a, dtype: str) -> None:
    _check(what, a, dtype)
    if a.size != 1:
        raise ShapeError(f"{what}: expected a scalar, got shape {tuple(a.shape)}")


def _element_ctype(what: str, a) -> str:
    """The C type of a float32 or bf16 (uint16 bits) operand of a templated kernel."""
    _check(what, a, dtype=None)
    if a.dtype not in ELEMENT_CTYPES:
        raise ShapeError(f"{what}: the cuda kernels take float32 or bfloat16, got {a.dtype}")
    return ELEMENT_CTYPES[a.dtype]


def _typed(name: str, ctype: str) -> str:
    """The instantiation of kernel template `name` for element type `ctype`."""
    return f"{name}<{ctype}>"


def _check_int32(what: str, n: int) -> None:
    if n > MAX_INT:
        raise ShapeError(f"{what}: {n} elements exceed the kernels' 32-bit indexing")


def _aligned(*arrays, to: int = 16) -> bool:
    return all(a.data.ptr % to == 0 for a in arrays)


def _or_null(a):
    """a, or a null pointer argument for an absent optional array."""
    return np.uint64(0) if a is None else a


def _grid(work: int, block: int = BLOCK) -> tuple[int]:
    return (max(1, min((work + block - 1) // block, MAX_BLOCKS)),)


def _slope(attrs: dict) -> float:
    slope = attrs.get("slope")
    return 0.01 if slope is None else float(slope)


def _act_code(kind: str, allow_none: bool = False) -> int:
    if kind not in ACT_CODES or (kind == "none" and not allow_none):
        raise ValueError(f"unknown activation {kind!r}; expected one of {sorted(ACT_CODES)}")
    return ACT_CODES[kind]


def _capturing(ctx) -> bool:
    return bool(getattr(ctx, "capturing", False)) or ctx.stream.is_capturing()


# Device memory made once per (node, buffers): node -> {key: value}. Weak on the node, so it
# lives exactly as long as the plan that owns the node (and any graph captured from it).
_NODE_MEMORY: "weakref.WeakKeyDictionary[Node, dict]" = weakref.WeakKeyDictionary()


def _node_memory(node: Node, key: tuple, ctx, build: Callable[[], Any], required: bool = True):
    """The memory built for (node, key), building it now if this is an eager call. During a
    capture a missing one is a CaptureError (required) or None (the caller has a fallback)."""
    memory = _NODE_MEMORY.setdefault(node, {})
    if key not in memory:
        if _capturing(ctx):
            if not required:
                return None
            raise CaptureError(
                f"{node.op}: its device tables are built at the first eager run on these buffers;"
                " run the step eagerly once before capturing")
        with ctx.stream:   # allocation and upload ordered before the kernels that read them
            memory[key] = build()
    return memory[key]


def _buffers_key(arrays) -> tuple:
    return tuple((a.data.ptr, a.size) for a in arrays)


# ---- elementwise.cu ------------------------------------------------------------------------

def act_forward(ctx, x, y, kind: str, slope: float = 0.01) -> None:
    """y = kind(x) elementwise, float32 or bf16 (y of x's dtype); y may be x (in place)."""
    code = _act_code(kind)
    ctype = _element_ctype("act input", x)
    _check("act output", y, x.dtype, x.shape)
    n = x.size
    if n:
        _launch(ctx, "elementwise.cu", _typed("act_forward_kernel", ctype), _grid((n + 3) // 4),
                (BLOCK,),
                (x, y, np.int64(n), np.int32(code), np.float32(slope), np.int32(_aligned(x, y))))


def act_backward(ctx, dy, saved, dx, kind: str, slope: float = 0.01) -> None:
    """dx = dy * kind'(saved): saved is y for relu/sigmoid/tanh, the input z otherwise. All
    three float32 or all bf16."""
    code = _act_code(kind)
    ctype = _element_ctype("act_grad dy", dy)
    _check("act_grad saved", saved, dy.dtype, dy.shape)
    _check("act_grad dx", dx, dy.dtype, dy.shape)
    n = dy.size
    if n:
        _launch(ctx, "elementwise.cu", _typed("act_backward_kernel", ctype),
                _grid((n + 3) // 4), (BLOCK,),
                (dy, saved, dx, np.int64(n), np.int32(code), np.float32(slope),
                 np.int32(_aligned(dy, saved, dx))))


def add_forward(ctx, a, b, c) -> None:
    """c = a + b, same shapes, all float32 or all bf16; c may be a or b."""
    ctype = _element_ctype("add a", a)
    _check("add b", b, a.dtype, a.shape)
    _check("add output", c, a.dtype, a.shape)
    n = a.size
    if n:
        _launch(ctx, "elementwise.cu", _typed("add_forward_kernel", ctype), _grid((n + 3) // 4),
                (BLOCK,), (a, b, c, np.int64(n), np.int32(_aligned(a, b, c))))


def fill_forward(ctx, y, value) -> None:
    """y[...] = value, for every stepgraph dtype (uint16 storage: bfloat16, value rounded)."""
    _check("fill output", y, dtype=None)
    ctype = FILL_CTYPES.get(y.dtype)
    if ctype is None:
        raise ShapeError(f"fill: unsupported dtype {y.dtype}")
    scalar = y.dtype.type(value)
    if y.dtype == np.uint16:
        from ..numpy import bf16   # the rounding rule every bf16 kernel uses

        scalar = np.uint16(bf16.to_bits(np.float32(value)))
    if y.size:
        _launch(ctx, "elementwise.cu", f"fill_forward_kernel<{ctype}>", _grid(y.size), (BLOCK,),
                (y, np.int64(y.size), scalar))


def _dropout_constants(p: float) -> tuple[np.uint32, np.float32]:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    # As the numpy reference: integer threshold on 24 bits, scale = float32(1 / (1 - p)).
    return np.uint32(rng.keep_threshold(p)), np.float32(1.0 / (1.0 - p))


def _mask_shape(x, per_channel: bool) -> tuple:
    if per_channel and x.ndim < 2:
        raise ShapeError(f"dropout per_channel needs (N, C, ...) input, got {tuple(x.shape)}")
    return tuple(x.shape[:2]) if per_channel else tuple(x.shape)


def dropout_forward(ctx, x, step, y, mask, p: float, seed: int, site: int,
                    per_channel: bool = False) -> None:
    """y = x * mask / (1 - p) with the Philox mask of (seed, site, step) (rng.py); step is the
    int64 device counter. per_channel: mask (N, C), one decision per plane (Dropout2d)."""
    threshold, scale = _dropout_constants(p)
    if not 0 <= site < 2**32:
        raise ValueError(f"dropout site must fit in 32 bits, got {site}")
    ctype = _element_ctype("dropout input", x)
    _check_scalar("dropout step", step, "int64")
    _check("dropout output", y, x.dtype, x.shape)
    _check("dropout mask", mask, "uint8", _mask_shape(x, per_channel))
    n = x.size
    if not n:
        return
    key = (np.uint64(seed & (2**64 - 1)), np.uint32(site), threshold, scale)
    if per_channel:
        _check_int32("dropout per_channel", n)
        plane = n // mask.size
        name = _typed("dropout_channel_forward_kernel", ctype)
        _launch(ctx, "elementwise.cu", name, _grid(n), (BLOCK,),
                (x, step, y, mask, np.int32(n), np.int32(plane)) + key)
    else:
        vec = _aligned(x, y) and _aligned(mask, to=4)
        name = _typed("dropout_forward_kernel", ctype)
        _launch(ctx, "elementwise.cu", name, _grid((n + 3) // 4), (BLOCK,),
                (x, step, y, mask, np.int64(n)) + key + (np.int32(vec),))


def dropout_backward(ctx, dy, mask, dx, p: float, per_channel: bool = False) -> None:
    """dx = dy * mask / (1 - p), the mask broadcast over each plane when per_channel."""
    _, scale = _dropout_constants(p)
    ctype = _element_ctype("dropout_grad dy", dy)
    _check("dropout_grad mask", mask, "uint8", _mask_shape(dy, per_channel))
    _check("dropout_grad dx", dx, dy.dtype, dy.shape)
    n = dy.size
    if not n:
        return
    if per_channel:
        _check_int32("dropout_grad per_channel", n)
        name = _typed("dropout_channel_backward_kernel", ctype)
        _launch(ctx, "elementwise.cu", name, _grid(n), (BLOCK,),
                (dy, mask, dx, np.int32(n), np.int32(n // mask.size), scale))
    else:
        vec = _aligned(dy, dx) and _aligned(mask, to=4)
        name = _typed("dropout_backward_kernel", ctype)
        _launch(ctx, "elementwise.cu", name, _grid((n + 3) // 4), (BLOCK,),
                (dy, mask, dx, np.int64(n), scale, np.int32(vec)))


def linear_bias_act(ctx, acc, bias, y, z, kind: str, slope: float = 0.01) -> None:
    """The bf16 linear's epilogue from its float32 GEMM result acc (N, M): z = acc + bias
    (bias (M,) or None), y = kind(z); y and z (None: not saved) bf16, each rounded once
    (linear.py runs it where cuBLASLt has no epilogue for the activation)."""
    code = _act_code(kind)
    _check("linear acc", acc)
    if acc.ndim != 2:
        raise ShapeError(f"linear acc: expected (N, M), got {tuple(acc.shape)}")
    ctype = _element_ctype("linear output", y)
    _check("linear output", y, y.dtype, acc.shape)
    if z is not None:
        _check("linear preactivation", z, y.dtype, acc.shape)
    if bias is not None:
        _check("linear bias", bias, y.dtype, (acc.shape[1],))
    if acc.size:
        name = _typed("linear_bias_act_kernel", ctype)
        _launch(ctx, "elementwise.cu", name, _grid(acc.size), (BLOCK,),
                (acc, _or_null(bias), y, _or_null(z), np.int64(acc.size),
                 np.int32(acc.shape[1]), np.int32(code), np.float32(slope)))


# ---- reduce.cu -----------------------------------------------------------------------------

COLUMN_BLOCK = (32, 16)   # reduce.cu COLUMN_TILE x COLUMN_ROWS


def _column_splits(rows: int, column_blocks: int) -> int:
    """Row splits of a column kernel of `column_blocks` blocks across: about
    COLUMN_TARGET_BLOCKS blocks for tall inputs, none below COLUMN_SPLIT_ROWS rows per split
    (a second launch would cost more)."""
    return max(1, min(COLUMN_TARGET_BLOCKS // column_blocks, rows // COLUMN_SPLIT_ROWS))


def _column_partials(node: Node, ctx, cols: int, splits: int):
    """The node's float64 (cols, splits) partial sums, or a dummy pointer for one split."""
    if splits == 1:
        return np.uint64(0)
    return _node_memory(node, ("columns", cols, splits), ctx,
                        lambda: cp.empty(cols * splits, np.float64))


def _launch_columns(ctx, node: Node, name: str, rows: int, cols: int, out, arrays: tuple,
                    scalars: tuple, vec: int | None = None) -> None:
    """A column kernel (rows summed per column into `out`), args = arrays, the partials,
    scalars; with row splits, then the in-order sum of the splits' partials. `name` is the
    template's name; both take out's element type, and with `vec` (columns per thread) the
    kernel takes it as its second template argument."""
    ctype = ELEMENT_CTYPES[out.dtype]
    column_blocks = -(-cols // (32 * (vec or 1)))
    splits = _column_splits(rows, column_blocks)
    partial = _column_partials(node, ctx, cols, splits)
    kernel = _typed(name, ctype) if vec is None else f"{name}<{ctype}, {vec}>"
    _launch(ctx, "reduce.cu", kernel, (column_blocks, splits), COLUMN_BLOCK,
            arrays + (partial,) + scalars)
    if splits > 1:
        _launch(ctx, "reduce.cu", _typed("reduce_sum_splits_kernel", ctype), _grid(cols),
                (BLOCK,), (partial, out, np.int32(cols), np.int32(splits)))


def reduce_sum_columns(ctx, node: Node, x, y, rows: int, cols: int) -> None:
    """y (cols,) = x viewed as (rows, cols) summed over rows."""
    _launch_columns(ctx, node, "reduce_sum_columns_kernel", rows, cols, y, (x, y),
                    (np.int32(rows), np.int32(cols)))


def reduce_sum_planes(ctx, node: Node, x, y, outer: int, mid: int, inner: int) -> None:
    """y (mid,) = x viewed as (outer, mid, inner) summed over outer and inner: blocks per
    plane and split of the outer rows, then (several splits) one launch adding the splits'
    float64 partial sums in order, from the node's own memory."""
    splits = max(1, min(PLANE_TARGET_BLOCKS // max(mid, 1), outer))
    ctype = ELEMENT_CTYPES[y.dtype]
    partial = np.uint64(0)
    if splits > 1:
        partial = _node_memory(node, ("reduce_sum", mid, splits), ctx,
                               lambda: cp.empty(mid * splits, np.float64))
    _launch(ctx, "reduce.cu", _typed("reduce_sum_planes_kernel", ctype), (mid, splits),
            (BLOCK,), (x, y, partial, np.int32(outer), np.int32(mid), np.int32(inner)))
    if splits > 1:
        _launch(ctx, "reduce.cu", _typed("reduce_sum_splits_kernel", ctype), _grid(mid),
                (BLOCK,), (partial, y, np.int32(mid), np.int32(splits)))


def _reduced_axes(shape: tuple, axes) -> list[int]:
    nd = len(shape)
    return sorted({a % nd for a in axes}) if nd else []


def _kept_block(shape: tuple, axes) -> tuple[int, int, int] | None:
    """(outer, kept, inner) sizes when the axes NOT reduced are one contiguous run, else None."""
    nd = len(shape)
    axes = _reduced_axes(shape, axes)
    kept = [i for i in range(nd) if i not in axes]
    if kept and kept != list(range(kept[0], kept[-1] + 1)):
        return None
    lo, hi = (kept[0], kept[-1] + 1) if kept else (nd, nd)
    return math.prod(shape[:lo]), math.prod(shape[lo:hi]), math.prod(shape[hi:])


def _strided_reduction(shape: tuple, axes) -> tuple[list[int], list[int], list[int], list[int]]:
    """(kept sizes, kept strides, reduced sizes, reduced strides) in elements of contiguous x,
    outermost first: size-1 axes dropped, neighbours of the same kind merged (x is contiguous,
    so they always can be), each list padded in front to REDUCE_DIMS entries."""
    axes = set(_reduced_axes(shape, axes))
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
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
    """y = x.sum(axis=axes): column sums (bias grads), sums over (outer, inner) per kept
    index (axes (0, 2, 3) of NCHW: conv bias grads), or any other axes (strided fallback)."""
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
        reduce_sum_strided(ctx, x, y, axes)
        return
    outer, mid, inner = block
    if inner == 1 and mid > 1:    # one block per 32 columns; a full sum takes the planes path
        reduce_sum_columns(ctx, node, x, y, outer, mid)
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
    # four columns a thread where rows stay aligned to four elements (reduce.cu)
    vec = 4 if cols % 4 == 0 and _aligned(dy, saved, dz, to=4 * dy.itemsize) else 1
    if cols:
        _launch_columns(ctx, node, "act_bias_backward_kernel", rows, cols, db,
                        (dy, saved, dz, db), (np.int32(rows), np.int32(cols), np.int32(code),
                                              np.float32(slope)), vec)


def _chunk_jobs(sizes: list[int]) -> np.ndarray:
    """(tensor, chunk) work items of a multi-tensor kernel, at least one per tensor."""
    jobs = [(t, c) for t, n in enumerate(sizes) for c in range(max(1, -(-n // UPDATE_CHUNK)))]
    if len(jobs) > MAX_INT:
        raise ShapeError(f"multi-tensor kernel: {len(jobs)} blocks exceed the grid limit")
    return np.array(jobs, dtype=np.int32).reshape(-1, 2)


def _build_norm_tables(tensors) -> dict:
    entries = np.array([(t.data.ptr, t.size, _aligned(t), t.dtype == np.uint16)
                        for t in tensors], dtype=np.int64)
    jobs = _chunk_jobs([t.size for t in tensors])
    return dict(entries=cp.asarray(entries), jobs=cp.asarray(jobs),
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
             np.int32(UPDATE_CHUNK)))


def _checked_norm_tables(tensors) -> dict:
    for i, t in enumerate(tensors):
        # float32, or a bf16 gradient whose cast fuse_gradient_casts dropped
        _element_ctype(f"global_norm input {i}", t)
    return _build_norm_tables(tensors)


# ---- loss.cu -------------------------------------------------------------------------------

def _row_block(cols: int, threads: int) -> tuple[int, int]:
    """(threads per row, rows per block) for `threads` threads a block: one warp per row up
    to 1024 columns, more threads for longer rows."""
    per_row = 32 if cols <= 1024 else 128 if cols <= 8192 else 256
    return per_row, max(1, threads // per_row)


def _row_grid(n_rows: int, rows_per_block: int) -> tuple[int]:
    return (max(1, min(-(-n_rows // rows_per_block), MAX_BLOCKS)),)


def _check_logits(what: str, x, labels=None, dtype: str | None = "float32") -> tuple[int, int]:
    _check(f"{what} logits", x, dtype=dtype)
    if x.ndim != 2:
        raise ShapeError(f"{what}: expected (batch, classes), got {tuple(x.shape)}")
    _check_int32(what, x.size)
    if labels is not None:
        _check(f"{what} labels", labels, dtype=None, shape=(x.shape[0],))
        if labels.dtype not in LABEL_CTYPES:
            raise ShapeError(f"{what} labels: expected int32 or int64, got {labels.dtype}")
    return x.shape


def _check_rows(what: str, x) -> tuple[int, int]:
    """(rows, cols) of x (any rank >= 1) viewed as rows of its last axis."""
    _check(what, x)
    if x.ndim < 1:
        raise ShapeError(f"{what}: expected rank >= 1 (rows of the last axis), got a scalar")
    _check_int32(what, x.size)
    return math.prod(x.shape[:-1]), x.shape[-1]


def log_softmax_forward(ctx, x, y) -> None:
    """y = x - logsumexp(x, last axis), any rank >= 1."""
    n, c = _check_rows("log_softmax input", x)
    _check("log_softmax output", y, shape=x.shape)
    if x.size:
        block = _row_block(c, BLOCK)
        _launch(ctx, "loss.cu", "log_softmax_forward_kernel", _row_grid(n, block[1]), block,
                (x, y, np.int32(n), np.int32(c)))


def log_softmax_backward(ctx, dy, y, dx) -> None:
    """dx = dy - exp(y) * dy.sum(last axis), any rank >= 1."""
    n, c = _check_rows("log_softmax_grad dy", dy)
    _check("log_softmax_grad y", y, shape=dy.shape)
    _check("log_softmax_grad dx", dx, shape=dy.shape)
    if dy.size:
        block = _row_block(c, BLOCK)
        _launch(ctx, "loss.cu", "log_softmax_backward_kernel", _row_grid(n, block[1]), block,
                (dy, y, dx, np.int32(n), np.int32(c)))


def _loss_layout(node: Node, ctx, n: int, c: int, rowloss: bool):
    """(grid, block, scratch) of a cross-entropy kernel: one block of 1024 threads for small
    inputs (no scratch), else one block per 256 threads' rows with the node's scratch."""
    single = _row_block(c, 1024)
    if n * c <= SINGLE_BLOCK_ELEMENTS or n <= single[1]:
        return (1,), single, None
    key = ("cross_entropy", n, rowloss)

    def build():
        return dict(counter=cp.zeros(1, np.uint32), count=cp.zeros(1, np.int32),
                    rowloss=cp.empty(n if rowloss else 1, np.float32))

    scratch = _node_memory(node, key, ctx, build, required=False)
    if scratch is None:      # capture without a warm-up: one block is slower, still exact
        return (1,), single, None
    block = _row_block(c, BLOCK)
    return _row_grid(n, block[1]), block, scratch


def _scratch_args(scratch, fallback) -> tuple:
    if scratch is None:      # unused by a one-block launch; any valid pointer will do
        return fallback, fallback
    return scratch["rowloss"], scratch["counter"]


def _count_kept(ctx, labels, ignore: np.int64, count) -> None:
    """count (device int32) = how many labels are not ignore_index (one block)."""
    _launch(ctx, "loss.cu", f"cross_entropy_count_kernel<{LABEL_CTYPES[labels.dtype]}>", (1,),
            (1024,), (labels, np.int32(labels.size), ignore, count))


def _ignore(ignore_index) -> np.int64:
    """ignore_index as the kernels take it (PyTorch's default -100 when None)."""
    value = -100 if ignore_index is None else int(ignore_index)
    if not -2**63 <= value < 2**63:
        raise ValueError(f"ignore_index {value} does not fit in 64 bits")
    return np.int64(value)


def _smoothing(eps: float, classes: int) -> tuple[np.float32, np.float32, np.float32]:
    """(eps, hit, off) of label smoothing eps (loss.cu): hit = float32(1 - eps) weighs the
    label, off = float32(eps / C) every class; (0, 1, 0) without smoothing."""
    eps = float(eps or 0.0)
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {eps}")
    return np.float32(eps), np.float32(1.0 - eps), np.float32(eps / max(classes, 1))


def cross_entropy_forward(ctx, node: Node, logits, labels, loss, lse,
                          label_smoothing: float = 0.0, ignore_index: int = -100) -> None:
    """loss = mean((1-eps)(lse - logits[i, label_i]) + eps (lse - mean_j logits[i, j])),
    eps = label_smoothing, over the rows whose label is not ignore_index; lse (N,) =
    logsumexp of each row."""
    n, c = _check_logits("cross_entropy", logits, labels)
    _check_scalar("cross_entropy loss", loss, "float32")
    _check("cross_entropy lse", lse, shape=(n,))
    eps, hit, _ = _smoothing(label_smoothing, c)
    # Smoothed losses over several blocks are parked per row (their means are not in lse).
    grid, block, scratch = _loss_layout(node, ctx, n, c, rowloss=bool(eps))
    rowloss, counter = _scratch_args(scratch, loss)
    _launch(ctx, "loss.cu", f"cross_entropy_forward_kernel<{LABEL_CTYPES[labels.dtype]}>",
            grid, block, (logits, labels, loss, lse, rowloss, counter, np.int32(n), np.int32(c),
                          eps, hit, _ignore(ignore_index)))


def cross_entropy_backward(ctx, dloss, logits, lse, labels, dx,
                           label_smoothing: float = 0.0, node: Node | None = None,
                           ignore_index: int = -100) -> None:
    """dlogits = dloss * (softmax(logits) - (1-eps) onehot(labels) - eps / C) / kept, zero in
    the rows whose label is ignore_index (kept: the other rows). With the node's count
    scratch, one block counts the kept rows first; else every block counts them."""
    n, c = _check_logits("cross_entropy_grad", logits, labels)
    _check_scalar("cross_entropy_grad dloss", dloss, "float32")
    _check("cross_entropy_grad lse", lse, shape=(n,))
    _check("cross_entropy_grad dx", dx, shape=logits.shape)
    _, hit, off = _smoothing(label_smoothing, c)
    if not logits.size:
        return
    ignore = _ignore(ignore_index)
    count = None
    if node is not None:
        count = _node_memory(node, ("cross_entropy_count",), ctx,
                             lambda: cp.zeros(1, np.int32), required=False)
    if count is not None:
        _count_kept(ctx, labels, ignore, count)
    _launch(ctx, "loss.cu", f"cross_entropy_backward_kernel<{LABEL_CTYPES[labels.dtype]}>",
            _grid(logits.size), (BLOCK,),
            (dloss, logits, lse, labels, dx, _or_null(count), np.int32(n), np.int32(c), off,
             hit, ignore))


def _train_loss_name(kernel: str, x: str, d: str, label: str) -> str:
    return f"{kernel}<{x}, {d}, {label}>"


def cross_entropy_train(ctx, node: Node, logits, labels, loss, dx,
                        label_smoothing: float = 0.0, ignore_index: int = -100) -> None:
    """Fused forward and backward with dloss = 1: loss and dlogits in one launch (several
    blocks: after a one-block launch counting the rows not ignored, which every block needs
    for the gradients' scale float32(1 / kept)). logits and dlogits float32, or bf16 where
    compile/fuse.py fuse_loss_casts dropped the casts around the loss."""
    n, c = _check_logits("cross_entropy_train", logits, labels, dtype=None)
    _check_scalar("cross_entropy_train loss", loss, "float32")
    _check("cross_entropy_train dlogits", dx, dtype=None, shape=logits.shape)
    types = (_element_ctype("cross_entropy_train logits", logits),
             _element_ctype("cross_entropy_train dlogits", dx), LABEL_CTYPES[labels.dtype])
    smoothing = _smoothing(label_smoothing, c)
    ignore = _ignore(ignore_index)
    if c <= SHORT_ROW and n * c <= SINGLE_BLOCK_ELEMENTS:
        _launch(ctx, "loss.cu", _train_loss_name("cross_entropy_train_short_kernel", *types),
                (1,), (min(1024, max(32, -(-n // 32) * 32)),),
                (logits, labels, loss, dx, np.int32(n), np.int32(c)) + smoothing + (ignore,))
        return
    grid, block, scratch = _loss_layout(node, ctx, n, c, rowloss=True)
    rowloss, counter = _scratch_args(scratch, loss)
    count = np.uint64(0)        # one block counts the kept rows itself
    if scratch is not None:
        count = scratch["count"]
        _count_kept(ctx, labels, ignore, count)
    _launch(ctx, "loss.cu", _train_loss_name("cross_entropy_train_kernel", *types),
            grid, block, (logits, labels, loss, dx, rowloss, counter, count, np.int32(n),
                          np.int32(c)) + smoothing + (ignore,))


def nll_loss_forward(ctx, logp, labels, loss) -> None:
    """loss = -mean(logp[i, label_i]) (one block)."""
    n, c = _check_logits("nll_loss", logp, labels)
    _check_scalar("nll_loss loss", loss, "float32")
    _launch(ctx, "loss.cu", f"nll_loss_forward_kernel<{LABEL_CTYPES[labels.dtype]}>", (1,),
            (1024,), (logp, labels, loss, np.int32(n), np.int32(c)))


def nll_loss_backward(ctx, dloss, labels, dx) -> None:
    """dlogp (N, C) = -dloss / N at (i, label_i), zero elsewhere."""
    n, c = _check_logits("nll_loss_grad", dx, labels)
    _check_scalar("nll_loss_grad dloss", dloss, "float32")
    if dx.size:
        _launch(ctx, "loss.cu", f"nll_loss_backward_kernel<{LABEL_CTYPES[labels.dtype]}>",
                _grid(dx.size), (BLOCK,), (dloss, labels, dx, np.int32(n), np.int32(c)))


def mse_forward(ctx, pred, target, loss) -> None:
    """loss = mean((pred - target)^2) over every element (one block)."""
    _check("mse pred", pred)
    _check("mse target", target, shape=pred.shape)
    _check_scalar("mse loss", loss, "float32")
    _launch(ctx, "loss.cu", "mse_forward_kernel", (1,), (1024,),
            (pred, target, loss, np.int64(pred.size)))


def mse_backward(ctx, dloss, pred, target, dx) -> None:
    """dpred = dloss * 2 * (pred - target) / numel."""
    _check_scalar("mse_grad dloss", dloss, "float32")
    _check("mse_grad pred", pred)
    _check("mse_grad target", target, shape=pred.shape)
    _check("mse_grad dx", dx, shape=pred.shape)
    if pred.size:
        _launch(ctx, "loss.cu", "mse_backward_kernel", _grid(pred.size), (BLOCK,),
                (dloss, pred, target, dx, np.int64(pred.size)))


# ---- optim.cu ------------------------------------------------------------------------------

def step_increment(ctx, step) -> None:
    """step += 1 on the device (int64 scalar)."""
    _check_scalar("step_increment step", step, "int64")
    _launch(ctx, "optim.cu", "step_increment_kernel", (1,), (32,), (step,))


def lr_schedule(ctx, step, schedule, lr) -> None:
    """lr = schedule(step) from the (6,) float32 schedule vector (optim/schedules.py)."""
    _check_scalar("lr_schedule step", step, "int64")
    _check("lr_schedule schedule", schedule, shape=(6,))
    _check_scalar("lr_schedule lr", lr, "float32")
    _launch(ctx, "optim.cu", "lr_schedule_kernel", (1,), (32,), (step, schedule, lr))


def record_loss(ctx, loss, step, history_loss, history_step) -> None:
    """history_loss[step % R] = loss, history_step[step % R] = step (compile/history.py)."""
    _check_scalar("record_loss loss", loss, "float32")
    _check_scalar("record_loss step", step, "int64")
    _check("record_loss history_loss", history_loss)
    _check("record_loss history_step", history_step, "int64", shape=history_loss.shape)
    _launch(ctx, "optim.cu", "record_loss_kernel", (1,), (32,),
            (loss, step, history_loss, history_step, np.int64(history_loss.size)))


def advance_step(ctx, step, schedule, loss, history_loss, history_step, lr) -> None:
    """step += 1, lr = schedule(step), loss recorded under step: one launch."""
    _check_scalar("advance_step step", step, "int64")
    _check("advance_step schedule", schedule, shape=(6,))
    _check_scalar("advance_step loss", loss, "float32")
    _check("advance_step history_loss", history_loss)
    _check("advance_step history_step", history_step, "int64", shape=history_loss.shape)
    _check_scalar("advance_step lr", lr, "float32")
    _launch(ctx, "optim.cu", "advance_step_kernel", (1,), (32,),
            (step, schedule, loss, history_loss, history_step, np.int64(history_loss.size), lr))


def _update_groups(node: Node, ins: list):
    """(lr, step, norm or None, params, grads, slots) of an update op's inputs (ops.py); the
    bf16 weight copies (attrs copies) follow the slots, a guarded one's flags (attrs guard)
    come last."""
    a = node.attrs
    n, k, s = a["n_params"], a["n_scalars"], a["n_slots"]
    copies = len(a.get("copies", ()))
    if k not in (2, 3) or len(ins) != k + (2 + s) * n + copies + bool(a.get("guard")):
        raise ShapeError(f"{node.op}: {len(ins)} inputs do not match n_params={n}, "
                         f"n_scalars={k}, n_slots={s}, {copies} bf16 copies")
    if k == 3 and a.get("max_norm") is None:
        raise ShapeError(f"{node.op}: a norm input needs attrs max_norm")
    slots = [ins[k + (2 + j) * n:k + (3 + j) * n] for j in range(s)]
    return ins[0], ins[1], (ins[2] if k == 3 else None), ins[k:k + n], ins[k + n:k + 2 * n], slots


UPDATE_HYPERPARAMETERS = ("lr_scale", "weight_decay", "beta1", "beta2")   # optim.cu UpdateEntry


def _hyperparameters(node: Node) -> list[tuple[float, ...]]:
    """Per parameter (lr_scale, weight_decay, beta1, beta2): from attrs tuples (optimizer
    parameter groups, one entry a parameter) or the scalar attrs (1.0 for a missing lr_scale,
    0.0 for a missing weight decay or beta: SGD has none)."""
    a, n = node.attrs, node.attrs["n_params"]
    columns = []
    for name in UPDATE_HYPERPARAMETERS:
        value = a.get(name)
        if isinstance(value, (tuple, list)):
            if len(value) != n:
                raise ShapeError(f"{node.op}: attrs {name} has {len(value)} entries for {n} "
                                 "parameters")
            columns.append([float(v or 0.0) for v in value])
        else:
            default = 1.0 if name == "lr_scale" else 0.0
            columns.append([default if value is None else float(value)] * n)
    return list(zip(*columns))


def _weight_copies(node: Node, ins: list) -> list[tuple[int, Any, Any]]:
    """(parameter index, bf16 copy, transpose dims or None) of each weight copy of an update
    (attrs copies, copy_dims: ops.py sgd_update), each copy checked against its parameter."""
    k = node.attrs["n_scalars"]
    found = []
    for j, (at_param, at_copy, dims) in enumerate(update_weight_copies(node.attrs)):
        i, p, copy = at_param - k, ins[at_param], ins[at_copy]
        _check(f"{node.op} bf16 copy {j}", copy, "uint16")
        if copy.size != p.size:
            raise ShapeError(f"{node.op} bf16 copy {j}: {tuple(copy.shape)} does not hold "
                             f"parameter {i} {tuple(p.shape)}")
        if dims is not None and (sorted(dims) != list(range(p.ndim)) or p.ndim > 4):
            raise ShapeError(f"{node.op} bf16 copy {j}: copy_dims {dims} is no permutation of "
                             f"a parameter of at most 4 dims {tuple(p.shape)}")
        if dims is not None and tuple(dims) == tuple(range(p.ndim)):
            dims = None              # the identity: the same element order
        found.append((i, copy, None if dims is None else tuple(dims)))
    return found


def _build_update_tables(op: str, params, grads, slots, hyper, copies) -> dict:
    """The update kernels' UpdateEntry rows and (parameter, chunk) jobs. copies: {parameter
    index: its bf16 copy in the parameter's element order}, written by the update itself."""
    rows = []
    for i, (p, g) in enumerate(zip(params, grads)):
        tensors = [p, g] + [group[i] for group in slots]
        for what, t in zip(("param", "grad", "slot 0", "slot 1"), tensors):
            _check(f"{op} {what} {i}", t, dtype=None if what == "grad" else "float32",
                   shape=p.shape)
        _element_ctype(f"{op} grad {i}", g)    # or bf16 bits (fuse.py fuse_gradient_casts)
        ptrs = [t.data.ptr for t in tensors] + [0] * (4 - len(tensors))
        copy = copies.get(i)
        ptrs.append(0 if copy is None else copy.data.ptr)
        aligned = _aligned(*tensors, *([] if copy is None else [copy]))
        doubles = np.array(hyper[i], dtype=np.float64).view(np.int64).tolist()
        rows.append(ptrs + [p.size, int(aligned), int(g.dtype == np.uint16)] + doubles)
    jobs = _chunk_jobs([p.size for p in params])
    width = 8 + len(UPDATE_HYPERPARAMETERS)
    return dict(entries=cp.asarray(np.array(rows, dtype=np.int64).reshape(-1, width)),
                jobs=cp.asarray(jobs))


def _update_tables(node: Node, ins: list, ctx):
    lr, step, norm, params, grads, slots = _update_groups(node, ins)
    _check_scalar(f"{node.op} lr", lr, "float32")
    _check_scalar(f"{node.op} step", step, "int64")
    if norm is not None:
        _check_scalar(f"{node.op} norm", norm, "float32")
    key = ("update",) + _buffers_key(ins)
    in_order = {i: copy for i, copy, dims in _weight_copies(node, ins) if dims is None}
    tables = _node_memory(node, key, ctx, lambda: _build_update_tables(
        node.op, params, grads, slots, _hyperparameters(node), in_order))
    clip = (norm if norm is not None else lr, np.int32(norm is not None),
            np.float64(node.attrs.get("max_norm") or 0.0))
    guard = np.uint64(0)   # null: no guard; else the step's flags, whose [1] says skip
    if node.attrs.get("guard"):
        guard = ins[-1]
        _check(f"{node.op} guard flags", guard, "int32", (2,))
    return tables, (tables["entries"], tables["jobs"], np.int32(UPDATE_CHUNK), lr, step) + clip \
        + (guard,)


def _permuted_copies(ctx, node: Node, ins: list) -> None:
    """After the update launch: the bf16 copies whose element order is a transpose of their
    parameter's (attrs copy_dims), one small gather launch each (the others were written by
    the update itself)."""
    guard = ins[-1] if node.attrs.get("guard") else np.uint64(0)
    k = node.attrs["n_scalars"]
    for i, copy, dims in _weight_copies(node, ins):
        if dims is None or not copy.size:
            continue
        p = ins[k + i]
        elem = [st // p.itemsize for st in p.strides]
        shape = [1] * (4 - p.ndim) + [p.shape[d] for d in dims]
        strides = [0] * (4 - p.ndim) + [elem[d] for d in dims]
        _launch(ctx, "optim.cu", "weight_copy_permute_kernel", _grid(copy.size), (BLOCK,),
                (p, copy, np.int64(copy.size), *(np.int32(v) for v in shape[1:]),
                 *(np.int64(v) for v in strides), guard))


def sgd_update(ctx, node: Node, ins: list) -> None:
    """torch.optim.SGD over every parameter in one launch (ins layout: ops.py sgd_update);
    lr_scale and weight_decay per parameter group from the table (_hyperparameters)."""
    a = node.attrs
    momentum = float(a.get("momentum") or 0.0)
    if momentum and a["n_slots"] < 1:
        raise ShapeError("sgd_update: momentum needs a momentum buffer slot (n_slots=1)")
    if not a["n_params"]:
        return
    tables, args = _update_tables(node, ins, ctx)
    args += (np.float32(momentum), np.float32(1.0 - float(a.get("dampening") or 0.0)),
             np.int32(bool(momentum)), np.int32(bool(a.get("nesterov"))))
    _launch(ctx, "optim.cu", "sgd_update_kernel", (len(tables["jobs"]),), (BLOCK,), args)
    _permuted_copies(ctx, node, ins)


def adam_update(ctx, node: Node, ins: list) -> None:
    """torch.optim.Adam (decoupled=False) / AdamW (True) over every parameter in one launch;
    lr_scale, weight_decay, beta1 and beta2 per parameter group from the table."""
    a = node.attrs
    if a["n_slots"] != 2:
        raise ShapeError(
            f"adam_update: needs n_slots=2 (exp_avg, exp_avg_sq), got {a['n_slots']}")
    if not a["n_params"]:
        return
    tables, args = _update_tables(node, ins, ctx)
    args += (np.float32(a["eps"]), np.int32(bool(a.get("decoupled"))))
    _launch(ctx, "optim.cu", "adam_update_kernel", (len(tables["jobs"]),), (BLOCK,), args)
    _permuted_copies(ctx, node, ins)


# ---- the op table --------------------------------------------------------------------------

def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name these launchers may launch}, templates expanded over the
    C types they are instantiated with (the compiler declares them; the NVRTC test checks
    that each exists and that none is missing here)."""
    label = ("cross_entropy_count", "cross_entropy_forward", "cross_entropy_backward",
             "nll_loss_forward", "nll_loss_backward")
    train = ("cross_entropy_train_short_kernel", "cross_entropy_train_kernel")
    elements_typed = ("act_forward_kernel", "act_backward_kernel", "add_forward_kernel",
               "dropout_forward_kernel", "dropout_backward_kernel",
               "dropout_channel_forward_kernel", "dropout_channel_backward_kernel")
    reduce = ("reduce_sum_planes_kernel", "reduce_sum_splits_kernel",
              "reduce_sum_strided_kernel", "reduce_sum_columns_kernel")
    elements = ELEMENT_CTYPES.values()
    return {
        "elementwise.cu": {_typed("linear_bias_act_kernel", "unsigned short")}
        | {_typed(k, ctype) for k in elements_typed for ctype in elements}
        | {f"fill_forward_kernel<{ctype}>" for ctype in FILL_CTYPES.values()},
        "reduce.cu": {"global_norm_forward_kernel"}
        | {_typed(k, ctype) for k in reduce for ctype in elements}
        | {f"act_bias_backward_kernel<{ctype}, {vec}>" for ctype in elements for vec in (1, 4)},
        "loss.cu": {"log_softmax_forward_kernel", "log_softmax_backward_kernel",
                    "mse_forward_kernel", "mse_backward_kernel"}
        | {f"{k}_kernel<{ctype}>" for k in label for ctype in LABEL_CTYPES.values()}
        | {_train_loss_name(k, x, d, lab) for k in train for x in elements for d in elements
           for lab in LABEL_CTYPES.values()},
        "optim.cu": {"adam_update_kernel", "advance_step_kernel", "lr_schedule_kernel",
                     "record_loss_kernel", "sgd_update_kernel", "step_increment_kernel",
                     "weight_copy_permute_kernel"},
    }


IMPLS: dict[str, Callable] = {
    "act": lambda node, ins, outs, ctx: act_forward(
        ctx, ins[0], outs[0], node.attrs["kind"], _slope(node.attrs)),
    "act_grad": lambda node, ins, outs, ctx: act_backward(
        ctx, ins[0], ins[1], outs[0], node.attrs["kind"], _slope(node.attrs)),
    "act_bias_grad": lambda node, ins, outs, ctx: act_bias_backward(
        ctx, node, ins[0], ins[1] if len(ins) > 1 else ins[0], outs[0], outs[1],
        node.attrs.get("kind") or "none", _slope(node.attrs)),
    "reduce_sum": lambda node, ins, outs, ctx: reduce_sum_forward(
        ctx, node, ins[0], outs[0], node.attrs["axes"]),
    "add": lambda node, ins, outs, ctx: add_forward(ctx, ins[0], ins[1], outs[0]),
    "fill": lambda node, ins, outs, ctx: fill_forward(ctx, outs[0], node.attrs["value"]),
    "dropout": lambda node, ins, outs, ctx: dropout_forward(
        ctx, ins[0], ins[1], outs[0], outs[1], node.attrs["p"], node.attrs["seed"],
        node.attrs["site"], bool(node.attrs.get("per_channel"))),
    "dropout_grad": lambda node, ins, outs, ctx: dropout_backward(
        ctx, ins[0], ins[1], outs[0], node.attrs["p"], bool(node.attrs.get("per_channel"))),
    "log_softmax": lambda node, ins, outs, ctx: log_softmax_forward(ctx, ins[0], outs[0]),
    "log_softmax_grad": lambda node, ins, outs, ctx: log_softmax_backward(
        ctx, ins[0], ins[1], outs[0]),
    "cross_entropy": lambda node, ins, outs, ctx: cross_entropy_forward(
        ctx, node, ins[0], ins[1], outs[0], outs[1], node.attrs.get("label_smoothing", 0.0),
        node.attrs.get("ignore_index", -100)),
    "cross_entropy_grad": lambda node, ins, outs, ctx: cross_entropy_backward(
        ctx, ins[0], ins[1], ins[2], ins[3], outs[0], node.attrs.get("label_smoothing", 0.0),
        node, node.attrs.get("ignore_index", -100)),
    "cross_entropy_train": lambda node, ins, outs, ctx: cross_entropy_train(
        ctx, node, ins[0], ins[1], outs[0], outs[1], node.attrs.get("label_smoothing", 0.0),
        node.attrs.get("ignore_index", -100)),
    "nll_loss": lambda node, ins, outs, ctx: nll_loss_forward(ctx, ins[0], ins[1], outs[0]),
    "nll_loss_grad": lambda node, ins, outs, ctx: nll_loss_backward(
        ctx, ins[0], ins[1], outs[0]),
    "mse": lambda node, ins, outs, ctx: mse_forward(ctx, ins[0], ins[1], outs[0]),
    "mse_grad": lambda node, ins, outs, ctx: mse_backward(ctx, ins[0], ins[1], ins[2], outs[0]),
    "step_increment": lambda node, ins, outs, ctx: step_increment(ctx, ins[0]),
    "lr_schedule": lambda node, ins, outs, ctx: lr_schedule(ctx, ins[0], ins[1], outs[0]),
    "record_loss": lambda node, ins, outs, ctx: record_loss(ctx, *ins),
    "advance_step": lambda node, ins, outs, ctx: advance_step(ctx, *ins, outs[0]),
    "global_norm": lambda node, ins, outs, ctx: global_norm_forward(ctx, node, ins, outs[0]),
    "sgd_update": lambda node, ins, outs, ctx: sgd_update(ctx, node, ins),
    "adam_update": lambda node, ins, outs, ctx: adam_update(ctx, node, ins),
}

