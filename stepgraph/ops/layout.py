"""Memory layouts of the image ops' 4-D tensors (attrs "layout", default "NCHW"), shared by the
conv, pool and norm families: "NHWC" is channels-last, x (N, H, W, C), and a conv weight
(O, kh, kw, C/groups). compile/layout.py rewrites a graph's image ops to NHWC; shapes stay
row-major, whatever the layout. The NumPy references run NHWC nodes on transposed views
(`channels_last_capable`); the VJPs hand the layout on to the gradients (`layout_attrs`).
"""
from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np

from ..ir.graph import Node
from ..ir.ops import _need

LAYOUTS = ("NCHW", "NHWC")
TO_NHWC, TO_NCHW = (0, 2, 3, 1), (0, 3, 1, 2)     # permute dims between the two
SHAPE_ATTRS = ("input_shape", "weight_shape")   # image ops' attrs holding stored shapes


def layout_of(op: str, attrs) -> str:
    """A node's layout attr ("NCHW" when absent), checked."""
    layout = attrs.get("layout", "NCHW")
    _need(layout in LAYOUTS, op, f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def nchw_shape(shape, layout: str) -> tuple[int, ...]:
    """The (N, C, H, W) shape of a 4-D array stored in `layout` ((O, C, kh, kw) of an
    (O, kh, kw, C) weight); other ranks as they are."""
    shape = tuple(shape)
    return tuple(shape[d] for d in TO_NCHW) if layout == "NHWC" and len(shape) == 4 else shape


def stored_shape(shape, layout: str) -> tuple[int, ...]:
    """The inverse of nchw_shape: the shape an (N, C, H, W) array has in `layout`."""
    shape = tuple(shape)
    return tuple(shape[d] for d in TO_NHWC) if layout == "NHWC" and len(shape) == 4 else shape


def nchw_attrs(attrs) -> dict:
    """A channels-last image node's attrs for its NCHW twin: the layout dropped and the
    stored-shape attrs (SHAPE_ATTRS) in NCHW order."""
    return {k: nchw_shape(v, "NHWC") if k in SHAPE_ATTRS else v
            for k, v in attrs.items() if k != "layout"}


def channel_sum_axes(layout: str) -> tuple[int, int, int]:
    """The axes of a 4-D image gradient that a per-channel bias gradient sums: every axis but
    the channels' ((N, H, W) of either layout)."""
    return (0, 1, 2) if layout == "NHWC" else (0, 2, 3)


def layout_attrs(node: Node) -> dict:
    """{"layout": "NHWC"} for a channels-last image op (its gradients run channels-last too),
    else {} (NCHW nodes stay as they were before layouts existed)."""
    layout = layout_of(node.op, node.attrs)
    return {} if layout == "NCHW" else {"layout": layout}


def channels_last_capable(reference):
    """`reference`, an NCHW image op's NumPy reference, also running nodes with attrs layout
    "NHWC": every array of rank >= 3 is viewed with its last axis (channels) moved to axis 1,
    as are the shape attrs; the NCHW reference then reads and writes through those views."""
    @functools.wraps(reference)
    def run(node: Node, ins, outs, ctx):
        if node.attrs.get("layout", "NCHW") == "NCHW":
            return reference(node, ins, outs, ctx)
        view = lambda a: np.moveaxis(a, -1, 1) if a.ndim >= 3 else a     # noqa: E731
        return reference(replace(node, attrs=nchw_attrs(node.attrs)), [view(a) for a in ins],
                         [view(a) for a in outs], ctx)
    return run
