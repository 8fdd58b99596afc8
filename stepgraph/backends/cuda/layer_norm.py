"""Launchers of layer_norm.cu (layer_norm, layer_norm_grad; add_layer_norm, rms_norm,
add_rms_norm and their gradients, made by compile/norm_rewrite.py) and their cuda op table.

x (any rank >= 1) is viewed as (rows, C), normalised over C. A row group of `threads` threads
(a multiple of 32) handles a row, `rows_per_block` rows a block; each thread keeps K groups of
VEC columns in registers between the passes (`Layout`). The row group is as few warps as keep
K * VEC at most 16 floats a thread: one warp (shuffles only, no barrier) for rows up to 512
floats, e.g. GPT's 384 or 768 columns in one or two warps. Rows too wide for MAX_THREADS
threads take the *_loop kernels.

layer_norm_grad is one kernel for dx and the per-block partial sums of dweight / dbias (a
block visits a fixed set of rows, sums its rows in registers, and adds its row lanes in order),
then, when either is wanted, one finalize launch adding the blocks' rows in a fixed order in
float64: deterministic, no atomics. Its grid is the number of blocks the GPU holds at once
(at most one block per row group), so the partial tables stay small (a few percent of the
bytes of x) and every block has the same work. The partial sums live in device memory made
once per node at its first eager call (runtime/launch.py _node_memory): a capture may not allocate,
and Executable warms up eagerly before capture. Launchers check their preconditions and launch
on ctx.stream: no host sync.

The backwards may store dx rounded to bf16 or float16 for a float32 x as well (the node's
dx_half output) or in its place (a half dx output): compile/norm_casts.py, the kernels' H.
layer_norm and layer_norm_grad may read a bf16 x with float32 parameters (XI), for the same
pass: the cast to float32 autocast put before a LayerNorm that reads a bf16 GEMM or
convolution output directly, widened as loaded.

float16 (model.half(): x, weight, bias, y, dy, dx, dweight and dbias all float16): the same
kernels with X = fp16_bits, float32 statistics and arithmetic, each float16 store rounded once;
`FP16_OPS`. precision="fp16" keeps x float32 (autocast runs layer_norm in float32) and takes
the bf16 instantiations' float16 twins for a fused cast's y or dy (fuse_layer_norm_casts).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ...errors import ShapeError
from ...ir.graph import Node
from .elementwise import dropout_constants, fill_forward
from .reduce import reduce_sum_columns
from .runtime.launch import (ELEMENT_CTYPES, _aligned, _check, _check_int32, _check_scalar,
                             _element_ctype, _kernel, _launch, _node_memory, _or_null,
                             _row_grid, _typed, sm_count)

SOURCE = "layer_norm.cu"
# bf16 y (forward) or dy (backward) where compile/norm_casts.py fuse_layer_norm_casts dropped a cast
BF16_OPS = frozenset({"layer_norm", "layer_norm_grad", "add_layer_norm", "add_layer_norm_grad",
                      "rms_norm", "rms_norm_grad", "add_rms_norm", "add_rms_norm_grad"})
# The kernel name prefixes of layer_norm.cu, each with the same templates and layouts.
KERNEL_OPS = ("layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm")
ADD_OPS = ("add_layer_norm", "add_rms_norm")    # a half b beside a float32 a (btype)
FP16_OPS = BF16_OPS
# (x, y) C types of the forward (x, dx) and (dy) of the backward alike: float32 x with a
# float32, bf16 or float16 y (a fused cast); a float16 x with float16 everywhere.
IO_CTYPES = [("float", ctype) for ctype in ELEMENT_CTYPES.values()] + [("fp16_bits", "fp16_bits")]
# The half C types (bf16, float16) a float32 norm's kernels also take: add_layer_norm's b
# beside a float32 a (precision "bf16" / "fp16": the widening cast before the residual add,
# compile/norm_rewrite.py), and a backward's half dx copy (H; compile/norm_casts.py).
HALF_CTYPES = ("unsigned short", "fp16_bits")
BF16_CTYPE = "unsigned short"      # layer_norm's bf16 x beside float32 parameters (XI)
MAX_THREADS = 512            # threads of a block (LAYER_NORM_MAX_THREADS, __launch_bounds__)
ROWS_BLOCK_THREADS = 256     # threads of a block of several rows (LAYER_NORM_BLOCK_ROWS_THREADS)
FLOATS_PER_THREAD = 16       # K * VEC at most: dy, xhat, weight and two sums in registers
KS = {4: (1, 2, 3, 4), 1: (1, 2, 3, 4, 6, 8, 12, 16)}   # K per VEC the templates exist for
LOOP_THREADS = 256           # row group of the *_loop kernels (one row a block)
PARTIAL_MAX = 1 << 21        # floats of one partial-sum table (blocks * C) at most
FINALIZE_LANES = 32          # slot lanes of a finalize block (FINALIZE_LANES in the .cu)


@dataclass(frozen=True)
class Layout:
    """How a row is spread over threads: `threads` per row, `rows_per_block` rows a block,
    each thread holding k groups of vec columns (k == 0: the loop kernels)."""

    vec: int
    k: int
    threads: int
    rows_per_block: int

    def kernel(self, direction: str, ctype: str = "float", xtype: str = "float",
               op: str = "layer_norm", btype: str | None = None,
               htype: str | None = None, itype: str | None = None) -> str:
        """The forward's or backward's kernel of `op` (KERNEL_OPS)
        for a y (forward) or dy (backward) of C type ctype: float, or unsigned short for bf16
        bits (fuse_layer_norm_casts); and x (weight, bias, dx) of C type xtype: float, or
        fp16_bits (a float16 model). btype: an add_* forward's b when it is not
        xtype (a bf16 or float16 b widened as loaded; None: xtype). htype: a backward's half
        dx copy (None: none). itype: layer_norm's x when it is not xtype (a bf16 x with float32
        parameters; None: xtype)."""
        x = "" if xtype == "float" else f", {xtype}"     # the template's default: float
        if btype is not None and btype != xtype:
            x = f", {xtype}, {btype}"
        if htype is not None:
            x = f", {xtype}, {htype}"
        if itype is not None:     # a backward's H comes before XI: explicit then
            x = f", {xtype}, {itype}" if direction == "forward" else \
                f", {xtype}, {htype or xtype}, {itype}"
        if self.k == 0:
            return f"{op}_{direction}_loop_kernel<{ctype}{x}>"
        return f"{op}_{direction}_kernel<{ctype}, {self.vec}, {self.k}{x}>"

    @property
    def block(self) -> tuple[int, int]:
        return (self.threads, self.rows_per_block)


def row_layout(c: int, arrays) -> Layout:
    """The layout of rows of c columns: vec 4 when c % 4 == 0 and every array is 16-byte
    aligned; the fewest warps a row that hold it in FLOATS_PER_THREAD floats a thread, and the
    smallest K that covers the row with them; ROWS_BLOCK_THREADS threads a block."""
    vec = 4 if c % 4 == 0 and _aligned(*arrays) else 1
    groups = c // vec
    ks = KS[vec]
    threads = 32 * -(-groups // (32 * (FLOATS_PER_THREAD // vec)))
    if threads > MAX_THREADS:
        return Layout(1, 0, LOOP_THREADS, 1)
    need = -(-groups // threads)
    k = next(k for k in ks if k >= need)
    return Layout(vec, k, threads, max(1, ROWS_BLOCK_THREADS // threads))


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    names = {_finalize_name(t, s) for t in ("float", "fp16_bits") for s in (None, t)}
    names |= {_finalize_name("float", h) for h in HALF_CTYPES}
    layouts = [Layout(1, 0, LOOP_THREADS, 1)] + [Layout(vec, k, 32, 1)
                                                 for vec, ks in KS.items() for k in ks]
    for lay in layouts:
        names |= {lay.kernel(d, ctype, xtype, op) for d in ("forward", "backward")
                  for xtype, ctype in IO_CTYPES for op in KERNEL_OPS}
        names |= {lay.kernel("forward", ctype, "float", op, btype)
                  for ctype in ELEMENT_CTYPES.values() for btype in HALF_CTYPES
                  for op in ADD_OPS}
        names |= {lay.kernel("backward", ctype, "float", op, htype=htype)
                  for htype in HALF_CTYPES for ctype in ("float", htype) for op in KERNEL_OPS}
        names |= {lay.kernel("forward", ctype, "float", itype=BF16_CTYPE)
                  for ctype in ELEMENT_CTYPES.values()}
        names |= {lay.kernel("backward", ctype, "float", htype=htype, itype=BF16_CTYPE)
                  for ctype in ("float", BF16_CTYPE) for htype in (None, BF16_CTYPE)}
    return {SOURCE: names}


@functools.cache
def _resident_blocks(device: int, name: str, threads: int) -> int:
    fn = _kernel(SOURCE, name)
    per_sm = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads, 0)
    return max(1, per_sm) * sm_count(device)


def resident_blocks(name: str, threads: int) -> int:
    """How many blocks of `threads` threads of kernel `name` the current GPU runs at once
    (the occupancy calculator; a fixed number per GPU, so reruns are bit-identical)."""
    return _resident_blocks(cp.cuda.runtime.getDevice(), name, threads)


def _rows(what: str, x, dtype: str | None = "float32") -> tuple[int, int]:
    _check(what, x, dtype=dtype)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ShapeError(f"{what}: expected (..., C) with C >= 1, got {tuple(x.shape)}")
    _check_int32(what, x.size)
    return math.prod(x.shape[:-1]), x.shape[-1]


def _input_ctypes(what: str, x) -> tuple[str, str | None]:
    """(xtype, itype) of layer_norm's x: the C type of its parameters and dx (_x_ctype's), and
    of x itself where that differs: a bf16 x with float32 parameters (None: x is xtype)."""
    if x.dtype == np.uint16:
        return "float", BF16_CTYPE
    return _x_ctype(what, x), None


def _param_dtype(x):
    """The dtype of the parameters (and dx) of a norm of x: float32 for a bf16 x, else x's."""
    return np.dtype(np.float32) if x.dtype == np.uint16 else x.dtype


