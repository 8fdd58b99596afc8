"""Chains of slices, reshapes and permutes as one copy (layout_copy, layout_concat).

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
nodes only it read go with dead-code elimination. A chain of one copy is left alone (a
permute keeps its tiled transpose kernel; a slice of a contiguous range stays a view,
compile/aliases.py), except where a concat reads it: a concat of which one input or more is
a chain that copied becomes a layout_concat of their roots, each read through its view
straight into its range of the output (the gradients of q, k and v permuted back and joined
for the packed projection's backward).

Two chains copy nothing at all, or once where they copied twice:
- a chain whose view is its root's whole buffer in another shape (permutes that cancel, as
  channels-last's conversion back to NCHW followed by the user's transpose to (B, T, C))
  becomes a reshape of the root: a view;
- a layout_concat read by nothing but a chain that ends in a copy of the whole of it in
  another axis order (a padded (B, C, T + 2) converted to channels-last for a convolution)
  is written in that order: the copy's node becomes the layout_concat, each part's view
  carried through the chain's axes.

Left alone: roots some node writes in place (the copy now reads the root where the chain's
last node stood, which must see the values its first node saw) and dtypes the strided copy
kernels lack (the float dtypes only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..ir.graph import Graph, Node, Value
from ..ops.shape import _slice_bounds, contiguous_strides, matched_axes, slice_length
from .aliases import view_roots, written_buffers
from .rewrite import _copy, sole_chain

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


def _reshaped(view: _View, shape: tuple) -> _View | None:
    """The view reshaped without a copy, or None where NumPy's reshape would copy."""
    probe = np.lib.stride_tricks.as_strided(np.zeros(1, np.int8), view.shape, view.strides)
    try:        # raises where the reshape would copy (NumPy >= 2.1; setting the shape before)
        probe = np.reshape(probe, shape, copy=False)
    except TypeError:
        probe = probe.view()
        try:
            probe.shape = shape
        except AttributeError:
            return None
    except ValueError:
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


def chain_views(nodes: list[Node]) -> dict[Value, _View | None]:
    """The view of its root each layout node's output is (None where a reshape would copy);
    a layout_copy's output is its attrs view of its input, one copy."""
    views: dict[Value, _View | None] = {}
    for n in nodes:
        if n.op == "layout_copy":
            a = n.attrs
            views[n.outputs[0]] = _View(n.inputs[0], tuple(a["shape"]), tuple(a["strides"]),
                                        int(a["offset"]), 1)
        elif n.op in LAYOUT_OPS:
            x = n.inputs[0]
            base = views.get(x) or _View(x, tuple(x.shape), contiguous_strides(x.shape), 0, 0)
            views[n.outputs[0]] = _step(n, base)
    return views


def view_reads(graph: Graph, fits: Callable[[_View, Value], bool],
               reads: Callable[[Node, Value], bool]):
    """(views, readable): chain_views of the graph, and whether a value may be read through
    its view in place of its copy by nodes that can (compile/pointwise_views.py,
    attention_views.py): the chain copied, the value is no graph output, the view `fits`
    those nodes, its root has the value's dtype and nothing writes the root in place (a reader
    reads the root where it stands, later than the copy did), and every reader `reads` it
    through a view."""
    views = chain_views(graph.nodes)
    users = graph.consumers()
    outputs = set(graph.outputs.values())
    roots = view_roots(graph.nodes)
    written = written_buffers(graph.nodes, roots)

    def readable(v: Value) -> bool:
        view = views.get(v)
        return view is not None and view.copies > 0 and v not in outputs and fits(view, v) \
            and view.root.dtype == v.dtype and roots.get(view.root, view.root) not in written \
            and all(reads(u, v) for u in users.get(v, []))
    return views, readable


def collapse_layout_chains(graph: Graph) -> Graph:
    graph = _copy(graph)
    chain = [n for n in graph.nodes if n.op in LAYOUT_OPS]
    views = chain_views(chain)
    users = graph.consumers()
    outputs = set(graph.outputs.values())
    roots = view_roots(graph.nodes)
    written = written_buffers(graph.nodes, roots)

    def materialised(y: Value) -> bool:
        """Read as a contiguous value: by a graph output, a node of another op, or a layout
        node that cannot go on from its view (a reshape that would need a copy)."""
        return y in outputs or any(u.op not in LAYOUT_OPS or views[u.outputs[0]] is None
                                   for u in users.get(y, []))

    def usable(view: _View | None, copies: int) -> bool:
        return view is not None and view.copies >= copies and \
            roots.get(view.root, view.root) not in written and view.root.dtype in COPY_DTYPES

    for n in chain:
        view = views[n.outputs[0]]
        if usable(view, MIN_COPIES) and materialised(n.outputs[0]):
            if _whole(view):          # permutes that cancel: the root's own bytes
                n.op, n.inputs, n.attrs = "reshape", [view.root], {"shape": view.shape}
            else:
                n.op, n.inputs = "layout_copy", [view.root]
                n.attrs = {"shape": view.shape, "strides": view.strides, "offset": view.offset}
    producers = graph.producers()
    nodes = []
    for n in graph.nodes:
        nodes.append(n)
        if n.op == "concat":
            nodes += _concat_of_views(n, views, producers, usable)
    graph.nodes = nodes
    return _permuted_concats(graph, usable)


