"""Launchers of norm.cu (batch_norm_train, batch_norm_stats, batch_norm_grad) and their
cuda op table.

x (N, C, *spatial) is viewed as (N, C, inner); a channels-last x (attrs layout "NHWC", channels
on the last axis) as (N * spatial, C), the "columns" layout. Each op is a stats pass writing float64
partial sums per (channel, split), a finalize kernel adding each channel's splits in order,
and an elementwise pass: deterministic, no float atomics. The partial sums (and the grad's
per-channel coefficients) live in device memory made once per node at its first eager call
(runtime/launch.py _node_memory): a captured graph must not allocate, and Executable warms up
eagerly before capture. Launchers check their preconditions and launch on ctx.stream: no host sync.

The activations (x, y, dy, dx, the fused residual) are float32, bfloat16 (precision="bf16":
uint16 raw bits) or float16 (precision="fp16", model.half() with float BatchNorms); the pass
kernels are templates over that storage, norm.cu), all of one
dtype; the per-channel values stay float32 (torch's CUDA autocast runs batch_norm in the
input's dtype with float32 weight, bias and statistics; compile/autocast.py). A bf16 kernel
widens on load, computes exactly as the float32 one and rounds each output once, on store:
the NumPy emulation's rounding point (NumpyBackend.run_node).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ...errors import ShapeError
from ...ir.graph import Node
from ...ops.norm import residual_norm_inputs, residual_position
from .cast import CAST_CTYPES, shared_ctype
from .runtime.launch import (BLOCK, _aligned, _check, _check_int32, _check_scalar, _launch,
                             _node_memory, _or_null)

SOURCE = "norm.cu"
COLUMN_TILE = 32             # norm.cu COLUMN_TILE: most thread lanes along C in a columns block
STATS_ROWS = 16              # norm.cu STATS_ROWS: row lanes of a columns stats block
APPLY_ROWS = 8               # row lanes of a columns elementwise block (256 threads)
COLUMN_MIN_CHANNELS = 8      # (N, C) inputs with fewer channels walk each channel's column
STATS_TARGET_BLOCKS = 512    # stats passes: split channels' elements to about this many blocks
APPLY_TARGET_BLOCKS = 2048   # elementwise passes: the same, with shallower blocks
STATS_MIN_PER_SPLIT = BLOCK * 4   # packs (planes) a stats split takes at least
APPLY_MIN_PER_SPLIT = BLOCK * 4   # packs an elementwise split takes at least
STATS_MIN_ROWS = 256         # rows a columns stats split takes at least
APPLY_MIN_ROWS = 64          # rows a columns elementwise split takes at least
FEW_BLOCKS_SHARE = 4         # columns passes under target / 4 blocks: splits of one round
FINALIZE_BLOCK = 128         # a warp per channel (norm.cu channel_sums), blocks over channels
# IR dtype -> (storage dtype, the pass kernels' template argument T)
ACTIVATION_CTYPES = CAST_CTYPES
BF16_OPS = frozenset({"batch_norm_train", "batch_norm_stats", "batch_norm_grad"})
FP16_OPS = BF16_OPS        # float16 activations (fp16_bits), float32 per-channel values
KINDS = ("stats", "forward", "grad_stats", "backward")    # the passes of norm.cu
# passes templated on a fused input: the gradient's on its fused sum (norm.cu SUM), the
# forward's on the shortcut's fused BatchNorm (NORM_R)
FUSED_KINDS = ("forward", "grad_stats", "backward")
# Columns passes: (V adjacent channels a thread in one access, R rows a round) by activation C
# type and pass (norm.cu walk_column), chosen by each pass's time inside the resnet step on an
# H200 (docs/perf-notes.md, 2026-11-26 03:40-04:10): wider accesses with several in flight;
# the float32 gradient sums' (2, 4) by the isolated passes of three nets' shapes (2026-12-02).
# V falls back to 1 where C % V != 0 or an array is not 16-byte aligned.
COLUMN_WALKS = {
    "float": {"stats": (1, 4), "forward": (2, 4), "grad_stats": (2, 4), "backward": (2, 4)},
    "unsigned short": {"stats": (2, 4), "forward": (2, 4), "grad_stats": (2, 4),
                       "backward": (2, 4)},
    # float16: bf16's walks (the same 2-byte accesses; not timed on their own)
    "fp16_bits": {"stats": (2, 4), "forward": (2, 4), "grad_stats": (2, 4), "backward": (2, 4)},
}


@dataclass(frozen=True)
class PassShape:
    """One pass's launch: kernel, grid, block, and each channel's elements per split."""

    kernel: str
    grid: tuple[int, int]
    block: tuple[int, ...]
    per: int

    @property
    def splits(self) -> int:
        return self.grid[1]


@dataclass(frozen=True)
class Layout:
    """How the kernels walk x viewed as (n, c, inner): `columns` when inner == 1 and C is
    wide enough (threads along C), else planes of `inner` packs of `vec` floats. `aligned`:
    every array of the op is 16-byte aligned (vector accesses allowed)."""

    n: int
    c: int
    inner: int
    columns: bool
    vec: int
    aligned: bool = True

    @property
    def count(self) -> int:
        """Elements per channel (M)."""
        return self.n * self.inner

    def column_walk(self, kind: str, ctype: str) -> tuple[int, int]:
        """(channels a thread, rows a round) of a columns pass (COLUMN_WALKS)."""
        vec, rows = COLUMN_WALKS[ctype][kind]
        return (vec if self.aligned and self.c % vec == 0 else 1), rows

    def pass_shape(self, kind: str, ctype: str, fused: bool = False) -> PassShape:
        """The launch of pass `kind` (KINDS) for activations of C type `ctype`, with its
        fused input when `fused` (FUSED_KINDS): each channel's rows (columns) or packs
        (planes) split over about STATS_TARGET_BLOCKS (reductions) or APPLY_TARGET_BLOCKS
        (elementwise) blocks, a split taking at least the minimum work."""
        reduces = kind in ("stats", "grad_stats")
        target = STATS_TARGET_BLOCKS if reduces else APPLY_TARGET_BLOCKS
        if self.columns:
            vec, rows = self.column_walk(kind, ctype)
            # lanes along C: its channel groups, whole warps with the row lanes (a multiple of 4)
            lanes = min(COLUMN_TILE, -(-(self.c // vec) // 4) * 4)
            work, blocks = self.n, -(-self.c // (vec * lanes))
            minimum = STATS_MIN_ROWS if reduces else APPLY_MIN_ROWS
            block = (lanes, STATS_ROWS if reduces else APPLY_ROWS)
            kernel = f"batch_norm_{kind}_columns_kernel<{ctype}, {vec}, {rows}"
        else:
            work, blocks = self.n * self.inner // self.vec, self.c
            minimum = STATS_MIN_PER_SPLIT if reduces else APPLY_MIN_PER_SPLIT
            block = None
            kernel = (f"batch_norm_{kind}_planes{'_vec4' if self.vec == 4 else ''}_kernel"
                      f"<{ctype}")
        if kind in FUSED_KINDS:
            kernel += f", {'true' if fused else 'false'}"
        kernel += ">"
        splits = max(1, min(-(-work // minimum), target // blocks))
        if self.columns and blocks * splits < target // FEW_BLOCKS_SHARE:
            # few rows (a late stage's small maps at a small batch): splits of `minimum`
            # rows would leave most of the GPU idle and each thread walking its rows one
            # after another; splits of one round of rows a thread fill it
            rounds = block[1] * self.column_walk(kind, ctype)[1]
            splits = max(1, min(-(-work // rounds), target // blocks))
        per = max(1, -(-work // splits))
        if block is None:   # short channels (few elements per split) get fewer threads
            block = (min(BLOCK, max(32, -(-per // 32) * 32)),)
        return PassShape(kernel, (blocks, max(1, -(-work // per))), block, per)


def _layout(op: str, x, arrays) -> Layout:
    """The layout of x (rank >= 2); vec 4 when inner % 4 == 0 and every array is 16-byte
    aligned (each (n, c) row then starts on a float4)."""
    if x.ndim < 2:
        raise ShapeError(f"{op}: input must be (N, C, ...), got {tuple(x.shape)}")
    n, c = x.shape[:2]
    inner = math.prod(x.shape[2:])
    if n * inner == 0 or c == 0:
        raise ShapeError(f"{op}: no elements per channel in input {tuple(x.shape)}")
    _check_int32(op, x.size)
    columns = inner == 1 and c >= COLUMN_MIN_CHANNELS
    aligned = _aligned(*arrays)
    vec = 4 if not columns and inner % 4 == 0 and aligned else 1
    return Layout(n, c, inner, columns, vec, aligned)


def _launch_pass(ctx, layout: Layout, shape: PassShape, arrays: tuple) -> None:
    """One stats or elementwise pass of norm.cu over x in `layout`: `arrays` first, then the
    shape arguments."""
    if layout.columns:
        sizes = (np.int32(layout.n), np.int32(layout.c), np.int32(shape.per))
    else:
        inner = layout.inner // layout.vec
        sizes = (np.int32(layout.c), np.int32(inner), np.int32(layout.n * inner),
                 np.int32(shape.per))
    _launch(ctx, SOURCE, shape.kernel, shape.grid, shape.block, arrays + sizes)


def _finalize_blocks(channels: int) -> int:
    """Blocks of a finalize kernel: a warp per channel."""
    return -(-channels * 32 // FINALIZE_BLOCK)


def _partials(node: Node, ctx, layout: Layout, splits: int, extra: int = 0) -> dict:
    """The node's float64 (C, splits, 2) partial sums, and `extra` floats per channel."""
    key = ("batch_norm", node.op, layout.c, splits, extra)
    return _node_memory(node, key, ctx, lambda: dict(
        partial=cp.empty(layout.c * splits * 2, np.float64),
        coef=cp.empty(max(1, layout.c * extra), np.float32)))


