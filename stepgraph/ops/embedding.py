"""Embedding family: row lookup in a (V, C) table and its gradient (PyTorch's F.embedding).

The gradient sums the rows of dy per index. The NumPy reference adds them in position order
(np.add.at); the CUDA kernels do without float atomics, so both are deterministic.
"""
from __future__ import annotations

import numpy as np

from ..ir.ops import _need, defop, impl, vjp

INDEX_DTYPES = ("int32", "int64")
WEIGHT_DTYPES = ("float32", "float64", "float16")     # float16: a model.half()'s table


@defop("embedding")
def _embedding(ins, attrs):
    """out[..., :] = weight[idx[...], :]; ins (weight (V, C) float32, float64 or float16, idx
    int32/int64 of any shape) -> out idx.shape + (C,) of weight's dtype. An index outside [0, V) gives a row of
    NaN (PyTorch raises; a device kernel cannot)."""
    weight, idx = ins
    _need(len(weight.shape) == 2, "embedding", f"weight must be (V, C), got {weight.shape}")
    _need(weight.dtype in WEIGHT_DTYPES, "embedding",
          f"weight must be float32, float64 or float16, got {weight.dtype}")
    _need(idx.dtype in INDEX_DTYPES, "embedding", f"indices must be int32 or int64, got "
          f"{idx.dtype}")
    return [(tuple(idx.shape) + (weight.shape[1],), weight.dtype)]


@defop("embedding_grad")
def _embedding_grad(ins, attrs):
    """dweight (attrs num_embeddings, C) = the rows of dy (idx.shape + (C,)) summed per index
    (rows of indices outside [0, V) are dropped); ins (dy, idx)."""
    dy, idx = ins
    _need(idx.dtype in INDEX_DTYPES, "embedding_grad",
          f"indices must be int32 or int64, got {idx.dtype}")
    _need(len(dy.shape) == len(idx.shape) + 1 and tuple(dy.shape[:-1]) == tuple(idx.shape),
          "embedding_grad", f"dy {dy.shape} must be indices {idx.shape} + (C,)")
    return [((int(attrs["num_embeddings"]), dy.shape[-1]), dy.dtype)]


@vjp("embedding")
def _embedding_vjp(emit, node, dy, wants) -> list:
    weight, idx = node.inputs
    dweight = emit("embedding_grad", [dy[0], idx],
                   num_embeddings=weight.shape[0])[0] if wants(0) else None
    return [dweight, None]                     # indices have no gradient


@impl("embedding")
def _embedding_impl(node, ins, outs, ctx):
    weight, idx = ins
    # rows counted by the indices, not -1: a row of 0 elements leaves -1 undetermined
    flat = idx.reshape(-1)
    out = outs[0].reshape(flat.size, weight.shape[1])
    valid = (flat >= 0) & (flat < weight.shape[0])
    if valid.all():
        np.take(weight, flat, axis=0, out=out)
        return
    out[...] = np.nan
    out[valid] = weight[flat[valid]]


@impl("embedding_grad")
def _embedding_grad_impl(node, ins, outs, ctx):
    dy, idx = ins
    dweight = outs[0]
    flat = idx.reshape(-1)
    rows = dy.reshape(flat.size, dy.shape[-1])
    valid = (flat >= 0) & (flat < dweight.shape[0])
    dweight[...] = 0
    np.add.at(dweight, flat[valid], rows[valid])
