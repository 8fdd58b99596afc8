"""Launchers of attention.cu (sdpa, sdpa_grad) and their cuda op table.

q (..., L, E), k (..., S, E), v (..., S, Ev) and every output are read and written through
explicit strides: the leading dims are (batch..., heads), bh = b * heads + h, and each operand
gives the element strides of its batch, head and row (columns contiguous). A C-contiguous
tensor is one layout among others, so callers may pass CuPy views without copies: sdpa_qkv
and sdpa_qkv_grad (compile/attention.py) read the heads out of a packed (..., T, 3C)
projection and write out and dq/dk/dv in (..., T, heads, hd) order.

Grouped heads (k, v of fewer heads than q, ops/attention.py group_of) are read in place:
query head h reads kv head h // group, and the dk/dv kernel sums each kv head's group (no
repeated copies, no atomics). The op's additive mask (of q's dtype) is read through its
broadcast strides (batch, head, row, column; 0 where it broadcasts), copied into the node's
own memory only where its leading dims do not flatten to one batch stride; rows it blocks
wholly give out 0, lse -inf and no gradient (torch's safe softmax). cuDNN's path takes
neither.

One template per head dim (the smallest of HEAD_DIMS holding E and Ev; zero padded: 80 runs
on 96's), per kernel and problem its (queries, keys) tile (the fastest of `CANDIDATES`, timed
once per problem as other families choose among kernels: runtime/autotune.py), and per
precision the arithmetic of the tensor-core
tile products (`MATH`), each kernel compiled on its own when a plan names it: "tf32"
rounds the inputs to TF32, as the GEMMs do; "fp32" splits each input into two TF32 parts and
makes three products (float32-level accuracy, the scheme cuBLAS and CUTLASS call 3xTF32;
on an H100 1.3x the speed of float32 FMAs on CUDA cores, see docs/perf-notes.md). Operands
are float32, or bfloat16 (precision="bf16": q, k, v, out and the gradients as uint16 bits,
exact in TF32, so the TF32 kernels read them widened and round only their stores; lse and D
float32), which is the NumPy emulation's arithmetic but for TF32's rounding of the
probabilities and of dS inside the products.

bf16 problems that cuDNN's fused attention takes run there instead (attention_cudnn.py:
four times faster on the gpt workload's attention). float32 problems have a second path,
cuBLASLt GEMMs over the scores in memory (attention_composed.py), timed against these kernels
per problem and direction (_run_path): it wins where the tiles waste work (65 tokens).

The forward is one launch; the gradient two, dq (which also sums D = rowsum(dout * out) into
a per-node scratch of bh * L floats, made at the first eager call: runtime/launch.py _node_memory),
then dk/dv. Dynamic shared memory above 48 KiB is opted into once per kernel, at its first
(eager) launch. No atomics: bits are the same on every run, eager or replayed.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ....errors import ShapeError
from ....ir.graph import Node, storage_dtype
from ....ops.attention import collapsed_stride as _collapsed_stride
from ....ops.attention import group_of, out_perms, seen_inputs
from ....ops.pointwise import input_views
from . import attention_composed, attention_cudnn
from .operands import SOURCE, THREADS, Heads, Problem
from ..elementwise import dropout_constants
from ..runtime import autotune
from ..runtime.launch import ELEMENT_CTYPES, _kernel, _node_memory

HEAD_DIMS = (32, 64, 96, 128)     # the templates' head dims (multiples of 32: attention.cu)
LOG2E = 1.4426950408889634
DEFAULT_SHARED = 48 * 1024    # bytes of dynamic shared memory a kernel gets without opting in
# kernel -> head dim -> the (queries, keys) tiles timed per problem (`_run_tiled`), the first
# the default: the one run untimed (during a capture before the problem's choice, or where
# it is the only one). attention.cu takes BQ and BK multiples of 32 (TcTile splits a tile
# into 2 x 2 warps of 16-row, 8-column fragments, a thread's columns step by 32: 4 cg + 32 j)
# and, for dk/dv, BK <= BQ (dk and dv leave through the q and dout tiles). The smaller tiles
# waste less where a length sits just above a tile multiple (65 rows: two 64-row tiles, the
# second of one row, against three of 32) and give few heads more blocks; the default wins
# on long sequences. 96 takes 128's tiles (its registers and shared memory fit where 128's
# do); their backward runs 32 x 32 already, the smallest the kernels take.
CANDIDATES = {
    "forward": {32: ((64, 64), (64, 32), (32, 32)), 64: ((64, 64), (64, 32), (32, 32)),
                96: ((64, 32), (32, 32)), 128: ((64, 32), (32, 32))},
    "backward_dq": {32: ((64, 64), (64, 32), (32, 32)), 64: ((64, 64), (64, 32), (32, 32)),
                    96: ((32, 32),), 128: ((32, 32),)},
    "backward_dkdv": {32: ((64, 64), (64, 32), (32, 32)), 64: ((64, 64), (64, 32), (32, 32)),
                      96: ((32, 32),), 128: ((32, 32),)}}
# kernel -> head dim -> its default (queries, keys) tile
TILES = {kind: {hd: tiles[0] for hd, tiles in per_hd.items()}
         for kind, per_hd in CANDIDATES.items()}


# attention.cu's SDPA_TF32 and SDPA_3XTF32, and the storages each is launched for
TF32, TF32X3 = 1, 2
CTYPES = {TF32: ("float", "unsigned short", "fp16_bits"), TF32X3: ("float",)}
# precision -> the products' arithmetic on float32 operands; bf16 and float16 operands (exact
# in TF32: 8 and 11 significant bits, TF32 has 11) always take TF32
MATH = {"fp32": TF32X3, "tf32": TF32, "bf16": TF32, "fp16": TF32}
STORAGE = ELEMENT_CTYPES             # float32, uint16 (bf16 bits) or float16 -> the kernels' T
BF16_OPS = frozenset({"sdpa", "sdpa_grad", "sdpa_qkv", "sdpa_qkv_grad"})
# float16 runs on the own kernels (fp16_bits, TF32 products); cuDNN's fused attention is
# taken for bf16 only (attention_cudnn.py)
FP16_OPS = BF16_OPS


def math_of(precision: str, ctype: str) -> int:
    if ctype != "float":
        return TF32
    if precision not in MATH:
        raise ShapeError(f"sdpa: no kernels for precision {precision!r}")
    return MATH[precision]


def kernel_name(kind: str, hd: int, math: int, ctype: str,
                tile: tuple[int, int] | None = None) -> str:
    """The kernel of `kind` for head dim template hd on `tile` (default: TILES')."""
    bq, bk = tile or TILES[kind][hd]
    return f"sdpa_{kind}_kernel<{hd}, {bq}, {bk}, {math}, {ctype}>"


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test): every
    candidate tile of every kernel, head dim, arithmetic and storage."""
    return {SOURCE: {kernel_name(kind, hd, math, ctype, tile)
                     for kind, per_hd in CANDIDATES.items() for hd, tiles in per_hd.items()
                     for tile in tiles for math, ctypes in CTYPES.items() for ctype in ctypes},
            **attention_cudnn.kernel_names()}


def tile_label(tile: tuple[int, int]) -> str:
    """A tile's name among the autotuner's paths (and on disk): "64x32"."""
    return f"{tile[0]}x{tile[1]}"


def choice_key(kind: str, hd: int, bh: int, L: int, S: int, group: int, causal: bool,
               dropout: bool, masked: bool, ctype: str, math: int) -> tuple:
    """The problem whose tile the autotuner chooses (in memory and on disk): what changes the
    kernels' work, not the operands' strides, so that a packed problem and its contiguous
    twin run the same tile and give the same bits. The candidates' names are part of it: a
    changed candidate list times again."""
    return ("sdpa", kind, hd, bh, L, S, group, bool(causal), bool(dropout), bool(masked),
            ctype, math, tuple(tile_label(t) for t in CANDIDATES[kind][hd]))


def kernels_ahead(node: Node, precision: str) -> list[tuple[str, str]]:
    """(file, kernel) of the kernels the node will launch or time, compiled side by side
    with the plan's others when it is built (CudaBackend.prepare): the forward's for sdpa and
    sdpa_qkv, dq's and dk/dv's for their gradients, on each candidate tile (only the chosen
    one where the disk holds the problem's choice); none where cuDNN will run it."""
    grouped = False
    if node.op in ("sdpa", "sdpa_grad"):
        seen = seen_inputs(node.op, node.inputs, node.attrs)
        q, k, v = seen[:3] if node.op == "sdpa" else seen[1:4]
        e, ev, rows, keys = q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2]
        grouped = q.shape[:-2] != k.shape[:-2]
        bh, group = math.prod(q.shape[:-2]), group_of(tuple(q.shape), tuple(k.shape)) or 1
    else:                   # packed: q, k, v are thirds of the projection's last axis
        q = node.inputs[0] if node.op == "sdpa_qkv" else node.inputs[1]
        heads = int(node.attrs["heads"])
        e = ev = q.shape[-1] // (3 * heads)
        rows = keys = q.shape[-2]
        bh, group = math.prod(q.shape[:-2]) * heads, 1
    ctype = STORAGE.get(np.dtype(storage_dtype(q.dtype)))
    if ctype is None or max(e, ev) > HEAD_DIMS[-1]:
        return []       # the launcher refuses it, naming why
    if ctype == "unsigned short" and not node.attrs.get("mask") and not grouped and \
            attention_cudnn.shape_reason(
            e, ev, bool(node.attrs.get("causal")), rows, keys) is None:
        return []       # cuDNN's (its own kernels compile at a first launch if it declines)
    arith, hd = math_of(precision, ctype), head_dim_template(e, ev)
    forward = node.op in ("sdpa", "sdpa_qkv")
    kinds = ("forward",) if forward else ("backward_dq", "backward_dkdv")
    # Every candidate tile while the problem is untimed: its first eager step times them all
    # (run_fastest compiles each then), so compiling them here, side by side with the plan's
    # other kernels, adds no compile to a cold start, only moves it ahead; where an earlier
    # process chose (the disk's choice), only the chosen tile's kernel.
    ahead = []
    for kind in kinds:
        key = choice_key(kind, hd, bh, rows, keys, group, bool(node.attrs.get("causal")),
                         float(node.attrs.get("dropout_p", 0.0)) > 0.0,
                         bool(node.attrs.get("mask")), ctype, arith)
        chosen = _stored_tile(kind, hd, key)
        ahead += [(SOURCE, kernel_name(kind, hd, arith, ctype, tile))
                  for tile in ([chosen] if chosen else CANDIDATES[kind][hd])]
    pb = Problem(bh, 1, rows, keys, e, ev, group)
    if attention_composed.takes(pb, ctype):
        ahead += attention_composed.kernels(forward)
    return ahead


