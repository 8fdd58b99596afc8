"""Pool family: max pooling (a ReLU after it fused) and average pooling (PyTorch's
avg_pool2d, ceil_mode=False). Both take attrs layout "NHWC" (channels-last, compile/layout.py):
the same windows over x stored (N, H, W, C). And 3-d max and average pooling (maxpool3d,
avgpool3d) with torch's every argument: ceil_mode, dilation, divisor_override.
"""
from __future__ import annotations

import itertools

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..ir.graph import Node
from ..ir.ops import _need, defop, impl, vjp
from .activation import act_derivative, act_forward
from .conv import conv_out
from .layout import channels_last_capable, layout_attrs, layout_of, nchw_shape, stored_shape


def pool_geometry(op: str, shape, attrs) -> tuple[int, int]:
    """(Ho, Wo) of a pooling window sweep over an (N, C, H, W) input, checking the attrs
    kernel, stride and padding (default (0, 0); at most half the kernel); attrs ceil_mode
    (maxpool2d) counts torch's partial last windows."""
    _need(len(shape) == 4, op, f"input must be (N, C, H, W), got {tuple(shape)}")
    (kh, kw), (sh, sw) = attrs["kernel"], attrs["stride"]
    ph, pw = attrs.get("padding", (0, 0))
    _need(2 * ph <= kh and 2 * pw <= kw, op,
          f"padding {(ph, pw)} must be at most half the kernel {(kh, kw)}")
    ceil = bool(attrs.get("ceil_mode"))
    ho, wo = pool_out(shape[2], kh, sh, ph, 1, ceil), pool_out(shape[3], kw, sw, pw, 1, ceil)
    _need(ho > 0 and wo > 0, op, f"window {(kh, kw)} larger than padded input {shape[2:]}")
    return ho, wo


# ---- max pooling ---------------------------------------------------------------------------

@defop("maxpool2d")
def _maxpool2d(ins, attrs):
    """y = max over kernel windows (attrs kernel, stride, padding pairs; padding default
    (0, 0), implicit -inf padding of at most half the kernel; floor mode, or with attrs
    ceil_mode torch's partial last windows, clipped at the input's end); idx (int32) = h*W + w
    of the first maximum (row-major window order) in each window, within its (n, c) plane:
    always a real element. With attrs relu, y = relu(max) (the ReLU that followed the pool,
    fused). attrs layout "NHWC": x, y and idx stored (N, H, W, C) (idx still h*W + w)."""
    x, layout = ins[0], layout_of("maxpool2d", attrs)
    xs = nchw_shape(x.shape, layout)
    ho, wo = pool_geometry("maxpool2d", xs, attrs)
    shape = stored_shape((xs[0], xs[1], ho, wo), layout)
    return [(shape, x.dtype), (shape, "int32")]


@defop("maxpool2d_grad")
def _maxpool2d_grad(ins, attrs):
    """dx (attrs input_shape): each dy element added at its idx in its (n, c) plane. With attrs
    relu, ins (dy, idx, y) and only the elements with y > 0 are added (ReLU's gradient).
    attrs layout as maxpool2d's (input_shape stored in it)."""
    layout_of("maxpool2d_grad", attrs)
    return [(tuple(attrs["input_shape"]), ins[0].dtype)]


@vjp("maxpool2d")
def _maxpool2d_vjp(emit, node: Node, dy: list, wants) -> list:
    ceil = {"ceil_mode": True} if node.attrs.get("ceil_mode") else {}
    return [emit("maxpool2d_grad", [dy[0], node.outputs[1]], input_shape=node.inputs[0].shape,
                 kernel=node.attrs["kernel"], stride=node.attrs["stride"],
                 padding=tuple(node.attrs.get("padding", (0, 0))), **ceil,
                 **layout_attrs(node))[0]]


def _windows(xp: np.ndarray, kh: int, kw: int, sh: int, sw: int) -> np.ndarray:
    """(N, C, Ho, Wo, kh, kw) strided view of the windows of a padded NCHW array."""
    return sliding_window_view(xp, (kh, kw), axis=(2, 3))[:, :, ::sh, ::sw]


