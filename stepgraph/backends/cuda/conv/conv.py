"""conv2d forward and its two gradients: im2col / col2im kernels (conv.cu) + cuBLASLt.

All row-major; gemm.py derives each cuBLASLt call from row-major shapes, written out per op
below. W (O, C, kh, kw) is the row-major (O, CK) matrix as it is (CK = C*kh*kw, P = Ho*Wo).

  forward      y[n] (O, P) = W (O, CK) @ cols[n] (CK, P)       strided batch over n
  grad_input   dcols[n] (CK, P) = W^T @ dy[n] (O, P)           strided batch, then col2im
  grad_weight  dW (O, CK) = dy_t (O, nP) @ cols_t (CK, nP)^T   one GEMM sums over the batch

The column buffers live in a grow-only scratch pool per context (never freed, so a captured
graph's pointers stay valid; shared by every conv node, which run one after another on the
context's stream). A node takes its scratch on its first, eager call: run an eager warm-up
before capture. A batch needing more than geometry.SCRATCH_CHUNK_BYTES runs in chunks of
samples (two launches per chunk).

Small and depthwise convolutions skip all of that. Three kernel families compute each op in
one launch (the weight gradient: two), no im2col, no GEMM:
  tiled  (conv_tiled.py) stride 1, kernels up to 7x7, a kernel compiled per conv shape:
         a block stages a sample in shared memory, threads keep register tiles; dx is the same
         kernel over dy with the flipped weights; dw comes with db (the fused bias gradient).
         Variants (tile, channel splits, block splits) are candidates of their own.
  direct (conv_direct.cu) any stride, sizes as runtime ints, a thread per output pixel
         and 4 channels ("direct") or 1 ("direct_narrow"); usable when
           C*kh*kw <= 1024 and O*kh*kw <= 1024   (a block's slice of w fits shared memory)
           and x, y have <= 2^30 elements         (32-bit offsets in the kernels)
  depthwise (conv_depthwise.py) groups == C == O only (a filter per channel: MobileNet's and
         ConvNeXt's), NCHW and NHWC, float32, bfloat16 and float16, any stride, padding and
         dilation, sizes as runtime ints: a thread per output element (dx: per input
         element, gathering), threads along W (NCHW) or C (NHWC); dw and db from blocks per
         channel and split of the pixels, then an in-order sum of the splits. Memory-bound
         work, where cuDNN's grouped kernels took 3-5x what the traffic needs (H200: a 1x3
         depthwise forward over 4 MB, 13.6 us); the bias and the fused ReLU are in the
         forward kernel, y rounded once.
  depthwise_plane (conv_depthwise.py) the same convolutions' forward and dx in NCHW at
         stride 1 and dilation 1, a block per plane: the padded plane and its filter staged
         in shared memory once, each output's taps read from there without index arithmetic
         (dx: the same kernel over dy with the filter flipped). Measured against the flat
         kernels and cuDNN per problem.
cuDNN (conv_cudnn.py) adds a candidate per execution plan ("cudnn:<i>"), and is the only
family beside "depthwise" that runs groups > 1 or dilation != 1 (tiled, direct and im2col +
GEMM decline those). A forward with bias also offers each plain cuDNN plan followed by
conv2d_bias_act ("cudnn:<i>+epilogue"): few float32 engines fuse the bias. With attrs act
"relu" (the ReLU that followed, fused) every path applies it: in the cuDNN graph, in the
depthwise, tiled and direct kernels, in cuBLASLt's RELU epilogue (im2col + GEMM), or through
that epilogue kernel.
Every path that can run an op is a candidate; the first eager call of a problem (op,
geometry, dtype, precision) times each on its real buffers (`_run_faster`, autotune.py) and
the backend keeps the fastest for every node with that problem: no size rule predicted the
benchmark convs. Where the choice is known already (this process's, or on disk from an
earlier one: `_with_cudnn`) the cuDNN plans are not all built: only the chosen one, or none
for an own path; building every plan of every problem was most of a warm process's first
step. What a node's first launch will build is started when the plan gets its buffers
(`start_plans`, from CudaBackend.prepare) on the ahead lane (runtime/ahead.py), beside the
NVRTC compiles: the launch then waits for its own builds alone. A capture with no timing
yet takes the depthwise path where there is one, else a tiled path, else `use_direct`'s rule:
  direct  iff  it can run, N*O*Ho*Wo * C*kh*kw <= 2^26 multiply-adds (about 10 us of direct
               work; above it cuBLASLt's throughput pays for the im2col traffic)
          and, for grad_weight, N*Ho*Wo <= 2^18  (one block sums each weight's products)
  else im2col + GEMM. `PATH` = one of PATHS forces a family (tests).
The direct, tiled and depthwise kernels are exact FP32 (FMA) whatever ctx.precision says:
TF32 only speeds GEMMs. Each output has one owner summing in a fixed order, so they are
deterministic like the GEMMs.

bfloat16 (precision="bf16": every operand bf16, stored as uint16 raw bits) has two families
of candidates, timed against each other like any others (a depthwise conv has a third, its
own kernels, computing as the tiled ones do with the bias and ReLU before the one
rounding): the tiled kernels, for the plain NCHW problems they run (the MNIST cnn's convs,
where cuDNN took ~70 us a step and the float32 tiled kernels ~30), and cuDNN's plans;
direct and im2col + GEMM stay float32 / float64. The tiled kernels compute as the NumPy
emulation does: bf16 widened to float32, float32 sums (the bias first), y, dx, dw and db
each rounded once on store (grad_weight's partial sums are float32
scratch, db comes alongside dw), so they differ from it only by the order of the float32
sums; a fused ReLU runs after them in the epilogue kernel, exactly (ReLU commutes with the
rounding). cuDNN's plans: bf16 in and out, float32 accumulation, bias and ReLU fused in
float32, one rounding of what is stored (conv_cudnn.py). Only where no fused bias plan builds
(or, for a grouped convolution, always) does a bf16 forward with bias also offer a plain
cuDNN plan + the epilogue kernel ("cudnn:<i>+epilogue"), which rounds y twice (the
convolution's sum, then with the bias added): the emulation rounds once, so such a result can
differ from it by the rounding of the sum (many ulps of y where the bias cancels the sum).
A ReLU alone commutes with the rounding: its epilogue is exact. On a cuDNN path
conv2d_grad_weight's db is reduce_sum's (bf16 dy summed in float32, rounded once). float16
(precision="fp16", model.half(): float16 storage, fp16_bits in the kernels, cuDNN's HALF data)
takes every bfloat16 path above with float16's rounding.

Channels-last nodes (attrs layout "NHWC", compile/layout.py: x (N, H, W, C), w (O, kh, kw,
C/groups), y (N, Ho, Wo, O)) run through cuDNN, and the depthwise ones through the depthwise
kernels too: the other own kernels are NCHW. Their bias and ReLU
epilogue and the bias gradient's sum read the channels along the last axis. A channels-last
problem cuDNN has no plan for (or every one, without cuDNN) runs as its NCHW twin between
permutes (`_through_nchw`): slow, but no convolution is left without a path.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from ....errors import ShapeError, UnsupportedOpError
from ....ir.graph import Node, Value, storage_dtype
from ....ops.layout import (TO_NCHW, TO_NHWC, channel_sum_axes, layout_of, nchw_attrs,
                            nchw_shape, stored_shape)
from .. import reduce
from ..matmul import gemm
from ..runtime import autotune, compiler
from ..runtime.launch import _node_memory
from ..runtime.scratch import ScratchPool
from . import conv_cudnn
from . import conv_depthwise as depthwise
from . import conv_tiled as tiled
from .geometry import Geometry
from .geometry import geometry as _geometry

BLOCK = 256
MAX_BLOCKS = 1 << 15     # grid-stride loops cover the rest
_CTYPES = compiler.FLOAT_CTYPES
GEMM_PATH_KERNELS = ("conv2d_im2col_kernel", "conv2d_grad_weight_gather_kernel",
                     "conv2d_col2im_kernel")
EPILOGUE_KERNEL = "conv2d_bias_act_kernel"
EPILOGUE_SUFFIX = "+epilogue"     # of a plain cuDNN plan's path, run with the epilogue kernel
# The epilogue also runs bfloat16 (uint16 bits: conv.cu's unsigned short specialisation) and
# float16 (its fp16_bits specialisation)
EPILOGUE_CTYPES = {**compiler.FLOAT_CTYPES, "uint16": "unsigned short", "float16": "fp16_bits"}
BF16_OPS = frozenset({"conv2d", "conv2d_grad_input", "conv2d_grad_weight"})
# float16 (precision="fp16", model.half()): bf16's families, the tiled kernels and cuDNN's
# plans with HALF data and float32 compute, the same roundings (module docstring)
FP16_OPS = BF16_OPS

PATHS = ("direct", "direct_narrow", "tiled", "gemm", "cudnn", "depthwise", "depthwise_plane")
PATH = "auto"                 # "auto" (timed per problem) or one of PATHS: tests force one
DIRECT_SOURCE = "conv_direct.cu"
DIRECT_MAX_TAPS = 1024        # conv_direct.cu's MAX_TAPS: a block's slice of w in shared memory
DIRECT_MAX_MACS = 1 << 26     # multiply-adds of one op, N*O*Ho*Wo*C*kh*kw
DIRECT_MAX_SUM = 1 << 18      # grad_weight: products per weight (N*Ho*Wo), summed by one block
DIRECT_MAX_ELEMENTS = 1 << 30  # per tensor: the direct kernels' offsets are 32-bit ints
DIRECT_BLOCK = 128            # threads of a forward / grad_input block
DIRECT_CHANNELS = 4           # channels per thread: output channels (forward), input (grad_input)
NARROW_CHANNELS = 1           # the "direct_narrow" path: 4x the threads, for few pixels
GRAD_WEIGHT_THREADS = 256     # at most, per grad_weight block
GRAD_WEIGHT_TILES = ((4, 4), (2, 4), (2, 2), (1, 2), (1, 1))   # (out channels, taps) per block
GRAD_WEIGHT_MIN_BLOCKS = 128  # the largest tile that still gives about one block per SM wins
GRAD_WEIGHT_TARGET_BLOCKS = 1024  # tiles x sample splits: enough blocks to fill the GPU


def _contiguous(arr, name: str, shape=None):
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise ShapeError(f"conv2d: {name} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    if not arr.flags.c_contiguous:
        raise ShapeError(f"conv2d: {name} {arr.shape} must be contiguous (no copies are made)")
    return arr


# ---- scratch -------------------------------------------------------------------------------

def _chunk_plan(op: str, g: Geometry, itemsize: int) -> tuple[int, list[tuple[int, ...]]]:
    """(samples per chunk, scratch array shapes) of one conv op."""
    if op == "conv2d_grad_weight":
        nb = g.chunk((g.ck + g.o) * g.p * itemsize)
        return nb, [(g.ck, nb * g.p), (g.o, nb * g.p)]
    nb = g.chunk(g.ck * g.p * itemsize)
    return nb, ([] if g.pointwise else [(nb, g.ck, g.p)])


def _scratch(ctx, shapes: list[tuple[int, ...]], dtype) -> list:
    """Contiguous arrays of the given shapes, carved one after another from the scratch pool
    (each starting 256-byte aligned)."""
    import cupy as cp

    item = np.dtype(dtype).itemsize
    sizes = [int(np.prod(s)) * item for s in shapes]
    offsets = np.cumsum([0] + [-(-b // 256) * 256 for b in sizes])
    pool = ctx.extras.setdefault("conv_scratch", ScratchPool())
    buf = pool.get(int(offsets[-1]), ctx)
    return [cp.ndarray(s, dtype=dtype, memptr=buf.data + int(off))
            for s, off in zip(shapes, offsets[:-1])]


# ---- launchers -----------------------------------------------------------------------------

def _launch(ctx, name: str, dtype, total: int, args: tuple, ctypes=None) -> None:
    ctypes = _CTYPES if ctypes is None else ctypes
    if str(dtype) not in ctypes:
        raise ShapeError(f"{name}: dtype {dtype} not supported (want one of {list(ctypes)})")
    if total <= 0:
        return
    kern = compiler.kernel("conv.cu", f"{name}<{ctypes[str(dtype)]}>")
    blocks = min(-(-total // BLOCK), MAX_BLOCKS)
    with ctx.stream:
        kern((blocks,), (BLOCK,), args)


def conv2d_im2col(ctx, g: Geometry, x, cols, bias, y) -> None:
    """cols (nb, CK, P) = patches of x (nb, C, H, W); y (nb, O, P) = bias broadcast if given.
    cols may be None (pointwise convolutions need no patches, only the bias fill)."""
    nb = x.shape[0]
    n_cols = 0 if cols is None else nb * g.ck * g.p
    n_bias = 0 if bias is None else nb * g.o * g.p
    args = (x, cols if cols is not None else y, bias if bias is not None else y, y,
            np.int64(n_cols), np.int64(n_bias), np.int32(g.o)) + g.kernel_args()
    _launch(ctx, "conv2d_im2col_kernel", x.dtype, n_cols + n_bias, args)


def conv2d_grad_weight_gather(ctx, g: Geometry, x, dy, cols_t, dy_t) -> None:
    """cols_t (CK, nb*P) = patches of x (nb, ...); dy_t (O, nb*P) = dy (nb, O, P) regrouped."""
    nb = x.shape[0]
    total = (g.ck + g.o) * nb * g.p
    args = (x, dy, cols_t, dy_t, np.int32(nb), np.int32(g.o)) + g.kernel_args()
    _launch(ctx, "conv2d_grad_weight_gather_kernel", x.dtype, total, args)


def conv2d_bias_act(ctx, y, bias, relu: bool, layout: str = "NCHW") -> None:
    """y (N, O, Ho, Wo) += bias[o] (bias None: none), then ReLU when relu, in place: the
    epilogue of a convolution computed without them (a cuDNN plan that fuses neither).
    layout "NHWC": y (N, Ho, Wo, O), the channels innermost. bfloat16 y and bias (uint16
    bits): added in float32, rounded once more on store (module docstring)."""
    o, p = (y.shape[3], 1) if layout == "NHWC" else (y.shape[1], y.shape[2] * y.shape[3])
    if bias is not None and bias.dtype != y.dtype:
        raise ShapeError(f"{EPILOGUE_KERNEL}: bias is {bias.dtype}, y {y.dtype}")
    args = (y, y if bias is None else bias, np.int64(y.size), np.int32(o), np.int32(p),
            np.int32(bias is not None), np.int32(relu))
    _launch(ctx, EPILOGUE_KERNEL, y.dtype, y.size, args, EPILOGUE_CTYPES)


def conv2d_col2im(ctx, g: Geometry, dcols, dx) -> None:
    """dx (nb, C, H, W) = sum of the patch entries of dcols (nb, CK, P) that read each pixel."""
    nb = dx.shape[0]
    args = (dcols, dx, np.int32(nb)) + g.kernel_args()
    _launch(ctx, "conv2d_col2im_kernel", dx.dtype, nb * g.c * g.h * g.w, args)


# ---- direct kernels (conv_direct.cu) ------------------------------------------------

def direct_unsupported(g: Geometry, dtype) -> str | None:
    """Why the direct kernels cannot run this convolution at all, or None if they can."""
    if str(dtype) not in _CTYPES:
        return f"dtype {dtype} (want one of {list(_CTYPES)})"
    if max(g.ck, g.o * g.kh * g.kw) > DIRECT_MAX_TAPS:
        return (f"C*kh*kw = {g.ck} or O*kh*kw = {g.o * g.kh * g.kw} exceeds "
                f"{DIRECT_MAX_TAPS} (the weights staged in shared memory)")
    if max(g.n * g.c * g.h * g.w, g.n * g.o * g.p) > DIRECT_MAX_ELEMENTS:
        return f"a tensor of more than {DIRECT_MAX_ELEMENTS} elements (32-bit offsets)"
    return None


def use_direct(op: str, g: Geometry, dtype) -> bool:
    """Whether `op` runs as one direct kernel (the rule in the module docstring) rather than
    im2col + GEMM; `PATH` overrides the rule."""
    if PATH != "auto":
        if PATH not in PATHS:
            raise ValueError(f"conv.PATH must be 'auto' or one of {PATHS}, got {PATH!r}")
        return PATH not in ("gemm", "cudnn")
    if direct_unsupported(g, dtype) is not None or g.macs > DIRECT_MAX_MACS:
        return False
    return op != "conv2d_grad_weight" or g.n * g.p <= DIRECT_MAX_SUM


def _direct_name(kind: str, ctype: str, tile: tuple[int, ...]) -> str:
    return f"conv2d_direct_{kind}_kernel<{', '.join([ctype, *map(str, tile)])}>"


def _direct_kernel(name: str, g: Geometry, kind: str, tile: tuple[int, ...], arrays: dict):
    """The kernel of one direct launcher, after checking that it can run on these arrays."""
    dtype = next(iter(arrays.values())).dtype
    why = direct_unsupported(g, dtype)
    if why is not None:
        raise ShapeError(f"{name}: the direct kernels cannot run this convolution: {why}")
    for what, arr in arrays.items():
        if arr.dtype != dtype:
            raise ShapeError(f"{name}: {what} is {arr.dtype}, the other operands {dtype}")
    return compiler.kernel(DIRECT_SOURCE, _direct_name(kind, _CTYPES[str(dtype)], tile))


def grad_weight_tile(g: Geometry) -> tuple[int, int]:
    """(output channels, taps) of dw per block: the largest tile that still gives
    GRAD_WEIGHT_MIN_BLOCKS blocks (fewer loads per multiply-add), else the smallest."""
    for ob, tb in GRAD_WEIGHT_TILES:
        if -(-g.o // ob) * -(-g.ck // tb) >= GRAD_WEIGHT_MIN_BLOCKS:
            return ob, tb
    return GRAD_WEIGHT_TILES[-1]


def grad_weight_block(g: Geometry) -> tuple[int, int]:
    """(bx, by) of a grad_weight block: bx threads over the output pixels, in as few equal
    passes as GRAD_WEIGHT_THREADS allows (a multiple of 32: whole warps for the reduction),
    by over the samples with the threads left over."""
    passes = -(-g.p // GRAD_WEIGHT_THREADS)
    bx = -(-g.p // (passes * 32)) * 32
    return bx, max(1, min(GRAD_WEIGHT_THREADS // bx, g.n))


def conv2d_direct_forward(ctx, g: Geometry, x, w, bias, y,
                          channels: int = DIRECT_CHANNELS, relu: bool = False) -> None:
    """y (N, O, Ho, Wo) = conv2d(x, w) + bias (None: no bias), then max(y, 0) when relu, one
    launch: a thread per output pixel and DIRECT_CHANNELS output channels, the block's weights
    in shared memory."""
    arrays = {"x": x, "weight": w, "y": y} | ({} if bias is None else {"bias": bias})
    kern = _direct_kernel("conv2d_direct_forward", g, "forward", (channels,), arrays)
    pixels = g.n * g.p
    if pixels == 0 or g.o == 0:
        return
    grid = (-(-pixels // DIRECT_BLOCK), -(-g.o // channels))
    flags = (bias is not None) | (relu << 1)
    args = (x, w, w if bias is None else bias, y, np.int32(flags), np.int32(g.n),
            np.int32(g.o)) + g.kernel_args()
    kern(grid, (DIRECT_BLOCK,), args, stream=ctx.stream)


def conv2d_direct_grad_input(ctx, g: Geometry, dy, w, dx,
                             channels: int = DIRECT_CHANNELS) -> None:
    """dx (N, C, H, W) of conv2d given dy and w, one launch: a thread per input pixel and
    DIRECT_CHANNELS input channels gathers the taps that read it."""
    arrays = {"dy": dy, "weight": w, "dx": dx}
    kern = _direct_kernel("conv2d_direct_grad_input", g, "grad_input", (channels,), arrays)
    pixels = g.n * g.h * g.w
    if pixels == 0 or g.c == 0:
        return
    grid = (-(-pixels // DIRECT_BLOCK), -(-g.c // channels))
    args = (dy, w, dx, np.int32(g.n), np.int32(g.o)) + g.kernel_args()
    kern(grid, (DIRECT_BLOCK,), args, stream=ctx.stream)


def grad_weight_splits(g: Geometry) -> int:
    """Sample splits of the grad_weight grid: enough blocks to fill the GPU, each split
    keeping at least a few samples."""
    ob, tb = grad_weight_tile(g)
    blocks = -(-g.ck // tb) * -(-g.o // ob)
    return max(1, min(-(-GRAD_WEIGHT_TARGET_BLOCKS // blocks), g.n // 4))


def conv2d_direct_grad_weight(ctx, g: Geometry, dy, x, dw) -> None:
    """dw (O, C, kh, kw) of conv2d given dy and x: a block per tile of dw (grad_weight_tile)
    and split of the samples sums over them and the output pixels in a fixed order; with
    several splits, a second launch adds the splits' partial sums in order (scratch)."""
    ob, tb = grad_weight_tile(g)
    arrays = {"dy": dy, "x": x, "dw": dw}
    kern = _direct_kernel("conv2d_direct_grad_weight", g, "grad_weight", (ob, tb), arrays)
    if g.o * g.ck == 0:
        return
    splits = grad_weight_splits(g)
    out = dw if splits == 1 else _scratch(ctx, [(splits, g.o * g.ck)], dw.dtype)[0]
    grid = (-(-g.ck // tb), -(-g.o // ob), splits)
    args = (dy, x, out, np.int32(g.n), np.int32(g.o)) + g.kernel_args()
    kern(grid, grad_weight_block(g), args, stream=ctx.stream)
    if splits > 1:
        total = g.o * g.ck
        name = f"conv2d_direct_grad_weight_sum_kernel<{_CTYPES[str(dw.dtype)]}>"
        compiler.kernel(DIRECT_SOURCE, name)(
            (-(-total // BLOCK),), (BLOCK,), (out, dw, np.int32(total), np.int32(splits)),
            stream=ctx.stream)


# Geometries kernel_names() instantiates the tiled kernels for (the NVRTC test): the benchmark
# CNN's convs and a padded 3x3 one.
TILED_NAME_GEOMETRIES = (Geometry(64, 1, 28, 28, 10, 5, 5, 1, 1, 0, 0),
                         Geometry(64, 10, 12, 12, 20, 5, 5, 1, 1, 0, 0),
                         Geometry(8, 16, 14, 14, 32, 3, 3, 1, 1, 1, 1))


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch}, template instantiations included
    (the NVRTC compile test instantiates each; the tiled kernels for TILED_NAME_GEOMETRIES),
    conv_depthwise's among them."""
    names: dict[str, set[str]] = {"conv.cu": set(), DIRECT_SOURCE: set(), tiled.SOURCE: set()}
    for ctype in _CTYPES.values():
        names["conv.cu"].update(f"{kernel}<{ctype}>"
                                for kernel in GEMM_PATH_KERNELS + (EPILOGUE_KERNEL,))
        names[DIRECT_SOURCE].update(
            [_direct_name(kind, ctype, (channels,)) for kind in ("forward", "grad_input")
             for channels in (DIRECT_CHANNELS, NARROW_CHANNELS)]
            + [_direct_name("grad_weight", ctype, tile) for tile in GRAD_WEIGHT_TILES]
            + [f"conv2d_direct_grad_weight_sum_kernel<{ctype}>"])
    for dtype in tiled.TYPES:          # bfloat16 (uint16 storage) and float16 too
        names[tiled.SOURCE].update(tiled.kernel_names(TILED_NAME_GEOMETRIES, dtype))
    names["conv.cu"].update(f"{EPILOGUE_KERNEL}<{EPILOGUE_CTYPES[s]}>"
                            for s in ("uint16", "float16"))
    return names | depthwise.kernel_names()


# ---- choosing the path ---------------------------------------------------------------------

def _run_faster(node, ctx, g: Geometry, dtype, paths: dict[str, Callable[[], None]]) -> None:
    """Run the op through one of `paths` (path name -> launch function, only the paths that can
    run this op: "gemm" among them unless groups or dilation leave cuDNN alone, or bfloat16
    the tiled kernels and cuDNN): PATH when forced (a tiled path for "tiled", a cuDNN plan
    for "cudnn"); else the fastest as timed on real buffers once per problem (autotune.py: no
    size rule predicted the benchmark convs, the direct kernel won 4x on conv1's forward and
    lost 2.5x on conv2's grad_input); during a capture with no timing yet, a tiled path if
    there is one, else `use_direct`'s rule, else the first cuDNN plan; a depthwise problem
    takes the depthwise path there (made for it: cuDNN's grouped kernels took 3-5x what
    the traffic needs)."""
    layout = layout_of(node.op, node.attrs)
    if not paths:
        raise UnsupportedOpError(f"{node.op}: no cuda path runs {g} ({dtype}, {layout}): "
                                 f"{conv_cudnn.reason(ctx, node.op, g, dtype, layout)}")
    first = "direct" if "direct" in paths else "gemm" if "gemm" in paths else next(iter(paths))
    if PATH != "auto":
        if PATH not in PATHS:
            raise ValueError(f"conv.PATH must be 'auto' or one of {PATHS}, got {PATH!r}")
        # grad_weight has one direct kernel, which both direct names run.
        autotune.run_family(paths, PATH, first)
        return
    tiled = [name for name in paths if name.startswith("tiled")]
    default = "depthwise" if "depthwise" in paths else tiled[0] if tiled else \
        "direct" if "direct" in paths and use_direct(node.op, g, dtype) else \
        "gemm" if "gemm" in paths else first
    own = [name for name in paths if name.split(":")[0] != "cudnn"]
    key = _choice_key(node, ctx, g, dtype, own)
    autotune.run_fastest(ctx, key, paths, default)
    _remember_kernels(node, ctx, g, dtype, paths[ctx.paths.get(key, default)])


_remembered: set[str] = set()


def _ahead_problem(node, g: Geometry, dtype, precision: str) -> str:
    """The problem whose chosen path's own kernels the disk remembers for tiled_kernels."""
    return repr((node.op, g, str(dtype), precision, bool(node.attrs.get("bias"))))


def _remember_kernels(node, ctx, g: Geometry, dtype, chosen: Callable[[], None]) -> None:
    """Store (once per process and problem) the kernels the chosen path compiles, none for a
    cuDNN or GEMM path: a later process then compiles ahead only those, not every tiled
    variant the autotuner would time (tiled_kernels)."""
    problem = _ahead_problem(node, g, dtype, ctx.precision)
    if problem in _remembered or ctx.stream.is_capturing():
        return
    _remembered.add(problem)
    disk = autotune.choices(ctx, "ahead")
    kernels = [list(pair) for pair in getattr(chosen, "kernels", ())]
    if disk is not None and disk.get(problem) != kernels:
        disk.put(problem, kernels)


def _choice_key(node, ctx, g: Geometry, dtype, own: Iterable[str]) -> tuple:
    """The problem's key among the autotuner's choices, in memory and on disk. The layout
    and whether nondeterministic plans competed are part of the problem. Of the candidates,
    the own paths' names, and for cuDNN's what decides them (conv_cudnn.candidates_key):
    their names are known only once every plan is built, and a known choice needs one."""
    return (node.op, g, str(dtype), ctx.precision, len(node.inputs), len(node.outputs),
            node.attrs.get("act"), layout_of(node.op, node.attrs),
            getattr(ctx, "deterministic", True), tuple(own), conv_cudnn.candidates_key())


def _with_cudnn(node, ctx, g: Geometry, dtype, own: dict[str, Callable[[], None]],
                cudnn: Callable[[str | None], dict[str, Callable[[], None]]]
                ) -> dict[str, Callable[[], None]]:
    """`own` and the cuDNN candidates worth building: cudnn(None) builds every plan,
    cudnn(name) that candidate's alone. Where the problem's choice is known, only it is
    offered: no plan for an own path, one for a cuDNN path. Otherwise (a miss, a forced PATH,
    a chosen plan that no longer builds) every plan is built and the problem timed: a
    choice that did not build is forgotten here, and run_fastest rejects the disk's as
    no longer a candidate, so nothing else is used untimed in its place."""
    if PATH != "auto" or not conv_cudnn.available():    # forced, or no plan to spare
        return own | cudnn(None)
    key = _choice_key(node, ctx, g, dtype, own)
    choice = _known_choice(ctx, key)
    if choice is not None:
        offered = own if choice in own else own | cudnn(choice)
        if choice in offered:
            ctx.paths[key] = choice
            return offered
        ctx.paths.pop(key, None)
    return own | cudnn(None)


def _known_choice(ctx, key: tuple) -> str | None:
    """The choice for `key` made in this process, else the one on disk; None when there is
    none."""
    if key in ctx.paths:
        return ctx.paths[key]
    return autotune.stored_choice(ctx, key, lambda name: isinstance(name, str))


@dataclass
class Offer:
    """What can run a conv node, before any cuDNN plan is built: its problem's geometry and IR
    dtype, its own paths (name -> launch) and cudnn(only), the cuDNN candidates bound to its
    arrays, whose plans it builds (`only`: one candidate's; see _with_cudnn)."""
    g: Any                # Geometry, or conv3d's Geometry3d
    dtype: str
    own: dict[str, Callable[[], None]]
    cudnn: Callable[[str | None], dict[str, Callable[[], None]]]


def _run_offer(impl, offer_of, node, ins, outs, ctx) -> None:
    """Run a conv node (impl) through the fastest of its offer's own paths and the cuDNN
    candidates worth building (_with_cudnn, _run_faster); a channels-last node with none
    runs as its NCHW twin."""
    offer = offer_of(node, ins, outs, ctx)
    paths = _with_cudnn(node, ctx, offer.g, offer.dtype, offer.own, offer.cudnn)
    if not paths and layout_of(node.op, node.attrs) == "NHWC":
        return _through_nchw(impl, node, ins, outs, ctx)
    _run_faster(node, ctx, offer.g, offer.dtype, paths)


def start_plans(offer_of, node, ins, outs, ctx) -> None:
    """Start building on the ahead lane the cuDNN plans this node's first launch will ask for
    (CudaBackend.prepare, once the plan has its buffers): _with_cudnn's decision on the same
    offer (every candidate's plans while the problem's choice is unknown, the chosen one's
    alone, none for a chosen own path), without its effects on ctx.paths. The launch asks
    for its builds as it always did and finds these under way (conv_cudnn.plans_for): what
    is started ahead changes how long it waits, never what it chooses."""
    if not conv_cudnn.available():
        return
    offer = offer_of(node, ins, outs, ctx)
    only = None
    if PATH == "auto":
        only = _known_choice(ctx, _choice_key(node, ctx, offer.g, offer.dtype, offer.own))
        if only in offer.own:
            return
    with conv_cudnn.starting_ahead():
        offer.cudnn(only)


# ---- op impls ------------------------------------------------------------------------------

def conv2d_forward(node, ins, outs, ctx) -> None:
    """y = conv2d(x, w) + b (ops.py, "conv2d").

    Per chunk of nb samples, row-major y[n] (O, P) = W (O, CK) @ cols[n] (CK, P) as a strided
    batch (gemm.matmul_spec):
      cuBLASLt A = cols[n]: stored (P, CK) ld P, op N, batch stride CK*P
      cuBLASLt B = W:       stored (CK, O) ld CK, op N, batch stride 0 (same W for every n)
      cuBLASLt D = y[n]:    stored (P, O) ld P, batch stride O*P
    The bias runs along O, D's columns, where cuBLASLt's bias epilogue cannot go; instead the
    im2col kernel fills y with the bias and the GEMM accumulates onto it (beta = 1), exact FP32.
    """
    _run_offer(conv2d_forward, _forward_offer, node, ins, outs, ctx)


def _forward_offer(node, ins, outs, ctx) -> Offer:
    x, w = _contiguous(ins[0], "x"), _contiguous(ins[1], "weight")
    layout = layout_of(node.op, node.attrs)
    g = _geometry(nchw_shape(x.shape, layout), nchw_shape(w.shape, layout), node.attrs)
    bias = _contiguous(ins[2], "bias", (g.o,)) if len(ins) == 3 else None
    y = _contiguous(outs[0], "y", stored_shape((g.n, g.o, g.ho, g.wo), layout))
    relu = _fused_relu(node)
    _same_dtype(node.op, x=x, weight=w, bias=bias, y=y)
    paths: dict[str, Callable[[], None]] = {}
    if _own(g, layout):
        paths = _tiled_paths("conv2d", g, x,      # each kernel stores the ReLU itself
                             lambda conv: tiled.conv2d_tiled(ctx, conv, x, w, bias, y, relu))
        if direct_unsupported(g, x.dtype) is None:
            paths["direct"] = lambda: conv2d_direct_forward(ctx, g, x, w, bias, y, relu=relu)
            paths["direct_narrow"] = lambda: conv2d_direct_forward(ctx, g, x, w, bias, y,
                                                                   NARROW_CHANNELS, relu)
        if _gemm_dtype(x.dtype):        # the ReLU in cuBLASLt's epilogue where it takes it
            paths["gemm"] = autotune.searching(
                lambda: _forward_gemm(ctx, node, g, x, w, bias, y, relu))
    if depthwise.supported(g, layout, x.dtype) is None:     # bias and ReLU in the kernel
        paths["depthwise"] = autotune.compiling(
            lambda: depthwise.conv2d_depthwise_forward(ctx, g, layout, x, w, bias, y, relu),
            (depthwise.SOURCE, depthwise.kernel_name("forward", layout, x.dtype)))
    if depthwise.plane_supported(g, layout, x.dtype) is None:
        paths["depthwise_plane"] = autotune.compiling(
            lambda: depthwise.conv2d_depthwise_plane_forward(ctx, g, x, w, bias, y, relu),
            (depthwise.SOURCE, depthwise.plane_kernel_name(x.dtype)))
    return Offer(g, conv_cudnn.ir_dtype(x.dtype), paths, functools.partial(
        _forward_cudnn_paths, ctx, g, x, w, y, bias, relu, layout))


def _forward_cudnn_paths(ctx, g: Geometry, x, w, y, bias, relu: bool, layout: str,
                         only: str | None) -> dict[str, Callable[[], None]]:
    """The forward's cuDNN candidates: each plan with the bias and ReLU in its graph, then,
    where either is asked, each plain plan followed by the epilogue kernel ("+epilogue");
    `only`: that one candidate, its plan alone built (conv_cudnn.conv2d_paths)."""
    def with_epilogue(plain_only: str | None) -> dict[str, Callable[[], None]]:
        if bias is None and not relu:
            return {}
        epilogue = functools.partial(conv2d_bias_act, ctx, y, bias, relu, layout)
        plain = conv_cudnn.conv2d_paths(ctx, g, x, w, y, layout=layout, only=plain_only)
        return {name + EPILOGUE_SUFFIX: _then(run, epilogue) for name, run in plain.items()}

    if only is not None and only.endswith(EPILOGUE_SUFFIX):
        return with_epilogue(only.removesuffix(EPILOGUE_SUFFIX))
    fused = conv_cudnn.conv2d_paths(ctx, g, x, w, y, bias, relu, layout=layout, only=only)
    # bf16: the epilogue rounds the sum before adding the bias; only where nothing fuses it
    # (ahead of the builds, the fused plans are expected to build: conv_cudnn.starting_ahead),
    # or for grouped convolutions: cuDNN's fast depthwise engines fuse nothing, and its grouped
    # kernels that fuse the bias took 4x their time (ConvNeXt's 7x7 depthwise convs on an
    # H200); there the two roundings (torch's too: its conv, then its bias add) compete
    fuses = bool(fused) or conv_cudnn.is_starting_ahead()
    if only is not None or (str(x.dtype) not in _CTYPES and bias is not None and fuses
                            and g.groups == 1):
        return fused
    return fused | with_epilogue(None)


def _own(g: Geometry, layout: str) -> bool:
    """Whether the own kernels (tiled, direct, im2col + GEMM) may run: plain NCHW problems.
    Each family says which dtypes it runs (tiled.unsupported, direct_unsupported,
    _gemm_dtype): bfloat16 ones get the tiled kernels alone (module docstring)."""
    return g.plain and layout == "NCHW"


def _gemm_dtype(dtype) -> bool:
    """Whether the im2col + GEMM path runs this dtype: float32 and float64 only (its im2col
    kernels and GEMMs have no bfloat16 form)."""
    return str(dtype) in _CTYPES


def _same_dtype(op: str, **arrays) -> None:
    """Every operand of a convolution has one dtype (None: absent)."""
    dtypes = {what: str(a.dtype) for what, a in arrays.items() if a is not None}
    if len(set(dtypes.values())) > 1:
        raise ShapeError(f"{op}: operands of one dtype expected, got {dtypes}")


def _fused_relu(node) -> bool:
    """Whether the forward applies the ReLU that followed it (attrs act "relu")."""
    act = node.attrs.get("act")
    if act not in (None, "none", "relu"):
        raise UnsupportedOpError(f"{node.op}: fused activation {act!r} (the cuda conv paths "
                                 "fuse only relu)")
    return act == "relu"


def _then(run: Callable[[], None], after: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        run()
        after()
    return autotune.marked_like(both, run)


def _tiled_paths(op: str, g: Geometry, x, run) -> dict[str, Callable[[], None]]:
    """{"tiled:OBxPXkKS": launch} for each variant (tile and channel split) whose block fits
    (none where the tiled kernels cannot run `op`); run(conv) launches one TiledConv."""
    if tiled.unsupported(op, g, x.dtype) is not None:
        return {}
    paths, itemsize = {}, tiled.compute_dtype(x.dtype).itemsize    # bf16: float32 shared
    for (ob, px), ks in tiled.CONV_VARIANTS:
        conv = tiled.plan_conv(g, op == "conv2d_grad_input", (ob, px), ks, itemsize)
        if conv is not None:
            paths[f"tiled:{ob}x{px}k{ks}"] = autotune.compiling(
                lambda conv=conv: run(conv), (tiled.SOURCE, conv.name(x.dtype)))
    return paths


def _forward_gemm(ctx, node, g: Geometry, x, w, bias, y, relu: bool = False) -> None:
    """The im2col + GEMM forward; with relu, cuBLASLt's RELU epilogue applies it to each
    chunk's sum (bias included: the GEMM accumulates onto it); from a chunk cuBLASLt has no
    such algorithm for on (it then launched nothing), plain GEMMs and one ReLU pass over the
    whole y after the last (ReLU twice is ReLU once)."""
    w2 = w.reshape(g.o, g.ck)
    nb, shapes = _chunk_plan(node.op, g, x.itemsize)
    cols = _scratch(ctx, shapes, x.dtype)[0] if shapes else None
    fused = relu
    for n0 in range(0, g.n, nb):
        m = min(nb, g.n - n0)
        xc, yc = x[n0:n0 + m], y[n0:n0 + m].reshape(m, g.o, g.p)
        cc = xc.reshape(m, g.c, g.h * g.w) if g.pointwise else cols[:m]
        if not g.pointwise or bias is not None:
            conv2d_im2col(ctx, g, xc, None if g.pointwise else cc, bias, yc)
        if fused:
            try:
                gemm.matmul(ctx, w2, cc, yc, accumulate=bias is not None, epilogue="RELU")
                continue
            except gemm.GemmUnsupportedError:
                fused = False
        gemm.matmul(ctx, w2, cc, yc, accumulate=bias is not None)
    if relu and not fused:
        conv2d_bias_act(ctx, y, None, True)


def conv2d_grad_input(node, ins, outs, ctx) -> None:
    """dx of conv2d given dy and w (ops.py, "conv2d_grad_input").

    Per chunk, row-major dcols[n] (CK, P) = W^T (CK, O) @ dy[n] (O, P), strided batch:
      cuBLASLt A = dy[n]:    stored (P, O) ld P, op N, batch stride O*P
      cuBLASLt B = W:        stored (CK, O) ld CK, op T -> (O, CK), batch stride 0
      cuBLASLt D = dcols[n]: stored (P, CK) ld P, batch stride CK*P
    then col2im gathers dcols into dx. Pointwise convolutions write dx[n] (C, HW) directly.
    """
    _run_offer(conv2d_grad_input, _grad_input_offer, node, ins, outs, ctx)


def _grad_input_offer(node, ins, outs, ctx) -> Offer:
    w = _contiguous(ins[1], "weight")
    layout = layout_of(node.op, node.attrs)
    g = _geometry(nchw_shape(node.attrs["input_shape"], layout), nchw_shape(w.shape, layout),
                  node.attrs)
    dy = _contiguous(ins[0], "dy", stored_shape((g.n, g.o, g.ho, g.wo), layout))
    dx = _contiguous(outs[0], "dx", stored_shape((g.n, g.c, g.h, g.w), layout))
    _same_dtype(node.op, dy=dy, weight=w, dx=dx)
    paths: dict[str, Callable[[], None]] = {}
    if _own(g, layout):
        paths = _tiled_paths("conv2d_grad_input", g, dy,
                             lambda conv: tiled.conv2d_tiled(ctx, conv, dy, w, None, dx))
        if direct_unsupported(g, dy.dtype) is None:
            paths["direct"] = lambda: conv2d_direct_grad_input(ctx, g, dy, w, dx)
            paths["direct_narrow"] = lambda: conv2d_direct_grad_input(ctx, g, dy, w, dx,
                                                                      NARROW_CHANNELS)
        if _gemm_dtype(dy.dtype):
            paths["gemm"] = autotune.searching(lambda: _grad_input_gemm(ctx, node, g, dy, w, dx))
    if depthwise.supported(g, layout, dy.dtype) is None:
        paths["depthwise"] = autotune.compiling(
            lambda: depthwise.conv2d_depthwise_grad_input(ctx, g, layout, dy, w, dx),
            (depthwise.SOURCE, depthwise.kernel_name("grad_input", layout, dy.dtype)))
    if depthwise.plane_supported(g, layout, dy.dtype) is None:
        paths["depthwise_plane"] = autotune.compiling(
            lambda: depthwise.conv2d_depthwise_plane_grad_input(ctx, g, dy, w, dx),
            (depthwise.SOURCE, depthwise.plane_kernel_name(dy.dtype)))
    return Offer(g, conv_cudnn.ir_dtype(dy.dtype), paths, lambda only: (
        conv_cudnn.grad_input_paths(ctx, g, dy, w, dx, layout=layout, only=only)))


def _grad_input_gemm(ctx, node, g: Geometry, dy, w, dx) -> None:
    w2 = w.reshape(g.o, g.ck)
    nb, shapes = _chunk_plan(node.op, g, dy.itemsize)
    dcols = _scratch(ctx, shapes, dy.dtype)[0] if shapes else None
    for n0 in range(0, g.n, nb):
        m = min(nb, g.n - n0)
        dyc = dy[n0:n0 + m].reshape(m, g.o, g.p)
        if g.pointwise:
            gemm.matmul(ctx, w2, dyc, dx[n0:n0 + m].reshape(m, g.c, g.p), trans_a=True)
            continue
        gemm.matmul(ctx, w2, dyc, dcols[:m], trans_a=True)
        conv2d_col2im(ctx, g, dcols[:m], dx[n0:n0 + m])


def conv2d_grad_weight(node, ins, outs, ctx) -> None:
    """dw of conv2d given dy and x, and with attrs bias also db = dy summed over (N, Ho, Wo)
    (ops.py, "conv2d_grad_weight"). The tiled kernel computes db alongside dw; the other paths
    add a reduce_sum launch.

    GEMM path: the batch sum goes into the GEMM's K dimension, deterministic: per chunk a
    gather kernel writes cols_t (CK, nb*P) and dy_t (O, nb*P), then row-major
    dW (O, CK) = dy_t @ cols_t^T, accumulating over chunks (beta = 1 after the first):
      cuBLASLt A = cols_t: stored (nbP, CK) ld nbP, op T -> (CK, nbP)
      cuBLASLt B = dy_t:   stored (nbP, O) ld nbP, op N
      cuBLASLt D = dW:     stored (CK, O) ld CK
    """
    _run_offer(conv2d_grad_weight, _grad_weight_offer, node, ins, outs, ctx)


def _grad_weight_offer(node, ins, outs, ctx) -> Offer:
    x = _contiguous(ins[1], "x")
    layout = layout_of(node.op, node.attrs)
    g = _geometry(nchw_shape(x.shape, layout), nchw_shape(node.attrs["weight_shape"], layout),
                  node.attrs)
    dy = _contiguous(ins[0], "dy", stored_shape((g.n, g.o, g.ho, g.wo), layout))
    dw = _contiguous(outs[0], "dw", stored_shape(g.w_shape, layout))
    db = _contiguous(outs[1], "db", (g.o,)) if node.attrs.get("bias") else None
    spatial = channel_sum_axes(layout)    # db sums dy over these

    def with_bias(run: Callable[[], None]) -> Callable[[], None]:
        def both() -> None:
            run()
            if db is not None:
                reduce.reduce_sum_forward(ctx, node, dy, db, spatial)
        return both

    partial_dtype = tiled.compute_dtype(x.dtype)      # bf16: float32 partial sums

    def tiled_grad_weight(plan: tiled.TiledGradWeight) -> None:
        partial = _scratch(ctx, [(plan.parts, plan.per_part)], partial_dtype)[0]
        tiled.conv2d_tiled_grad_weight(ctx, plan, dy, x, dw, db, partial)

    _same_dtype(node.op, dy=dy, x=x, dw=dw, db=db)
    paths: dict[str, Callable[[], None]] = {}
    own = _own(g, layout)
    if own and tiled.unsupported(node.op, g, x.dtype) is None:
        for rb, os in tiled.GRAD_WEIGHT_SPLITS:
            plan = tiled.plan_grad_weight(g, (rb, os), db is not None, partial_dtype.itemsize)
            if plan is not None:
                paths[f"tiled:r{rb}o{os}"] = autotune.compiling(
                    lambda plan=plan: tiled_grad_weight(plan),
                    (tiled.SOURCE, plan.name(x.dtype)))
    if own and direct_unsupported(g, x.dtype) is None:
        paths["direct"] = with_bias(lambda: conv2d_direct_grad_weight(ctx, g, dy, x, dw))
    if own and _gemm_dtype(x.dtype):
        paths["gemm"] = autotune.searching(
            with_bias(lambda: _grad_weight_gemm(ctx, node, g, dy, x, dw)))
    if depthwise.supported(g, layout, x.dtype) is None:     # db alongside dw
        paths["depthwise"] = autotune.compiling(
            lambda: _grad_weight_depthwise(ctx, g, layout, dy, x, dw, db),
            (depthwise.SOURCE, depthwise.kernel_name(
                "grad_weight", layout, x.dtype, depthwise.grad_weight_taps(g, db is not None))),
            (depthwise.SOURCE, depthwise.sum_kernel_name(x.dtype)))
    return Offer(g, conv_cudnn.ir_dtype(x.dtype), paths, lambda only: {
        name: with_bias(run) for name, run in conv_cudnn.grad_weight_paths(
            ctx, g, dy, x, dw, layout=layout, only=only).items()})


def _grad_weight_depthwise(ctx, g: Geometry, layout: str, dy, x, dw, db) -> None:
    """The depthwise kernels' dw (and db), their partial sums in the conv scratch pool."""
    elements = depthwise.grad_weight_scratch(g, layout, db is not None)
    partial = _scratch(ctx, [(elements,)], np.float32)[0] if elements else None
    depthwise.conv2d_depthwise_grad_weight(ctx, g, layout, dy, x, dw, db, partial)


def _grad_weight_gemm(ctx, node, g: Geometry, dy, x, dw) -> None:
    dw2 = dw.reshape(g.o, g.ck)
    nb, shapes = _chunk_plan(node.op, g, x.itemsize)
    cols_t, dy_t = _scratch(ctx, shapes, x.dtype)
    for n0 in range(0, g.n, nb):
        m = min(nb, g.n - n0)
        # A short last chunk uses the leading m*P columns, as contiguous (CK, m*P) matrices.
        ct, dt = cols_t.ravel()[:g.ck * m * g.p], dy_t.ravel()[:g.o * m * g.p]
        ct, dt = ct.reshape(g.ck, m * g.p), dt.reshape(g.o, m * g.p)
        conv2d_grad_weight_gather(ctx, g, x[n0:n0 + m], dy[n0:n0 + m], ct, dt)
        gemm.matmul(ctx, dt, ct, dw2, trans_b=True, accumulate=n0 > 0)


# ---- channels-last problems without a cuDNN plan ---------------------------------------------


def _through_nchw(impl, node, ins, outs, ctx) -> None:
    """Run a channels-last node as its NCHW twin: each 4-D operand permuted into an NCHW buffer
    of the node's own (made with the twin at its first eager call), the NCHW op (all its
    paths, timed as its own problem), each 4-D output permuted back. For problems cuDNN has
    no NHWC plan for; the permutes cost a pass over each tensor."""
    from ..broadcast import permute_forward

    def build() -> dict:
        import cupy as cp

        values = [[Value(nchw_shape(v.shape, "NHWC"), v.dtype) for v in vs]
                  for vs in (node.inputs, node.outputs)]
        return {"twin": Node(node.op, *values, nchw_attrs(node.attrs), label=node.label),
                "buffers": [cp.empty(nchw_shape(a.shape, "NHWC"), a.dtype) if a.ndim == 4
                            else None for a in [*ins, *outs]]}

    memory = _node_memory(node, ("nchw twin",), ctx, build)
    buffers = memory["buffers"]
    nchw_ins = []
    for a, buf in zip(ins, buffers):
        if buf is not None:
            permute_forward(ctx, a, buf, TO_NCHW)
        nchw_ins.append(a if buf is None else buf)
    out_buffers = buffers[len(ins):]
    impl(memory["twin"], nchw_ins, [a if b is None else b for a, b in zip(outs, out_buffers)],
         ctx)
    for a, buf in zip(outs, out_buffers):
        if buf is not None:
            permute_forward(ctx, buf, a, TO_NHWC)


def tiled_kernels(node, precision: str = "fp32") -> list[tuple[str, str]]:
    """(file, kernel) of every tiled variant the autotuner may time for this node (as
    _tiled_paths and conv2d_grad_weight plan them): the backend compiles them side by side
    with the plan's other kernels when the plan is built (CudaBackend.prepare). The same at
    every precision of one dtype: the tiled kernels are exact FP32 (bfloat16 nodes, of
    precision "bf16", name their bf16 instantiations). Where an earlier process timed the
    problem, only the chosen path's kernels (none for cuDNN or the GEMM path:
    _remember_kernels)."""
    layout = layout_of(node.op, node.attrs)
    dtype = str(node.inputs[0].dtype)           # the IR dtype: bfloat16, not uint16
    storage = storage_dtype(dtype)
    if layout != "NCHW" or storage not in tiled.TYPES:
        return []
    itemsize = tiled.compute_dtype(storage).itemsize
    x_shape = {"conv2d": node.inputs[0].shape, "conv2d_grad_weight": node.inputs[1].shape}.get(
        node.op, node.attrs.get("input_shape"))
    w_shape = node.attrs["weight_shape"] if node.op == "conv2d_grad_weight" \
        else node.inputs[1].shape
    g = _geometry(tuple(x_shape), tuple(w_shape), node.attrs)
    if not g.plain or tiled.unsupported(node.op, g, storage) is not None:
        return []
    disk = autotune.choices(None, "ahead")
    known = None if disk is None else disk.get(
        _ahead_problem(node, g, dtype, precision),
        lambda pairs: all(len(pair) == 2 and pair[0] == tiled.SOURCE for pair in pairs))
    if known is not None:          # an earlier process chose: its kernels only
        return [tuple(pair) for pair in known]
    if node.op == "conv2d_grad_weight":
        plans = [tiled.plan_grad_weight(g, split, bool(node.attrs.get("bias")), itemsize)
                 for split in tiled.GRAD_WEIGHT_SPLITS]
    else:
        plans = [tiled.plan_conv(g, node.op == "conv2d_grad_input", tile, ks, itemsize)
                 for tile, ks in tiled.CONV_VARIANTS]
    return [(tiled.SOURCE, plan.name(storage)) for plan in plans if plan is not None]


IMPLS = {
    "conv2d": conv2d_forward,
    "conv2d_grad_input": conv2d_grad_input,
    "conv2d_grad_weight": conv2d_grad_weight,
}
KERNELS_AHEAD = dict.fromkeys(IMPLS, tiled_kernels)
OFFERS = {"conv2d": _forward_offer, "conv2d_grad_input": _grad_input_offer,
          "conv2d_grad_weight": _grad_weight_offer}
# op -> start(node, ins, outs, ctx): the host builds its first launch needs (CudaBackend.prepare)
BUILDS_AHEAD = {op: functools.partial(start_plans, offer) for op, offer in OFFERS.items()}
