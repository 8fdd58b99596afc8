"""Recomputation of checkpointed activations (torch.utils.checkpoint) as a graph transform.

A train forward traced through `checkpoint(fn, ...)` leaves the values `fn` computed in
`Tracer.recomputed`. After autodiff, every backward node that reads one of them reads a copy
instead: the forward nodes that computed it are cloned (new output values, same op, inputs and
attrs, cloning back through the marked values they read) and placed just before the first
backward node that needs them. The forward's own values then end at their last forward reader,
so the planner reuses their memory during the rest of the forward; what stays alive into the
backward is the region's inputs, as with torch's checkpoint. Clones compute the same bits: the
same ops on the same inputs (a dropout clone reads the same step counter with the same seed and
site, so it draws the same mask).

A node that writes state in place (`mutates`: BatchNorm's running statistics) is never cloned:
running it twice would update twice, so its outputs are kept as without checkpoint, and clones
downstream read them.
"""
from __future__ import annotations

from ..ir.graph import Graph, Node, Value


def recompute(graph: Graph, marked: set[Value], n_forward: int) -> Graph:
    """`graph` (forward nodes first, then `n_forward`.. the backward) with the backward's
    reads of `marked` values served by clones of their producers (module doc). The node list
    is rebuilt in place; the graph is returned."""
    forward, backward = graph.nodes[:n_forward], graph.nodes[n_forward:]
    producers = {v: n for n in forward for v in n.outputs}
    clones: dict[Value, Value] = {}

    def cloneable(v: Value) -> bool:
        node = producers.get(v)
        return v in marked and node is not None and not node.mutates

    def clone(v: Value, out: list[Node]) -> Value:
        if v not in clones:
            node = producers[v]
            inputs = [clone(u, out) if cloneable(u) else u for u in node.inputs]
            copy = Node(node.op, inputs, [Value(o.shape, o.dtype) for o in node.outputs],
                        dict(node.attrs), node.mutates, f"{node.label} recompute".strip())
            clones.update(zip(node.outputs, copy.outputs))
            out.append(copy)
        return clones[v]

    nodes = list(forward)
    for node in backward:
        if any(cloneable(v) for v in node.inputs):
            node.inputs = [clone(v, nodes) if cloneable(v) else v for v in node.inputs]
        nodes.append(node)
    graph.nodes = nodes
    return graph
