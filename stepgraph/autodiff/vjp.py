"""Reverse-mode autodiff as a Graph -> Graph transform.

Walks the forward nodes backwards, calls each op's VJP rule (ir/ops.py VJPS, registered by
the op's family in stepgraph/ops/), and appends the nodes the rules emit to the same graph.
Gradients reaching a value from several uses are summed with `add` nodes. A node is
differentiated when any of its outputs has a gradient (an LSTM cell's c' may have one while
its h' has none); its rule gets None for the others. The result is
ordinary graph code: the planner, the fusion passes and the CUDA graph see the backward like
any other nodes.
"""
from __future__ import annotations

from ..ir.graph import Graph, Node, Value
from ..ir.ops import VJPS
from ..ir.trace import Tracer


def _needs_grad(graph: Graph, wrt: list[Value]) -> set[Value]:
    """Values that depend on any of `wrt` (only their gradients are worth computing); a
    stop_gradient's output depends on nothing, so the backward stops there."""
    needs = set(wrt)
    for node in graph.nodes:
        if node.op != "stop_gradient" and any(v in needs for v in node.inputs):
            needs.update(node.outputs)
    return needs


def append_backward(tracer: Tracer, loss: Value, wrt: list[Value]) -> list[Value]:
    """Append the gradient of scalar `loss` w.r.t. each of `wrt`; returns them in order."""
    if loss.shape != ():
        raise ValueError(f"the loss must be a scalar, got shape {loss.shape}")
    graph = tracer.graph
    forward: list[Node] = list(graph.nodes)
    needs = _needs_grad(graph, wrt)
    grads: dict[Value, Value] = {}

    def accumulate(v: Value, g: Value):
        grads[v] = tracer.emit("add", [grads[v], g])[0] if v in grads else g

    tracer.label = "loss seed"
    grads[loss] = tracer.emit("fill", [], value=1.0, shape=(), dtype=loss.dtype)[0]
    for node in reversed(forward):
        dys = [grads.get(v) for v in node.outputs]
        if all(g is None for g in dys) or not any(v in needs for v in node.inputs):
            continue
        rule = VJPS.get(node.op)
        if rule is None:
            raise NotImplementedError(f"no VJP rule for op {node.op!r}")
        tracer.label = f"{node.label} bwd" if node.label else "bwd"

        def emit(op, inputs, **attrs):
            return tracer.emit(op, inputs, **attrs)

        dxs = rule(emit, node, dys, lambda i, node=node: node.inputs[i] in needs)
        for v, g in zip(node.inputs, dxs):
            if g is not None and v in needs:
                accumulate(v, g)
    missing = [v for v in wrt if v not in grads]
    if missing:
        raise ValueError(f"the loss does not depend on {missing}")
    return [grads[v] for v in wrt]
