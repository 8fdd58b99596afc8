"""Linear family: the 2-D product matmul and linear (x @ w.T + b, an optional activation
fused). `product_vjp` is the product ops' VJP rule, bmm's too.
"""
from __future__ import annotations

import numpy as np

from ..ir.graph import Node
from ..ir.ops import Emit, _need, defop, impl, vjp
from .activation import act_forward


@defop("matmul")
def _matmul(ins, attrs):
    """c = op(a) @ op(b), op = transpose when attrs trans_a / trans_b. 2-D only.
    With attrs["bias_grad"] (trans_a only: a weight gradient dw = dz^T @ x) a second output
    db = a.sum(0), the sums of op(a) over k: the bias gradient beside it
    (compile/fuse.py fuse_matmul_bias_grad), which the GEMM's epilogue can produce.
    With attrs["add_c"] a third input c of the result's shape and dtype (float32 or float64)
    and the result op(a) @ op(b) + c: a sum that read the product alone
    (compile/matmul_add.py), which the GEMM adds as cuBLASLt's C with beta = 1."""
    a, b = ins[:2]
    _need(len(ins) == 2 + bool(attrs.get("add_c")), "matmul",
          f"{len(ins)} inputs with add_c={bool(attrs.get('add_c'))}: a, b and c only with add_c")
    _need(len(a.shape) == 2 and len(b.shape) == 2, "matmul",
          f"2-D operands, got {a.shape} @ {b.shape}")
    m, k = a.shape[::-1] if attrs.get("trans_a") else a.shape
    k2, n = b.shape[::-1] if attrs.get("trans_b") else b.shape
    _need(k == k2, "matmul", f"inner dims differ: {a.shape} @ {b.shape} with {attrs}")
    if attrs.get("add_c"):
        _check_addend(ins[2], (m, n), a.dtype, attrs)
    if attrs.get("bias_grad"):
        _need(bool(attrs.get("trans_a")), "matmul", "bias_grad needs trans_a (dz^T @ x)")
        return [((m, n), a.dtype), ((m,), a.dtype)]
    return [((m, n), a.dtype)]


def _check_addend(c, shape: tuple, dtype: str, attrs: dict) -> None:
    """add_c's c: the result's shape and dtype, a wide float (in 16 bits the unfused graph
    rounds the product before the add, the GEMM would not), no bias_grad beside it."""
    _need(not attrs.get("bias_grad"), "matmul", "add_c and bias_grad together (one epilogue)")
    _need(c.shape == shape and c.dtype == dtype, "matmul",
          f"add_c's c is {c.dtype}{list(c.shape)}, the product {dtype}{list(shape)}")
    _need(dtype in ("float32", "float64"), "matmul",
          f"add_c in {dtype}: only float32 or float64 products take a c")


@defop("linear")
def _linear(ins, attrs):
    """y = act(x @ w.T + b); x (N, K), w (M, K), b (M,) optional; act = attrs["act"] or None.
    With attrs["save_preact"] a second output z = x @ w.T + b (what act_grad needs)."""
    x, w = ins[0], ins[1]
    _need(len(x.shape) == 2, "linear", f"input must be (batch, features), got {x.shape}")
    _need(x.shape[1] == w.shape[1], "linear",
          f"input has {x.shape[1]} features, weight expects {w.shape[1]}")
    if len(ins) == 3:
        _need(ins[2].shape == (w.shape[0],), "linear", f"bias shape {ins[2].shape}")
    out = ((x.shape[0], w.shape[0]), x.dtype)
    return [out, out] if attrs.get("save_preact") else [out]


def product_vjp(op: str):
    """The VJP rule of a product op `op` (matmul, bmm): c = op(a) @ op(b), op = transpose
    where attrs trans_a / trans_b. d op(a) = g @ op(b).T and d op(b) = op(a).T @ g, transposed
    back where the operand entered transposed; the flags absorb every transpose."""
    def rule(emit: Emit, node: Node, dy: list, wants) -> list:
        (g,), (a, b) = dy, node.inputs
        ta, tb = bool(node.attrs.get("trans_a")), bool(node.attrs.get("trans_b"))
        da = db = None
        if wants(0):
            da = (emit(op, [b, g], trans_a=tb, trans_b=True) if ta
                  else emit(op, [g, b], trans_b=not tb))[0]
        if wants(1):
            db = (emit(op, [g, a], trans_a=True, trans_b=ta) if tb
                  else emit(op, [a, g], trans_a=not ta))[0]
        return [da, db]
    return rule


_product_rule = product_vjp("matmul")


@vjp("matmul")
def _matmul_vjp(emit: Emit, node: Node, dy: list, wants) -> list:
    if node.attrs.get("add_c"):
        raise NotImplementedError("matmul: no VJP with add_c; compile/matmul_add.py makes "
                                  "such nodes after autodiff, differentiate the matmul and add")
    return _product_rule(emit, node, dy, wants)


@vjp("linear")
def _linear_vjp(emit: Emit, node: Node, dy: list, wants) -> list:
    (g,), (x, w) = dy, node.inputs[:2]
    dx = emit("matmul", [g, w])[0] if wants(0) else None
    dw = emit("matmul", [g, x], trans_a=True)[0] if wants(1) else None
    grads = [dx, dw]
    if len(node.inputs) == 3:
        grads.append(emit("reduce_sum", [g], axes=(0,))[0] if wants(2) else None)
    return grads


@impl("matmul")
def matmul(node: Node, ins, outs, ctx):
    a, b = ins[:2]
    if node.attrs.get("bias_grad"):
        outs[1][...] = a.sum(axis=0)      # as reduce_sum(a, axes=(0,)) computes it
    a = a.T if node.attrs.get("trans_a") else a
    b = b.T if node.attrs.get("trans_b") else b
    np.matmul(a, b, out=outs[0])
    if node.attrs.get("add_c"):
        np.add(outs[0], ins[2], out=outs[0])    # as the add it replaced: the stored product + c


@impl("linear")
def linear(node: Node, ins, outs, ctx):
    x, w = ins[0], ins[1]
    z = x @ w.T
    if len(ins) == 3:
        z += ins[2]
    kind = node.attrs.get("act")
    outs[0][...] = z if kind is None else act_forward(z, kind, node.attrs.get("slope", 0.01))
    if node.attrs.get("save_preact"):
        outs[1][...] = z
