"""What every fusion pass uses to rewrite a graph without touching the one it was given."""
from __future__ import annotations

from ..ir.graph import Graph, Node, Value


def _copy(graph: Graph) -> Graph:
    """The same program over the same Values, in fresh Node objects: passes rewrite nodes in
    place, and the graph they were given must still compute what it did. (Node's own
    constructor: dataclasses.replace took half of a transformer file's fusion time.)"""
    nodes = [Node(n.op, list(n.inputs), list(n.outputs), dict(n.attrs), n.mutates, n.label)
             for n in graph.nodes]
    return Graph(nodes, graph.inputs, graph.params, graph.state, dict(graph.outputs))


def sole_reader(graph: Graph, users, v: Value, op: str | None = None) -> Node | None:
    """The one node reading v (once), when v is no graph output (and, given `op`, that node
    is an `op` node)."""
    readers = users.get(v, [])
    if len(readers) != 1 or v in graph.outputs.values() or op not in (None, readers[0].op):
        return None
    return readers[0]


def sole_chain(graph: Graph, users, v: Value, ops: tuple[str, ...]) -> tuple[list[Node], Value]:
    """The nodes of `ops` that read v one after another, each the only reader of what it reads
    (no graph output), and the value at the chain's end (v when there is none)."""
    chain = []
    while True:
        step = sole_reader(graph, users, v)
        if step is None or step.op not in ops:
            return chain, v
        chain.append(step)
        v = step.outputs[0]


def _rebuild(graph: Graph, nodes: list[Node], subst: dict[Value, Value]) -> Graph:
    """A copy of `graph` with `nodes`, every input and output renamed through `subst`."""
    for n in nodes:
        n.inputs = [subst.get(v, v) for v in n.inputs]
    outputs = {k: subst.get(v, v) for k, v in graph.outputs.items()}
    return Graph(nodes, graph.inputs, graph.params, graph.state, outputs)


def _live(nodes: list[Node], outputs) -> list[Node]:
    """The nodes, in order, that the graph outputs depend on (nodes that mutate state are
    always live): a backward walk keeping each node one of whose outputs is read later."""
    live: set[Value] = set(outputs)
    kept: list[Node] = []
    for n in reversed(nodes):
        if n.mutates or any(v in live for v in n.outputs):
            kept.append(n)
            live.update(n.inputs)
    return kept[::-1]


def _join(*labels: str) -> str:
    return "+".join(dict.fromkeys(l.split(" ")[0] for l in labels if l))


def splice(graph: Graph, replaced: dict[Node, list[Node]], dropped: set[Node]) -> Graph:
    """`graph` with each matched chain spliced out: the nodes in `dropped` go, and the nodes
    that run instead are placed where the chain's last node was (`replaced`: that node ->
    them), after everything the chain read."""
    nodes: list[Node] = []
    for n in graph.nodes:
        if n in replaced:
            nodes += replaced[n]
        elif n not in dropped:
            nodes.append(n)
    return Graph(nodes, graph.inputs, graph.params, graph.state, dict(graph.outputs))
