"""Pool family: average pooling (PyTorch's avg_pool2d, ceil_mode=False). Max pooling lives in
ir/ops.py with the older ops. Both take attrs layout "NHWC" (channels-last, compile/layout.py):
the same windows over x stored (N, H, W, C).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..autodiff.rules import layout_attrs, vjp
from ..backends.numpy.kernels import channels_last_capable, impl
from ..ir.ops import _need, conv_out, defop, layout_of, nchw_shape, pool_geometry, stored_shape


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
