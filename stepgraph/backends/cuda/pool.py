"""Launchers of pool.cu (maxpool2d, maxpool2d_grad) and avgpool.cu (avgpool2d,
avgpool2d_grad), and their cuda op table.

Every op runs NCHW tensors, or channels-last ones (attrs layout "NHWC", compile/layout.py:
(N, H, W, C)) through the `_nhwc_` kernels, the same window code over the other layout
(include/pool.cuh). Channels-last max pooling takes the `_nhwc_vec_` kernels where C is a
multiple of PACK (16 bytes of elements: 4 float32, 8 16-bit) and every array is 16-byte aligned:
a thread per PACK adjacent channels of a pixel, the same results bit for bit. Launchers check
their preconditions and launch on ctx.stream: no host sync, no allocation.

Every kernel is a template over the element storage: float32, bfloat16 (precision="bf16": uint16 raw
bits, ir/graph.py) or float16 (fp16_bits). 16-bit values are widened on load, windows are summed
(and divided) in float32 and each output is rounded to nearest even once, when stored: the NumPy
emulation's rounding point (NumpyBackend.run_node), so max pooling and its gradient match it bit for
bit. The indices stay int32; an op's float operands share one dtype.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ...errors import ShapeError
from ...ops.layout import layout_of, nchw_shape, stored_shape
from ...ops.pool import pool_out
from .runtime.launch import BLOCK, _aligned, _check, _check_int32, _grid, _launch, _or_null
from .cast import CAST_CTYPES, shared_ctype

SOURCE, MAX_SOURCE = "avgpool.cu", "pool.cu"
WARP = 32
WARP_WINDOW = 64      # NCHW windows of at least this many elements: a warp per output
GLOBAL_SLICES = 8     # avgpool.cu's: pixel slices a block of global channels-last pooling
KERNELS = ("avgpool2d_forward_kernel", "avgpool2d_forward_nhwc_kernel",
           "avgpool2d_forward_warp_kernel", "avgpool2d_forward_global_nhwc_kernel",
           "avgpool2d_backward_kernel",
           "avgpool2d_backward_nhwc_kernel", "avgpool2d_backward_tiling_kernel",
           "avgpool2d_backward_tiling_nhwc_kernel")
MAX_KERNELS = ("maxpool2d_forward_kernel", "maxpool2d_forward_nhwc_kernel",
               "maxpool2d_backward_kernel", "maxpool2d_backward_nhwc_kernel",
               "maxpool2d_backward_tiling_kernel", "maxpool2d_backward_tiling_nhwc_kernel",
               "maxpool2d_forward_nhwc_vec_kernel", "maxpool2d_backward_nhwc_vec_kernel",
               "maxpool2d_backward_tiling_nhwc_vec_kernel")
PACK_BYTES = 16       # the _nhwc_vec_ kernels' access: PACK<T> = 16 / sizeof(T) channels
# IR dtype -> (storage dtype, the kernels' template argument T)
POOL_CTYPES = CAST_CTYPES
BF16_OPS = frozenset({"maxpool2d", "maxpool2d_grad", "avgpool2d", "avgpool2d_grad"})
FP16_OPS = BF16_OPS          # float16: the fp16_bits instantiations (CAST_CTYPES)


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    ctypes = [ctype for _, ctype in POOL_CTYPES.values()]
    return {SOURCE: {f"{k}<{t}>" for k in KERNELS for t in ctypes},
            MAX_SOURCE: {f"{k}<{t}>" for k in MAX_KERNELS for t in ctypes}}


# ---- shapes --------------------------------------------------------------------------------

def _pool_args(x_shape: tuple, y_shape: tuple, kernel, stride, padding=(0, 0)) -> tuple:
    """POOL_SHAPE_ARGS of include/pool.cuh, from (N, C, H, W) input and output shapes."""
    n, c, h, w = x_shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    return tuple(np.int32(v) for v in (n * c, h, w, y_shape[2], y_shape[3], kh, kw, sh, sw,
                                       ph, pw))


def _pool_out_shape(x_shape: tuple, kernel, stride, padding=(0, 0), op: str = "maxpool2d",
                    ceil_mode: bool = False):
    """(N, C, Ho, Wo) of a pool over an (N, C, H, W) input, floor mode or ceil_mode (torch's
    partial last windows, which the kernels clip at the input's end as they clip padding);
    padding at most half the window (PyTorch's rule, which keeps a real element in every
    window)."""
    if len(x_shape) != 4:
        raise ShapeError(f"{op}: input must be 4-D (N, C, H, W or N, H, W, C), got {x_shape}")
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    ho = pool_out(x_shape[2], kh, sh, ph, 1, ceil_mode) if kh > 0 and sh > 0 else 0
    wo = pool_out(x_shape[3], kw, sw, pw, 1, ceil_mode) if kw > 0 and sw > 0 else 0
    if ho <= 0 or wo <= 0 or min(kh, kw, sh, sw) <= 0 or min(ph, pw) < 0 \
            or 2 * ph > kh or 2 * pw > kw:
        raise ShapeError(f"{op}: window {tuple(kernel)} stride {tuple(stride)} padding "
                         f"{tuple(padding)} on input {x_shape}")
    return (x_shape[0], x_shape[1], ho, wo)


def _shapes(op: str, x_shape, kernel, stride, padding, layout: str, ceil_mode: bool = False):
    """(x (N, C, H, W), y (N, C, Ho, Wo), y as stored, the kernel name suffix and its layout
    arguments (C for channels-last)) of a pool over an input stored as x_shape."""
    if layout not in ("NCHW", "NHWC"):
        raise ShapeError(f"{op}: layout must be 'NCHW' or 'NHWC', got {layout!r}")
    xs = nchw_shape(x_shape, layout)
    ys = _pool_out_shape(xs, kernel, stride, padding, op, ceil_mode)
    nhwc = layout == "NHWC" and len(xs) == 4
    return xs, ys, stored_shape(ys, layout), ("_nhwc" if nhwc else ""), \
        ((np.int32(xs[1]),) if nhwc else ())


def _tiles(x_shape: tuple, kernel, stride, padding) -> bool:
    """True when the windows tile the (N, C, H, W) input exactly: each element in one window."""
    h, w = x_shape[2:]
    return tuple(stride) == tuple(kernel) and h % kernel[0] == 0 and w % kernel[1] == 0 \
        and tuple(padding) == (0, 0)


def _kernel(name: str, suffix: str, ctype: str = "float") -> str:
    """The instantiation of kernel `name` for a layout suffix ("" or "_nhwc") and element T."""
    return name.replace("_kernel", f"{suffix}_kernel") + f"<{ctype}>"


# ---- max pooling (pool.cu) -----------------------------------------------------------------

def _max_walk(suffix: str, channels: int, *arrays) -> tuple[str, int]:
    """(layout suffix, elements a thread) of a max pooling kernel: ("_nhwc_vec", PACK<T>) for
    a channels-last launch whose C is a multiple of PACK<T> and whose arrays (None entries
    skipped; the first's storage is T) start 16-byte aligned; else (suffix, 1)."""
    present = [a for a in arrays if a is not None]
    pack = PACK_BYTES // present[0].dtype.itemsize
    if suffix == "_nhwc" and channels % pack == 0 and _aligned(*present, to=PACK_BYTES):
        return "_nhwc_vec", pack
    return suffix, 1


def maxpool2d_forward(ctx, x, y, idx, kernel, stride, relu: bool = False, padding=(0, 0),
                      layout: str = "NCHW", ceil_mode: bool = False) -> None:
    """y = window maxima (relu: relu of them; padding is -inf), idx (int32) = plane-local
    h * W + w of each window's first maximum."""
    ctype = shared_ctype("maxpool2d", {"input": x, "output": y})
    xs, ys, stored, suffix, extra = _shapes("maxpool2d", tuple(x.shape), kernel, stride,
                                            padding, layout, ceil_mode)
    _check("maxpool2d output", y, None, stored)
    _check("maxpool2d indices", idx, "int32", stored)
    _check_int32("maxpool2d", max(x.size, y.size))
    if y.size:
        suffix, per_thread = _max_walk(suffix, xs[1], x, y, idx)
        _launch(ctx, MAX_SOURCE, _kernel("maxpool2d_forward_kernel", suffix, ctype),
                _grid(y.size // per_thread), (BLOCK,), (x, y, idx, np.int32(relu)) + extra
                + _pool_args(xs, ys, kernel, stride, padding))


def maxpool2d_backward(ctx, dy, idx, dx, kernel, stride, y=None, padding=(0, 0),
                       layout: str = "NCHW", ceil_mode: bool = False) -> None:
    """dx = each dy added at its idx (windows may overlap: gathered, fixed order); with the
    fused ReLU's output y, only where y > 0. Windows that tile the input exactly (no
    padding) take the scatter kernel (a thread per window)."""
    ctype = shared_ctype("maxpool2d_grad", {"dx": dx, "dy": dy, "relu output": y})
    xs, ys, stored, suffix, extra = _shapes("maxpool2d_grad", tuple(dx.shape), kernel, stride,
                                            padding, layout, ceil_mode)
    _check("maxpool2d_grad dy", dy, None, stored)
    _check("maxpool2d_grad indices", idx, "int32", stored)
    if y is not None:
        _check("maxpool2d_grad relu output", y, None, stored)
    _check_int32("maxpool2d_grad", max(dx.size, dy.size))
    if not dx.size:
        return
    args = (dy, idx, _or_null(y), dx) + extra + _pool_args(xs, ys, kernel, stride, padding)
    suffix, per_thread = _max_walk(suffix, xs[1], dy, idx, y, dx)
    if _tiles(xs, kernel, stride, padding):
        _launch(ctx, MAX_SOURCE, _kernel("maxpool2d_backward_tiling_kernel", suffix, ctype),
                _grid(dy.size // per_thread), (BLOCK,), args)
    else:
        _launch(ctx, MAX_SOURCE, _kernel("maxpool2d_backward_kernel", suffix, ctype),
                _grid(dx.size // per_thread), (BLOCK,), args)


# ---- average pooling (avgpool.cu) ----------------------------------------------------------

def avgpool2d_forward(ctx, x, y, kernel, stride, padding=(0, 0),
                      count_include_pad: bool = True, layout: str = "NCHW") -> None:
    """y = window means of x (N, C, H, W), zero padding; the divisor counts the padding only
    with count_include_pad (PyTorch avg_pool2d, floor mode)."""
    ctype = shared_ctype("avgpool2d", {"input": x, "output": y})
    xs, ys, stored, suffix, extra = _shapes("avgpool2d", tuple(x.shape), kernel, stride,
                                            padding, layout)
    _check("avgpool2d output", y, None, stored)
    _check_int32("avgpool2d", max(x.size, y.size))
    if not y.size:
        return
    n, c, h, w = xs
    if suffix and tuple(kernel) == (h, w) and tuple(padding) == (0, 0):
        # global pooling of channels-last maps: 32 channels x GLOBAL_SLICES a block
        _launch(ctx, SOURCE, _kernel("avgpool2d_forward_global_nhwc_kernel", "", ctype),
                (-(-c // WARP), n), (WARP, GLOBAL_SLICES), (x, y, np.int32(h * w), np.int32(c)))
        return
    args = (x, y, np.int32(bool(count_include_pad))) + extra \
        + _pool_args(xs, ys, kernel, stride, padding)
    if kernel[0] * kernel[1] >= WARP_WINDOW and not suffix:
        _launch(ctx, SOURCE, _kernel("avgpool2d_forward_warp_kernel", "", ctype),
                _grid(y.size * WARP), (BLOCK,), args)
    else:
        _launch(ctx, SOURCE, _kernel("avgpool2d_forward_kernel", suffix, ctype),
                _grid(y.size), (BLOCK,), args)


def avgpool2d_backward(ctx, dy, dx, kernel, stride, padding=(0, 0),
                       count_include_pad: bool = True, layout: str = "NCHW") -> None:
    """dx = avgpool2d's gradient: each dy / its divisor spread over its window, gathered per
    input element (fixed order, no atomics); windows that tile the input exactly take the
    tiling kernel (a thread per window)."""
    ctype = shared_ctype("avgpool2d_grad", {"dx": dx, "dy": dy})
    xs, ys, stored, suffix, extra = _shapes("avgpool2d_grad", tuple(dx.shape), kernel, stride,
                                            padding, layout)
    _check("avgpool2d_grad dy", dy, None, stored)
    _check_int32("avgpool2d_grad", max(dx.size, dy.size))
    if not dx.size:
        return
    shape = _pool_args(xs, ys, kernel, stride, padding)
    if _tiles(xs, kernel, stride, padding):
        _launch(ctx, SOURCE, _kernel("avgpool2d_backward_tiling_kernel", suffix, ctype),
                _grid(dy.size), (BLOCK,), (dy, dx) + extra + shape)
    else:
        _launch(ctx, SOURCE, _kernel("avgpool2d_backward_kernel", suffix, ctype),
                _grid(dx.size), (BLOCK,), (dy, dx, np.int32(bool(count_include_pad))) + extra
                + shape)


# ---- the op table --------------------------------------------------------------------------

def _window(node) -> tuple:
    a = node.attrs
    return tuple(a["kernel"]), tuple(a["stride"]), tuple(a.get("padding", (0, 0)))


def _avg(node) -> dict:
    return dict(count_include_pad=bool(node.attrs.get("count_include_pad", True)),
                layout=layout_of(node.op, node.attrs))


IMPLS: dict[str, Callable] = {
    "maxpool2d": lambda node, ins, outs, ctx: maxpool2d_forward(
        ctx, ins[0], outs[0], outs[1], *_window(node)[:2], bool(node.attrs.get("relu")),
        _window(node)[2], layout_of(node.op, node.attrs), bool(node.attrs.get("ceil_mode"))),
    "maxpool2d_grad": lambda node, ins, outs, ctx: maxpool2d_backward(
        ctx, ins[0], ins[1], outs[0], *_window(node)[:2],
        ins[2] if node.attrs.get("relu") else None, _window(node)[2],
        layout_of(node.op, node.attrs), bool(node.attrs.get("ceil_mode"))),
    "avgpool2d": lambda node, ins, outs, ctx: avgpool2d_forward(
        ctx, ins[0], outs[0], *_window(node), **_avg(node)),
    "avgpool2d_grad": lambda node, ins, outs, ctx: avgpool2d_backward(
        ctx, ins[0], outs[0], *_window(node), **_avg(node)),
}