def _stored_tile(kind: str, hd: int, key: tuple) -> tuple[int, int] | None:
    """The tile an earlier process chose for problem `key` (autotune.py's "paths" on disk);
    None with the cache off, without an entry, or with one a candidate no longer has."""
    tiles = {tile_label(t): t for t in CANDIDATES[kind][hd]}
    if len(tiles) == 1:
        return next(iter(tiles.values()))
    disk = autotune.choices(None, "paths")
    name = None if disk is None else disk.get(repr(key), lambda value: value in tiles)
    return None if name is None else tiles[name]


def shared_floats(kind: str, hd: int, tile: tuple[int, int] | None = None) -> int:
    """Floats of dynamic shared memory of a kernel on `tile` (default: TILES'): its tiles as
    attention.cu lays them out ("rows" tiles [R][HD + 4], scores [BQ][BK + 4])."""
    bq, bk = tile or TILES[kind][hd]
    rows_q, rows_k, tile = bq * (hd + 4), bk * (hd + 4), bq * (bk + 4)
    if kind == "forward":           # q, k, v, P, the rows' rescale
        return rows_q + 2 * rows_k + tile + bq
    return 2 * rows_q + 2 * rows_k + 2 * tile       # q, dout, k, v, S (or P), dS


def head_dim_template(e: int, ev: int) -> int:
    for hd in HEAD_DIMS:
        if max(e, ev) <= hd:
            return hd
    raise ShapeError(f"sdpa: head dims up to {HEAD_DIMS[-1]}, got {e} and {ev}")


