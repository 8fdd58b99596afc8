"""fold_zeros: products and sums with a constant-zero operand, folded before autodiff.

A recurrent layer without a given initial state starts from zeros (`new_zeros`: a fill), so
its first step multiplies zeros by W_hh: a GEMM whose result is known, and in the backward a
product whose term of dW_hh is zero. The pass follows known zeros (a fill of 0, a constant
of zeros, a reshape of either) through the forward graph:

- matmul, or linear without bias and activation, with a zero operand: a fill of zeros of its
  output (no GEMM, no gradient terms for the other operand);
- add, or binary add, of a zero and a value of the result's shape and dtype: that value;
- lstm_cell with two gate addends, one of them zero: the other alone (the op sums them).

Run before autodiff, the gradients then hold no term of the folded products at all.
Semantics: a product with zeros is zeros here even where the other operand holds inf or NaN
(IEEE gives NaN there); a non-finite weight still shows in every later use of it.
"""
from __future__ import annotations

from ..ir.graph import Graph, Node, Value
from .rewrite import _copy, _rebuild

SUM_KINDS = ("add",)


def _zero_source(node: Node) -> bool:
    """node writes zeros whatever its inputs: a fill of 0, a constant of zeros."""
    if node.op == "fill":
        return node.attrs.get("value") == 0
    if node.op == "constant":
        array = node.attrs["data"].array
        return array.size > 0 and not array.any()
    return False


def _zeros(out: Value, label: str) -> Node:
    return Node("fill", [], [out], {"value": 0.0, "shape": tuple(out.shape),
                                    "dtype": out.dtype}, (), label)


def _product_of_zero(node: Node, zero: set[Value]) -> bool:
    if node.op == "matmul":
        return any(v in zero for v in node.inputs)
    if node.op == "linear":
        plain = len(node.inputs) == 2 and node.attrs.get("act") is None \
            and not node.attrs.get("save_preact")
        return plain and any(v in zero for v in node.inputs)
    return False


def _sum_with_zero(node: Node, zero: set[Value]) -> Value | None:
    """The operand an add of a zero equals (shape and dtype of the result), else None."""
    is_sum = node.op == "add" or (node.op == "binary" and node.attrs.get("kind") in SUM_KINDS)
    if not is_sum or len(node.inputs) != 2:
        return None
    out = node.outputs[0]
    for z, other in (node.inputs, node.inputs[::-1]):
        if z in zero and other.shape == out.shape and other.dtype == out.dtype:
            return other
    return None


def fold_zeros(graph: Graph, kept: tuple[Value, ...] = ()) -> Graph:
    """The graph with products and sums of known zeros folded (the module docstring); values
    it no longer reads are left to dead-code elimination. kept: values held outside the
    graph (the loss), which stay computed by a node of their own."""
    graph = _copy(graph)
    outputs = set(graph.outputs.values()) | set(kept)
    zero: set[Value] = set()
    subst: dict[Value, Value] = {}
    nodes: list[Node] = []
    for n in graph.nodes:
        n.inputs = [subst.get(v, v) for v in n.inputs]
        if _zero_source(n) or (n.op == "reshape" and n.inputs[0] in zero):
            zero.update(n.outputs)
        elif _product_of_zero(n, zero):
            n = _zeros(n.outputs[0], n.label)
            zero.add(n.outputs[0])
        elif (kept := _sum_with_zero(n, zero)) is not None and n.outputs[0] not in outputs:
            subst[n.outputs[0]] = kept
            continue
        elif n.op == "lstm_cell" and len(n.inputs) == 3:
            addends = [v for v in n.inputs[:2] if v not in zero]
            if len(addends) == 1:
                n.inputs = [addends[0], n.inputs[2]]
        nodes.append(n)
    return _rebuild(graph, nodes, subst)
