"""Sums over the last axis fused with the elementwise code before and after them.

`F.normalize(q, dim=-1)` is q * q, a sum over the head's last axis, a clamp and a square root
of the sums, then q divided by them; its backward has the same shape of sums. Each piece is a
kernel of its own, the product (as big as q) is written only for the sum to read it back, and
the code on the sums is a launch for a few KB. A `pointwise_sum` node (ops/pointwise.py) runs
all of it: per row, the producing program's value of each element summed as it is computed
(the sum's own order: a warp per row, as reduce_sum's rows kernel adds), then, on the row's
sum, the program that read it.

A reduce_sum over the last axis only, of float32 values, becomes one where:
- what it sums is the one result of a pointwise node (or a lone elementwise node) that
  nothing else reads: that program runs inside the sum (its prologue); else the sum reads
  its input as it is;
- the first node that reads its sums is a pointwise node (or a lone elementwise node) over
  the sums' shape that reads them as they are: that program runs on each row's sum (its
  epilogue), and that node's outputs are the fused node's, the sums too where a later node
  reads them (a normalisation's backward reads the forward's). Without a prologue, only this
  makes it worth it.
Rows of at most MAX_COLS elements (a warp sums a row); float32 programs only (a bf16 step's
sums are left to reduce_sum), and no epilogue that reads an input through a view. The fused
node runs where the last of the nodes it replaces ran, so nothing it reads may be written in
place in between: roots some node writes in place are left alone. Same numbers: each program
computes what its node did, and the sum adds the same float32 values.
"""
from __future__ import annotations

from ..ir.graph import Graph, Node, Value
from ..ops.pointwise import input_views, register_dtypes, renumbered
from .aliases import view_roots, written_buffers
from .pointwise_views import program_of
from .rewrite import _copy

MAX_COLS = 1024          # backends/cuda/reduce.py ROW_SUM_MAX_COLS: a warp per row


def _identity(x: Value) -> Node:
    """The program that reads x as it is (a sum without a prologue)."""
    return Node("pointwise", [x], [x], dict(program=(), results=(0,), shape=tuple(x.shape)))


def _epilogue(q: Node, sums: Value) -> tuple[list[Value], tuple, tuple]:
    """Q's inputs other than the sums, and its program and results renumbered so that the
    sums are register 0 and those inputs 1, 2, ..."""
    at = q.inputs.index(sums)
    order = [at] + [i for i in range(len(q.inputs)) if i != at]
    moved = {old: new for new, old in enumerate(order)}
    # instructions keep their registers
    program, results = renumbered(q.attrs["program"], q.attrs["results"],
                                  lambda r: moved.get(r, r))
    return [q.inputs[i] for i in order[1:]], program, results


def _float32(n: Node) -> bool:
    """Whether pointwise node n reads float32 values and computes float32 (or bool) ones
    only: the fused kernel's arithmetic (backends/cuda/pointwise_sum.py)."""
    dtypes = register_dtypes(n.attrs["program"], tuple(v.dtype for v in n.inputs))
    return all(v.dtype == "float32" for v in n.inputs) and set(dtypes) <= {"float32", "bool"}


def fuse_row_sums(graph: Graph) -> Graph:
    graph = _copy(graph)
    producers, users = graph.producers(), graph.consumers()
    order = {n: i for i, n in enumerate(graph.nodes)}
    outputs = set(graph.outputs.values())
    roots = view_roots(graph.nodes)
    written = written_buffers(graph.nodes, roots)

    def only_reader(v: Value) -> Node | None:
        readers = users.get(v, [])
        return readers[0] if len(readers) == 1 and v not in outputs else None

    def untouched(values) -> bool:
        return not any(roots.get(v, v) in written for v in values)

    replaced: dict[Node, Node] = {}
    dropped: set[Node] = set()
    for r in graph.nodes:
        x = r.inputs[0] if r.op == "reduce_sum" else None
        if x is None or x.dtype != "float32" or not x.shape or \
                tuple(a % len(x.shape) for a in r.attrs["axes"]) != (len(x.shape) - 1,) or \
                not 1 <= x.shape[-1] <= MAX_COLS:
            continue
        p = producers.get(x)
        if p is None or p in dropped or p in replaced or only_reader(x) is not r or \
                len(p.outputs) != 1:
            p = None
        pro = program_of(p)
        sums = r.outputs[0]
        readers = sorted(users.get(sums, []), key=order.get)
        q = readers[0] if readers else None
        epi = program_of(q)
        if epi is not None and (tuple(epi.attrs["shape"]) != sums.shape
                                or epi.inputs.count(sums) != 1 or epi.attrs.get("views")
                                or not _float32(epi) or q in replaced or q in dropped):
            epi = None
        if pro is not None and not _float32(pro):
            pro = None
        if epi is None and pro is None:
            continue
        fused_producer = p if pro is not None else None
        pro = pro or _identity(x)
        extra, program, results = _epilogue(epi, sums) if epi is not None else ([], (), ())
        outs = list(epi.outputs) if epi is not None else [sums]
        if epi is not None and (len(readers) > 1 or sums in outputs):
            results, outs = (*results, 0), [*outs, sums]   # register 0: the sums themselves
        if not untouched([*pro.inputs, *extra]):
            continue
        k = len(pro.inputs)
        views = input_views(pro.attrs, k)
        fused = Node("pointwise_sum", [*pro.inputs, *extra], outs,
                     dict(program=pro.attrs["program"], summed=pro.attrs["results"][0],
                          shape=tuple(x.shape), n_prologue=k,
                          views=views if any(v is not None for v in views) else None,
                          epilogue=program, epilogue_results=results),
                     label="+".join(n.label for n in (fused_producer, r, q if epi else None)
                                    if n is not None and n.label))
        last = q if epi is not None else r
        replaced[last] = fused
        dropped.update(n for n in (fused_producer, r) if n is not None and n is not last)
    graph.nodes = [replaced.get(n, n) for n in graph.nodes if n not in dropped]
    return graph