@functools.cache
def _function(name: str, shared_bytes: int):
    """Kernel `name`, allowed `shared_bytes` of dynamic shared memory (an attribute set once,
    at the first launch, which is an eager one: never while capturing)."""
    fn = _kernel(SOURCE, name)          # a cupy.RawKernel
    if shared_bytes > DEFAULT_SHARED:
        fn.max_dynamic_shared_size_bytes = shared_bytes
    return fn


def _run_tiled(ctx, kind: str, hd: int, ctype: str, pb: Problem, attn: Attn, masked: bool,
               args: tuple) -> None:
    """Launch `kind` on the fastest of its candidate tiles (CANDIDATES) for this problem:
    timed once per problem on the real buffers at its first eager call, the choice shared by
    the backend's contexts and kept on disk (autotune.run_fastest); the default tile during
    a capture before the problem's choice. Every candidate writes the same outputs (the dq
    kernel's delta included), so timing one leaves the buffers as the chosen one would."""
    arith = math_of(getattr(ctx, "precision", "fp32"), ctype)
    paths = {tile_label(tile): autotune.compiling(
        functools.partial(_launch_tile, ctx, kind, hd, arith, ctype, tile, pb, args),
        (SOURCE, kernel_name(kind, hd, arith, ctype, tile)))
        for tile in CANDIDATES[kind][hd]}
    default = tile_label(CANDIDATES[kind][hd][0])
    if len(paths) == 1:
        paths[default]()
        return
    key = choice_key(kind, hd, pb.bh, pb.L, pb.S, pb.group, attn.causal, attn.dropout_p > 0.0,
                     masked, ctype, arith)
    autotune.run_fastest(ctx, key, paths, default)