def _check_channels(op: str, c: int, **arrays) -> None:
    for what, arr in arrays.items():
        if arr is not None:
            _check(f"{op} {what}", arr, shape=(c,))


def _channels_last(attrs: dict, arrays: list, positions) -> list:
    """`arrays` with those at `positions` viewed as (M, C) when attrs layout is "NHWC"
    (channels on the last axis: M rows of C, what the columns layout walks)."""
    layout = attrs.get("layout", "NCHW")
    if layout == "NCHW":
        return arrays
    if layout != "NHWC":
        raise ValueError(f"batch_norm: layout must be 'NCHW' or 'NHWC', got {layout!r}")
    return [a.reshape(-1, a.shape[-1]) if i in positions and a.ndim > 2 else a
            for i, a in enumerate(arrays)]


def _relu(attrs: dict) -> bool:
    act = attrs.get("act") or "none"
    if act not in ("none", "relu"):
        raise ValueError(f"batch_norm: act must be 'none' or 'relu', got {act!r}")
    return act == "relu"


# ---- batch_norm_train ----------------------------------------------------------------------

@dataclass
class TrainArrays:
    """batch_norm_train's inputs and outputs by name (ops/norm.py: x, [weight, bias],
    [running_mean, running_var, num_batches_tracked], [residual, [r_mean, r_invstd,
    [r_weight, r_bias]]] -> y, save_mean, save_invstd)."""

    x: Any
    y: Any
    save_mean: Any
    save_invstd: Any
    weight: Any = None
    bias: Any = None
    running_mean: Any = None
    running_var: Any = None
    tracked: Any = None
    residual: Any = None
    r_mean: Any = None       # the shortcut's fused BatchNorm (attrs residual_norm)
    r_invstd: Any = None
    r_weight: Any = None
    r_bias: Any = None
    ctype: str = "float"     # of x, the residual and y (ACTIVATION_CTYPES)


