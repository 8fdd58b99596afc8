"""Conv family: conv2d (stride, padding, dilation, groups; PyTorch's cross-correlation) and
its input and weight gradients, NCHW or channels-last (ops/layout.py)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..ir.graph import Node
from ..ir.ops import Emit, _need, defop, impl, vjp
from .layout import (channel_sum_axes, channels_last_capable, layout_attrs, layout_of,
                     nchw_shape, stored_shape)


def conv_out(size: int, k: int, stride: int, pad: int, dilation: int = 1) -> int:
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


def conv_geometry(attrs) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], int]:
    """(stride, padding, dilation, groups) of a conv node; nodes made before dilation and
    groups existed mean (1, 1) and 1."""
    return (tuple(attrs["stride"]), tuple(attrs["padding"]),
            tuple(attrs.get("dilation", (1, 1))), int(attrs.get("groups", 1)))


@defop("conv2d")
def _conv2d(ins, attrs):
    """y = cross-correlation of x (N,C,H,W) with w (O,C/groups,kh,kw) + b (O,); attrs stride,
    padding, dilation (pairs; dilation default (1, 1)), groups (default 1; output channels
    of group g read only input channels of group g, both split in equal groups), zero
    padding; y (N,O,Ho,Wo), Ho = (H + 2 ph - dh (kh - 1) - 1) // sh + 1 (PyTorch's).
    attrs layout "NHWC" (default "NCHW"): x (N,H,W,C), w (O,kh,kw,C/groups), y (N,Ho,Wo,O),
    the same numbers stored channels-last."""
    layout = layout_of("conv2d", attrs)
    _need(len(ins[0].shape) == 4, "conv2d",
          f"input must be ({'N, H, W, C' if layout == 'NHWC' else 'N, C, H, W'}), got "
          f"{ins[0].shape}")
    _need(len(ins[1].shape) == 4, "conv2d", f"weight must be 4-D, got {ins[1].shape}")
    xs, ws = nchw_shape(ins[0].shape, layout), nchw_shape(ins[1].shape, layout)
    (sh, sw), (ph, pw), (dh, dw), groups = conv_geometry(attrs)
    _need(groups >= 1 and xs[1] % groups == 0 and ws[0] % groups == 0, "conv2d",
          f"groups={groups} must divide input channels {xs[1]} and output channels {ws[0]}")
    _need(xs[1] == ws[1] * groups, "conv2d",
          f"input has {xs[1]} channels, weight expects {ws[1]} x {groups} groups")
    ho = conv_out(xs[2], ws[2], sh, ph, dh)
    wo = conv_out(xs[3], ws[3], sw, pw, dw)
    _need(ho > 0 and wo > 0, "conv2d",
          f"kernel {ws[2:]} (dilation {(dh, dw)}) larger than padded input {xs[2:]}")
    return [(stored_shape((xs[0], ws[0], ho, wo), layout), ins[0].dtype)]


@defop("conv2d_grad_input")
def _conv2d_grad_input(ins, attrs):
    """dx (attrs input_shape) of conv2d given dy and w; attrs as conv2d's (with layout "NHWC",
    input_shape, dy and w are stored channels-last)."""
    layout_of("conv2d_grad_input", attrs)
    return [(tuple(attrs["input_shape"]), ins[0].dtype)]


@defop("conv2d_grad_weight")
def _conv2d_grad_weight(ins, attrs):
    """dw (attrs weight_shape) of conv2d given dy and x (attrs as conv2d's; with layout
    "NHWC" dy, x and weight_shape (O, kh, kw, C/groups) are stored channels-last); with attrs
    bias (the conv bias's gradient, fused), also db (O,) = dy summed over (N, Ho, Wo)."""
    o = attrs["weight_shape"][0]
    layout_of("conv2d_grad_weight", attrs)
    return [(tuple(attrs["weight_shape"]), ins[0].dtype)] + (
        [((o,), ins[0].dtype)] if attrs.get("bias") else [])


@vjp("conv2d")
def _conv2d_vjp(emit: Emit, node: Node, dy: list, wants) -> list:
    (g,), (x, w) = dy, node.inputs[:2]
    stride, padding, dilation, groups = conv_geometry(node.attrs)
    geometry = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                    **layout_attrs(node))
    dx = dw = None
    if wants(0):
        dx = emit("conv2d_grad_input", [g, w], input_shape=x.shape, **geometry)[0]
    if wants(1):
        dw = emit("conv2d_grad_weight", [g, x], weight_shape=w.shape, **geometry)[0]
    grads = [dx, dw]
    if len(node.inputs) == 3:
        axes = channel_sum_axes(layout_of(node.op, node.attrs))
        grads.append(emit("reduce_sum", [g], axes=axes)[0] if wants(2) else None)
    return grads


