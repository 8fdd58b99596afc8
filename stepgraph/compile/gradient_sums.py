"""Gradient sums that autodiff writes as `add` nodes, taken into the nodes that read them.

fuse_product_sums: sum_k a_kᵀ b_k  =>  [a_1; ...; a_n]ᵀ [b_1; ...; b_n]. A weight used n times
in a step (an unrolled recurrence's W_hh at every time step, a tied weight) gets n gradients
matmul(g_k, x_k, trans_a) that autodiff sums with `add` nodes: n small GEMMs, each writing a
gradient of the weight's size, all of them live until the sum reads them. Stacking the
operands' rows gives the same sum from one GEMM over all rows: two concats of the operands
(copies of what the n GEMMs read anyway), one GEMM with a long inner dimension (far better
use of the GPU than n short ones), one output of the weight's size.

fuse_cell_grad_sums: an LSTM step's h' feeds the layer's output and the next step, so its
gradient is an add of two terms; lstm_cell_grad (ops/lstm_cell.py) takes both terms and adds
them itself: one kernel fewer per time step.
"""
from __future__ import annotations

import numpy as np

from ..ir.graph import Graph, Node, Value
from .rewrite import _copy, _join, _rebuild

MIN_PRODUCTS = 2


def _is_sum(node: Node) -> bool:
    return node.op == "add" and len(node.inputs) == 2


def _sum_roots(graph: Graph, users, outputs: set) -> list[Node]:
    """The add nodes that end an add tree: read by something other than one more add, or a
    graph output."""
    return [n for n in graph.nodes if _is_sum(n) and not (
        len(users.get(n.outputs[0], [])) == 1 and _is_sum(users[n.outputs[0]][0])
        and n.outputs[0] not in outputs)]


def _leaves(v: Value, producers, users, outputs: set, tree: list[Node]) -> list[Value]:
    """The terms of the add tree computing v, its add nodes appended to `tree`: an add's
    input is a term unless it is itself an add read by nothing else."""
    node = producers[v]
    tree.append(node)
    terms = []
    for u in node.inputs:
        p = producers.get(u)
        if p is not None and _is_sum(p) and len(users.get(u, [])) == 1 and u not in outputs:
            terms += _leaves(u, producers, users, outputs, tree)
        else:
            terms.append(u)
    return terms


def _gradient_product(v: Value, producers, users, outputs: set) -> Node | None:
    """The matmul(a, b, trans_a) writing v, when the sum is v's only reader."""
    p = producers.get(v)
    if p is None or p.op != "matmul" or not p.attrs.get("trans_a") or p.attrs.get("trans_b"):
        return None
    if len(users.get(v, [])) != 1 or v in outputs:
        return None
    # Only products with a short inner dimension (operands no bigger than the gradient): the
    # stacked operands then live longer than the n GEMMs' did, but take less memory than
    # the n gradients of the weight's size that the sum kept.
    if sum(int(np.prod(a.shape)) for a in p.inputs) > int(np.prod(v.shape)):
        return None
    return p


def _first_written(product: Node, position: dict[Value, int]) -> int:
    """Where the earlier of a product's operands is written (-1: an external). Stacking the
    products in this order lays their rows out in forward order (an unrolled recurrence's
    time order, where autodiff sums them last step first): the order in which the forward's
    own stacks hold those rows, so the planner can read the stack as a view of them
    (compile/aliases.py) instead of copying."""
    return min(position.get(v, -1) for v in product.inputs)


def _stacked(products: list[Node], label: str) -> tuple[list[Node], Value]:
    """concat the products' operands along their rows, one matmul: its nodes and output."""
    nodes, operands = [], []
    for k in range(2):
        parts = [p.inputs[k] for p in products]
        rows = sum(v.shape[0] for v in parts)
        stacked = Value((rows, parts[0].shape[1]), parts[0].dtype)
        nodes.append(Node("concat", parts, [stacked], {"dim": 0}, (), label))
        operands.append(stacked)
    out = Value(products[0].outputs[0].shape, products[0].outputs[0].dtype)
    nodes.append(Node("matmul", operands, [out], dict(products[0].attrs), (), label))
    return nodes, out


def _sum_nodes(terms: list[Value], root: Value, label: str) -> list[Node]:
    """A chain of adds of `terms` (at least two) whose last writes `root`."""
    nodes, acc = [], terms[0]
    for k, t in enumerate(terms[1:]):
        out = root if k == len(terms) - 2 else Value(root.shape, root.dtype)
        nodes.append(Node("add", [acc, t], [out], {}, (), label))
        acc = out
    return nodes


def fuse_product_sums(graph: Graph) -> Graph:
    """add trees summing >= MIN_PRODUCTS matmul(a_k, b_k, trans_a) of one result shape and
    operand dtypes, each with operands no bigger than its result  =>  concat(a_k),
    concat(b_k) (dim 0), one matmul, added to the other terms. The products are stacked in
    the order their operands were written (_first_written)."""
    graph = _copy(graph)
    producers, users = graph.producers(), graph.consumers()
    position = {v: i for i, n in enumerate(graph.nodes) for v in n.outputs}
    outputs = set(graph.outputs.values())
    roots = _sum_roots(graph, users, outputs)
    drop: set[Node] = set()
    replace: dict[Node, list[Node]] = {}
    subst: dict[Value, Value] = {}
    for root in roots:
        tree: list[Node] = []
        terms = _leaves(root.outputs[0], producers, users, outputs, tree)
        groups: dict[tuple, list[Node]] = {}
        for t in terms:
            p = _gradient_product(t, producers, users, outputs)
            if p is not None:
                key = (t.shape, p.inputs[0].dtype, p.inputs[1].dtype)
                groups.setdefault(key, []).append(p)
        groups = {k: ps for k, ps in groups.items() if len(ps) >= MIN_PRODUCTS}
        if not groups:
            continue
        label = _join(root.label, *(p.label for ps in groups.values() for p in ps))
        new: list[Node] = []
        merged = {p.outputs[0] for ps in groups.values() for p in ps}
        rest = [t for t in terms if t not in merged]
        for ps in groups.values():
            nodes, out = _stacked(sorted(ps, key=lambda p: _first_written(p, position)), label)
            new += nodes
            rest.append(out)
            drop.update(ps)
        if len(rest) == 1:       # every term merged: the matmul's output is the sum
            subst[root.outputs[0]] = rest[0]
        else:
            new += _sum_nodes(rest, root.outputs[0], label)
        drop.update(tree)
        replace[root] = new
    nodes = [m for n in graph.nodes for m in replace.get(n, [] if n in drop else [n])]
    return _rebuild(graph, nodes, subst)


def fuse_cell_grad_sums(graph: Graph) -> Graph:
    """add(a, b) -> dh; lstm_cell_grad(dh, ...) with dh its only reader   =>
    lstm_cell_grad(a, b, ...) with attrs dh = 2."""
    graph = _copy(graph)
    producers, users = graph.producers(), graph.consumers()
    outputs = set(graph.outputs.values())
    drop: set[Node] = set()
    for n in graph.nodes:
        if n.op != "lstm_cell_grad" or int(n.attrs.get("dh", 0)) != 1:
            continue
        dh = n.inputs[0]
        p = producers.get(dh)
        if p is None or not _is_sum(p) or len(users.get(dh, [])) != 1 or dh in outputs \
                or any(v.shape != dh.shape or v.dtype != dh.dtype for v in p.inputs):
            continue
        n.inputs = [*p.inputs, *n.inputs[1:]]
        n.attrs = dict(n.attrs, dh=2)
        n.label = _join(n.label, p.label)
        drop.add(p)
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], {})
