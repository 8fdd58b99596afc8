"""Launchers of conv_depthwise.cu: depthwise convolutions (groups == C == O, a filter per
channel), NCHW and NHWC, float32 / bfloat16 (uint16 bits) / float16 storage computed in float32.
conv.py offers them as the "depthwise" path of the three conv ops, timed against cuDNN's plans:

  forward      conv2d_depthwise_forward       y = conv + bias, the fused ReLU (attrs act) in it
  grad_input   conv2d_depthwise_grad_input    dx, a gather per input element
  grad_weight  conv2d_depthwise_grad_weight   dw, and db alongside it; blocks per channel (NCHW)
                                              or 32 channels (NHWC) and split of the N*Ho*Wo
                                              pixels, then a sum kernel over the splits

Sizes are runtime ints (no per-shape compile): 7 templates x 3 storages, declared like
conv_direct.cu's. Each output is rounded once, on store (conv_depthwise.cu).
"""
from __future__ import annotations

import numpy as np

from ....errors import ShapeError
from ..runtime.launch import _kernel
from .geometry import Geometry

SOURCE = "conv_depthwise.cu"
# Storage dtype -> the kernels' S (bf16.cuh / fp16.cuh load and store each as float)
CTYPES = {"float32": "float", "uint16": "unsigned short", "float16": "fp16_bits"}
LAYOUTS = ("NCHW", "NHWC")
KINDS = ("forward", "grad_input", "grad_weight")
SUM_KERNEL = "conv2d_depthwise_grad_weight_sum_kernel"
MAX_ELEMENTS = 1 << 30       # per tensor: the kernels' offsets are 32-bit ints
MAX_TAPS = 64                # conv_depthwise.cu's: kh*kw of an NHWC block's staged filters
BLOCK = 256                  # threads of an NCHW block (flat kernels, grad_weight)
LANES, ROWS = 32, 8          # an NHWC block: channels x pixel rows (conv_depthwise.cu)
TAP_BLOCKS = (4, 16)         # grad_weight: taps (and db) a block sums, its kernel's TB
MAX_FLAT_BLOCKS = 1 << 20    # flat kernels stride over the rest
MAX_ROW_BLOCKS = 65535       # NHWC grid.y: blocks stride over the rest
# grad_weight's batch splits: about TARGET_BLOCKS blocks fill an H200 (132 SMs), but a split
# keeps at least MIN_ROWS_PER_THREAD output pixels for each of its block's threads along the
# pixels (BLOCK of an NCHW block, ROWS of an NHWC one, whose lanes run along the channels:
# counted as an NCHW block's, a 256-channel NHWC problem had 32 blocks of 128 pixels a thread)
# and the partial sums stay few (MAX_SPLITS).
TARGET_BLOCKS = 1024
MIN_ROWS_PER_THREAD = 4
MAX_SPLITS = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _launch(ctx, filename: str, name: str, grid: tuple, block: tuple, args: tuple,
            shared: int = 0) -> None:
    """One launch, with `shared` bytes of dynamic shared memory (the plane kernels')."""
    _kernel(filename, name)(grid, block, args, shared_mem=shared, stream=ctx.stream)


def supported(g: Geometry, layout: str, dtype) -> str | None:
    """Why the depthwise kernels cannot run this convolution, or None if they can. `dtype`:
    the tensors' storage dtype (uint16 for bfloat16)."""
    if str(dtype) not in CTYPES:
        return f"dtype {dtype} (want one of {list(CTYPES)}, uint16 being bfloat16)"
    if layout not in LAYOUTS:
        return f"layout {layout!r} (want one of {LAYOUTS})"
    if not g.groups == g.c == g.o:
        return (f"not depthwise: groups {g.groups}, {g.c} input and {g.o} output channels "
                f"(want groups == C == O)")
    if layout == "NHWC" and g.kh * g.kw > MAX_TAPS:
        return f"kernel {g.kh}x{g.kw} has more than {MAX_TAPS} taps (NHWC stages the filters)"
    if max(g.n * g.c * g.h * g.w, g.n * g.o * g.p) > MAX_ELEMENTS:
        return f"a tensor of more than {MAX_ELEMENTS} elements (32-bit offsets)"
    return None