def _pad(x: np.ndarray, ph: int, pw: int) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))) if ph or pw else x


def _conv_windows(x: np.ndarray, kh: int, kw: int, attrs) -> np.ndarray:
    """(N, groups, C/groups, Ho, Wo, kh, kw) strided view of a conv's (dilated) windows."""
    (sh, sw), (ph, pw), (dh, dw), groups = conv_geometry(attrs)
    span = (dh * (kh - 1) + 1, dw * (kw - 1) + 1)
    win = sliding_window_view(_pad(x, ph, pw), span, axis=(2, 3))[:, :, ::sh, ::sw, ::dh, ::dw]
    return win.reshape(x.shape[0], groups, x.shape[1] // groups, *win.shape[2:])


def _split_groups(a: np.ndarray, groups: int, axis: int) -> np.ndarray:
    """A view with `axis` (channels) split into (groups, channels per group)."""
    return a.reshape(*a.shape[:axis], groups, a.shape[axis] // groups, *a.shape[axis + 1:])


@impl("conv2d")
@channels_last_capable
def conv2d(node: Node, ins, outs, ctx):
    x, w = ins[0], ins[1]
    groups = conv_geometry(node.attrs)[3]
    win = _conv_windows(x, w.shape[2], w.shape[3], node.attrs)
    y = np.einsum("ngchwij,gocij->ngohw", win, _split_groups(w, groups, 0),
                  optimize=True).reshape(outs[0].shape)
    if len(ins) == 3:
        y += ins[2][None, :, None, None]
    outs[0][...] = y


@impl("conv2d_grad_weight")
@channels_last_capable
def conv2d_grad_weight(node: Node, ins, outs, ctx):
    dy, x = ins
    groups = conv_geometry(node.attrs)[3]
    _, _, kh, kw = node.attrs["weight_shape"]
    win = _conv_windows(x, kh, kw, node.attrs)
    dw = np.einsum("ngchwij,ngohw->gocij", win, _split_groups(dy, groups, 1), optimize=True)
    outs[0][...] = dw.reshape(outs[0].shape)
    if node.attrs.get("bias"):
        outs[1][...] = dy.sum(axis=(0, 2, 3))


@impl("conv2d_grad_input")
@channels_last_capable
def conv2d_grad_input(node: Node, ins, outs, ctx):
    dy, w = ins
    (sh, sw), (ph, pw), (dh, dw), groups = conv_geometry(node.attrs)
    n, c, h, wd = node.attrs["input_shape"]
    _, _, kh, kw = w.shape
    _, _, ho, wo = dy.shape
    dxp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw), dtype=dy.dtype)
    # Scatter each kernel tap's contribution: kh*kw strided adds, no Python loop over pixels.
    contrib = np.einsum("ngohw,gocij->ngcijhw", _split_groups(dy, groups, 1),
                        _split_groups(w, groups, 0), optimize=True).reshape(n, c, kh, kw, ho, wo)
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i * dh:i * dh + sh * ho:sh, j * dw:j * dw + sw * wo:sw] += contrib[:, :, i, j]
    outs[0][...] = dxp[:, :, ph:ph + h, pw:pw + wd]