def _whole(view: _View) -> bool:
    """Whether the view is its root's contiguous buffer in another shape (strides of extent-1
    axes do not matter)."""
    kept = [(e, s) for e, s in zip(view.shape, view.strides) if e != 1]
    shape = tuple(e for e, _ in kept)
    return view.offset == 0 and math.prod(shape) == view.root.size and \
        tuple(s for _, s in kept) == contiguous_strides(shape)


def _permuted_concats(graph: Graph, usable) -> Graph:
    """A layout_concat read by nothing but a chain of reshapes and permutes that ends in a
    copy of all of it (a permute, or a layout_copy of the whole) writes that copy's layout
    itself: the copy's node becomes the layout_concat, its parts' views carried through the
    chain (a causal convolution's padded input concatenated and then converted to
    channels-last is one copy)."""
    users = graph.consumers()
    views = chain_views([n for n in graph.nodes if n.op in LAYOUT_OPS + ("layout_copy",)])
    for joined in [n for n in graph.nodes if n.op == "layout_concat"]:
        chain, _ = sole_chain(graph, users, joined.outputs[0],
                              ("reshape", "permute", "layout_copy"))
        if all(n.op == "reshape" for n in chain):       # none, or views only: nothing to fold
            continue
        end = chain[-1]
        view = views.get(end.outputs[0])
        dim = int(joined.attrs["dim"])
        parts = [_View(x, *v, 0) for x, v in zip(joined.inputs, joined.attrs["views"])]
        carried = _carried(view, joined.outputs[0].shape, dim, parts) if view else None
        if carried is None or not all(usable(p, 0) for p in parts):
            continue
        end_dim, part_views = carried
        end.op, end.inputs = "layout_concat", list(joined.inputs)
        end.attrs = {"dim": end_dim, "views": part_views}
    return graph


def _carried(view: _View, shape: tuple, dim: int, parts: list[_View]):
    """(end_dim, views): where the concat's axis `dim` lands in `view` (a view of the whole
    concat output of `shape`, its axes only permuted, with extent-1 axes added or dropped) and
    each part's view carried there; None where the view slices, merges or splits axes."""
    if view.offset or math.prod(view.shape) != math.prod(shape):
        return None
    axis_of = matched_axes(view.shape, view.strides, shape)     # view axis -> output axis
    if axis_of is None or dim not in axis_of.values():
        return None
    end_dim = next(j for j, i in axis_of.items() if i == dim)
    carried = []
    for p in parts:
        extents = tuple(p.shape[axis_of[j]] if j in axis_of else 1 for j in range(len(view.shape)))
        steps = tuple(p.strides[axis_of[j]] if j in axis_of else 0 for j in range(len(view.shape)))
        carried.append((extents, steps, p.offset))
    return end_dim, tuple(carried)


def _concat_of_views(n: Node, views: dict, producers: dict, usable) -> list[Node]:
    """Turn concat node n into a layout_concat where one of its inputs or more is a chain that
    copied; the nodes to place after it (the reshape back from a lifted shape), or none.

    An input whose chain ends in a reshape that is no view (the heads merged back, (B, H, T,
    D) permuted to (B, T, H, D) then viewed as (B, T, H * D)) is read at the shape before that
    reshape: the concat then runs at that rank (along the same dim, its size split the same
    way for every input) and a reshape gives the concat's own shape."""
    dim = int(n.attrs["dim"]) % len(n.outputs[0].shape)

    def plain(x: Value) -> _View:
        return _View(x, tuple(x.shape), contiguous_strides(x.shape), 0, 0)

    def before_reshape(x: Value) -> _View | None:
        p = producers.get(x)
        if p is None or p.op != "reshape" or not usable(views.get(p.inputs[0]), 1):
            return None
        return views[p.inputs[0]]

    parts = [views[x] if usable(views.get(x), 1) else plain(x) for x in n.inputs]
    if not any(p.copies for p in parts):
        lifted = [before_reshape(x) for x in n.inputs]
        first = next((v for v in lifted if v is not None), None)
        if first is None or first.shape[:dim] != n.outputs[0].shape[:dim]:
            return []
        tail = first.shape[dim + 1:]
        parts = []
        for x, v in zip(n.inputs, lifted):
            want = x.shape[:dim] + (x.shape[dim] // max(math.prod(tail), 1),) + tail
            if v is None or v.shape != want:
                v = _reshaped(plain(x), want) if x.shape[dim] % max(math.prod(tail), 1) == 0 \
                    else None
            if v is None:
                return []
            parts.append(v)
    if not all(p.root.dtype in COPY_DTYPES for p in parts):
        return []
    out = n.outputs[0]
    shape = parts[0].shape[:dim] + (sum(p.shape[dim] for p in parts),) + parts[0].shape[dim + 1:]
    joined = out if shape == out.shape else Value(shape, out.dtype)
    n.op, n.inputs, n.outputs = "layout_concat", [p.root for p in parts], [joined]
    n.attrs = {"dim": dim, "views": tuple((p.shape, p.strides, p.offset) for p in parts)}
    if joined is out:
        return []
    return [Node("reshape", [joined], [out], {"shape": tuple(out.shape)}, label=n.label)]