def _x_ctype(what: str, x) -> str:
    """The C type of x (and of the parameters and dx): float, or fp16_bits for float16."""
    if x.dtype not in (np.float32, np.float16):
        raise ShapeError(f"{what}: the cuda kernels take float32 or float16, got {x.dtype}")
    return ELEMENT_CTYPES[x.dtype]


def _check_stats(what: str, rows: int, *stats) -> None:
    for name, t in zip(("mean", "rstd"), stats):
        _check(f"{what} {name}", t)
        if t.size != rows:
            raise ShapeError(f"{what} {name}: expected {rows} values (one a row), got shape "
                             f"{tuple(t.shape)}")


def layer_norm_forward(ctx, x, weight, bias, y, mean, rstd, eps: float) -> None:
    """y = (x - mean) * rstd [* weight] [+ bias] over the last axis; mean and rstd (rows,)
    float32, rstd = 1 / sqrt(biased variance + eps). x, weight and bias float32 (y float32,
    bf16 or float16) or all float16 with y; a bf16 x with the float32 ones (widened as
    loaded)."""
    rows, c = _rows("layer_norm input", x, dtype=None)
    xtype, itype = _input_ctypes("layer_norm input", x)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            _check(f"layer_norm {name}", t, _param_dtype(x), shape=(c,))
    _check("layer_norm output", y, dtype=None if xtype == "float" else x.dtype, shape=x.shape)
    ctype = _element_ctype("layer_norm output", y)       # bf16: fuse_layer_norm_casts
    _check_stats("layer_norm", rows, mean, rstd)
    if not rows:
        return
    lay = row_layout(c, [a for a in (x, y, weight, bias) if a is not None])
    _launch(ctx, SOURCE, lay.kernel("forward", ctype, xtype, itype=itype),
            _row_grid(rows, lay.rows_per_block), lay.block,
            (x, _or_null(weight), _or_null(bias), y, mean, rstd, np.int32(rows), np.int32(c),
             np.float32(eps)))


