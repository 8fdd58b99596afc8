"""Pointwise fusion: chains and trees of elementwise nodes become one `pointwise` node.

A residual block's `add` + ReLU, BatchNorm's eval-mode scale/shift, an activation's gradient
followed by a gradient sum: each elementwise op alone is a launch and a full memory pass. This
pass groups connected elementwise nodes that produce values of one shape into a `pointwise`
node whose `program` (ops/pointwise.py) the backends run as one loop over the output: the CUDA
backend generates and compiles one kernel per program. Values read only inside a group never
reach memory; values read elsewhere (saved activations for the backward) become outputs.

A group grows in program order. A node joins the group of one of its producers when its output
has the group's shape and when every value the group produced so far that is read outside the
group is read only after this node: the fused node runs where its last member ran, so every
outside reader must come after that point. Where the node reads from several such groups, those
that meet the same condition merge with it into one.

bfloat16 nodes (precision="bf16") fuse like float32 ones: a node's inputs and output share one
dtype, and casts between float32 and bf16 join too, so a group may mix the two (autocast's
bf16 dropout, its cast and the float32 residual add after it). Bool masks (comparisons,
logic, where, masked_fill, casts to and from bool) join groups of any float dtype. The
program rounds each instruction whose value is bf16, as the unfused node's store would
(ops/pointwise.py), so fusing changes no bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.graph import BF16, FLOAT_DTYPES, Graph, Node, Value
from ..ops.pointwise import Instr, PROGRAM_OPS, renumbered
from .rewrite import _copy, _join, _rebuild


def _eligible(n: Node) -> bool:
    if n.op in ("dropout", "dropout_grad"):
        return _dropout_eligible(n)
    if n.op == "cast":              # between float32 and bf16: a copy, rounded when narrowing
        pair = {n.inputs[0].dtype, n.outputs[0].dtype}
        return pair == {"float32", BF16} or (len(pair) == 2 and "bool" in pair
                                            and pair <= {"bool", *FLOAT_DTYPES})
    if n.op not in PROGRAM_OPS or len(n.outputs) != 1:
        return False
    # Masks (bool) mix with one float dtype: comparisons, where, masked_fill.
    dtypes = {v.dtype for v in (*n.inputs, *n.outputs)}
    return dtypes <= {"bool", *FLOAT_DTYPES} and len(dtypes - {"bool"}) <= 1


def _dropout_eligible(n: Node) -> bool:
    """dropout (x, step) -> (y, mask) and dropout_grad (dy, mask) -> dx, elementwise masks."""
    if n.attrs.get("per_channel"):
        return False
    x, y = n.inputs[0], n.outputs[0]
    if y.dtype not in FLOAT_DTYPES or x.dtype != y.dtype or x.shape != y.shape:
        return False
    if n.op == "dropout":
        step = n.inputs[1]
        return step.dtype == "int64" and step.shape == () and n.outputs[1].shape == y.shape
    return n.inputs[1].dtype == "uint8" and n.inputs[1].shape == y.shape


@dataclass(eq=False)
class _Group:
    shape: tuple[int, ...]
    members: list[Node] = field(default_factory=list)
    produced: set = field(default_factory=set)


def _groups(graph: Graph, singles: bool = False) -> list[_Group]:
    """The groups fuse_pointwise fuses (two members or more; every group with singles)."""
    users = graph.consumers()
    order = {n: i for i, n in enumerate(graph.nodes)}
    group_of: dict[Value, _Group] = {}     # value -> the group that produces it
    groups: list[_Group] = []

    def can_join(joined: list[_Group], n: Node) -> bool:
        inside = {n}.union(*(g.members for g in joined))
        return all(order[u] > order[n] for g in joined for v in g.produced
                   for u in users.get(v, []) if u not in inside)

    for n in graph.nodes:
        if not _eligible(n):
            continue
        shape = n.outputs[0].shape
        candidates = list({id(group_of[v]): group_of[v] for v in n.inputs
                           if v in group_of and group_of[v].shape == shape}.values())
        g = next((c for c in candidates if can_join([c], n)), None)
        if g is None:
            g = _Group(shape)
            groups.append(g)
        for h in candidates:    # n's other producer groups, merged where n may join them too
            if h is not g and can_join([g, h], n):
                g.members = sorted(g.members + h.members, key=order.get)
                g.produced |= h.produced
                group_of.update((v, g) for v in h.produced)
                groups.remove(h)
        g.members.append(n)
        g.produced.update(n.outputs)
        group_of.update((v, g) for v in n.outputs)
    return [g for g in groups if singles or len(g.members) > 1]


def _program(g: _Group, graph: Graph, users) -> Node:
    """The pointwise node computing group g: inputs are the values read from outside."""
    inputs: list[Value] = []
    reg: dict[Value, int] = {}
    instrs: list[Instr] = []

    def register(v: Value) -> int:
        if v not in reg:
            inputs.append(v)
            reg[v] = -len(inputs)          # loads are negative: input i is register -(i+1)
        return reg[v]

    def emit(op: str, args: tuple[int, ...], attrs: dict) -> int:
        instrs.append(Instr(op, args, tuple(sorted(attrs.items()))))
        return len(instrs) - 1

    for n in g.members:
        args = tuple(reg[v] if v in g.produced else register(v) for v in n.inputs)
        if n.op == "dropout":           # the mask from the step counter, then x * mask * scale
            mask = reg[n.outputs[1]] = emit("dropout_mask", args[1:], n.attrs)
            reg[n.outputs[0]] = emit("dropout_grad", (args[0], mask), n.attrs)
        else:
            reg[n.outputs[0]] = emit(n.op, args, n.attrs)
    members = set(g.members)
    graph_outputs = set(graph.outputs.values())
    outputs = [v for n in g.members for v in n.outputs
               if v in graph_outputs or any(u not in members for u in users.get(v, []))]
    # Registers are renumbered so loads come first: input i is register i, instruction j is
    # register len(inputs) + j (what ops/pointwise.py and the CUDA code generator read).
    k = len(inputs)
    program, results = renumbered(tuple(instrs), tuple(reg[v] for v in outputs),
                                  lambda r: -r - 1 if r < 0 else k + r)
    attrs = dict(program=program, results=results, shape=g.shape)
    return Node("pointwise", inputs, outputs, attrs, (), _join(*(n.label for n in g.members)))


def fuse_pointwise(graph: Graph) -> Graph:
    """Groups of two or more connected elementwise nodes of one output shape => `pointwise`."""
    graph = _copy(graph)
    users = graph.consumers()
    fused_at: dict[Node, Node] = {}
    drop: set[Node] = set()
    for g in _groups(graph):
        fused_at[g.members[-1]] = _program(g, graph, users)
        drop.update(g.members[:-1])
    nodes = [fused_at.get(n, n) for n in graph.nodes if n not in drop]
    return _rebuild(graph, nodes, {})