@impl("maxpool2d")
@channels_last_capable
def maxpool2d(node: Node, ins, outs, ctx):
    x = ins[0]
    (kh, kw), (sh, sw) = node.attrs["kernel"], node.attrs["stride"]
    ph, pw = node.attrs.get("padding", (0, 0))
    ho, wo = pool_geometry("maxpool2d", x.shape, node.attrs)
    # -inf padding is never a window's maximum: at most half a window is padding, and a
    # ceil_mode window starts inside the input or its left padding
    eh, ew = max(0, (ho - 1) * sh + kh - x.shape[2] - 2 * ph), \
        max(0, (wo - 1) * sw + kw - x.shape[3] - 2 * pw)
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph + eh), (pw, pw + ew)), constant_values=-np.inf) \
        if ph or pw or eh or ew else x
    win = _windows(xp, kh, kw, sh, sw)
    n, c, ho, wo = win.shape[:4]
    flat = win.reshape(n, c, ho, wo, kh * kw)
    arg = flat.argmax(axis=-1)  # first maximum in row-major window order, as PyTorch
    y = np.take_along_axis(flat, arg[..., None], axis=-1)[..., 0]
    outs[0][...] = act_forward(y, "relu") if node.attrs.get("relu") else y
    rows = np.arange(ho)[:, None] * sh + arg // kw - ph
    cols = np.arange(wo)[None, :] * sw + arg % kw - pw
    outs[1][...] = rows * x.shape[3] + cols


@impl("maxpool2d_grad")
@channels_last_capable
def maxpool2d_grad(node: Node, ins, outs, ctx):
    dy, idx = ins[:2]
    if node.attrs.get("relu"):                  # ReLU's gradient, from the pooled output
        dy = dy * act_derivative(ins[2], "relu")
    n, c, h, w = node.attrs["input_shape"]
    dx = np.zeros((n * c, h * w), dtype=dy.dtype)
    planes = np.repeat(np.arange(n * c), idx[0, 0].size)
    np.add.at(dx, (planes, idx.reshape(-1)), dy.reshape(-1))
    outs[0][...] = dx.reshape(n, c, h, w)


# ---- average pooling -----------------------------------------------------------------------

@defop("avgpool2d")
def _avgpool2d(ins, attrs):
    """y = mean over kernel windows of x (N, C, H, W); attrs kernel, stride, padding (pairs,
    implicit zero padding of at most half the kernel, floor mode), count_include_pad (bool):
    divide by kh*kw when true, else by the number of real (unpadded) elements in the window.
    PyTorch's avg_pool2d with ceil_mode=False and no divisor_override. attrs layout "NHWC":
    x and y stored (N, H, W, C)."""
    x, layout = ins[0], layout_of("avgpool2d", attrs)
    xs = nchw_shape(x.shape, layout)
    ho, wo = pool_geometry("avgpool2d", xs, attrs)
    return [(stored_shape((xs[0], xs[1], ho, wo), layout), x.dtype)]


@defop("avgpool2d_grad")
def _avgpool2d_grad(ins, attrs):
    """dx (attrs input_shape) of avgpool2d: each dy element divided by its window's divisor
    and added to every real element of its window; ins (dy,); attrs as avgpool2d's
    (input_shape stored in its layout)."""
    dy, layout = ins[0], layout_of("avgpool2d_grad", attrs)
    shape = tuple(attrs["input_shape"])
    xs = nchw_shape(shape, layout)
    want = stored_shape((xs[0], xs[1], *pool_geometry("avgpool2d_grad", xs, attrs)), layout)
    _need(dy.shape == want, "avgpool2d_grad", f"dy {dy.shape} for input {shape}: expected {want}")
    return [(shape, dy.dtype)]


@vjp("avgpool2d")
def _avgpool2d_vjp(emit, node, dy, wants):
    a = node.attrs
    return [emit("avgpool2d_grad", [dy[0]], input_shape=node.inputs[0].shape, kernel=a["kernel"],
                 stride=a["stride"], padding=a["padding"],
                 count_include_pad=a["count_include_pad"], **layout_attrs(node))[0]]