def _launch_tile(ctx, kind: str, hd: int, arith: int, ctype: str, tile: tuple[int, int],
                 pb: Problem, args: tuple) -> None:
    """One block per (tile, head): tile-major, so the heaviest causal tiles start first; the
    forward and dq kernels tile the queries, dk/dv the keys of each kv head."""
    bq, bk = tile
    tiles, heads = (-(-pb.S // bk), pb.bh // pb.group) if kind == "backward_dkdv" else \
        (-(-pb.L // bq), pb.bh)
    blocks = tiles * heads
    if blocks > 2**31 - 1:
        raise ShapeError(f"sdpa: {tiles} tiles x {heads} heads exceed the grid")
    shared = shared_floats(kind, hd, tile) * 4
    _function(kernel_name(kind, hd, arith, ctype, tile), shared)(
        (blocks,), (THREADS,), args, shared_mem=shared, stream=ctx.stream)


# ---- operands: strides, checks ---------------------------------------------------------------

def storage(q) -> str:
    """The kernels' T for q's dtype: float32, uint16 (bf16 bits) or float16; k, v, out and
    the gradients must have the same (_heads)."""
    if not isinstance(q, cp.ndarray) or q.dtype not in STORAGE:
        raise ShapeError(f"sdpa: q must be a float32, bf16 (uint16) or float16 CuPy array, got "
                         f"{getattr(q, 'dtype', type(q).__name__)}")
    return STORAGE[q.dtype]


def _heads(what: str, a, shape: tuple, dtype) -> Heads:
    """The layout of CuPy array `a` of logical `shape` and `dtype` (any strides the kernels
    can walk)."""
    if not isinstance(a, cp.ndarray):
        raise ShapeError(f"{what}: expected a CuPy array, got {type(a).__name__}")
    if a.dtype != dtype or tuple(a.shape) != tuple(shape):
        raise ShapeError(f"{what}: expected {np.dtype(dtype)} {tuple(shape)} (q's dtype), got "
                         f"{a.dtype} {tuple(a.shape)}")
    if any(s % a.itemsize for s in a.strides):
        raise ShapeError(f"{what}: strides {a.strides} are not whole elements")
    st = tuple(s // a.itemsize for s in a.strides)
    if shape[-1] > 1 and st[-1] != 1:
        raise ShapeError(f"{what}: columns must be contiguous (strides {a.strides})")
    lead, lead_st = shape[:-2], st[:-2]
    head = lead_st[-1] if len(lead) >= 2 and lead[-1] > 1 else 0
    outer = lead if len(lead) < 2 else lead[:-1]
    batch = _collapsed_stride(outer, lead_st[:len(outer)])
    if batch is None:
        raise ShapeError(f"{what}: leading dims {lead} with strides {a.strides} do not "
                         f"flatten to (batch, heads)")
    return Heads(batch, head, st[-2])


def problem(q, k, v) -> Problem:
    q_shape, k_shape, v_shape = tuple(q.shape), tuple(k.shape), tuple(v.shape)
    group = group_of(q_shape, k_shape) if len(q_shape) == len(k_shape) >= 2 else None
    if not (group is not None and len(k_shape) == len(v_shape)
            and k_shape[:-2] == v_shape[:-2] and q_shape[-1] == k_shape[-1]
            and k_shape[-2] == v_shape[-2]):
        raise ShapeError(f"sdpa: q {q_shape}, k {k_shape}, v {v_shape} do not fit together")
    lead = q_shape[:-2]
    if group > 1 and len(lead) < 2:
        raise ShapeError(f"sdpa: grouped heads need (batch, heads) leading dims, got q "
                         f"{q_shape} (view 3-d operands as 4-d: grouped_views)")
    heads = lead[-1] if len(lead) >= 2 else 1
    bh = math.prod(lead)
    if bh >= 2**31 or max(q_shape[-2], k_shape[-2]) >= 2**31:
        raise ShapeError(f"sdpa: sizes {q_shape}, {k_shape} exceed the kernels' 32-bit counts")
    return Problem(bh, max(heads, 1), q_shape[-2], k_shape[-2], q_shape[-1], v_shape[-1],
                   group)


@dataclass(frozen=True)
class Mask:
    """The additive mask as the kernels read it: element (bh = b * heads + h, r, c) at
    array[b * batch + h * head + r * row + c * col] (elements; 0 where it broadcasts)."""

    array: object                 # the mask input (or the node's broadcast copy of it)
    batch: int
    head: int
    row: int
    col: int

    def args(self) -> tuple:
        return (self.array,) + tuple(np.int64(x) for x in (self.batch, self.head, self.row,
                                                            self.col))


NO_MASK = (np.uint64(0),) + (np.int64(0),) * 4


def mask_strides(shape: tuple, strides: tuple, itemsize: int, lead: tuple, L: int,
                 S: int) -> tuple[int, int, int, int] | None:
    """(batch, head, row, col) element strides of a mask of `shape` and byte `strides`
    broadcast to the (lead..., L, S) scores (0 along the dims it broadcasts over), or None
    where the leading dims do not flatten to one batch stride."""
    full = tuple(lead) + (L, S)
    if len(shape) > len(full) or any(m not in (1, f) for m, f in zip(shape[::-1],
                                                                      full[::-1])):
        raise ShapeError(f"sdpa: mask {shape} does not broadcast to the scores {full}")
    if any(st % itemsize for st in strides):
        raise ShapeError(f"sdpa: mask strides {strides} are not whole elements")
    st = (0,) * (len(full) - len(shape)) + tuple(
        x // itemsize if m > 1 else 0 for m, x in zip(shape, strides))
    head = st[-3] if len(lead) >= 2 and lead[-1] > 1 else 0
    outer = lead if len(lead) < 2 else lead[:-1]
    batch = _collapsed_stride(tuple(outer), st[:len(outer)])
    return None if batch is None else (batch, head, st[-2], st[-1])


def mask_layout(mask, q, pb: Problem) -> Mask | None:
    """The mask (broadcasting to q's (..., L, S) scores, of q's dtype) read in place through
    its broadcast strides, or None where they do not fit the kernels (mask_operand copies it
    then)."""
    if mask.dtype != q.dtype:
        raise ShapeError(f"sdpa: the mask must have q's dtype {q.dtype}, got {mask.dtype}")
    st = mask_strides(tuple(mask.shape), tuple(mask.strides), mask.itemsize,
                      tuple(q.shape[:-2]), pb.L, pb.S)
    return None if st is None else Mask(mask, *st)


def mask_operand(ctx, node: Node, mask, q, pb: Problem) -> Mask:
    """mask_layout's, else a copy of the broadcast mask in the node's own memory (made at the
    first eager call, refilled by a copy kernel on every call)."""
    layout = mask_layout(mask, q, pb)
    if layout is not None:
        return layout
    shape = tuple(q.shape[:-2]) + (pb.L, pb.S)
    copy = _node_memory(node, ("sdpa_mask", shape), ctx, lambda: cp.empty(shape, q.dtype))
    with ctx.stream:
        cp.copyto(copy, cp.broadcast_to(mask, shape))
    return mask_layout(copy, q, pb)


def grouped_views(q, k, *arrays) -> list:
    """q, k and `arrays` as given, or, for 3-d operands (heads, rows, dim) of grouped heads
    (q's heads a multiple of k's), viewed as (1, heads, rows, dim): the kernels index kv heads
    within the last leading dim."""
    everything = [q, k, *arrays]
    if q.ndim != 3 or q.shape[0] == k.shape[0]:
        return everything
    return [a[None] for a in everything]


def _vectorized(pb: Problem, arrays, layouts) -> int:
    """1 when every row can move four elements a load: head dims % 4 == 0, pointers aligned
    to four elements and strides of whole groups of four."""
    return int(pb.E % 4 == 0 and pb.Ev % 4 == 0
               and all(a.data.ptr % (4 * a.itemsize) == 0 for a in arrays)
               and all(s % 4 == 0 for h in layouts for s in (h.batch, h.head, h.row)))


def _check_rows(what: str, a, pb: Problem) -> None:
    """lse and delta: C-contiguous float32 of bh * L elements (any shape)."""
    if not isinstance(a, cp.ndarray) or a.dtype != np.float32 or a.size != pb.bh * pb.L \
            or not a.flags.c_contiguous:
        raise ShapeError(f"{what}: expected C-contiguous float32 of {pb.bh * pb.L} rows")


@dataclass(frozen=True)
class Attn:
    """The node's attrs as the kernels take them."""

    scale: float
    causal: bool
    dropout_p: float = 0.0
    seed: int = 0
    site: int = 0

    def args(self, step, backward: bool) -> tuple:
        """(scale * log2(e) [, scale], causal, seed, site, threshold, drop_scale, dropout)."""
        dropout = self.dropout_p > 0.0
        threshold, drop_scale = dropout_constants(self.dropout_p)
        if dropout:
            if not 0 <= self.site < 2**32:
                raise ValueError(f"sdpa dropout site must fit in 32 bits, got {self.site}")
            _check_step(step)
        scales = (np.float32(self.scale * LOG2E),) + ((np.float32(self.scale),) if backward
                                                       else ())
        return scales + (np.int32(self.causal), np.uint64(self.seed & (2**64 - 1)),
                         np.uint32(self.site if dropout else 0), threshold, drop_scale,
                         np.int32(dropout))


def _check_step(step) -> None:
    if not isinstance(step, cp.ndarray) or step.dtype != np.int64 or step.size != 1:
        raise ShapeError("sdpa: dropout needs the int64 step counter on the device")


def attn_of(node: Node) -> Attn:
    a = node.attrs
    return Attn(float(a.get("scale", 1.0)), bool(a.get("causal", False)),
                float(a.get("dropout_p", 0.0)), int(a.get("seed", 0)), int(a.get("site", 0)))


def _step_arg(attn: Attn, step):
    return step if attn.dropout_p > 0.0 else np.uint64(0)


# ---- launchers -------------------------------------------------------------------------------

def sdpa_forward(ctx, q, k, v, out, lse, step, attn: Attn, mask: Mask | None = None,
                 node: Node | None = None) -> None:
    """out = dropout(softmax(scale * q @ k^T + causal mask + mask)) @ v and lse (bh * L rows)
    = logsumexp of the scaled, masked scores; step (int64 device scalar) with dropout; k, v
    of grouped heads read in place. With the node (whose memory holds the composed path's
    scores), the composed path is timed against the fused kernels (_run_path)."""
    pb, ctype = problem(q, k, v), storage(q)
    lead = tuple(q.shape[:-2])
    layouts = [_heads("sdpa q", q, q.shape, q.dtype), _heads("sdpa k", k, k.shape, q.dtype),
               _heads("sdpa v", v, v.shape, q.dtype),
               _heads("sdpa out", out, lead + (pb.L, pb.Ev), q.dtype)]
    _check_rows("sdpa lse", lse, pb)
    if attn.causal and pb.L > pb.S:
        raise ShapeError(f"sdpa: causal needs L <= S, got {pb.L} > {pb.S}")
    if pb.bh == 0 or pb.L == 0:
        return
    if pb.S == 0:
        raise ShapeError("sdpa: needs at least one key")
    if ctype == "unsigned short" and mask is None and pb.group == 1 and \
            attention_cudnn.forward(ctx, pb, attn, layouts, q, k, v, out, lse, step):
        return
    hd = head_dim_template(pb.E, pb.Ev)
    vec = _vectorized(pb, (q, k, v, out), layouts)
    args = (q, k, v, out, lse, _step_arg(attn, step)) + pb.args() \
        + sum((h.args() for h in layouts), ()) + attn.args(step, False) + (np.int32(vec),) \
        + _extra(pb, mask)
    fused = functools.partial(_run_tiled, ctx, "forward", hd, ctype, pb, attn,
                              mask is not None, args)
    composed = functools.partial(attention_composed.forward, ctx, node, pb, layouts, q, k, v,
                                 out, lse, _step_arg(attn, step),
                                 attn.args(step, False) + _mask_args(mask))
    _run_path(ctx, node, True, pb, ctype, attn, mask is not None, layouts, fused, composed)


def _mask_args(mask: Mask | None) -> tuple:
    return NO_MASK if mask is None else mask.args()


PATHS = ("fused", attention_composed.NAME)
PATH = "auto"          # "auto" (timed per problem) or one of PATHS: tests force one


def path_key(forward: bool, pb: Problem, ctype: str, attn: Attn, masked: bool,
             precision: str, launches: int) -> tuple:
    """The problem whose path (fused kernels or composed GEMMs) the autotuner chooses: what
    changes either's work, the composed GEMMs' launches a product included (heads read out
    of a packed projection take one a head: attention_composed.gemm_launches)."""
    return ("sdpa-path", "forward" if forward else "backward", pb.bh, pb.L, pb.S, pb.E,
            pb.Ev, bool(attn.causal), attn.dropout_p > 0.0, bool(masked), ctype, precision,
            launches, PATHS)


def _run_path(ctx, node: Node | None, forward: bool, pb: Problem, ctype: str, attn: Attn,
              masked: bool, layouts: list[Heads], fused: Callable[[], None],
              composed: Callable[[], None]) -> None:
    """The fused kernels, or the composed GEMMs (attention_composed.py) where they are a
    candidate: the faster of the two for this problem, timed once at its first eager call
    (autotune.run_fastest; the fused kernels during a capture before the choice). Both are
    `searching` candidates: the fused one times its tiles, the composed one its GEMMs'
    algorithms, inside their first run."""
    if node is None or not attention_composed.takes(pb, ctype):
        fused()
        return
    if PATH != "auto":
        if PATH not in PATHS:
            raise ValueError(f"attention.PATH must be 'auto' or one of {PATHS}, got {PATH!r}")
        (composed if PATH == attention_composed.NAME else fused)()
        return
    paths = {"fused": autotune.searching(fused),
             attention_composed.NAME: autotune.searching(autotune.compiling(
                 composed, *attention_composed.kernels(forward)))}
    key = path_key(forward, pb, ctype, attn, masked, getattr(ctx, "precision", "fp32"),
                   attention_composed.gemm_launches(pb, layouts))
    autotune.run_fastest(ctx, key, paths, "fused")


def _extra(pb: Problem, mask: Mask | None) -> tuple:
    """The kernels' last arguments: group, then the mask pointer and its four strides."""
    return (np.int32(pb.group),) + (NO_MASK if mask is None else mask.args())


def sdpa_backward_dq(ctx, q, k, v, out, dout, lse, step, dq, delta, attn: Attn,
                     mask: Mask | None = None) -> None:
    """dq of sdpa, and delta (bh * L) = rowsum(dout * out), which sdpa_backward_dkdv reads."""
    pb, ctype = problem(q, k, v), storage(q)
    o_shape = tuple(q.shape[:-1]) + (pb.Ev,)
    layouts = [_heads(f"sdpa_grad {name}", a, shape, q.dtype) for name, a, shape in
               (("q", q, q.shape), ("k", k, k.shape), ("v", v, v.shape), ("out", out, o_shape),
                ("dout", dout, o_shape), ("dq", dq, q.shape))]
    _check_rows("sdpa_grad lse", lse, pb)
    _check_rows("sdpa_grad delta", delta, pb)
    if pb.bh == 0 or pb.L == 0:
        return
    hd = head_dim_template(pb.E, pb.Ev)
    vec = _vectorized(pb, (q, k, v, out, dout, dq), layouts)
    args = (q, k, v, out, dout, lse, _step_arg(attn, step), dq, delta) + pb.args() \
        + sum((h.args() for h in layouts), ()) + attn.args(step, True) + (np.int32(vec),) \
        + _extra(pb, mask)
    _run_tiled(ctx, "backward_dq", hd, ctype, pb, attn, mask is not None, args)


def sdpa_backward_dkdv(ctx, q, k, v, dout, lse, delta, step, dk, dv, attn: Attn,
                       mask: Mask | None = None) -> None:
    """dk and dv of sdpa (of grouped heads: summed over each kv head's query heads, one
    block per key tile and kv head); delta as sdpa_backward_dq left it."""
    pb, ctype = problem(q, k, v), storage(q)
    o_shape = tuple(q.shape[:-1]) + (pb.Ev,)
    layouts = [_heads(f"sdpa_grad {name}", a, shape, q.dtype) for name, a, shape in
               (("q", q, q.shape), ("k", k, k.shape), ("v", v, v.shape),
                ("dout", dout, o_shape), ("dk", dk, k.shape), ("dv", dv, v.shape))]
    _check_rows("sdpa_grad lse", lse, pb)
    _check_rows("sdpa_grad delta", delta, pb)
    if pb.bh == 0 or pb.S == 0:
        return
    if pb.L == 0:
        raise ShapeError("sdpa_grad: needs at least one query")
    hd = head_dim_template(pb.E, pb.Ev)
    vec = _vectorized(pb, (q, k, v, dout, dk, dv), layouts)
    args = (q, k, v, dout, lse, delta, _step_arg(attn, step), dk, dv) + pb.args() \
        + sum((h.args() for h in layouts), ()) + attn.args(step, True) + (np.int32(vec),) \
        + _extra(pb, mask)
    _run_tiled(ctx, "backward_dkdv", hd, ctype, pb, attn, mask is not None, args)


def sdpa_backward(ctx, node: Node, q, k, v, out, dout, lse, step, dq, dk, dv,
                  attn: Attn, mask: Mask | None = None) -> None:
    """dq, dk, dv of sdpa: on cuDNN where the problem runs there (attention_cudnn: no mask,
    no grouped heads), else the dq launch (summing D into the node's scratch) and the dk/dv
    launch."""
    pb = problem(q, k, v)
    o_shape = tuple(q.shape[:-1]) + (pb.Ev,)
    layouts = [_heads(f"sdpa_grad {name}", a, shape, q.dtype) for name, a, shape in
               (("q", q, q.shape), ("k", k, k.shape), ("v", v, v.shape), ("out", out, o_shape),
                ("dout", dout, o_shape), ("dq", dq, q.shape), ("dk", dk, k.shape),
                ("dv", dv, v.shape))]
    _check_rows("sdpa_grad lse", lse, pb)
    if storage(q) == "unsigned short" and mask is None and pb.group == 1 and pb.bh and pb.L \
            and pb.S and attention_cudnn.backward(ctx, pb, attn, layouts, q, k, v, out, dout,
                                                  lse, step, dq, dk, dv):
        return
    def fused():
        rows = lse.size
        delta = _node_memory(node, ("sdpa_delta", rows), ctx,
                             lambda: cp.empty(rows, np.float32))
        sdpa_backward_dq(ctx, q, k, v, out, dout, lse, step, dq, delta, attn, mask)
        sdpa_backward_dkdv(ctx, q, k, v, dout, lse, delta, step, dk, dv, attn, mask)

    if not (pb.bh and pb.L and pb.S):
        fused()         # sdpa_backward_dkdv's checks
        return
    composed = functools.partial(attention_composed.backward, ctx, node, pb, layouts, q, k, v,
                                 out, dout, lse, _step_arg(attn, step), dq, dk, dv,
                                 attn.args(step, True) + _mask_args(mask))
    _run_path(ctx, node, False, pb, storage(q), attn, mask is not None, layouts, fused,
              composed)


def cudnn_keep_mask(ctx, q, k, v, step, attn: Attn) -> np.ndarray:
    """The (bh, L, S) dropout keep mask (bool) that cuDNN's forward draws for these operands
    at this step (attention_cudnn.keep_mask: for checking that path against the reference)."""
    pb = problem(q, k, v)
    layouts = [_heads(f"sdpa {name}", a, a.shape, q.dtype) for name, a in
               (("q", q), ("k", k), ("v", v))]
    return attention_cudnn.keep_mask(ctx, pb, attn, layouts, q, k, v, step)


def _mask_and_step(node: Node, rest: list) -> tuple:
    """(mask, step) of the inputs after the operands: the mask first with attrs mask."""
    mask = rest[0] if node.attrs.get("mask") else None
    rest = rest[1:] if mask is not None else rest
    return mask, (rest[0] if rest else None)


def _in_layouts(node: Node, ins, outs) -> tuple[list, list]:
    """ins read through the node's attrs views and outs as views of the op's own layout where
    attrs out_perms writes them permuted (ops/attention.py): the kernels walk the strides."""
    ins = [_read_through(view, a) for view, a in zip(input_views(node.attrs, len(ins)), ins)]
    outs = [o if p is None else o.transpose(tuple(int(d) for d in np.argsort(p)))
            for o, p in zip(outs, out_perms(node.op, node.attrs, len(outs)))]
    return ins, outs


def _read_through(view, a):
    if view is None:
        return a
    shape, strides, offset = view
    return cp.lib.stride_tricks.as_strided(a.reshape(-1)[offset:], tuple(shape),
                                           tuple(s * a.itemsize for s in strides))


def _sdpa(node: Node, ins, outs, ctx) -> None:
    ins, outs = _in_layouts(node, ins, outs)
    raw_mask, step = _mask_and_step(node, list(ins[3:]))
    q, k, v, out = grouped_views(*ins[:3], outs[0])
    mask = None if raw_mask is None else mask_operand(ctx, node, raw_mask, q, problem(q, k, v))
    sdpa_forward(ctx, q, k, v, out, outs[1], step, attn_of(node), mask, node)


def _sdpa_grad(node: Node, ins, outs, ctx) -> None:
    ins, outs = _in_layouts(node, ins, outs)
    raw_mask, step = _mask_and_step(node, list(ins[6:]))
    q, k, v, dout, out, dq, dk, dv = grouped_views(ins[1], ins[2], ins[3], ins[0], ins[4],
                                                   *outs)
    mask = None if raw_mask is None else mask_operand(ctx, node, raw_mask, q, problem(q, k, v))
    sdpa_backward(ctx, node, q, k, v, out, dout, ins[5], step, dq, dk, dv, attn_of(node), mask)


def heads_of(x, heads: int):
    """A C-contiguous (..., T, H * D) CuPy array viewed as (..., H, T, D)."""
    split = x.reshape(x.shape[:-1] + (heads, x.shape[-1] // heads))
    return cp.moveaxis(split, -2, -3)


def qkv_heads(qkv, heads: int) -> list:
    """q, k, v of a C-contiguous packed (..., T, 3 * H * D) CuPy array, as (..., H, T, D)
    views: the kernels read them through their strides, no copies."""
    split = qkv.reshape(qkv.shape[:-1] + (3, heads, qkv.shape[-1] // (3 * heads)))
    return [cp.moveaxis(split[..., i, :, :], -2, -3) for i in range(3)]


def _packed(what: str, *arrays) -> None:
    for a in arrays:
        if not isinstance(a, cp.ndarray) or not a.flags.c_contiguous:
            raise ShapeError(f"{what}: packed operands must be C-contiguous CuPy arrays")


def _sdpa_qkv(node: Node, ins, outs, ctx) -> None:
    heads = int(node.attrs["heads"])
    _packed("sdpa_qkv", ins[0], outs[0])
    step = ins[1] if len(ins) > 1 else None
    sdpa_forward(ctx, *qkv_heads(ins[0], heads), heads_of(outs[0], heads), outs[1], step,
                 attn_of(node), node=node)


def _sdpa_qkv_grad(node: Node, ins, outs, ctx) -> None:
    heads = int(node.attrs["heads"])
    dout, qkv, out, lse = ins[:4]
    _packed("sdpa_qkv_grad", dout, qkv, out, outs[0])
    step = ins[4] if len(ins) > 4 else None
    sdpa_backward(ctx, node, *qkv_heads(qkv, heads), heads_of(out, heads),
                  heads_of(dout, heads), lse, step, *qkv_heads(outs[0], heads), attn_of(node))


IMPLS: dict[str, Callable] = {"sdpa": _sdpa, "sdpa_grad": _sdpa_grad, "sdpa_qkv": _sdpa_qkv,
                              "sdpa_qkv_grad": _sdpa_qkv_grad}
KERNELS_AHEAD = dict.fromkeys(IMPLS, kernels_ahead)
