"""The permutes of one program point as one node (permute_group), run by one multi-tensor
launch: a channels-last step permutes every conv weight to (O, kh, kw, C) in its forward and
every weight gradient back to (O, C, kh, kw) for the update, one small launch each (35 a step
for a ResNet-18 at tf32, a few microseconds each, most of it launch and tail).

- Permutes of parameters (the forward's weights) run together where the first of them was:
  they read only parameters, which nothing writes before the update.
- The other permutes run together at the latest point before any of their outputs is read:
  of the points where one of them runs, the one that the most of them can move to (each from
  its own point, where its input exists, to one before its first reader), which for the weight
  gradients is where the last of them was, before the guard and the update read them all.

Each group is of one dtype (one kernel instantiation) and of permutes over at most 4 dims (the
gather's). A permute moved later whose input some node writes in place (other than a
parameter read before the update) stays where it is, as does one whose output the step
returns. Groups take effect where they join at least MIN_GROUP permutes.

It runs on the final program order (after fusion, data parallelism's all-reduces and the
overlapped update), so a gradient an all-reduce bucket or an early update reads is not held
back: its first reader comes before the others' point and it stays out of the group."""
from __future__ import annotations

from ..ir.graph import PARAM, Graph, Node
from .rewrite import _copy

MIN_GROUP = 2
MAX_DIMS = 4          # include/permute.cuh: the gather's dims


def group_permutes(graph: Graph) -> Graph:
    graph = _copy(graph)
    nodes = graph.nodes
    at = {n: i for i, n in enumerate(nodes)}
    users = graph.consumers()
    returned = set(graph.outputs.values())
    written = {n.inputs[j] for n in nodes for j in n.mutates}
    first_write = next((i for i, n in enumerate(nodes)
                        if any(n.inputs[j].role == PARAM for j in n.mutates)), len(nodes))
    movable = [n for n in nodes if n.op == "permute" and len(n.attrs["dims"]) <= MAX_DIMS
               and n.outputs[0] not in returned and users.get(n.outputs[0])]
    groups: list[tuple[int, list[Node]]] = []
    for dtype in dict.fromkeys(n.inputs[0].dtype for n in movable):
        of_dtype = [n for n in movable if n.inputs[0].dtype == dtype]
        hoisted = [n for n in of_dtype if n.inputs[0].role == PARAM and at[n] < first_write]
        if len(hoisted) >= MIN_GROUP:
            groups.append((at[hoisted[0]], hoisted))
        rest = [n for n in of_dtype if n not in hoisted and n.inputs[0] not in written]
        first_read = {n: min(at[u] for u in users[n.outputs[0]]) for n in rest}
        best: list[Node] = []
        for point in sorted({at[n] for n in rest}):
            joined = [n for n in rest if at[n] <= point < first_read[n]]
            if len(joined) > len(best):
                best = joined
        if len(best) >= MIN_GROUP:
            groups.append((max(at[n] for n in best), best))
    if not groups:
        return graph
    placed: dict[int, Node] = {}
    grouped: set[Node] = set()
    for point, members in groups:
        placed[point] = Node("permute_group", [n.inputs[0] for n in members],
                             [n.outputs[0] for n in members],
                             {"dims": tuple(tuple(n.attrs["dims"]) for n in members)}, (),
                             members[0].label)
        grouped.update(members)
    kept = []
    for i, n in enumerate(nodes):
        if i in placed:
            kept.append(placed[i])
        if n not in grouped:
            kept.append(n)
    return Graph(kept, graph.inputs, graph.params, graph.state, graph.outputs)