def _divisor(shape, attrs, dtype) -> np.ndarray:
    """(Ho, Wo) window divisors: kh*kw, or the count of real elements in each window."""
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["padding"]
    ho, wo = conv_out(shape[2], kh, sh, ph), conv_out(shape[3], kw, sw, pw)
    if attrs["count_include_pad"]:
        return np.full((ho, wo), kh * kw, dtype=dtype)
    real = np.pad(np.ones(shape[2:], dtype), ((ph, ph), (pw, pw)))
    return sliding_window_view(real, (kh, kw))[::sh, ::sw].sum(axis=(-2, -1))[:ho, :wo]


@impl("avgpool2d")
@channels_last_capable
def _avgpool2d_impl(node, ins, outs, ctx):
    x, a = ins[0], node.attrs
    (kh, kw), (sh, sw), (ph, pw) = a["kernel"], a["stride"], a["padding"]
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))) if ph or pw else x
    win = sliding_window_view(xp, (kh, kw), axis=(2, 3))[:, :, ::sh, ::sw]
    outs[0][...] = win.sum(axis=(-2, -1)) / _divisor(x.shape, a, x.dtype)


@impl("avgpool2d_grad")
@channels_last_capable
def _avgpool2d_grad_impl(node, ins, outs, ctx):
    dy, a = ins[0], node.attrs
    (kh, kw), (sh, sw), (ph, pw) = a["kernel"], a["stride"], a["padding"]
    n, c, h, w = a["input_shape"]
    _, _, ho, wo = dy.shape
    share = dy / _divisor((n, c, h, w), a, dy.dtype)
    dxp = np.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=dy.dtype)
    for i in range(kh):            # one strided add per window tap
        for j in range(kw):
            dxp[:, :, i:i + sh * ho:sh, j:j + sw * wo:sw] += share
    outs[0][...] = dxp[:, :, ph:ph + h, pw:pw + w]


# ---- 3-d pooling ---------------------------------------------------------------------------
# Torch's max_pool3d / avg_pool3d with every argument in the op (ceil_mode, dilation,
# divisor_override), NCDHW. The references are written over any number of spatial axes.

def pool_out(size: int, k: int, stride: int, pad: int, dilation: int, ceil_mode: bool) -> int:
    """Windows along one axis, torch's rule: with ceil_mode a last partial window counts if
    it starts inside the input or its left padding."""
    span = size + 2 * pad - dilation * (k - 1) - 1
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def pool3d_sizes(op: str, shape, attrs) -> tuple[int, ...]:
    """(Do, Ho, Wo) of a 3-d pool over an (N, C, D, H, W) input, the attrs kernel, stride,
    padding, dilation (default 1) and ceil_mode checked: padding at most half the kernel
    (torch's rule, which keeps a real element in every window)."""
    _need(len(shape) == 5, op, f"input must be (N, C, D, H, W), got {tuple(shape)}")
    kernel, stride, padding = attrs["kernel"], attrs["stride"], attrs["padding"]
    dilation = attrs.get("dilation", (1, 1, 1))
    _need(all(len(a) == 3 for a in (kernel, stride, padding, dilation)), op,
          f"kernel, stride, padding, dilation must be triples, got {kernel}, {stride}, "
          f"{padding}, {dilation}")
    _need(min(*kernel, *stride, *dilation) > 0 and min(padding) >= 0, op,
          f"kernel {kernel}, stride {stride}, dilation {dilation} must be positive")
    _need(all(2 * p <= k for p, k in zip(padding, kernel)), op,
          f"padding {tuple(padding)} must be at most half the kernel {tuple(kernel)}")
    out = tuple(pool_out(n, k, s, p, d, bool(attrs.get("ceil_mode")))
                for n, k, s, p, d in zip(shape[2:], kernel, stride, padding, dilation))
    _need(min(out) > 0, op, f"window {tuple(kernel)} (dilation {tuple(dilation)}) larger than "
          f"padded input {tuple(shape[2:])}")
    return out


