"""Attention reads its operands where they lie and writes its results where they are read.

Attention written by hand splits heads with a view and a transpose (`q.view(B, T, H,
D).transpose(1, 2)`, a slice of a packed projection first when q, k and v come from one) and
merges them back the same way (`y.transpose(1, 2).reshape(B, T, C)`). Every value of the graph
is contiguous, so each transpose is a copy: of v before sdpa, of the output after it, of the
output's gradient before sdpa_grad and of q's, k's and v's gradients after it. The attention
kernels walk any (batch, head, row) strides with contiguous columns
(backends/cuda/attention/attention.py), so the copies are passes over memory and launches for
nothing. (A projection packed the way nanoGPT's and timm's are becomes sdpa_qkv instead,
compile/attention.py; this pass takes the rest.)

- Reads: an operand of sdpa (q, k, v) or sdpa_grad (dout, q, k, v, out) that a chain of
  slices, reshapes and permutes (or their layout_copy, compile/layout_chains.py) made from a
  root is read as the root at the chain's (shape, strides, offset) (ops/attention.py attrs
  views), where every reader of the chain's value can do the same; the copy goes with
  dead-code elimination.
- Writes: a result of sdpa (out) or sdpa_grad (dq, dk, dv) whose one reader besides
  attention ops is a permute keeping the last axis is written straight into that permute's
  output (attrs out_perms); the permute goes, and sdpa_grad reads out through its view of
  that output.

Left alone, as in compile/pointwise_views.py: graph outputs, roots some node writes in place
(the node reads the root where it stands, later than the copy did), a view whose last axis is
strided, and leading dims that do not flatten to (batch, heads). Same bits: the kernels read
and write the same elements.
"""
from __future__ import annotations

from ..ir.graph import Graph, Node, Value
from ..ops.attention import PERMUTED_OUTPUTS, VIEW_INPUTS, collapsed_stride, out_perms
from ..ops.pointwise import input_views
from ..ops.shape import contiguous_strides
from .aliases import view_roots, written_buffers
from .layout_chains import view_reads
from .rewrite import _copy


def attention_views(graph: Graph) -> Graph:
    return read_attention_views(write_attention_permuted(graph))


def _fits(shape: tuple, strides: tuple) -> bool:
    """Columns contiguous, and the leading dims before (heads, rows, columns) flattening to
    one batch stride, as the kernels take operands."""
    return len(shape) >= 2 and (shape[-1] == 1 or strides[-1] == 1) and \
        collapsed_stride(shape[:-3], strides[:-3]) is not None


def _reads_views(u: Node, v: Value) -> bool:
    """Whether every read of v by u is at an operand u can read through a view (and is not
    one already)."""
    views = input_views(u.attrs, len(u.inputs))
    return u.op in VIEW_INPUTS and all(i < VIEW_INPUTS[u.op] and views[i] is None
                                       for i, x in enumerate(u.inputs) if x is v)


def _view_into(n: Node, i: int, root: Value, view: tuple) -> None:
    """Node n reads `root` through `view` where it read its input i."""
    views = list(input_views(n.attrs, len(n.inputs)))
    n.inputs[i], views[i] = root, view
    n.attrs = {**n.attrs, "views": tuple(views)}


def write_attention_permuted(graph: Graph) -> Graph:
    graph = _copy(graph)
    users = graph.consumers()
    outputs = set(graph.outputs.values())
    roots = view_roots(graph.nodes)
    written = written_buffers(graph.nodes, roots)
    gone: set[int] = set()
    for n in graph.nodes:
        if n.op not in PERMUTED_OUTPUTS:
            continue
        perms = list(out_perms(n.op, n.attrs, len(n.outputs)))
        for i in range(PERMUTED_OUTPUTS[n.op]):
            o = n.outputs[i]
            readers = users.get(o, [])
            permutes = [u for u in readers if u.op == "permute"]
            others = [u for u in readers if u.op != "permute"]
            if o in outputs or o in written or len(permutes) != 1 or \
                    not all(_reads_views(u, o) for u in others):
                continue
            p = permutes[0]
            dims, out = tuple(p.attrs["dims"]), p.outputs[0]
            if dims[-1] != len(dims) - 1 or roots.get(out, out) in written:
                continue
            # o's element (i...) lies in out at sum(i[perm[j]] * out's stride j).
            at = contiguous_strides(out.shape)
            strides = tuple(at[dims.index(d)] for d in range(len(dims)))
            if not _fits(o.shape, strides):
                continue
            n.outputs[i], perms[i] = out, dims
            gone.add(id(p))
            for u in others:
                for j, x in enumerate(u.inputs):
                    if x is o:
                        _view_into(u, j, out, (tuple(o.shape), strides, 0))
        if any(p is not None for p in perms):
            last = max(j for j, p in enumerate(perms) if p is not None)
            n.attrs = {**n.attrs, "out_perms": tuple(perms[:last + 1])}
    graph.nodes = [n for n in graph.nodes if id(n) not in gone]
    return graph


def read_attention_views(graph: Graph) -> Graph:
    graph = _copy(graph)
    views, readable = view_reads(graph, lambda view, v: _fits(view.shape, view.strides),
                                 _reads_views)

    for n in graph.nodes:
        if n.op not in VIEW_INPUTS:
            continue
        for i, v in enumerate(n.inputs[:VIEW_INPUTS[n.op]]):
            if input_views(n.attrs, len(n.inputs))[i] is None and readable(v):
                view = views[v]
                _view_into(n, i, view.root, (view.shape, view.strides, view.offset))
    return graph
