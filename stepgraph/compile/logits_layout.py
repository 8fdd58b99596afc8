"""Logits stored classes-first where their rows would break the GEMMs' alignment.

A language model's head computes logits = x @ w.T, (N, C); cross_entropy_train reads them and
writes dlogits, which two GEMMs read: dx = dlogits @ w and dw = dlogits.T @ x. When a row of
C classes is not a multiple of 16 bytes (a 65-character vocabulary: 130-byte bf16 rows), all
three GEMMs have a matrix whose leading dimension breaks the 16-byte alignment of cuBLASLt's
tensor-core kernels, and they fall back to kernels that load an element at a time (on an
H200, 66 us a step of gpt bf16's three CUTLASS align1 GEMMs). Stored transposed, (C, N),
those matrices lead with the N rows, and the same products run aligned:

    logits.T = w @ x.T                       matmul(w, x, trans_b)
    (loss, dlogits.T) = cross_entropy_train(logits.T, labels, classes_first)
    dx = (dlogits.T).T @ w, dw = dlogits.T @ x     each reader's transpose flag flipped

Where: cross_entropy_train reads the output of a linear without bias or activation, alone and
no graph output; every reader of dlogits is a matmul without bias_grad (whose sums follow
the operand's layout), and dlogits is no graph output; N rows make 16-byte aligned rows of
the transposed layout. The products are the same sums (other GEMM kernels may add them in
another order); the loss kernel reads a column of C classes a sample (backends/cuda/loss.cu).
"""
from __future__ import annotations

from ..ir.graph import Graph, Node, Value, itemsize
from .rewrite import _copy, _rebuild, sole_reader

ALIGNMENT = 16       # bytes a GEMM operand's leading dimension needs for the aligned kernels


def _aligned(elements: int, dtype: str) -> bool:
    return elements * itemsize(dtype) % ALIGNMENT == 0


def _plain_linear(node: Node | None) -> bool:
    return node is not None and node.op == "linear" and len(node.inputs) == 2 and \
        node.attrs.get("act") is None and not node.attrs.get("save_preact")


def _gradient_products(graph: Graph, users, dlogits: Value) -> list[Node] | None:
    """The matmuls reading dlogits as a factor, when they are all its readers and none sums
    a bias."""
    readers = users.get(dlogits, [])
    if not readers or dlogits in graph.outputs.values() or any(
            r.op != "matmul" or r.attrs.get("bias_grad") or dlogits in r.inputs[2:]
            for r in readers):
        return None
    return readers


def transpose_unaligned_logits(graph: Graph) -> Graph:
    """The heads the module docstring describes, with their logits stored classes-first."""
    graph = _copy(graph)
    users, producers = graph.consumers(), graph.producers()
    subst: dict[Value, Value] = {}
    for ce in graph.nodes:
        if ce.op != "cross_entropy_train" or ce.attrs.get("classes_first"):
            continue
        logits, dlogits = ce.inputs[0], ce.outputs[1]
        (rows, classes), dtype = logits.shape, logits.dtype
        head = producers.get(logits)
        readers = _gradient_products(graph, users, dlogits)
        if _aligned(classes, dtype) or not _aligned(rows, dtype) or not _plain_linear(head) \
                or sole_reader(graph, users, logits) is not ce or readers is None:
            continue
        x, w = head.inputs
        logits_t, dlogits_t = Value((classes, rows), dtype), Value((classes, rows), dlogits.dtype)
        head.op, head.inputs, head.outputs, head.attrs = "matmul", [w, x], [logits_t], \
            {"trans_b": True}
        ce.inputs[0], ce.outputs[1] = logits_t, dlogits_t
        ce.attrs["classes_first"] = True
        for r in readers:
            for slot, flag in enumerate(("trans_a", "trans_b")):
                if r.inputs[slot] is dlogits and not r.attrs.pop(flag, False):
                    r.attrs[flag] = True
        subst[dlogits] = dlogits_t
    return _rebuild(graph, graph.nodes, subst)