@defop("maxpool3d")
def _maxpool3d(ins, attrs):
    """y = max over the windows of x (N, C, D, H, W): attrs kernel, stride, padding,
    dilation (triples; implicit -inf padding of at most half the kernel), ceil_mode (bool,
    torch's: a last partial window that starts inside the input or its left padding). idx
    (int32) = (d * H + h) * W + w of the first maximum (row-major window order) of each
    window within its (n, c) volume. torch.nn.functional.max_pool3d."""
    x = ins[0]
    shape = (*x.shape[:2], *pool3d_sizes("maxpool3d", x.shape, attrs))
    return [(shape, x.dtype), (shape, "int32")]


@defop("maxpool3d_grad")
def _maxpool3d_grad(ins, attrs):
    """dx (attrs input_shape) of maxpool3d: each dy element (ins dy, idx) added at its idx in
    its (n, c) volume; attrs as maxpool3d's."""
    dy, shape = ins[0], tuple(attrs["input_shape"])
    want = (*shape[:2], *pool3d_sizes("maxpool3d_grad", shape, attrs))
    _need(dy.shape == want and ins[1].shape == want, "maxpool3d_grad",
          f"dy {dy.shape}, idx {ins[1].shape} for input {shape}: expected {want}")
    return [(shape, dy.dtype)]


def _window_attrs(node: Node, *names: str) -> dict:
    a = node.attrs
    return dict(input_shape=node.inputs[0].shape, kernel=a["kernel"], stride=a["stride"],
                padding=a["padding"], ceil_mode=bool(a.get("ceil_mode")),
                **{k: a[k] for k in names if k in a})


@vjp("maxpool3d")
def _maxpool3d_vjp(emit, node: Node, dy: list, wants) -> list:
    return [emit("maxpool3d_grad", [dy[0], node.outputs[1]],
                 **_window_attrs(node, "dilation"))[0]]


@defop("avgpool3d")
def _avgpool3d(ins, attrs):
    """y = mean over the windows of x (N, C, D, H, W): attrs kernel, stride, padding
    (triples, implicit zero padding of at most half the kernel), ceil_mode,
    count_include_pad, divisor_override (None or an int). Torch's divisor: divisor_override
    when given; else with count_include_pad the window's size clipped to the padded input
    (a ceil_mode window past it is smaller), without it the count of real elements.
    torch.nn.functional.avg_pool3d."""
    x = ins[0]
    return [((*x.shape[:2], *pool3d_sizes("avgpool3d", x.shape, attrs)), x.dtype)]


@defop("avgpool3d_grad")
def _avgpool3d_grad(ins, attrs):
    """dx (attrs input_shape) of avgpool3d: each dy element divided by its window's divisor
    and added to every real element of its window; attrs as avgpool3d's."""
    dy, shape = ins[0], tuple(attrs["input_shape"])
    want = (*shape[:2], *pool3d_sizes("avgpool3d_grad", shape, attrs))
    _need(dy.shape == want, "avgpool3d_grad", f"dy {dy.shape} for input {shape}: expected {want}")
    return [(shape, dy.dtype)]


@vjp("avgpool3d")
def _avgpool3d_vjp(emit, node, dy, wants):
    return [emit("avgpool3d_grad", [dy[0]], **_window_attrs(
        node, "count_include_pad", "divisor_override"))[0]]


def _pads(size, out, attrs) -> list[tuple[int, int]]:
    """(before, after) padding of each spatial axis: the padding before it, and after it as
    far as the last window reaches (beyond the padding for a ceil_mode window; negative
    where the floor mode leaves a tail, which no window reads)."""
    dilation = attrs.get("dilation", (1,) * len(out))
    return [(p, (o - 1) * s + d * (k - 1) + 1 - n - p) for n, o, k, s, p, d in
            zip(size, out, attrs["kernel"], attrs["stride"], attrs["padding"], dilation)]


def _padded(x: np.ndarray, out, attrs, fill: float) -> np.ndarray:
    """x padded by `fill` as _pads says (a negative amount pads nothing)."""
    pads = [(b, max(a, 0)) for b, a in _pads(x.shape[2:], out, attrs)]
    return np.pad(x, ((0, 0), (0, 0), *pads), constant_values=fill)


