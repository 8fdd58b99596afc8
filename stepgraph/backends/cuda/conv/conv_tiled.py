"""Launchers of conv_tiled.cu: stride-1 convolutions of small images, a kernel compiled
per conv shape (every size a template parameter), a block staging a sample in shared memory and
threads keeping register tiles. conv.py offers them as paths of the conv ops:

  forward     conv2d_tiled over x                      (TiledConv, flip False)
  grad_input  conv2d_tiled over dy, flipped weights    (TiledConv, flip True)
  grad_weight conv2d_tiled_grad_weight, dw with db     (TiledGradWeight: partials + their sum)

Each plan_* function sizes one variant (tile, splits) to the shared memory and thread limits
or returns None; conv.py times every variant that fits against the other paths.

The kernels take float32, float64 or bfloat16 tensors (uint16 raw bits, precision "bf16"),
every operand of a launch of one dtype (TYPES: the template's storage S and compute type T).
bfloat16 computes in float32 like the NumPy emulation: the shared arrays and grad_weight's
partial sums hold float32 (so the plans size them by compute_dtype's itemsize), and each
output is rounded to bf16 once, when stored.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from ....errors import ShapeError
from ..runtime import compiler
from .geometry import Geometry

SOURCE = "conv_tiled.cu"
# Storage dtype of the tensors -> the kernels' (S, T): the C type stored and the one computed
# in (bf16.cuh widens and rounds the unsigned short bits of bfloat16, fp16.cuh float16's)
TYPES = {"float32": ("float", "float"), "float64": ("double", "double"),
         "uint16": ("unsigned short", "float"), "float16": ("fp16_bits", "float")}

# Candidates, each compiled and timed per problem: ((channels, pixels) a thread computes,
# input-channel split) (forward, grad_input); (row ranges, output-channel ranges) per sample
# (grad_weight). Each costs a cold start 0.1-0.2 s of NVRTC (0.3-1 s each when 16 compile at
# once): kept are those that were ever the only fastest. Of 1,012 timings of 78 problems on an
# H200 (docs/perf-notes.md, 2026-11-29), the splits 2 (both tiles), 4 with the 2x4 tile, 5
# with the 2x2 tile and the (2, 2) grad_weight split never were.
CONV_VARIANTS = (((2, 2), 1), ((2, 4), 1), ((2, 2), 4), ((2, 4), 5))
GRAD_WEIGHT_SPLITS = ((1, 1), (1, 2), (1, 4), (2, 1), (4, 1))

MAX_KERNEL = 7                    # larger windows unroll into too much code
MAX_ELEMENTS = 1 << 30            # per tensor: the kernels' offsets are 32-bit ints
SHARED_BYTES = (48 << 10) - 256   # static shared arrays (alignment slack under 48 KiB)
ITEMS = 256                       # thread items a block aims at
MAX_THREADS = 512                 # conv_tiled.cu's __launch_bounds__
MAX_PARTIAL_BYTES = 8 << 20       # grad_weight partial sums: beyond this, no such split
ROW_TILE = 8                      # dy pixels per step of the grad_weight kernel (WT)
BLOCK = 256                       # the partial-sum kernel: 32 columns x 8 slices


def _odd(stride: int) -> int:
    return stride | 1          # conv_tiled.cu's odd(): bank-spreading row and plane strides


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _threads(items: int) -> int:
    return min(MAX_THREADS, max(32, _cdiv(items, 32) * 32))


def template_types(dtype) -> str:
    """The kernels' first template arguments, "S, T", for tensors of storage `dtype`."""
    return ", ".join(TYPES[str(dtype)])


def compute_dtype(dtype) -> np.dtype:
    """T's dtype for tensors of storage `dtype`: of the shared arrays (its itemsize is what
    plan_conv and plan_grad_weight take) and of grad_weight's partial sums."""
    return np.dtype("float64" if str(dtype) == "float64" else "float32")


def unsupported(op: str, g: Geometry, dtype) -> str | None:
    """Why the tiled kernels cannot run this op at all (shared-memory size aside), or None.
    `dtype`: the tensors' storage dtype (uint16 for bfloat16)."""
    if str(dtype) not in TYPES:
        return f"dtype {dtype} (want one of {list(TYPES)}, uint16 being bfloat16)"
    if (g.sh, g.sw) != (1, 1):
        return f"stride {(g.sh, g.sw)} (the tiled kernels are stride 1)"
    if max(g.kh, g.kw) > MAX_KERNEL:
        return f"kernel {(g.kh, g.kw)} larger than {MAX_KERNEL}"
    if op == "conv2d_grad_input" and (g.ph >= g.kh or g.pw >= g.kw):
        return f"padding {(g.ph, g.pw)} not smaller than the kernel {(g.kh, g.kw)}"
    if max(g.n * g.c * g.h * g.w, g.n * g.o * g.p) > MAX_ELEMENTS:
        return f"a tensor of more than {MAX_ELEMENTS} elements (32-bit offsets)"
    return None


