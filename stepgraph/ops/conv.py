"""Conv family: conv2d and conv3d (stride, padding, dilation, groups; PyTorch's
cross-correlation) and their input and weight gradients. conv2d runs NCHW or channels-last
(ops/layout.py); conv3d NCDHW only. The NumPy references are written once over any number
of spatial dims (windows as strided views, one einsum per op)."""
from __future__ import annotations

import itertools

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..ir.graph import Node
from ..ir.ops import Emit, _need, defop, impl, vjp
from .layout import (channel_sum_axes, channels_last_capable, layout_attrs, layout_of,
                     nchw_shape, stored_shape)

# The einsum letters of the spatial axes: output positions and kernel taps, by spatial rank
# (n, g, c, o name batch, group, channel in group, output channel).
_OUT, _TAP = "DHW", "ijk"


def conv_out(size: int, k: int, stride: int, pad: int, dilation: int = 1) -> int:
    return (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1


def conv_geometry(attrs, dims: int = 2) -> tuple[tuple[int, ...], tuple[int, ...],
                                                 tuple[int, ...], int]:
    """(stride, padding, dilation, groups) of a conv node over `dims` spatial axes; nodes
    made before dilation and groups existed mean dilation 1 and groups 1."""
    return (tuple(attrs["stride"]), tuple(attrs["padding"]),
            tuple(attrs.get("dilation", (1,) * dims)), int(attrs.get("groups", 1)))


def _conv_shape(op: str, xs, ws, attrs) -> tuple[int, ...]:
    """The output (N, O, *spatial) of a convolution of an (N, C, *spatial) x with an
    (O, C/groups, *kernel) weight (NCHW-ordered shapes), the attrs checked."""
    dims = len(xs) - 2
    stride, padding, dilation, groups = conv_geometry(attrs, dims)
    _need(len(stride) == len(padding) == len(dilation) == dims, op,
          f"stride {stride}, padding {padding}, dilation {dilation} must have {dims} entries")
    _need(groups >= 1 and xs[1] % groups == 0 and ws[0] % groups == 0, op,
          f"groups={groups} must divide input channels {xs[1]} and output channels {ws[0]}")
    _need(xs[1] == ws[1] * groups, op,
          f"input has {xs[1]} channels, weight expects {ws[1]} x {groups} groups")
    out = tuple(conv_out(*a) for a in zip(xs[2:], ws[2:], stride, padding, dilation))
    _need(min(out) > 0, op, f"kernel {tuple(ws[2:])} (dilation {dilation}) larger than padded "
          f"input {tuple(xs[2:])}")
    return (xs[0], ws[0], *out)


@defop("conv2d")
def _conv2d(ins, attrs):
    """y = cross-correlation of x (N,C,H,W) with w (O,C/groups,kh,kw) + b (O,); attrs stride,
    padding, dilation (pairs; dilation default (1, 1)), groups (default 1; output channels
    of group g read only input channels of group g, both split in equal groups), zero
    padding; y (N,O,Ho,Wo), Ho = (H + 2 ph - dh (kh - 1) - 1) // sh + 1 (PyTorch's).
    attrs layout "NHWC" (default "NCHW"): x (N,H,W,C), w (O,kh,kw,C/groups), y (N,Ho,Wo,O),
    the same numbers stored channels-last. attrs act "relu" (default none): y = max(y, 0),
    the ReLU that read the convolution alone, fused (compile/fuse.py fuse_conv_relu); no VJP
    needed, fusion runs after autodiff."""
    _need(attrs.get("act") in (None, "none", "relu"), "conv2d",
          f"fused activation must be 'relu', got {attrs.get('act')!r}")
    layout = layout_of("conv2d", attrs)
    _need(len(ins[0].shape) == 4, "conv2d",
          f"input must be ({'N, H, W, C' if layout == 'NHWC' else 'N, C, H, W'}), got "
          f"{ins[0].shape}")
    _need(len(ins[1].shape) == 4, "conv2d", f"weight must be 4-D, got {ins[1].shape}")
    xs, ws = nchw_shape(ins[0].shape, layout), nchw_shape(ins[1].shape, layout)
    return [(stored_shape(_conv_shape("conv2d", xs, ws, attrs), layout), ins[0].dtype)]


@defop("conv3d")
def _conv3d(ins, attrs):
    """y = cross-correlation of x (N,C,D,H,W) with w (O,C/groups,kd,kh,kw) + b (O,), as
    conv2d with a depth axis: attrs stride, padding, dilation (triples), groups; zero
    padding; y (N,O,Do,Ho,Wo), each size as conv2d's. NCDHW only (no layout attr)."""
    _need(attrs.get("layout", "NCHW") == "NCHW", "conv3d", "only the NCDHW layout")
    _need(len(ins[0].shape) == 5, "conv3d", f"input must be (N, C, D, H, W), got {ins[0].shape}")
    _need(len(ins[1].shape) == 5, "conv3d", f"weight must be 5-D, got {ins[1].shape}")
    _need(len(ins) == 2 or ins[2].shape == (ins[1].shape[0],), "conv3d",
          f"bias must be ({ins[1].shape[0]},), got {ins[-1].shape}")
    return [(_conv_shape("conv3d", ins[0].shape, ins[1].shape, attrs), ins[0].dtype)]


@defop("conv2d_grad_input")
def _conv2d_grad_input(ins, attrs):
    """dx (attrs input_shape) of conv2d given dy and w; attrs as conv2d's (with layout "NHWC",
    input_shape, dy and w are stored channels-last)."""
    layout_of("conv2d_grad_input", attrs)
    return [(tuple(attrs["input_shape"]), ins[0].dtype)]


@defop("conv3d_grad_input")
def _conv3d_grad_input(ins, attrs):
    """dx (attrs input_shape) of conv3d given dy and w; attrs as conv3d's."""
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


@defop("conv3d_grad_weight")
def _conv3d_grad_weight(ins, attrs):
    """dw (attrs weight_shape) of conv3d given dy and x (attrs as conv3d's); the bias's
    gradient is a reduce_sum of dy (no fused form)."""
    _need(not attrs.get("bias"), "conv3d_grad_weight", "no fused bias gradient")
    return [(tuple(attrs["weight_shape"]), ins[0].dtype)]


def _conv_vjp(emit: Emit, node: Node, dy: list, wants) -> list:
    """conv2d's and conv3d's VJP: <op>_grad_input, <op>_grad_weight, and the bias's
    gradient, dy summed over every axis but the channels."""
    (g,), (x, w) = dy, node.inputs[:2]
    stride, padding, dilation, groups = conv_geometry(node.attrs, len(x.shape) - 2)
    geometry = dict(stride=stride, padding=padding, dilation=dilation, groups=groups,
                    **layout_attrs(node))
    dx = dw = None
    if wants(0):
        dx = emit(f"{node.op}_grad_input", [g, w], input_shape=x.shape, **geometry)[0]
    if wants(1):
        dw = emit(f"{node.op}_grad_weight", [g, x], weight_shape=w.shape, **geometry)[0]
    grads = [dx, dw]
    if len(node.inputs) == 3:
        axes = channel_sum_axes(layout_of(node.op, node.attrs)) if node.op == "conv2d" \
            else (0,) + tuple(range(2, len(x.shape)))
        grads.append(emit("reduce_sum", [g], axes=axes)[0] if wants(2) else None)
    return grads


vjp("conv2d")(_conv_vjp)
vjp("conv3d")(_conv_vjp)


@vjp("conv2d_grad_input")
def _conv_grad_input_vjp(emit: Emit, node: Node, dz: list, wants) -> list:
    """conv_transpose2d runs as conv2d_grad_input(x, w) (nn/functional.py), linear in each
    operand: x's gradient is the conv2d of dz with w (same geometry), w's the conv2d weight
    gradient with x in dy's place and dz in the input's."""
    (g,), (x, w) = dz, node.inputs
    geometry = {k: node.attrs[k] for k in ("stride", "padding", "dilation", "groups")
                if k in node.attrs} | layout_attrs(node)
    dx = emit("conv2d", [g, w], **geometry)[0] if wants(0) else None
    dw = emit("conv2d_grad_weight", [x, g], weight_shape=w.shape, **geometry)[0] \
        if wants(1) else None
    return [dx, dw]


def _pad(x: np.ndarray, padding) -> np.ndarray:
    """x (N, C, *spatial) zero-padded by padding[i] on both sides of spatial axis i."""
    if not any(padding):
        return x
    return np.pad(x, ((0, 0), (0, 0)) + tuple((p, p) for p in padding))


def _conv_windows(x: np.ndarray, kernel, attrs) -> np.ndarray:
    """(N, groups, C/groups, *out, *kernel) strided view of a conv's (dilated) windows."""
    dims = len(kernel)
    stride, padding, dilation, groups = conv_geometry(attrs, dims)
    span = tuple(d * (k - 1) + 1 for d, k in zip(dilation, kernel))
    win = sliding_window_view(_pad(x, padding), span, axis=tuple(range(2, 2 + dims)))
    win = win[(slice(None),) * 2 + tuple(slice(None, None, s) for s in stride)
              + tuple(slice(None, None, d) for d in dilation)]
    return win.reshape(x.shape[0], groups, x.shape[1] // groups, *win.shape[2:])


def _split_groups(a: np.ndarray, groups: int, axis: int) -> np.ndarray:
    """A view with `axis` (channels) split into (groups, channels per group)."""
    return a.reshape(*a.shape[:axis], groups, a.shape[axis] // groups, *a.shape[axis + 1:])


def _letters(dims: int) -> tuple[str, str]:
    """(output positions, kernel taps): the einsum letters of `dims` spatial axes."""
    return _OUT[-dims:], _TAP[:dims]


def _forward(node: Node, ins, outs, ctx):
    x, w = ins[0], ins[1]
    dims = x.ndim - 2
    groups = conv_geometry(node.attrs, dims)[3]
    out, tap = _letters(dims)
    win = _conv_windows(x, w.shape[2:], node.attrs)
    y = np.einsum(f"ngc{out}{tap},goc{tap}->ngo{out}", win, _split_groups(w, groups, 0),
                  optimize=True).reshape(outs[0].shape)
    if len(ins) == 3:
        y += ins[2].reshape((1, -1) + (1,) * dims)
    if node.attrs.get("act") == "relu":
        np.maximum(y, 0, out=y)
    outs[0][...] = y


def _grad_weight(node: Node, ins, outs, ctx):
    dy, x = ins
    dims = x.ndim - 2
    groups = conv_geometry(node.attrs, dims)[3]
    out, tap = _letters(dims)
    win = _conv_windows(x, tuple(node.attrs["weight_shape"][2:]), node.attrs)
    dw = np.einsum(f"ngc{out}{tap},ngo{out}->goc{tap}", win, _split_groups(dy, groups, 1),
                   optimize=True)
    outs[0][...] = dw.reshape(outs[0].shape)
    if node.attrs.get("bias"):
        outs[1][...] = dy.sum(axis=(0,) + tuple(range(2, dy.ndim)))


def _grad_input(node: Node, ins, outs, ctx):
    dy, w = ins
    dims = dy.ndim - 2
    stride, padding, dilation, groups = conv_geometry(node.attrs, dims)
    n, c, *size = node.attrs["input_shape"]
    kernel, out_size = w.shape[2:], dy.shape[2:]
    out, tap = _letters(dims)
    dxp = np.zeros((n, c, *(s + 2 * p for s, p in zip(size, padding))), dtype=dy.dtype)
    # Scatter each kernel tap's contribution: one strided add per tap, no loop over pixels.
    contrib = np.einsum(f"ngo{out},goc{tap}->ngc{tap}{out}", _split_groups(dy, groups, 1),
                        _split_groups(w, groups, 0), optimize=True
                        ).reshape(n, c, *kernel, *out_size)
    for taps in itertools.product(*map(range, kernel)):
        at = tuple(slice(t * d, t * d + s * o, s)
                   for t, d, s, o in zip(taps, dilation, stride, out_size))
        dxp[(slice(None),) * 2 + at] += contrib[(slice(None),) * 2 + taps]
    outs[0][...] = dxp[(slice(None),) * 2 + tuple(slice(p, p + s) for p, s in zip(padding, size))]


conv2d = impl("conv2d")(channels_last_capable(_forward))
conv2d_grad_weight = impl("conv2d_grad_weight")(channels_last_capable(_grad_weight))
conv2d_grad_input = impl("conv2d_grad_input")(channels_last_capable(_grad_input))
conv3d = impl("conv3d")(_forward)
conv3d_grad_weight = impl("conv3d_grad_weight")(_grad_weight)
conv3d_grad_input = impl("conv3d_grad_input")(_grad_input)