def _pool_windows(xp: np.ndarray, out, attrs) -> np.ndarray:
    """(N, C, *out, *kernel) strided view of the (dilated) windows of a padded array."""
    kernel, stride = attrs["kernel"], attrs["stride"]
    dilation = attrs.get("dilation", (1,) * len(out))
    span = tuple(d * (k - 1) + 1 for k, d in zip(kernel, dilation))
    win = sliding_window_view(xp, span, axis=tuple(range(2, xp.ndim)))
    return win[(slice(None),) * 2 + tuple(slice(0, o * s, s) for o, s in zip(out, stride))
               + tuple(slice(None, None, d) for d in dilation)]


@impl("maxpool3d")
def _maxpool3d_impl(node, ins, outs, ctx):
    x, a = ins[0], node.attrs
    out = outs[0].shape[2:]
    win = _pool_windows(_padded(x, out, a, -np.inf), out, a)
    flat = win.reshape(*win.shape[:2 + len(out)], -1)
    arg = flat.argmax(axis=-1)      # the first maximum in row-major window order, as torch
    outs[0][...] = np.take_along_axis(flat, arg[..., None], axis=-1)[..., 0]
    taps = np.unravel_index(arg, a["kernel"])
    flat_at = np.zeros(arg.shape, np.int64)
    for axis, (t, n, s, p, d) in enumerate(zip(taps, x.shape[2:], a["stride"], a["padding"],
                                               a.get("dilation", (1, 1, 1)))):
        o = np.arange(out[axis]).reshape((-1,) + (1,) * (len(out) - axis - 1))
        flat_at = flat_at * n + o * s - p + t * d
    outs[1][...] = flat_at


@impl("maxpool3d_grad")
def _maxpool3d_grad_impl(node, ins, outs, ctx):
    dy, idx = ins
    n, c, *size = node.attrs["input_shape"]
    dx = np.zeros((n * c, int(np.prod(size))), dtype=dy.dtype)
    planes = np.repeat(np.arange(n * c), idx[0, 0].size)
    np.add.at(dx, (planes, idx.reshape(-1)), dy.reshape(-1))
    outs[0][...] = dx.reshape(n, c, *size)


def _divisors(shape, out, attrs, dtype) -> np.ndarray:
    """The (*out) window divisors of avgpool3d (its docstring): a product over the axes."""
    if attrs.get("divisor_override"):
        return np.full(out, attrs["divisor_override"], dtype=dtype)
    total = np.ones((), dtype)
    for n, o, k, s, p in zip(shape[2:], out, attrs["kernel"], attrs["stride"],
                             attrs["padding"]):
        start = np.arange(o) * s - p
        end = np.minimum(start + k, n + p)
        count = end - start if attrs["count_include_pad"] else \
            np.minimum(end, n) - np.maximum(start, 0)
        total = np.multiply.outer(total, count.astype(dtype))
    return total


@impl("avgpool3d")
def _avgpool3d_impl(node, ins, outs, ctx):
    x, a = ins[0], node.attrs
    out = outs[0].shape[2:]
    win = _pool_windows(_padded(x, out, a, 0.0), out, a)
    outs[0][...] = win.sum(axis=tuple(range(-len(out), 0))) / _divisors(x.shape, out, a,
                                                                           x.dtype)


@impl("avgpool3d_grad")
def _avgpool3d_grad_impl(node, ins, outs, ctx):
    dy, a = ins[0], node.attrs
    shape, out = tuple(a["input_shape"]), dy.shape[2:]
    share = dy / _divisors(shape, out, a, dy.dtype)
    padded = [n + b + max(e, 0) for n, (b, e) in zip(shape[2:], _pads(shape[2:], out, a))]
    dxp = np.zeros((*shape[:2], *padded), dy.dtype)
    for taps in itertools.product(*map(range, a["kernel"])):    # one strided add per tap
        dxp[(slice(None),) * 2 + tuple(slice(t, t + s * o, s) for t, s, o in
                                       zip(taps, a["stride"], out))] += share
    outs[0][...] = dxp[(slice(None),) * 2 + tuple(slice(p, p + n) for p, n in
                                                  zip(a["padding"], shape[2:]))]
