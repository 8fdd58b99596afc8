"""Elementwise ops moved to the shape their inputs had before a reshape.

`torch.stack([a, b], -1).prod(-1)`, `x.unsqueeze(-1) * y.unsqueeze(-1)` and their backwards
reshape values to add or drop a unit axis, run one elementwise op at that shape, then reshape
back. The reshapes cost nothing (views), but pointwise fusion (compile/pointwise.py) groups
only nodes of one output shape, so each reshape splits a chain of elementwise ops into
separate kernels: the gate of a hand-written `stack(...).prod` took five launches a block
where one does.

An elementwise op computes the same numbers at any shape of the same elements in the same
order, so an op whose every input is a reshape of a value of one shape S (its own output's
shape, the inputs' shape) runs at S instead, and a reshape gives its old output. A reshape of
a reshape reads the first one's input, and is gone where it gives that input's shape back.
Same bits: every element is computed by the same op from the same elements.

Left alone: broadcasting (an input of another shape), ops with an attribute of the shape
(expand) and the dropout ops (their masks are drawn per element of their own shape).
"""
from __future__ import annotations

from ..ir.graph import Graph, Node, Value
from ..ops.pointwise import PROGRAM_OPS
from .rewrite import _copy, _live, _rebuild

_SHAPED = ("expand", "dropout_grad", "dropout_mask")


def _source_shape(n: Node, producers: dict) -> tuple | None:
    """S where every input of elementwise node n is a reshape of a value of shape S and has
    n's output shape; else None."""
    if n.op not in PROGRAM_OPS or n.op in _SHAPED or len(n.outputs) != 1 or not n.inputs:
        return None
    sources = []
    for v in n.inputs:
        p = producers.get(v)
        if p is None or p.op != "reshape" or v.shape != n.outputs[0].shape:
            return None
        sources.append(p.inputs[0].shape)
    return sources[0] if len(set(sources)) == 1 and sources[0] != n.outputs[0].shape else None


def move_elementwise_before_reshapes(graph: Graph) -> Graph:
    graph = _copy(graph)
    producers: dict[Value, Node] = {}
    subst: dict[Value, Value] = {}
    nodes: list[Node] = []

    def place(*placed: Node) -> None:
        for node in placed:
            nodes.append(node)
            producers.update((v, node) for v in node.outputs)

    for n in graph.nodes:
        n.inputs = [subst.get(v, v) for v in n.inputs]
        if n.op == "reshape" and not n.mutates:
            p = producers.get(n.inputs[0])
            if p is not None and p.op == "reshape":
                n.inputs = [p.inputs[0]]
                if n.inputs[0].shape == n.outputs[0].shape:
                    subst[n.outputs[0]] = n.inputs[0]
                    continue
        shape = _source_shape(n, producers)
        if shape is not None and not n.mutates:
            out = n.outputs[0]
            moved = Value(shape, out.dtype)
            place(Node(n.op, [producers[v].inputs[0] for v in n.inputs], [moved], n.attrs,
                       label=n.label),
                  Node("reshape", [moved], [out], {"shape": tuple(out.shape)}, label=n.label))
            continue
        place(n)
    graph = _rebuild(graph, nodes, subst)
    # The reshapes now read by no one go here: fusion must not see them as readers.
    graph.nodes = _live(graph.nodes, graph.outputs.values())
    return graph
