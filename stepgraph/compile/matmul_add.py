"""A GEMM adds its C operand: add(matmul(a, b), x) -> matmul(a, b, x, add_c) -> the sum.

Autodiff sums a value's gradients with `add` (autodiff/vjp.py accumulate). Where the value
feeds a Linear and something else (a hidden layer read by two branches, a block's input read
by its attention and its convolution), one term is the Linear's input gradient dx = g @ w, a
GEMM, and the add after it reads dx and the other term and writes their sum: a launch and a
pass over three arrays of the activation's size. cuBLASLt computes D = op(A) @ op(B) + beta C
with C an input of its own, so with beta = 1 the GEMM adds the other term as it stores its
result, and dx never reaches memory (backends/cuda/matmul/gemm.py GemmSpec.add_c).

Where: the product (or its reshape: a Linear on (..., K) inputs traces as reshape -> linear
-> reshape, so its dx is a view of the (N, K) product) is read by that add alone and is no
graph output; the add's operands and result have one shape (no broadcasting) and dtype,
float32 or float64 (a 16-bit product is rounded where the matmul stores it, before the add;
the GEMM would add c to its float32 sum and round once: other bits); the matmul has no
bias_grad and no add_c yet. The fused node runs where the add ran (everything it reads is
made by then), and nothing may write a, b or x in place between the matmul and the add, so
it reads what they read. Through a reshape, c is x viewed at the product's 2-D shape and the
result is viewed back as the add's output (views: no kernel, compile/aliases.py).

On the NumPy backend the fused node stores the product and adds c in its dtype, as the two
nodes did: the same bits (tests/unit/test_matmul_add.py).
"""
from __future__ import annotations

from ..ir.graph import Graph, Node, Value
from .aliases import view_roots
from .rewrite import _copy, _join, sole_reader, splice

WIDE_DTYPES = ("float32", "float64")


def _is_add(node: Node) -> bool:
    return (node.op == "add" or (node.op == "binary" and node.attrs.get("kind") == "add")) \
        and len(node.inputs) == 2


def _product_of(graph: Graph, users, producers, v: Value, add: Node) \
        -> tuple[Node, Node | None] | None:
    """(matmul, reshape or None): the plain matmul whose product `add` reads as v, directly or
    through one reshape, each read by the next alone."""
    view = producers.get(v)
    if view is not None and view.op == "reshape":
        mm = producers.get(view.inputs[0])
        hops = [(view.inputs[0], view), (v, add)]
    else:
        mm, view, hops = view, None, [(v, add)]
    if mm is None or mm.op != "matmul" or mm.attrs.get("bias_grad") or mm.attrs.get("add_c"):
        return None
    if any(sole_reader(graph, users, value) is not reader for value, reader in hops):
        return None
    return mm, view


def _plain_sum(add: Node) -> bool:
    """add sums two distinct values of its result's shape and dtype, float32 or float64."""
    out = add.outputs[0]
    return out.dtype in WIDE_DTYPES and add.inputs[0] is not add.inputs[1] and \
        all(v.shape == out.shape and v.dtype == out.dtype for v in add.inputs)


def _written_between(writes: list[tuple[int, Value]], start: int, stop: int) -> set[Value]:
    """The buffers (view roots) written in place by the nodes strictly between two
    positions."""
    return {root for i, root in writes if start < i < stop}


def _fused(mm: Node, view: Node | None, add: Node, x: Value) -> list[Node]:
    """The nodes that run where `add` ran: matmul(a, b, x) -> the sum; through a reshape,
    x viewed as the product, the product with it, and the result viewed as the sum."""
    label, attrs, s = _join(mm.label, add.label), dict(mm.attrs, add_c=True), add.outputs[0]
    if view is None:
        return [Node("matmul", [*mm.inputs, x], [s], attrs, (), label)]
    product = mm.outputs[0]
    flat = Value(product.shape, x.dtype)
    return [Node("reshape", [x], [flat], {"shape": product.shape}, (), label),
            Node("matmul", [*mm.inputs, flat], [product], attrs, (), label),
            Node("reshape", [product], [s], {"shape": s.shape}, (), label)]


def fuse_matmul_add(graph: Graph) -> Graph:
    """add(matmul(a, b) [-> reshape], x)   =>   [reshape ->] matmul(a, b, x, add_c) [-> reshape]
    (either argument order) where the module docstring says; of two products (a value read by
    two Linears), the later one takes the add, which then runs where that GEMM nearly did."""
    graph = _copy(graph)
    users, producers = graph.consumers(), graph.producers()
    order = {n: i for i, n in enumerate(graph.nodes)}
    roots = view_roots(graph.nodes)
    writes = [(i, roots.get(n.inputs[k], n.inputs[k]))
              for i, n in enumerate(graph.nodes) for k in n.mutates]
    replaced: dict[Node, list[Node]] = {}
    dropped: set[Node] = set()
    for add in graph.nodes:
        if not _is_add(add) or not _plain_sum(add):
            continue
        found = [(f, x) for v, x in (add.inputs, add.inputs[::-1])
                 if (f := _product_of(graph, users, producers, v, add)) is not None]
        for (mm, view), x in sorted(found, key=lambda fx: -order[fx[0][0]]):
            written = _written_between(writes, order[mm], order[add])
            if any(roots.get(v, v) in written for v in (*mm.inputs, x)):
                continue
            replaced[add] = _fused(mm, view, add, x)
            dropped.update(n for n in (mm, view) if n is not None)
            break
    return splice(graph, replaced, dropped)
