"""Chains of slices, reshapes and permutes as one copy (layout_copy).

Every value of the graph is contiguous, so each slice across the leading axes and each permute
is a copy; a chain of them copies the same elements several times. The head split of
attention written by hand is one: `q, k, v = qkv(x).split(C, dim=2)` then
`q.view(B, T, H, D).transpose(1, 2)` slices (a copy) then permutes (a second copy) before a
normalisation or a rotary embedding reads q; a convolution's input gradient sliced and
permuted back is another. Whatever the chain, the value it ends in is its first input read at
some (shape, strides, offset), and one strided copy (layout_copy) writes it.

Each chain value gets the view of its root it is (a strided view: shape, strides, offset in
elements over the root's contiguous buffer; a reshape keeps it only where it is a view, as
NumPy's no-copy reshape decides, else the chain ends before it). A chain node whose output is
read as a contiguous value (by another op, a graph output, or a reshape that ends the chain)
and which took two or more copies from its root becomes one layout_copy of the root; the
nodes only it read go with dead-code elimination. A chain of one
copy is left alone (a permute keeps its tiled transpose kernel; a slice of a contiguous range
stays a view, compile/aliases.py).

Left alone: roots some node writes in place (the copy now reads the root where the chain's
last node stood, which must see the values its first node saw) and dtypes the strided copy
kernels lack (the float dtypes only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..ir.graph import Graph, Value
from ..ops.shape import _slice_bounds, slice_length
from .rewrite import _copy

LAYOUT_OPS = ("reshape", "permute", "slice")
COPY_DTYPES = ("float32", "bfloat16", "float16")
MIN_COPIES = 2


@dataclass(frozen=True)
class _View:
    """A value as its root read at (shape, strides, offset), and the copies the chain made."""
    root: Value
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    copies: int


def _contiguous(shape) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))


def _reshaped(view: _View, shape: tuple) -> _View | None:
    """The view reshaped without a copy, or None where NumPy's reshape would copy."""
    probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), view.shape, view.strides)
    try:
        probe = probe.view()
        probe.shape = shape            # raises where the reshape needs a copy
    except AttributeError:
        return None
    return _View(view.root, tuple(shape), tuple(probe.strides), view.offset, view.copies)


def _step(node, view: _View) -> _View | None:
    """The view of node's output given its input's."""
    if node.op == "reshape":
        return _reshaped(view, tuple(node.attrs["shape"]))
    if node.op == "permute":
        dims = tuple(node.attrs["dims"])
        moved = dims != tuple(range(len(dims)))
        return _View(view.root, tuple(view.shape[d] for d in dims),
                     tuple(view.strides[d] for d in dims), view.offset, view.copies + moved)
    dim, start, stop, step = _slice_bounds("slice", view.shape, node.attrs)
    shape = list(view.shape)
    shape[dim] = slice_length(start, stop, step)
    strides = list(view.strides)
    strides[dim] *= step
    in_place = step == 1 and math.prod(view.shape[:dim]) == 1     # a view (aliases.py)
    return _View(view.root, tuple(shape), tuple(strides), view.offset + start * view.strides[dim],
                 view.copies + (not in_place))


def collapse_layout_chains(graph: Graph) -> Graph:
    graph = _copy(graph)
    chain = [n for n in graph.nodes if n.op in LAYOUT_OPS]
    views: dict[Value, _View | None] = {}
    for n in chain:
        x = n.inputs[0]
        base = views.get(x) or _View(x, tuple(x.shape), _contiguous(x.shape), 0, 0)
        views[n.outputs[0]] = _step(n, base)
    users = graph.consumers()
    outputs = set(graph.outputs.values())
    written = {n.inputs[i] for n in graph.nodes for i in n.mutates}

    def materialised(y: Value) -> bool:
        """Read as a contiguous value: by a graph output, a node of another op, or a layout
        node that cannot go on from its view (a reshape that would need a copy)."""
        return y in outputs or any(u.op not in LAYOUT_OPS or views[u.outputs[0]] is None
                                   for u in users.get(y, []))

    for n in chain:
        view = views[n.outputs[0]]
        if view is not None and view.copies >= MIN_COPIES and materialised(n.outputs[0]) \
                and view.root not in written and view.root.dtype in COPY_DTYPES:
            n.op, n.inputs = "layout_copy", [view.root]
            n.attrs = {"shape": view.shape, "strides": view.strides, "offset": view.offset}
    return graph