def grad_blocks(rows: int, c: int, lay: Layout, resident: int) -> int:
    """Blocks of layer_norm_grad: those the GPU holds at once (`resident`), at most one per
    row group, and partial tables of at most PARTIAL_MAX floats."""
    return max(1, min(-(-rows // lay.rows_per_block), resident, PARTIAL_MAX // c))


def _forward_impl(node: Node, ins, outs, ctx) -> None:
    a = node.attrs
    rest = list(ins[1:])
    weight = rest.pop(0) if a.get("weight") else None
    bias = rest.pop(0) if a.get("bias") else None
    layer_norm_forward(ctx, ins[0], weight, bias, outs[0], outs[1], outs[2],
                       a.get("eps", 1e-5))


def _grad_outputs(node: Node, outs) -> tuple:
    """(dx, dweight, dbias, dx_half, dsum) of a backward's outputs, None where it has none."""
    a = node.attrs
    rest = list(outs[1:])
    dweight = rest.pop(0) if a.get("weight") else None
    dbias = rest.pop(0) if a.get("bias") else None
    dx_half = rest.pop(0) if a.get("dx_half") else None
    return outs[0], dweight, dbias, dx_half, rest.pop(0) if a.get("dx_sum") else None


def _half_mask(node: Node, ins) -> tuple[list, HalfDropout | None]:
    """A backward's inputs without the keep mask of attrs dx_half_dropout, and that dropout
    (None without)."""
    p = node.attrs.get("dx_half_dropout")
    return (list(ins), None) if p is None else (list(ins[:-1]), HalfDropout(ins[-1], p))


def _backward_impl(node: Node, ins, outs, ctx) -> None:
    a = node.attrs
    ins, half_dropout = _half_mask(node, ins)
    dy, x = ins[0], ins[1]
    weight = ins[2] if a.get("weight") else None
    mean, rstd = ins[-2], ins[-1]
    dx, dweight, dbias, dx_half, dsum = _grad_outputs(node, outs)
    layer_norm_backward(ctx, node, dy, x, weight, mean, rstd, dx, dweight, dbias,
                        dx_half=dx_half, half_dropout=half_dropout, dsum=dsum)


# ---- the backwards, add_layer_norm and rms_norm: shared checks and partial-sum tables ----

def _norm_input(what: str, x, c: int, weight, bias=None) -> str:
    """xtype of a normalisation's x, after checking its weight and bias against it."""
    xtype = _x_ctype(what, x)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            _check(f"{what} {name}", t, x.dtype, shape=(c,))
    return xtype


@dataclass(frozen=True)
class BranchDropout:
    """An add_* forward's dropout of b (ops/layer_norm.py attrs dropout): the int64 step
    counter, the uint8 keep mask it writes (b's shape), and the dropout op's p, seed, site."""

    step: object
    mask: object
    p: float
    seed: int
    site: int

    def operands(self, what: str, b) -> tuple:
        """The kernel's trailing arguments, after checking the counter and the mask."""
        threshold, scale = dropout_constants(self.p)
        if not 0 <= self.site < 2**32:
            raise ValueError(f"{what} dropout site must fit in 32 bits, got {self.site}")
        _check_scalar(f"{what} step", self.step, "int64")
        _check(f"{what} mask", self.mask, "uint8", shape=b.shape)
        return (self.step, self.mask, np.uint64(self.seed & (2**64 - 1)), np.uint32(self.site),
                threshold, scale)


@dataclass(frozen=True)
class HalfDropout:
    """A backward's dropout of its half dx copy (ops/layer_norm.py attrs dx_half_dropout): the
    uint8 keep mask it reads (dy's shape) and p."""

    mask: object
    p: float


NO_DROPOUT = (_or_null(None), _or_null(None), np.uint64(0), np.uint32(0), np.uint32(0),
              np.float32(0.0))


def _dropout_operands(what: str, b, dropout: BranchDropout | None) -> tuple:
    return NO_DROPOUT if dropout is None else dropout.operands(what, b)


def _mask(dropout: BranchDropout | HalfDropout | None) -> object | None:
    """The keep mask a dropout writes or reads (the kernels access it in groups of four: it
    takes part in the layout's alignment check), None without one."""
    return None if dropout is None else dropout.mask


def add_layer_norm_forward(ctx, a, b, weight, bias, y, s, mean, rstd, eps: float,
                           dropout: BranchDropout | None = None) -> None:
    """s = a + b rounded to a's storage; y = layer_norm(s) as layer_norm_forward's; a, b, s,
    weight and bias all float32 (y float32, bf16 or float16) or all float16 with y; b may be
    bf16 or float16 with a float32 a (widened as loaded). dropout: b dropped first, as the
    dropout op drops it (its keep mask written)."""
    rows, c = _rows("add_layer_norm a", a, dtype=None)
    xtype = _norm_input("add_layer_norm", a, c, weight, bias)
    btype = _residual_operands("add_layer_norm", a, b, s, xtype)
    drop = _dropout_operands("add_layer_norm", b, dropout)
    _check("add_layer_norm output", y, dtype=None if xtype == "float" else a.dtype,
           shape=a.shape)
    ctype = _element_ctype("add_layer_norm output", y)
    _check_stats("add_layer_norm", rows, mean, rstd)
    if not rows:
        return
    lay = row_layout(c, [t for t in (a, b, s, y, weight, bias, _mask(dropout))
                         if t is not None])
    _launch(ctx, SOURCE, lay.kernel("forward", ctype, xtype, "add_layer_norm", btype),
            _row_grid(rows, lay.rows_per_block), lay.block,
            (a, b, _or_null(weight), _or_null(bias), y, s, mean, rstd, np.int32(rows),
             np.int32(c), np.float32(eps)) + drop)


def _residual_operands(what: str, a, b, s, xtype: str) -> str:
    """The C type of an add_* forward's b, after checking s (a's storage and shape) and b (a's
    shape; a's storage, or a bf16 / float16 b beside a float32 a)."""
    _check(f"{what} s", s, a.dtype, shape=a.shape)
    btype = _element_ctype(f"{what} b", b)
    _check(f"{what} b", b, a.dtype if xtype != "float" or btype == "float" else None,
           shape=a.shape)
    return btype


def _grad_tables(ctx, node: Node, what: str, name: str, lay: Layout, rows: int, c: int,
                 *sums) -> tuple:
    """(blocks, partial tables...) of the backward op `what`'s kernel `name`: its grid and the
    node's partial-sum table of each of `sums` (dweight, dbias, dsum: None where that sum is
    not wanted)."""
    blocks = grad_blocks(rows, c, lay, resident_blocks(name, lay.threads * lay.rows_per_block))
    wanted = tuple(t is not None for t in sums)
    if not any(wanted):                # no scratch asked of the node
        return (blocks, *sums)
    tables = _node_memory(node, (what, blocks, c, wanted), ctx, lambda: [
        cp.empty(blocks * c, np.float32) if want else None for want in wanted])
    return (blocks, *tables)


def _finalize_name(xtype: str, stype: str | None) -> str:
    """The finalize kernel of dweight and dbias of C type xtype and a dsum of stype (None or
    xtype: the template's default)."""
    if stype is None or stype == xtype:
        return _typed("layer_norm_grad_finalize_kernel", xtype)
    return f"layer_norm_grad_finalize_kernel<{xtype}, {stype}>"


def _finalize(ctx, xtype: str, blocks: int, c: int, partials, dweight, dbias, dsum) -> None:
    """One launch adding the blocks' rows of each partial table (partial_w, partial_b,
    partial_s; None where not wanted) into dweight, dbias and dsum."""
    tables = sum(t is not None for t in partials)
    if tables:
        stype = None if dsum is None else ELEMENT_CTYPES[dsum.dtype]
        _launch(ctx, SOURCE, _finalize_name(xtype, stype), (-(-c // 32), tables),
                (32, FINALIZE_LANES), tuple(map(_or_null, (*partials, dweight, dbias, dsum)))
                + (np.int32(blocks), np.int32(c)))


def _sum_inside(lay: Layout, c: int, dsum):
    """dsum where the backward kernel of `lay` sums its dx copy itself: the loop kernels, and
    the register kernels whose block's rows fit its shared table (layer_norm.cu
    dx_sums_begin); else None (_sum_outside takes it)."""
    if dsum is None or lay.k and lay.rows_per_block * c > ROWS_BLOCK_THREADS * lay.k * lay.vec:
        return None
    return dsum


def _sum_outside(ctx, node: Node, dsum, inside, dx, dx_half, rows: int, c: int) -> None:
    """dsum, where the backward kernel did not take it, by a column kernel over the copy."""
    if dsum is not None and inside is None:
        reduce_sum_columns(ctx, node, dx_half if dx_half is not None else dx, dsum, rows, c)


def _check_sum(what: str, dsum, dx, dx_half, c: int) -> None:
    """A backward's dsum: (c,) of the stored dx copy's dtype (dx_half's where given)."""
    if dsum is not None:
        copy = dx_half if dx_half is not None else dx
        _check(f"{what} dsum", dsum, copy.dtype, shape=(c,))


def _check_grad(what: str, dy, x, dx, dx_half, bf16_x: bool = False
                ) -> tuple[int, int, str, str, object, object]:
    """(rows, c, ctype, xtype, dx, dx_half) of a backward's dy, x, dx and its half copy: a
    half dx of a float32 x is stored as the copy alone (dx None). bf16_x: x may be bf16 (with
    float32 parameters and dx: layer_norm_grad's)."""
    rows, c = _rows(f"{what} dy", dy, dtype=None)
    ctype = _element_ctype(f"{what} dy", dy)
    _check(f"{what} x", x, dtype=None, shape=dy.shape)
    if x.dtype == np.uint16 and not bf16_x:
        raise ShapeError(f"{what}: a bf16 x is layer_norm_grad's alone")
    xtype = _input_ctypes(f"{what} x", x)[0]
    if xtype != "float":
        _check(f"{what} dy", dy, x.dtype)
    if xtype == "float" and dx.dtype != np.float32 and dx_half is None:
        dx, dx_half = None, dx
    if dx is not None:
        _check(f"{what} dx", dx, _param_dtype(x), shape=dy.shape)
    if dx_half is not None:
        if xtype != "float" or _element_ctype(f"{what} dx_half", dx_half) == "float":
            raise ShapeError(f"{what}: a half dx copy is of a float32 x, got {dx_half.dtype} "
                             f"of {x.dtype}")
        _check(f"{what} dx_half", dx_half, dtype=None, shape=dy.shape)
    return rows, c, ctype, xtype, dx, dx_half


def _half_ctype(dx_half) -> str | None:
    return None if dx_half is None else ELEMENT_CTYPES[dx_half.dtype]


def _half_dropout(what: str, dx, dx_half, half_dropout: HalfDropout | None) -> tuple:
    """A backward kernel's trailing (half_mask, half_scale): half_dropout's, checked against
    the dx_half copy it drops, or none."""
    if half_dropout is None:
        return (_or_null(None), np.float32(0.0))
    if dx is None or dx_half is None:
        raise ShapeError(f"{what}: a dropout of the half dx copy needs the float32 dx and the "
                         f"copy")
    _check(f"{what} dx_half mask", half_dropout.mask, "uint8", shape=dx_half.shape)
    return (half_dropout.mask, dropout_constants(half_dropout.p)[1])


def _zero_grads(ctx, *grads) -> None:
    for t in grads:
        if t is not None:
            fill_forward(ctx, t, 0.0)


def layer_norm_backward(ctx, node: Node, dy, x, weight, mean, rstd, dx, dweight=None,
                        dbias=None, ds=None, dx_half=None, half_dropout=None,
                        dsum=None) -> None:
    """dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) [+ ds], g = dy [* weight], xhat =
    (x - mean) * rstd; dweight = sum over rows of dy * xhat and dbias = sum of dy (each
    optional). ds: add_layer_norm's residual gradient (x is then the forward's s), added to
    dx by the add_layer_norm kernels. dx_half: dx rounded to bf16 / float16 as well (a half
    dx alone: in place of the float32 one). half_dropout: a dropout's gradient the dx_half
    copy goes through (compile/norm_casts.py). dsum: the column sums of the dx copy stored
    last (dx_half where given, else dx), as stored (compile/norm_casts.py
    fuse_norm_grad_bias_sums)."""
    what = "layer_norm_grad" if ds is None else "add_layer_norm_grad"
    rows, c, ctype, xtype, dx, dx_half = _check_grad(what, dy, x, dx, dx_half, ds is None)
    drop = _half_dropout(what, dx, dx_half, half_dropout)
    _check_sum(what, dsum, dx, dx_half, c)
    if ds is not None:
        _check(f"{what} ds", ds, x.dtype, shape=x.shape)
    _check_stats(what, rows, mean, rstd)
    for name, t in (("weight", weight), ("dweight", dweight), ("dbias", dbias)):
        if t is not None:
            _check(f"{what} {name}", t, _param_dtype(x), shape=(c,))
    if not rows:
        _zero_grads(ctx, dweight, dbias, dsum)
        return
    lay = row_layout(c, [t for t in (dy, x, ds, dx, dx_half, weight, _mask(half_dropout))
                         if t is not None])
    name = lay.kernel("backward", ctype, xtype, "layer_norm" if ds is None else "add_layer_norm",
                      htype=_half_ctype(dx_half), itype=_input_ctypes(what, x)[1])
    inside = _sum_inside(lay, c, dsum)
    blocks, *partials = _grad_tables(ctx, node, what, name, lay, rows, c, dweight, dbias,
                                     inside)
    _launch(ctx, SOURCE, name, (blocks,), lay.block,
            (dy, x, _or_null(weight), mean, rstd) + (() if ds is None else (ds,))
            + (_or_null(dx), _or_null(dx_half), *map(_or_null, partials),
               np.int32(rows), np.int32(c)) + drop)
    _finalize(ctx, xtype, blocks, c, partials, dweight, dbias, inside)
    _sum_outside(ctx, node, dsum, inside, dx, dx_half, rows, c)


def rms_norm_forward(ctx, x, weight, y, rstd, eps: float, b=None, s=None,
                     dropout: BranchDropout | None = None) -> None:
    """y = x * rstd [* weight], rstd = 1 / sqrt(mean(x^2) + eps) (rows,) float32; x and
    weight float32 (y float32, bf16 or float16) or all float16 with y. With b and s
    (add_rms_norm): x is a, s = a + b rounded to a's storage is normalised and stored, b (and
    its dropout) as add_layer_norm_forward's."""
    what = "rms_norm" if b is None else "add_rms_norm"
    rows, c = _rows(f"{what} input", x, dtype=None)
    xtype = _norm_input(what, x, c, weight)
    btype = None if b is None else _residual_operands(what, x, b, s, xtype)
    _check(f"{what} output", y, dtype=None if xtype == "float" else x.dtype, shape=x.shape)
    ctype = _element_ctype(f"{what} output", y)
    _check(f"{what} rstd", rstd)
    if rstd.size != rows:
        raise ShapeError(f"{what} rstd: expected {rows} values (one a row), got shape "
                         f"{tuple(rstd.shape)}")
    if not rows:
        return
    lay = row_layout(c, [t for t in (x, b, s, y, weight, _mask(dropout)) if t is not None])
    operands = (x, _or_null(weight), y) if b is None else (x, b, _or_null(weight), y, s)
    drop = () if b is None else _dropout_operands(what, b, dropout)
    _launch(ctx, SOURCE, lay.kernel("forward", ctype, xtype, what, btype),
            _row_grid(rows, lay.rows_per_block), lay.block,
            operands + (rstd, np.int32(rows), np.int32(c), np.float32(eps)) + drop)


def rms_norm_backward(ctx, node: Node, dy, x, weight, rstd, dx, dweight=None,
                      dx_half=None, ds=None, half_dropout=None, dsum=None) -> None:
    """dx = rstd * (g - xhat * mean(g * xhat)) [+ ds], g = dy [* weight], xhat = x * rstd;
    dweight = sum over rows of dy * xhat (optional); ds (add_rms_norm's residual gradient, x
    the forward's s), dx_half, half_dropout and dsum as layer_norm_backward's."""
    what = "rms_norm_grad" if ds is None else "add_rms_norm_grad"
    rows, c, ctype, xtype, dx, dx_half = _check_grad(what, dy, x, dx, dx_half)
    drop = _half_dropout(what, dx, dx_half, half_dropout)
    _check_sum(what, dsum, dx, dx_half, c)
    if ds is not None:
        _check(f"{what} ds", ds, x.dtype, shape=x.shape)
    _check(f"{what} rstd", rstd)
    if rstd.size != rows:
        raise ShapeError(f"{what} rstd: expected {rows} values (one a row), got shape "
                         f"{tuple(rstd.shape)}")
    _norm_input(what, x, c, weight)
    if dweight is not None:
        _check(f"{what} dweight", dweight, x.dtype, shape=(c,))
    if not rows:
        _zero_grads(ctx, dweight, dsum)
        return
    lay = row_layout(c, [t for t in (dy, x, ds, dx, dx_half, weight, _mask(half_dropout))
                         if t is not None])
    name = lay.kernel("backward", ctype, xtype, "rms_norm" if ds is None else "add_rms_norm",
                      htype=_half_ctype(dx_half))
    inside = _sum_inside(lay, c, dsum)
    blocks, partial_w, partial_s = _grad_tables(ctx, node, what, name, lay, rows, c, dweight,
                                                inside)
    _launch(ctx, SOURCE, name, (blocks,), lay.block,
            (dy, x, _or_null(weight), rstd) + (() if ds is None else (ds,))
            + (_or_null(dx), _or_null(dx_half), _or_null(partial_w), _or_null(partial_s),
               np.int32(rows), np.int32(c)) + drop)
    _finalize(ctx, xtype, blocks, c, (partial_w, None, partial_s), dweight, None, inside)
    _sum_outside(ctx, node, dsum, inside, dx, dx_half, rows, c)


def _branch_dropout(node: Node, ins, outs) -> tuple[list, list, BranchDropout | None]:
    """An add_* forward's inputs and outputs without the step counter and keep mask of attrs
    dropout, and that dropout (None without)."""
    a = node.attrs
    if a.get("dropout") is None:
        return list(ins), list(outs), None
    return list(ins[:-1]), list(outs[:-1]), BranchDropout(ins[-1], outs[-1], a["dropout"],
                                                          a["seed"], a["site"])


def _add_forward_impl(node: Node, ins, outs, ctx) -> None:
    a = node.attrs
    ins, outs, dropout = _branch_dropout(node, ins, outs)
    rest = list(ins[2:])
    weight = rest.pop(0) if a.get("weight") else None
    bias = rest.pop(0) if a.get("bias") else None
    add_layer_norm_forward(ctx, ins[0], ins[1], weight, bias, outs[0], outs[3], outs[1],
                           outs[2], a.get("eps", 1e-5), dropout)


def _add_backward_impl(node: Node, ins, outs, ctx) -> None:
    ins, half_dropout = _half_mask(node, ins)
    weight = ins[2] if node.attrs.get("weight") else None
    dx, dweight, dbias, dx_half, dsum = _grad_outputs(node, outs)
    layer_norm_backward(ctx, node, ins[0], ins[1], weight, ins[-3], ins[-2], dx, dweight,
                        dbias, ds=ins[-1], dx_half=dx_half, half_dropout=half_dropout,
                        dsum=dsum)


def _rms_forward_impl(node: Node, ins, outs, ctx) -> None:
    weight = ins[1] if node.attrs.get("weight") else None
    rms_norm_forward(ctx, ins[0], weight, outs[0], outs[1], node.attrs["eps"])


def _rms_backward_impl(node: Node, ins, outs, ctx) -> None:
    ins, half_dropout = _half_mask(node, ins)
    weight = ins[2] if node.attrs.get("weight") else None
    dx, dweight, _, dx_half, dsum = _grad_outputs(node, outs)
    rms_norm_backward(ctx, node, ins[0], ins[1], weight, ins[-1], dx, dweight, dx_half,
                      half_dropout=half_dropout, dsum=dsum)


def _add_rms_forward_impl(node: Node, ins, outs, ctx) -> None:
    ins, outs, dropout = _branch_dropout(node, ins, outs)
    weight = ins[2] if node.attrs.get("weight") else None
    rms_norm_forward(ctx, ins[0], weight, outs[0], outs[1], node.attrs["eps"], b=ins[1],
                     s=outs[2], dropout=dropout)


def _add_rms_backward_impl(node: Node, ins, outs, ctx) -> None:
    ins, half_dropout = _half_mask(node, ins)
    weight = ins[2] if node.attrs.get("weight") else None
    dx, dweight, _, dx_half, dsum = _grad_outputs(node, outs)
    rms_norm_backward(ctx, node, ins[0], ins[1], weight, ins[-2], dx, dweight, dx_half,
                      ds=ins[-1], half_dropout=half_dropout, dsum=dsum)


IMPLS: dict[str, Callable] = {
    "layer_norm": _forward_impl,
    "layer_norm_grad": _backward_impl,
    "add_layer_norm": _add_forward_impl,
    "add_layer_norm_grad": _add_backward_impl,
    "rms_norm": _rms_forward_impl,
    "rms_norm_grad": _rms_backward_impl,
    "add_rms_norm": _add_rms_forward_impl,
    "add_rms_norm_grad": _add_rms_backward_impl,
}