@dataclass(frozen=True)
class TiledConv:
    """One instantiation and launch of conv2d_tiled_kernel: the forward (flip False: in = x,
    out = y) or the input gradient (flip True: in = dy, out = dx, the padding becomes
    kernel - 1 - padding). gb output-channel groups of ob per block, px pixels per thread."""
    n: int
    cin: int
    hin: int
    win: int
    cout: int
    kh: int
    kw: int
    ph: int
    pw: int
    ob: int
    px: int
    gb: int
    ks: int
    flip: bool

    @property
    def hout(self) -> int:
        return self.hin + 2 * self.ph - self.kh + 1

    @property
    def wout(self) -> int:
        return self.win + 2 * self.pw - self.kw + 1

    @property
    def groups(self) -> int:
        return _cdiv(self.cout, self.ob)

    @property
    def grid(self) -> tuple[int, int]:
        return self.n, _cdiv(self.groups, self.gb)

    @property
    def slots(self) -> int:
        """Thread items of a block (each on ks threads)."""
        return self.gb * self.hout * _cdiv(self.wout, self.px)

    @property
    def threads(self) -> int:
        return _threads(self.ks * self.slots)

    def shared_bytes(self, itemsize: int) -> int:
        wp = _cdiv(self.wout, self.px) * self.px + self.kw - 1
        plane = _odd((self.hout + self.kh - 1) * _odd(wp))
        handed = max(1, (self.ks - 1) * self.slots * self.ob * self.px)
        return (self.gb * self.cin * self.kh * self.kw * self.ob + self.cin * plane
                + handed) * itemsize

    def name(self, dtype) -> str:
        """The kernel's name for tensors of storage `dtype`."""
        params = (self.cin, self.hin, self.win, self.cout, self.kh, self.kw, self.ph, self.pw,
                  self.ob, self.px, self.gb, self.ks)
        return (f"conv2d_tiled_kernel<{template_types(dtype)}, {', '.join(map(str, params))}, "
                f"{'true' if self.flip else 'false'}>")


