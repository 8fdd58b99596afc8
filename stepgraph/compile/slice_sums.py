"""Sums of slice gradients, taken into one concat: the backward of split, chunk and slicing.

A value cut into slices along one axis (`q, k, v = x.split(C, dim=-1)`, `torch.chunk`, a
slice of a concat's gradient) gets one gradient per slice from autodiff: slice_grad writes a
buffer of the whole value's size, zeros with the slice's gradient at its range, and `add`
nodes sum them. For k slices that is k full-size writes and k - 1 full-size adds, where the
sum is the slice gradients laid side by side: one concat along the axis, with zero blocks
(`fill`) for what no slice covers. The concat is then written in place by the slices'
producers where compile/aliases.py allows it (ranges that are contiguous in memory).

Same numbers: at every position at most one slice gradient is not a zero that slice_grad
wrote, and x + 0 = x exactly. The other terms of the sum keep their order, and the concat
takes a place among them where each position sees the adds it saw (_place; where there is
none, as for slice gradients on both sides of two other terms, the sum is left as it is).
One difference, in the sign of a zero: a gradient entry of -0.0 was +0.0 after the adds
(-0.0 + 0.0 = +0.0) and stays -0.0 in the concat, as in torch's own split backward (a cat).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.graph import Graph, Node, Value
from .gradient_sums import _leaves, _sum_nodes, _sum_roots
from .rewrite import _copy, _join, _rebuild

MIN_SLICES = 2


@dataclass(frozen=True)
class _Piece:
    """One slice gradient of a sum: its node and the range [start, stop) it covers."""
    node: Node
    start: int
    stop: int


def _piece(v: Value, producers, users, outputs: set) -> _Piece | None:
    """The slice_grad (step 1) writing v, read by the sum alone."""
    p = producers.get(v)
    if p is None or p.op != "slice_grad" or int(p.attrs.get("step") or 1) != 1:
        return None
    if len(users.get(v, [])) != 1 or v in outputs:
        return None
    dim, start = int(p.attrs["dim"]), int(p.attrs["start"])
    return _Piece(p, start, start + p.inputs[0].shape[dim])


def _disjoint(pieces: list[_Piece]) -> list[_Piece]:
    """Pieces of one axis that do not overlap, by start: the first of each overlapping run."""
    kept: list[_Piece] = []
    for p in sorted(pieces, key=lambda p: (p.start, p.stop)):
        if p.start == p.stop:
            continue
        if not kept or kept[-1].stop <= p.start:
            kept.append(p)
    return kept


def _concat(pieces: list[_Piece], out: Value, label: str) -> list[Node]:
    """fill (for the gaps) and concat nodes writing `out`, the pieces in their places."""
    dim = int(pieces[0].node.attrs["dim"])
    nodes, parts, at = [], [], 0
    for p in [*pieces, None]:
        end = out.shape[dim] if p is None else p.start
        if end > at:
            gap = Value(out.shape[:dim] + (end - at,) + out.shape[dim + 1:], out.dtype)
            nodes.append(Node("fill", [], [gap], {"value": 0.0, "shape": gap.shape,
                                                    "dtype": out.dtype}, (), label))
            parts.append(gap)
        if p is not None:
            parts.append(p.node.inputs[0])
            at = p.stop
    nodes.append(Node("concat", parts, [out], {"dim": dim}, (), label))
    return nodes


def _place(terms: list[Value], mine: set) -> int | None:
    """How many of the other terms precede the concat in the new chain of adds, so that each
    position sees the adds it saw: a slice gradient g was added after the j other terms
    before it in the chain, and ((o_1 + ... + o_j) + g) + ... is one float for every piece's
    j only when those j agree, or are all 0 or 1 (g + o_1 = o_1 + g). None: they do not."""
    js, others = set(), 0
    for v in terms:
        if v in mine:
            js.add(0 if others <= 1 else others)
        else:
            others += 1
    return min(js) if len(js) == 1 else None


def _group(terms: list[Value], producers, users, outputs: set) -> tuple[list[_Piece], int]:
    """The disjoint slice gradients (of one value's shape, axis and dtype) among `terms`
    that can become one concat without changing how the other terms are added, at least
    MIN_SLICES of them (else none), and the concat's place among the others (_place)."""
    groups: dict[tuple, list[_Piece]] = {}
    for t in terms:
        p = _piece(t, producers, users, outputs)
        if p is not None:
            groups.setdefault((t.shape, t.dtype, int(p.node.attrs["dim"])), []).append(p)
    for pieces in groups.values():
        kept = _disjoint(pieces)
        if len(kept) < MIN_SLICES:
            continue
        at = _place(terms, {p.node.outputs[0] for p in kept})
        if at is not None:
            return kept, at
    return [], 0


def concat_slice_gradients(graph: Graph) -> Graph:
    """add trees summing >= MIN_SLICES slice_grad (step 1) of one shape, axis and dtype over
    disjoint ranges, each read by the sum alone  =>  one concat of their gradients (zero
    fills between), added to the sum's other terms in their order (module docstring)."""
    graph = _copy(graph)
    producers, users = graph.producers(), graph.consumers()
    outputs = set(graph.outputs.values())
    roots = _sum_roots(graph, users, outputs)
    drop: set[Node] = set()
    replace: dict[Node, list[Node]] = {}
    for root in roots:
        tree: list[Node] = []
        terms = _leaves(root.outputs[0], producers, users, outputs, tree)
        pieces, at = _group(terms, producers, users, outputs)
        if not pieces:
            continue
        mine = {p.node.outputs[0] for p in pieces}
        rest = [v for v in terms if v not in mine]
        label = _join(root.label, *(p.node.label for p in pieces))
        total = root.outputs[0]
        out = total if not rest else Value(total.shape, total.dtype)
        new = _concat(pieces, out, label)
        if rest:
            new += _sum_nodes([*rest[:at], out, *rest[at:]], total, label)
        drop.update(tree)
        drop.update(p.node for p in pieces)
        replace[root] = new
    nodes = [m for n in graph.nodes for m in replace.get(n, [] if n in drop else [n])]
    return _rebuild(graph, nodes, {})
