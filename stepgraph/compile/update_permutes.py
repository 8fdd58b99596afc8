"""An update reads a conv weight's gradient as the backward made it: channels-last.

A channels-last step's convolutions take their weights as (O, kh, kw, C) and give their
gradients in that order, which a permute turns back to the parameter's (O, C, kh, kw) for the
update (compile/layout.py). Such a permute, read only by the update (and the guard's
finiteness check, which reads any order), goes: the update reads its input with attrs
grad_dims[i] = the dims that give that input from a gradient in the parameter's order
(ops/optim.py update_grad_dims). On CUDA the update moves each output channel's slice of the
gradient through shared memory in the same launch, so the gradient is read once instead of
read, written and read again (docs/perf-notes.md: a U-Net's 31M weights' gradients took 87 µs
a step at bf16, 195 at tf32, in their own permutes).

Only the transposes that keep each axis-0 slice whole ((O, C, ...) -> (O, ..., C), the conv
weights') whose slices fit the kernel's tile (ops/optim.py update_transposes) are taken; any
other permute stays. It runs on the final program order (after data parallelism and the
overlapped update), so each bucket's update reads its own gradients."""
from __future__ import annotations

import numpy as np

from ..ir.graph import Graph, Node, Value
from ..ops.optim import UPDATE_OPS, update_transposes
from .rewrite import _copy, _rebuild

# What else may read such a gradient: the guard's check, and the join of an overlapped update
# (which only holds the memory its buckets read: it then holds the permute's input instead).
HOLDERS = ("guard_check", "update_join")


def read_gradients_through_permutes(graph: Graph) -> Graph:
    graph = _copy(graph)
    users = graph.consumers()
    outputs = set(graph.outputs.values())
    made_by = {v: n for n in graph.nodes for v in n.outputs}
    written = {n.inputs[j] for n in graph.nodes for j in n.mutates}
    subst: dict[Value, Value] = {}
    dropped: set[Node] = set()
    for update in [n for n in graph.nodes if n.op in UPDATE_OPS]:
        n, k = update.attrs["n_params"], update.attrs["n_scalars"]
        dims = list(update.attrs.get("grad_dims") or (None,) * n)
        for i in range(n):
            p, g = update.inputs[k + i], update.inputs[k + n + i]
            permute = made_by.get(g)
            if permute is None or permute.op != "permute" or g in outputs or dims[i]:
                continue
            source = permute.inputs[0]
            to_source = tuple(int(d) for d in np.argsort(permute.attrs["dims"]))
            readers = users.get(g, [])
            if source in written or not update_transposes(to_source, p.shape) or \
                    any(r is not update and r.op not in HOLDERS for r in readers) or \
                    sum(v is g for v in update.inputs) != 1:
                continue
            dims[i] = to_source
            subst[g] = source
            dropped.add(permute)
        if any(dims):
            update.attrs["grad_dims"] = tuple(dims)
    if not subst:
        return graph
    return _rebuild(graph, [n for n in graph.nodes if n not in dropped], subst)
