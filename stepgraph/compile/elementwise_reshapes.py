"""Elementwise ops moved to the shape their inputs had before a reshape.

`torch.stack([a, b], -1).prod(-1)`, `x.unsqueeze(-1) * y.unsqueeze(-1)` and their backwards
reshape values to add or drop a unit axis, run one elementwise op at that shape, then reshape
back. The reshapes cost nothing (views), but pointwise fusion (compile/pointwise.py) groups
only nodes of one output shape, so each reshape splits a chain of elementwise ops into
separate kernels: the gate of a hand-written `stack(...).prod` took five launches a block
where one does.

An elementwise op computes the same numbers at any shape of the same elements in the same
order, so an op whose every input is a reshape of a value of one shape S (its own output's
shape, the inputs' shape), or the output of an op moved to S, runs at S instead, and a
reshape gives its old output; a reshape of a reshape reads the first one's input, and is gone
where it gives that input's shape back. Only where that loses no fusion at the op's own
shape: an elementwise reader of that shape that does not move keeps it there (a cast or a
scale read by the ops after it: ConvNeXt's bf16 step took 15 more kernels, and MobileNet's 3,
when every such op moved). Same bits: every element is computed by the same op from the same
elements.

Left alone: broadcasting (an input of another shape), ops with an attribute of the shape
(expand) and the dropout ops (their masks are drawn per element of their own shape).
"""
from __future__ import annotations

from ..ir.graph import Graph, Node, Value
from ..ops.pointwise import PROGRAM_OPS
from .rewrite import _copy, _live, _rebuild

_SHAPED = ("expand", "dropout_grad", "dropout_mask")


def _elementwise(n: Node) -> bool:
    return n.op in PROGRAM_OPS and n.op not in _SHAPED and len(n.outputs) == 1 \
        and bool(n.inputs) and not n.mutates


def _without_double_reshapes(graph: Graph) -> Graph:
    """A reshape of a reshape reads the first one's input; gone where it gives it back."""
    producers: dict[Value, Node] = {}
    subst: dict[Value, Value] = {}
    nodes: list[Node] = []
    for n in graph.nodes:
        n.inputs = [subst.get(v, v) for v in n.inputs]
        p = producers.get(n.inputs[0]) if n.op == "reshape" and not n.mutates else None
        if p is not None and p.op == "reshape":
            n.inputs = [p.inputs[0]]
            if n.inputs[0].shape == n.outputs[0].shape:
                subst[n.outputs[0]] = n.inputs[0]
                continue
        nodes.append(n)
        producers.update((v, n) for v in n.outputs)
    graph = _rebuild(graph, nodes, subst)
    graph.nodes = _live(graph.nodes, graph.outputs.values())
    return graph


def _moving(graph: Graph) -> dict[Node, tuple]:
    """{elementwise node: the shape S it moves to}. A node may move where each input is a
    reshape of a value of shape S or the output of a node that moves to S; it does where
    moving loses no fusion at its own shape T: none of its readers is an elementwise node of
    output shape T that stays (reshapes, other ops and moving nodes read it as well at S)."""
    producers, users = graph.producers(), graph.consumers()
    moving: dict[Node, tuple] = {}
    for n in graph.nodes:
        if not _elementwise(n):
            continue
        here = n.outputs[0].shape
        sources = set()
        for v in n.inputs:
            p = producers.get(v)
            if p in moving:
                sources.add(moving[p])
            elif p is not None and p.op == "reshape" and v.shape == here:
                sources.add(p.inputs[0].shape)
            else:
                sources.add(None)
        if len(sources) == 1 and None not in sources and sources != {here}:
            moving[n] = sources.pop()

    def stays_fused(n: Node) -> bool:
        """Whether n would lose a fusion by moving: an elementwise reader at its shape that
        stays, or an input from a node that no longer moves."""
        here = n.outputs[0].shape
        return any(_elementwise(u) and u.outputs[0].shape == here and u not in moving
                   for u in users.get(n.outputs[0], [])) or \
            any(producers.get(v) is not None and producers[v].op != "reshape"
                and producers[v] not in moving for v in n.inputs)

    changed = True
    while changed:
        kept = {n: s for n, s in moving.items() if not stays_fused(n)}
        changed, moving = len(kept) != len(moving), kept
    return moving


def move_elementwise_before_reshapes(graph: Graph) -> Graph:
    graph = _without_double_reshapes(_copy(graph))
    moving = _moving(graph)
    if not moving:
        return graph
    producers: dict[Value, Node] = {}
    nodes: list[Node] = []
    for n in graph.nodes:
        if n in moving:
            out = n.outputs[0]
            moved = Value(moving[n], out.dtype)
            placed = [Node(n.op, [producers[v].inputs[0] for v in n.inputs], [moved], n.attrs,
                           label=n.label),
                      Node("reshape", [moved], [out], {"shape": tuple(out.shape)},
                           label=n.label)]
        else:
            placed = [n]
        for node in placed:
            nodes.append(node)
            producers.update((v, node) for v in node.outputs)
    graph.nodes = nodes
    return _without_double_reshapes(graph)
