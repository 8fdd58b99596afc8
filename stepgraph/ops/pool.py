"""Pool family: max pooling (a ReLU after it fused) and average pooling (PyTorch's
avg_pool2d, ceil_mode=False). Both take attrs layout "NHWC" (channels-last, compile/layout.py):
the same windows over x stored (N, H, W, C).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..ir.graph import Node
from ..ir.ops import _need, defop, impl, vjp
from .activation import act_derivative, act_forward
from .conv import conv_out
from .layout import channels_last_capable, layout_attrs, layout_of, nchw_shape, stored_shape


def pool_geometry(op: str, shape, attrs) -> tuple[int, int]:
    """(Ho, Wo) of a pooling window sweep over an (N, C, H, W) input, checking the attrs
    kernel, stride and padding (default (0, 0); at most half the kernel)."""
    _need(len(shape) == 4, op, f"input must be (N, C, H, W), got {tuple(shape)}")
    (kh, kw), (sh, sw) = attrs["kernel"], attrs["stride"]
    ph, pw = attrs.get("padding", (0, 0))
    _need(2 * ph <= kh and 2 * pw <= kw, op,
          f"padding {(ph, pw)} must be at most half the kernel {(kh, kw)}")
    ho, wo = conv_out(shape[2], kh, sh, ph), conv_out(shape[3], kw, sw, pw)
    _need(ho > 0 and wo > 0, op, f"window {(kh, kw)} larger than padded input {shape[2:]}")
    return ho, wo


# ---- max pooling ---------------------------------------------------------------------------

@defop("maxpool2d")
def _maxpool2d(ins, attrs):
    """y = max over kernel windows (attrs kernel, stride, padding pairs; padding default
    (0, 0), implicit -inf padding of at most half the kernel, floor mode); idx (int32) =
    h*W + w of the first maximum (row-major window order) in each window, within its (n, c)
    plane: always a real element. With attrs relu, y = relu(max) (the ReLU that followed the
    pool, fused). attrs layout "NHWC": x, y and idx stored (N, H, W, C) (idx still h*W + w)."""
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
    return [emit("maxpool2d_grad", [dy[0], node.outputs[1]], input_shape=node.inputs[0].shape,
                 kernel=node.attrs["kernel"], stride=node.attrs["stride"],
                 padding=tuple(node.attrs.get("padding", (0, 0))), **layout_attrs(node))[0]]


def _windows(xp: np.ndarray, kh: int, kw: int, sh: int, sw: int) -> np.ndarray:
    """(N, C, Ho, Wo, kh, kw) strided view of the windows of a padded NCHW array."""
    return sliding_window_view(xp, (kh, kw), axis=(2, 3))[:, :, ::sh, ::sw]


@impl("maxpool2d")
@channels_last_capable
def maxpool2d(node: Node, ins, outs, ctx):
    x = ins[0]
    (kh, kw), (sh, sw) = node.attrs["kernel"], node.attrs["stride"]
    ph, pw = node.attrs.get("padding", (0, 0))
    # -inf padding is never a window's maximum: at most half a window is padding
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf) \
        if ph or pw else x
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