@functools.lru_cache(maxsize=None)
def plan_conv(g: Geometry, flip: bool, tile: tuple[int, int], ks: int,
              itemsize: int) -> TiledConv | None:
    """The forward (flip False) or grad_input (True) kernel of `g` with `tile` and the input
    channels split over ks threads: channel groups per block for about ITEMS thread
    items, fewer where shared memory runs out (ks > 1: all items in one pass of at most
    MAX_THREADS threads); None where even one group does not fit. itemsize: compute_dtype's
    (what the shared arrays hold). Memoised: every eager call of a conv op asks again
    (planning all variants took ~90 µs of host time a call)."""
    if flip:
        dims = (g.o, g.ho, g.wo, g.c, g.kh, g.kw, g.kh - 1 - g.ph, g.kw - 1 - g.pw)
    else:
        dims = (g.c, g.h, g.w, g.o, g.kh, g.kw, g.ph, g.pw)
    ob, px = tile
    conv = TiledConv(g.n, *dims, ob, px, 1, ks, flip)
    if ks > 1 and (conv.cin % ks or ks * conv.slots > MAX_THREADS):
        return None
    splits = min(conv.groups, max(1, _cdiv(conv.groups * conv.slots, ITEMS)))
    gb = _cdiv(conv.groups, splits)
    if ks > 1:
        gb = min(gb, MAX_THREADS // (ks * conv.slots))
    for gb in range(gb, 0, -1):
        conv = replace(conv, gb=gb)
        if conv.shared_bytes(itemsize) <= SHARED_BYTES:
            return conv
    return None


@dataclass(frozen=True)
class TiledGradWeight:
    """One instantiation and launch of conv2d_tiled_grad_weight_kernel: rb x os blocks per
    sample (row ranges x output-channel ranges), r row groups per (o, c) pair in a block, db
    alongside dw when bias."""
    g: Geometry
    rb: int
    os: int
    r: int
    bias: bool

    @property
    def rows(self) -> int:
        return _cdiv(self.g.ho, self.rb)

    @property
    def per_part(self) -> int:
        return self.g.o * self.g.ck + (self.g.o if self.bias else 0)

    @property
    def parts(self) -> int:
        return self.g.n * self.rb

    @property
    def channels(self) -> int:
        """Output channels of a block."""
        return _cdiv(self.g.o, self.os)

    @property
    def threads(self) -> int:
        return _threads(self.channels * self.g.c * self.r)

    def shared_bytes(self, itemsize: int) -> int:
        g, wd = self.g, _cdiv(self.g.wo, ROW_TILE) * ROW_TILE
        x_plane = _odd((self.rows + g.kh - 1) * _odd(wd + g.kw - 1))
        d_plane = _odd(self.rows * _odd(wd))
        mine = self.channels * (g.ck + (1 if self.bias else 0))
        sums = self.r * mine if self.r > 1 else 1
        return (g.c * x_plane + self.channels * d_plane + sums) * itemsize

    def name(self, dtype) -> str:
        """The kernel's name for tensors of storage `dtype`."""
        g = self.g
        params = (g.c, g.h, g.w, g.o, g.kh, g.kw, g.ph, g.pw, self.rb, self.os, self.r,
                  ROW_TILE)
        return (f"conv2d_tiled_grad_weight_kernel<{template_types(dtype)}, "
                f"{', '.join(map(str, params))}, "
                f"{'true' if self.bias else 'false'}>")


@functools.lru_cache(maxsize=None)
def plan_grad_weight(g: Geometry, split: tuple[int, int], bias: bool,
                     itemsize: int) -> TiledGradWeight | None:
    """The grad_weight kernel of `g` with split = (rb, os) blocks per sample and as many row
    groups as ITEMS and shared memory allow; None where a split leaves a block without
    rows or channels (or under 2 rows), the partial sums exceed MAX_PARTIAL_BYTES or
    one row group won't fit. itemsize: compute_dtype's (the shared arrays and the partial
    sums). Memoised, like plan_conv."""
    rb, os = split
    plan = TiledGradWeight(g, rb, os, 1, bias)
    if (rb > 1 and plan.rows < 2) or _cdiv(g.ho, plan.rows) < rb or \
            _cdiv(g.o, plan.channels) < os or \
            plan.parts * plan.per_part * itemsize > MAX_PARTIAL_BYTES:
        return None
    for r in range(max(1, min(plan.rows, ITEMS // max(1, plan.channels * g.c))), 0, -1):
        plan = replace(plan, r=r)
        if plan.shared_bytes(itemsize) <= SHARED_BYTES:
            return plan
    return None


def _dtype(arrays: dict) -> np.dtype:
    """The storage dtype all these arrays share, one of TYPES' (ShapeError otherwise)."""
    dtype = next(iter(arrays.values())).dtype
    for what, arr in arrays.items():
        if arr.dtype != dtype:
            raise ShapeError(f"conv2d tiled: {what} is {arr.dtype}, the other operands {dtype}")
    if str(dtype) not in TYPES:
        raise ShapeError(f"conv2d tiled: dtype {dtype} (want one of {list(TYPES)})")
    return dtype


def conv2d_tiled(ctx, conv: TiledConv, src, w, bias, out, relu: bool = False) -> None:
    """y = conv2d(x, w) + bias, then max(y, 0) when relu (conv.flip False: src = x, out = y),
    or dx of it (flip True: src = dy, out = dx, bias None, no relu): one launch of
    conv2d_tiled_kernel."""
    dtype = _dtype({"input": src, "weight": w, "output": out}
                   | ({} if bias is None else {"bias": bias}))
    if relu and conv.flip:
        raise ShapeError("conv2d tiled: a fused ReLU is the forward's only")
    kern = compiler.kernel(SOURCE, conv.name(dtype))
    flags = (bias is not None) | (relu << 1)
    kern(conv.grid, (conv.threads,), (src, w, w if bias is None else bias, out, np.int32(flags)),
         stream=ctx.stream)


def conv2d_tiled_grad_weight(ctx, plan: TiledGradWeight, dy, x, dw, db, partial) -> None:
    """dw (and db = dy summed over N, Ho, Wo, unless None) of a stride-1 conv: each block
    writes the partial sums of its rows and channels of one sample to `partial` (plan.parts x
    plan.per_part, of compute_dtype: float32 for bfloat16), a second launch adds the partials
    in a fixed order and rounds dw and db to their dtype."""
    dtype = _dtype({"dy": dy, "x": x, "dw": dw} | ({} if db is None else {"db": db}))
    if partial.size < plan.parts * plan.per_part or partial.dtype != compute_dtype(dtype):
        raise ShapeError(f"conv2d tiled grad_weight: {plan.parts * plan.per_part} partial sums "
                         f"need {compute_dtype(dtype)} scratch, got {partial.size} of "
                         f"{partial.dtype}")
    kern = compiler.kernel(SOURCE, plan.name(dtype))
    kern((plan.g.n, plan.rb, plan.os), (plan.threads,), (dy, x, partial), stream=ctx.stream)
    weights = plan.g.o * plan.g.ck
    compiler.kernel(SOURCE, sum_kernel_name(dtype))(
        (_cdiv(plan.per_part, 32),), (BLOCK,),
        (partial, dw, dw if db is None else db, np.int32(weights), np.int32(plan.per_part),
         np.int32(plan.parts)), stream=ctx.stream)


def sum_kernel_name(dtype) -> str:
    """conv2d_tiled_grad_weight_sum_kernel's name for dw and db of storage `dtype`."""
    return f"conv2d_tiled_grad_weight_sum_kernel<{template_types(dtype)}>"


def kernel_names(geometries, dtype) -> set[str]:
    """Every kernel name the variants of these geometries launch on tensors of storage
    `dtype` (the NVRTC test compiles them: the kernels are instantiated per shape, so a few
    shapes stand for the rest)."""
    itemsize = compute_dtype(dtype).itemsize
    names = {sum_kernel_name(dtype)}
    for g in geometries:
        convs = [plan_conv(g, flip, tile, ks, itemsize) for tile, ks in CONV_VARIANTS
                 for flip in (False, True)]
        grads = [plan_grad_weight(g, split, bias, itemsize)
                 for split in GRAD_WEIGHT_SPLITS for bias in (False, True)]
        names.update(k.name(dtype) for k in convs + grads if k is not None)
    return names
