"""Batched matrix multiply: c[i] = op(a[i]) @ op(b[i]) over a leading batch axis, the flags
as matmul's. Tensor @ on 3-D/4-D operands and scaled_dot_product_attention use it."""
from __future__ import annotations

import numpy as np

from ..ir.ops import _need, defop, impl, vjp
from .linear import product_vjp


@defop("bmm")
def _bmm(ins, attrs):
    """c (B, M, N) = op(a) @ op(b) per batch entry, op = transpose of the last two axes when
    attrs trans_a / trans_b; ins a (B, M, K) (or (B, K, M) with trans_a), b (B, K, N) (or
    (B, N, K) with trans_b), same dtype."""
    a, b = ins
    _need(len(a.shape) == 3 and len(b.shape) == 3, "bmm",
          f"3-D operands (batch, rows, cols), got {a.shape} @ {b.shape}")
    _need(a.shape[0] == b.shape[0], "bmm", f"batch sizes differ: {a.shape} @ {b.shape}")
    _need(a.dtype == b.dtype, "bmm", f"dtypes differ: {a.dtype} vs {b.dtype}")
    m, k = a.shape[:0:-1] if attrs.get("trans_a") else a.shape[1:]
    k2, n = b.shape[:0:-1] if attrs.get("trans_b") else b.shape[1:]
    _need(k == k2, "bmm", f"inner dims differ: {a.shape} @ {b.shape} with {attrs}")
    return [((a.shape[0], m, n), a.dtype)]


# As matmul's rule, per batch entry.
vjp("bmm")(product_vjp("bmm"))


@impl("bmm")
def _bmm_impl(node, ins, outs, ctx):
    a, b = ins
    a = a.transpose(0, 2, 1) if node.attrs.get("trans_a") else a
    b = b.transpose(0, 2, 1) if node.attrs.get("trans_b") else b
    np.matmul(a, b, out=outs[0])
