"""A concat of one pointwise program's results is written by the program itself.

A gated unit's backward computes the gradients of both halves of one projection in one
program (`a, b = self.gate(x).chunk(2, -1)`, SwiGLU, GLU, a product gate), and the projection's
backward reads them joined: `torch.cat` of the two, a copy of both. Sines and cosines of one
angle table joined into position features are the same pattern in the forward. The program
can store each result straight into its part of the joined value (ops/pointwise.py `Joined`:
the part is a strided view of the output, as a slice would read it), so the concat and the
separate results go.

Only where every input of the concat is a result of the one program that nothing else reads
(no other node, no graph output, no write in place), so the separate results need not exist.
Same bits: the program stores the values the concat copied.
"""
from __future__ import annotations

from ..ir.graph import Graph
from ..ops.pointwise import Joined
from .aliases import view_roots, written_buffers
from .rewrite import _copy


def join_pointwise_results(graph: Graph) -> Graph:
    graph = _copy(graph)
    producers, users = graph.producers(), graph.consumers()
    outputs = set(graph.outputs.values())
    written = written_buffers(graph.nodes, view_roots(graph.nodes))
    gone: set[int] = set()
    for cat in graph.nodes:
        if cat.op != "concat" or len(cat.inputs) < 2:
            continue
        program = producers.get(cat.inputs[0])
        if program is None or program.op != "pointwise":
            continue
        results = list(program.attrs["results"])
        at = {id(v): j for j, v in enumerate(program.outputs)}
        if not all(id(v) in at and isinstance(results[at[id(v)]], int) and v not in outputs
                   and v not in written and all(u is cat for u in users[v])
                   for v in cat.inputs):
            continue
        joined = Joined(int(cat.attrs["dim"]),
                        tuple(results[at[id(v)]] for v in cat.inputs))
        parts = {at[id(v)] for v in cat.inputs}
        first = min(parts)
        keep = [j for j in range(len(results)) if j not in parts or j == first]
        results[first] = joined
        program.outputs[first] = cat.outputs[0]
        program.outputs = [program.outputs[j] for j in keep]
        program.attrs = {**program.attrs, "results": tuple(results[j] for j in keep)}
        gone.add(id(cat))
    graph.nodes = [n for n in graph.nodes if id(n) not in gone]
    return graph