def _train_arrays(attrs: dict, ins: list, outs: list) -> TrainArrays:
    """The node's arrays, named and checked."""
    affine, track = bool(attrs.get("affine")), bool(attrs.get("track"))
    residual = bool(attrs.get("residual"))
    norm_r = residual_norm_inputs(attrs)
    want = 1 + 2 * affine + 3 * track + residual + norm_r
    if len(ins) != want or len(outs) != 3:
        raise ShapeError(f"batch_norm_train: affine={affine} track={track} residual={residual} "
                         f"residual_norm={bool(norm_r)} take {want} inputs and give 3 outputs, "
                         f"got {len(ins)} and {len(outs)}")
    t = TrainArrays(ins[0], *outs)
    if affine:
        t.weight, t.bias = ins[1], ins[2]
    if track:
        t.running_mean, t.running_var, t.tracked = ins[1 + 2 * affine:4 + 2 * affine]
        _check_scalar("batch_norm_train num_batches_tracked", t.tracked, "int64")
    if residual:
        t.residual = ins[residual_position(attrs)]
        _check("batch_norm_train residual", t.residual, None, t.x.shape)
    if norm_r:
        t.r_mean, t.r_invstd, *affine_r = ins[len(ins) - norm_r:]
        if affine_r:
            t.r_weight, t.r_bias = affine_r
    t.ctype = shared_ctype("batch_norm_train", {"input": t.x, "output": t.y,
                                                "residual": t.residual})
    _check("batch_norm_train output", t.y, None, t.x.shape)
    _check_channels("batch_norm_train", t.x.shape[1] if t.x.ndim >= 2 else 0,
                    save_mean=t.save_mean, save_invstd=t.save_invstd, weight=t.weight,
                    bias=t.bias, running_mean=t.running_mean, running_var=t.running_var,
                    r_mean=t.r_mean, r_invstd=t.r_invstd, r_weight=t.r_weight, r_bias=t.r_bias)
    return t