def kernel_name(kind: str, layout: str, dtype, taps: int = 0) -> str:
    """The kernel of op `kind` (KINDS) in `layout` for tensors of storage `dtype`; grad_weight's
    for `taps` sums a channel (grad_weight_taps)."""
    suffix = "_nhwc" if layout == "NHWC" else ""
    block = f", {tap_block(taps)}" if kind == "grad_weight" else ""
    return f"conv2d_depthwise_{kind}{suffix}_kernel<{CTYPES[str(dtype)]}{block}>"


def tap_block(taps: int) -> int:
    """The taps a grad_weight block sums: the fewest of TAP_BLOCKS holding a channel's, else
    the most (blocks then share them): every thread sets up and reduces that many."""
    return next((tb for tb in TAP_BLOCKS if taps <= tb), TAP_BLOCKS[-1])


def sum_kernel_name(dtype) -> str:
    return f"{SUM_KERNEL}<{CTYPES[str(dtype)]}>"


def kernel_names() -> dict[str, set[str]]:
    """{SOURCE: every kernel name the launchers below may launch} (the NVRTC compile test
    instantiates each; conv.py's kernel_names declares them to the compiler)."""
    names = {kernel_name(kind, layout, dtype, taps) for kind in KINDS for layout in LAYOUTS
             for dtype in CTYPES for taps in TAP_BLOCKS}
    return {SOURCE: names | {sum_kernel_name(dtype) for dtype in CTYPES}
            | plane_kernel_names()}


def _geometry_args(g: Geometry) -> tuple:
    """DEPTHWISE_PARAMS of conv_depthwise.cu, in order."""
    return tuple(np.int32(v) for v in (g.n, g.c, g.h, g.w, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw,
                                       g.dil_h, g.dil_w, g.ho, g.wo))


def _checked_dtype(op: str, g: Geometry, layout: str, arrays: dict):
    """The storage dtype every array shares, after checking that the kernels run them."""
    dtype = next(iter(arrays.values())).dtype
    for what, arr in arrays.items():
        if arr.dtype != dtype:
            raise ShapeError(f"{op}: {what} is {arr.dtype}, the other operands {dtype}")
    why = supported(g, layout, dtype)
    if why is not None:
        raise ShapeError(f"{op}: the depthwise kernels cannot run {g} ({layout}): {why}")
    return dtype


