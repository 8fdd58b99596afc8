"""Slices of a concat that give back one of its inputs: read that input instead.

`torch.stack([a, b], -1).prod(-1)` traces as a concat of a and b followed by one slice per
entry; `torch.cat` then `split` / `chunk` at the same sizes, and the backward of a stack
(the gradients' concat, then a slice per input), do the same. Each slice is a copy of a value
the graph already holds, and the concat a copy of all of them: when a slice (step 1) along
the concat's axis covers exactly input i's range, its readers read input i, and the concat
goes when nothing else reads it (dead-code elimination). Same numbers: the slice held
input i's values, bit for bit.

Left alone: a slice over parts of two inputs, or over several whole ones (that would still
need a copy), and inputs with no producer in the graph (inputs, parameters, state) or that
some node writes in place, where reading the value later could see another one.
"""
from __future__ import annotations

from ..ir.graph import Graph, Value
from ..ops.shape import _slice_bounds
from .aliases import view_roots, written_buffers
from .rewrite import _copy, _rebuild


def read_concat_inputs(graph: Graph) -> Graph:
    graph = _copy(graph)
    producers = graph.producers()
    roots = view_roots(graph.nodes)
    written = written_buffers(graph.nodes, roots)
    subst: dict[Value, Value] = {}
    for n in graph.nodes:
        if n.op != "slice":
            continue
        cat = producers.get(n.inputs[0])
        if cat is None or cat.op != "concat":
            continue
        dim, start, stop, step = _slice_bounds("slice", n.inputs[0].shape, n.attrs)
        if step != 1 or dim != int(cat.attrs["dim"]) % len(n.inputs[0].shape):
            continue
        at = 0
        for x in cat.inputs:
            if (at, at + x.shape[dim]) == (start, stop):
                if x in producers and roots.get(x, x) not in written and \
                        x.dtype == n.outputs[0].dtype:
                    subst[n.outputs[0]] = subst.get(x, x)
                break
            at += x.shape[dim]
    if not subst:
        return graph
    return _rebuild(graph, [n for n in graph.nodes
                                   if not (n.op == "slice" and n.outputs[0] in subst)], subst)
