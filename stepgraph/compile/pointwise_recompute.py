"""Saved elementwise values recomputed where they are read (before pointwise fusion).

An activation written out as elementwise ops (Hardswish x * clamp(x + 3, 0, 6) / 6, a
hand-written GELU) fuses into one forward kernel, but the backward reads its intermediates:
x + 3, the clamp's bounds, the clamped value. Each becomes an output of the forward kernel, a
full write, and a read in the backward, plus a comparison kernel for each mask:

    x -> [x + 3, max 0, min 6, * x, / 6] -> y          (writes y, t, m, r)
    dy, x, t, m, r -> [masks, products] -> dx          (compare kernels read t, m)

The backward already reads x, so it can compute t, m and r again from x in registers:

    x -> [x + 3, max 0, min 6, * x, / 6] -> y          (writes y)
    dy, x -> [x + 3, max 0, min 6, masks, products] -> dx

A value v is recomputed for its readers outside the group that computes it (the groups
fuse_pointwise would form) when every such reader is elementwise, v is no step output, and the
ops v depends on within its group are pure (no dropout) and at most MAX_OPS; each value those
ops read from outside the group (a source) must be read after v is made by something outside
the group anyway (the backward keeps it), be an input, parameter or state, or be small beside
v (a per-channel bias, a scalar); and nothing may write a source in place between v's making
and its first reader (a running statistic updated later in the forward). The copy runs the
same ops on the same inputs with the same dtypes, so it gives the same bits (ops/pointwise.py
rounds each bf16 instruction as a store would). Each value is copied once, before its first
reader; the later ones share it.
"""
from __future__ import annotations

from ..ir.graph import Graph, Node, Value
from .aliases import view_roots
from .pointwise import _groups
from .rewrite import _copy, _rebuild

MAX_OPS = 12                  # ops a recomputed value may take: cheap next to a memory pass
SMALL = 8                     # a source this many times smaller than v is read for free
RANDOM_OPS = ("dropout", "dropout_mask")


def recompute_saved_pointwise(graph: Graph) -> Graph:
    """`graph` with the elementwise values the module docstring describes recomputed by
    their readers instead of saved."""
    graph = _copy(graph)
    users, producers = graph.consumers(), graph.producers()
    order = {n: i for i, n in enumerate(graph.nodes)}
    group_of = {n: id(g) for g in _groups(graph, singles=True) for n in g.members}
    kept = set(graph.outputs.values())
    always = {*graph.inputs, *graph.params, *graph.state}
    roots = view_roots(graph.nodes)
    writes: dict[Value, list[int]] = {}       # a buffer's root -> where nodes write it in place
    for i, n in enumerate(graph.nodes):
        for k in n.mutates:
            writes.setdefault(roots.get(n.inputs[k], n.inputs[k]), []).append(i)
    copies: dict[Value, Value] = {}           # value -> its recomputed twin
    before: dict[Node, list[Node]] = {}       # reader -> the copies placed just before it

    def chain(v: Value) -> tuple[list[Node], list[Value]] | None:
        """The ops of v's group v depends on (in program order) and what they read from
        outside it, or None where they are too many or not pure."""
        group, ops, sources, todo = group_of[producers[v]], set(), set(), [v]
        while todo:
            w = todo.pop()
            p = producers.get(w)
            if p is None or group_of.get(p) != group:
                sources.add(w)
            elif p not in ops:
                if p.op in RANDOM_OPS or len(ops) == MAX_OPS:
                    return None
                ops.add(p)
                todo.extend(p.inputs)
        return sorted(ops, key=order.get), list(sources)

    def saved_anyway(s: Value, v: Value, start: int, first: Node) -> bool:
        """s is read later than v is made by something outside v's group (the backward
        needs it anyway), is external or no larger than a per-channel value, and nothing
        writes it between the first op v depends on (at `start`) and v's first reader."""
        p = producers[v]
        if any(start < i < order[first] for i in writes.get(roots.get(s, s), ())):
            return False
        return s in always or s.size * SMALL <= v.size or any(
            order[u] > order[p] and group_of.get(u) != group_of[p] for u in users.get(s, []))

    def recomputable(v: Value) -> tuple[list[Node], list[Node]] | None:
        """(the ops to copy, v's readers outside its group) where v should be recomputed."""
        p = producers.get(v)
        if p is None or p not in group_of or v in kept:
            return None
        outside = [u for u in users.get(v, []) if group_of.get(u) != group_of[p]]
        if not outside or not all(u in group_of for u in outside):
            return None
        found = chain(v)
        if found is None:
            return None
        ops, sources = found
        first = min(outside, key=order.get)
        if not all(saved_anyway(s, v, order[ops[0]], first) for s in sources):
            return None
        return ops, outside

    # Copies are made in the order of their first readers, so a copy a later value shares
    # is already placed before that value's first reader.
    found = [(v, *r) for n in graph.nodes if n in group_of for v in n.outputs
             if (r := recomputable(v)) is not None]
    for v, ops, outside in sorted(found, key=lambda f: min(map(order.get, f[2]))):
        first = min(outside, key=order.get)
        for op in ops:
            if op.outputs[0] in copies:
                continue
            twin = [Value(w.shape, w.dtype) for w in op.outputs]
            before.setdefault(first, []).append(Node(
                op.op, [copies.get(w, w) for w in op.inputs], twin, dict(op.attrs), (),
                op.label))
            copies.update(zip(op.outputs, twin))
        for u in outside:
            u.inputs = [copies[w] if w is v else w for w in u.inputs]
    return _rebuild(graph, [m for n in graph.nodes for m in before.get(n, []) + [n]], {})