def _grid(g: Geometry, layout: str, pixels: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(grid, block) of a forward or grad_input launch over `pixels` pixels per channel
    (N*Ho*Wo or N*H*W): flat over the elements (NCHW), or channels x pixel rows (NHWC)."""
    if layout == "NHWC":
        return (_cdiv(g.c, LANES), min(_cdiv(pixels, ROWS), MAX_ROW_BLOCKS)), (LANES, ROWS)
    return (min(_cdiv(pixels * g.c, BLOCK), MAX_FLAT_BLOCKS),), (BLOCK,)


def conv2d_depthwise_forward(ctx, g: Geometry, layout: str, x, w, bias, y, relu: bool) -> None:
    """y = conv2d(x, w) + bias (None: no bias), then ReLU where relu: one launch."""
    arrays = {"x": x, "weight": w, "y": y} | ({} if bias is None else {"bias": bias})
    dtype = _checked_dtype("conv2d_depthwise_forward", g, layout, arrays)
    if g.n * g.c * g.p == 0:
        return
    grid, block = _grid(g, layout, g.n * g.p)
    args = (x, w, w if bias is None else bias, y, np.int32(bias is not None),
            np.int32(relu)) + _geometry_args(g)
    _launch(ctx, SOURCE, kernel_name("forward", layout, dtype), grid, block, args)


def conv2d_depthwise_grad_input(ctx, g: Geometry, layout: str, dy, w, dx) -> None:
    """dx of the depthwise conv2d given dy and w: one launch."""
    dtype = _checked_dtype("conv2d_depthwise_grad_input", g, layout,
                           {"dy": dy, "weight": w, "dx": dx})
    if g.n * g.c * g.h * g.w == 0:
        return
    grid, block = _grid(g, layout, g.n * g.h * g.w)
    _launch(ctx, SOURCE, kernel_name("grad_input", layout, dtype), grid, block,
            (dy, w, dx) + _geometry_args(g))


def grad_weight_taps(g: Geometry, bias: bool) -> int:
    """The sums of a channel: its kh*kw weights, and db's."""
    return g.kh * g.kw + int(bias)


def grad_weight_splits(g: Geometry, layout: str, bias: bool) -> int:
    """Splits of the N*Ho*Wo pixels among grad_weight's blocks (see TARGET_BLOCKS)."""
    channel_blocks = g.c if layout == "NCHW" else _cdiv(g.c, LANES)
    taps = grad_weight_taps(g, bias)
    blocks = channel_blocks * _cdiv(taps, tap_block(taps))
    along_pixels = BLOCK if layout == "NCHW" else ROWS
    return max(1, min(_cdiv(TARGET_BLOCKS, blocks),
                      g.n * g.p // (MIN_ROWS_PER_THREAD * along_pixels), MAX_SPLITS))


def grad_weight_scratch(g: Geometry, layout: str, bias: bool) -> int:
    """float32 elements of the partial sums grad_weight needs (0: one split, none)."""
    splits = grad_weight_splits(g, layout, bias)
    return 0 if splits == 1 else splits * g.c * grad_weight_taps(g, bias)


def conv2d_depthwise_grad_weight(ctx, g: Geometry, layout: str, dy, x, dw, db,
                                 partial) -> None:
    """dw (and db = dy summed over N, Ho, Wo, unless None) of the depthwise conv2d: a block per
    channel (NCHW) or LANES channels (NHWC), tap_block taps and split of the output pixels;
    with several splits their float32 partial sums go to `partial` (grad_weight_scratch
    elements) and a second launch adds them in order and rounds dw and db."""
    arrays = {"dy": dy, "x": x, "dw": dw} | ({} if db is None else {"db": db})
    dtype = _checked_dtype("conv2d_depthwise_grad_weight", g, layout, arrays)
    if g.c == 0:
        return
    taps, splits = grad_weight_taps(g, db is not None), grad_weight_splits(g, layout,
                                                                          db is not None)
    if splits > 1 and (partial is None or partial.dtype != np.float32
                       or partial.size < grad_weight_scratch(g, layout, db is not None)):
        raise ShapeError(f"conv2d_depthwise_grad_weight: {splits} splits need "
                         f"{grad_weight_scratch(g, layout, db is not None)} float32 partial "
                         f"sums, got {None if partial is None else (partial.size, partial.dtype)}")
    channel_blocks, block = (g.c, (BLOCK,)) if layout == "NCHW" else \
        (_cdiv(g.c, LANES), (LANES, ROWS))
    sums = dw if partial is None else partial      # unused with one split: any pointer
    args = (dy, x, dw, dw if db is None else db, sums, np.int32(taps)) + _geometry_args(g)
    _launch(ctx, SOURCE, kernel_name("grad_weight", layout, dtype, taps),
            (channel_blocks, _cdiv(taps, tap_block(taps)), splits), block, args)
    if splits > 1:
        _launch(ctx, SOURCE, sum_kernel_name(dtype), (_cdiv(g.c * taps, BLOCK),), (BLOCK,),
                (partial, dw, dw if db is None else db, np.int32(g.c), np.int32(taps),
                 np.int32(g.kh * g.kw), np.int32(splits)))


# ---- plane kernel (conv_depthwise.cu): forward and dx in NCHW, stride 1, dilation 1 ----------

PLANE_SMEM = 48 * 1024       # bytes of shared memory a block may take without opting in
PLANE_MAX_BLOCKS = 1 << 20   # blocks stride over the rest of the planes


def _floats(n: int) -> int:
    return (n + 3) & ~3      # the kernels keep each staged array 16-byte aligned


def _plane_bytes(g: Geometry) -> dict[str, int]:
    """Shared memory of each op's plane kernel: the filter and the padded window of the
    plane it reads (forward: x; grad_input: dy)."""
    taps = _floats(g.kh * g.kw)
    return {"forward": 4 * (taps + (g.ho + g.kh - 1) * (g.wo + g.kw - 1)),
            "grad_input": 4 * (taps + (g.h + g.kh - 1) * (g.w + g.kw - 1))}


def plane_supported(g: Geometry, layout: str, dtype) -> str | None:
    """Why the plane kernels cannot run this convolution, or None if they can."""
    why = supported(g, layout, dtype)
    if why is not None:
        return why
    if layout != "NCHW":
        return "channels-last (the plane kernels read NCHW planes)"
    if (g.sh, g.sw, g.dil_h, g.dil_w) != (1, 1, 1, 1):
        return f"stride {(g.sh, g.sw)} or dilation {(g.dil_h, g.dil_w)} (want 1)"
    if max(_plane_bytes(g).values()) > PLANE_SMEM:
        return f"a plane of {g.h}x{g.w} does not fit {PLANE_SMEM} bytes of shared memory"
    return None


def plane_kernel_name(dtype) -> str:
    return f"conv2d_depthwise_plane_kernel<{CTYPES[str(dtype)]}>"


def plane_kernel_names() -> set[str]:
    return {plane_kernel_name(dtype) for dtype in CTYPES}


def _plane_block(rows: int, cols: int) -> tuple[int, int]:
    """Threads along a plane's columns (at most 128) and rows, 256 at most."""
    bx = max(1, min(128, cols))
    return bx, max(1, min(rows, 256 // bx))


def _plane(ctx, g: Geometry, src, w, bias, out, relu: bool, flip: bool, rows: int,
           cols: int, pad: tuple[int, int], src_hw: tuple[int, int], op: str) -> None:
    dtype = _checked_plane(op, g, {"input": src, "weight": w, "output": out}
                           | ({} if bias is None else {"bias": bias}))
    planes = g.n * g.c
    if planes * rows * cols == 0:
        return
    args = (src, w, w if bias is None else bias, out, np.int32(bias is not None),
            np.int32(relu), np.int32(flip), np.int32(planes), np.int32(g.c),
            *map(np.int32, (*src_hw, g.kh, g.kw, *pad, rows, cols)))
    _launch(ctx, SOURCE, plane_kernel_name(dtype), (min(planes, PLANE_MAX_BLOCKS),),
            _plane_block(rows, cols), args, _plane_bytes(g)[op])


def _checked_plane(op: str, g: Geometry, arrays: dict):
    dtype = _checked_dtype(f"conv2d_depthwise_plane ({op})", g, "NCHW", arrays)
    why = plane_supported(g, "NCHW", dtype)
    if why is not None:
        raise ShapeError(f"conv2d_depthwise_plane ({op}): cannot run {g}: {why}")
    return dtype


def conv2d_depthwise_plane_forward(ctx, g: Geometry, x, w, bias, y, relu: bool) -> None:
    """y = conv2d(x, w) + bias, then ReLU where relu: a block per plane, in shared memory."""
    _plane(ctx, g, x, w, bias, y, relu, False, g.ho, g.wo, (g.ph, g.pw), (g.h, g.w), "forward")


def conv2d_depthwise_plane_grad_input(ctx, g: Geometry, dy, w, dx) -> None:
    """dx: the plane kernel over dy padded by (kh - 1 - ph, kw - 1 - pw), the filter flipped."""
    _plane(ctx, g, dy, w, None, dx, False, True, g.h, g.w,
           (g.kh - 1 - g.ph, g.kw - 1 - g.pw), (g.ho, g.wo), "grad_input")