def batch_norm_train_forward(ctx, node: Node, ins: list, outs: list) -> None:
    """y = (x - mean) * invstd (* weight + bias) (+ the residual with attrs residual, itself
    normalised with attrs residual_norm; ReLU when attrs act == "relu"), batch statistics per
    channel in float64; save_mean, save_invstd (C,); with running stats, those updated in
    place (momentum None: cumulative average) and num_batches_tracked += 1."""
    a = node.attrs
    residual_at = (residual_position(a),) if a.get("residual") else ()
    t = _train_arrays(a, _channels_last(a, ins, (0, *residual_at)),
                      _channels_last(a, outs, (0,)))
    relu = _relu(a)
    layout = _layout("batch_norm_train", t.x,
                     tuple(v for v in (t.x, t.y, t.residual) if v is not None))
    _statistics(ctx, node, layout, t)
    norm_r = t.r_mean is not None
    _launch_pass(ctx, layout, layout.pass_shape("forward", t.ctype, norm_r),
                 (t.x, _or_null(t.residual), t.y, t.save_mean, t.save_invstd,
                  _or_null(t.weight), _or_null(t.bias), np.int32(relu),
                  *(_or_null(v) for v in (t.r_mean, t.r_invstd, t.r_weight, t.r_bias))))


def _statistics(ctx, node: Node, layout: Layout, t: TrainArrays) -> None:
    """The stats pass and the finalize: t.save_mean, t.save_invstd and the running
    statistics' update (attrs eps, momentum)."""
    a = node.attrs
    stats = layout.pass_shape("stats", t.ctype)
    scratch = _partials(node, ctx, layout, stats.splits)
    _launch_pass(ctx, layout, stats, (t.x, scratch["partial"]))
    momentum = a.get("momentum")
    # a cumulative average reads num_batches_tracked in every thread: one block, so that
    # every read precedes the increment (batch_norm_finalize_kernel)
    blocks = 1 if momentum is None else _finalize_blocks(layout.c)
    _launch(ctx, SOURCE, "batch_norm_finalize_kernel", (blocks,), (FINALIZE_BLOCK,),
            (scratch["partial"], np.int32(stats.splits), np.int32(layout.c),
             np.float64(layout.count), np.float64(a["eps"]), t.save_mean, t.save_invstd,
             _or_null(t.running_mean), _or_null(t.running_var), _or_null(t.tracked),
             np.float64(momentum or 0.0), np.int32(momentum is None)))


def batch_norm_stats_forward(ctx, node: Node, ins: list, outs: list) -> None:
    """batch_norm_train's statistics alone (ops/norm.py batch_norm_stats): save_mean,
    save_invstd and, with attrs track, the running statistics updated in place."""
    a = node.attrs
    track = bool(a.get("track"))
    if len(ins) != 1 + 3 * track or len(outs) != 2:
        raise ShapeError(f"batch_norm_stats: track={track} takes {1 + 3 * track} inputs and "
                         f"gives 2 outputs, got {len(ins)} and {len(outs)}")
    (x,) = _channels_last(a, ins[:1], (0,))
    t = TrainArrays(x, None, *outs, running_mean=ins[1] if track else None,
                    running_var=ins[2] if track else None, tracked=ins[3] if track else None)
    t.ctype = shared_ctype("batch_norm_stats", {"input": x})
    if track:
        _check_scalar("batch_norm_stats num_batches_tracked", t.tracked, "int64")
    _check_channels("batch_norm_stats", x.shape[1] if x.ndim >= 2 else 0,
                    save_mean=t.save_mean, save_invstd=t.save_invstd,
                    running_mean=t.running_mean, running_var=t.running_var)
    _statistics(ctx, node, _layout("batch_norm_stats", x, (x,)), t)


# ---- batch_norm_grad -----------------------------------------------------------------------

@dataclass
class GradArrays:
    """batch_norm_grad's inputs and outputs by name (ops/norm.py: dy, x, [weight], save_mean,
    save_invstd, [bias with the fused ReLU], [dy2 with the fused gradient sum] -> dx,
    [dweight, dbias])."""

    dy: Any
    x: Any
    weight: Any
    mean: Any
    invstd: Any
    bias: Any
    dx: Any
    dweight: Any = None
    dbias: Any = None
    dy2: Any = None
    ctype: str = "float"     # of dy, x and dx (ACTIVATION_CTYPES)


