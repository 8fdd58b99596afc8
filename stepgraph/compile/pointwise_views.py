"""Pointwise programs read a slice or permute of a value in place instead of its copy.

Every value is contiguous, so a slice across leading axes, a permute or a layout_copy
(compile/layout_chains.py) is a kernel that copies. Where only elementwise code reads that
copy, the copy is a wasted pass over memory and a launch: `a, b = self.gate(x).chunk(2, -1)`
then `sigmoid(a) * b` (a gated MLP, SwiGLU) slices both halves out of the Linear's output, and
the head split `q.view(B, T, H, D).transpose(1, 2)` copies q before a normalisation reads it.
A `pointwise` node (compile/pointwise.py) can read any input through a strided view of its
elements (ops/pointwise.py attrs views), so each such input becomes the chain's root read at
the chain's (shape, strides, offset), and the copy goes with dead-code elimination. A lone
elementwise node reading such a copy becomes a one-instruction pointwise node to do the same.

Only where every reader of the copy is elementwise (else the copy stays, and reading it is
cheaper than reading strided), where the view's last axis is contiguous (a permute that moves
it is left to the tiled transpose kernel: a program's threads would each read a strided
element, uncoalesced; an H200 took 8 µs for an add reading a conv gradient transposed, against
6.6 for the transpose and the add) and nothing writes the root in place (the program runs where
its node is, later than the copy did, and must see what the copy saw). Same bits: the program
reads the same elements.
"""
from __future__ import annotations

from ..ir.graph import FLOAT_DTYPES, Graph, Node
from ..ops.pointwise import as_program, input_views
from .layout_chains import view_reads
from .pointwise import _eligible
from .rewrite import _copy


def _elementwise(n: Node) -> bool:
    return n.op == "pointwise" or (_eligible(n) and n.op not in ("dropout", "expand")
                                   and not n.mutates)


def program_of(n: Node | None) -> Node | None:
    """n as a pointwise node (a lone elementwise one as its one-instruction program), or None
    where n is not elementwise."""
    if n is None or not _elementwise(n):
        return None
    return n if n.op == "pointwise" else as_program(n)


def read_pointwise_views(graph: Graph) -> Graph:
    graph = _copy(graph)
    views, readable = view_reads(
        graph, lambda view, v: v.dtype in FLOAT_DTYPES and (
            not view.shape or view.strides[-1] == 1 or view.shape[-1] == 1),
        lambda u, v: _elementwise(u))

    nodes = []
    for n in graph.nodes:
        if _elementwise(n) and any(readable(v) for v in n.inputs):
            n = program_of(n)
            entries = list(input_views(n.attrs, len(n.inputs)))
            for i, v in enumerate(n.inputs):
                if entries[i] is None and readable(v):
                    view = views[v]
                    n.inputs[i] = view.root
                    entries[i] = (view.shape, view.strides, view.offset)
            n.attrs = {**n.attrs, "views": tuple(entries)}
        nodes.append(n)
    graph.nodes = nodes
    return graph