def _grad_arrays(attrs: dict, ins: list, outs: list) -> GradArrays:
    """The node's arrays, named and checked."""
    affine, relu = bool(attrs.get("affine")), _relu(attrs)
    dy_sum = bool(attrs.get("dy_sum"))
    want = 4 + affine + (affine and relu) + dy_sum
    if len(ins) != want or len(outs) != 1 + 2 * affine:
        raise ShapeError(f"batch_norm_grad: affine={affine} act={attrs.get('act')!r} "
                         f"dy_sum={dy_sum} take {want} inputs and give {1 + 2 * affine} "
                         f"outputs, got {len(ins)} and {len(outs)}")
    g = GradArrays(ins[0], ins[1], ins[2] if affine else None, ins[2 + affine],
                   ins[3 + affine], ins[4 + affine] if affine and relu else None, *outs)
    g.dy2 = ins[-1] if dy_sum else None
    g.ctype = shared_ctype("batch_norm_grad", {"dy": g.dy, "x": g.x, "dx": g.dx,
                                               "dy2": g.dy2})
    for what, arr in (("x", g.x), ("dx", g.dx), ("dy2", g.dy2)):
        if arr is None:
            continue
        _check(f"batch_norm_grad {what}", arr, None, g.dy.shape)
    _check_channels("batch_norm_grad", g.dy.shape[1] if g.dy.ndim >= 2 else 0,
                    save_mean=g.mean, save_invstd=g.invstd, weight=g.weight, bias=g.bias,
                    dweight=g.dweight, dbias=g.dbias)
    return g


def batch_norm_grad_backward(ctx, node: Node, ins: list, outs: list) -> None:
    """dx (and dweight, dbias when affine) of batch_norm_train: g = dy (attrs dy_sum: dy + dy2,
    rounded as stored; with the fused ReLU, 0 where the pre-activation recomputed from x,
    weight and bias is not positive), dbias = sum g, dweight = sum g * xhat per channel
    (float64), dx = weight * invstd * (g - sum g / M - xhat * sum g xhat / M)."""
    a = node.attrs
    dy2_at = (len(ins) - 1,) if a.get("dy_sum") else ()
    g = _grad_arrays(a, _channels_last(a, ins, (0, 1, *dy2_at)),
                     _channels_last(a, outs, (0,)))
    relu = np.int32(_relu(a))
    # the pass kernels read weight and bias only for the ReLU's mask (both null: not affine)
    affine = (_or_null(g.weight), _or_null(g.bias)) if relu else (_or_null(None),) * 2
    layout = _layout("batch_norm_grad", g.dy,
                     tuple(v for v in (g.dy, g.x, g.dx, g.dy2) if v is not None))
    dy_sum = g.dy2 is not None
    stats = layout.pass_shape("grad_stats", g.ctype, dy_sum)
    scratch = _partials(node, ctx, layout, stats.splits, extra=3)
    _launch_pass(ctx, layout, stats,
                 (g.dy, _or_null(g.dy2), g.x, *affine, relu, g.mean, g.invstd,
                  scratch["partial"]))
    _launch(ctx, SOURCE, "batch_norm_grad_finalize_kernel", (_finalize_blocks(layout.c),),
            (FINALIZE_BLOCK,),
            (scratch["partial"], np.int32(stats.splits), np.int32(layout.c),
             np.float64(layout.count), _or_null(g.weight), g.invstd, scratch["coef"],
             _or_null(g.dweight), _or_null(g.dbias)))
    _launch_pass(ctx, layout, layout.pass_shape("backward", g.ctype, dy_sum),
                 (g.dy, _or_null(g.dy2), g.x, *affine, relu, g.mean, g.invstd,
                  scratch["coef"], g.dx))


# ---- names and the op table ----------------------------------------------------------------

def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    names = {"batch_norm_finalize_kernel", "batch_norm_grad_finalize_kernel"}
    for kind in KINDS:
        for _, ctype in ACTIVATION_CTYPES.values():
            names |= {Layout(1, c, 1 if columns else 4, columns, vec, aligned)
                      .pass_shape(kind, ctype, fused).kernel
                      for columns, vec in ((False, 1), (False, 4), (True, 1))
                      for c in (4, 1) for aligned in (True, False)
                      for fused in (False, True)}
    return {SOURCE: names}


IMPLS: dict[str, Callable] = {
    # attrs layout "NHWC" views the activations as (M, C) (_channels_last)
    "batch_norm_train": lambda node, ins, outs, ctx: batch_norm_train_forward(
        ctx, node, ins, outs),
    "batch_norm_stats": lambda node, ins, outs, ctx: batch_norm_stats_forward(
        ctx, node, ins, outs),
    "batch_norm_grad": lambda node, ins, outs, ctx: batch_norm_grad_backward(
        ctx, node, ins, outs),
}
