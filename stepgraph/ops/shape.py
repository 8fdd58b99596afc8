"""Shape family: permute (materialised transpose), and the VJPs of reshape-like reductions."""
from __future__ import annotations

import numpy as np

from ..autodiff.rules import vjp
from ..backends.numpy.kernels import impl
from ..ir.ops import _need, defop


@defop("permute")
def _permute(ins, attrs):
    """y = x.transpose(attrs dims) materialised (contiguous); dims is a permutation."""
    x, dims = ins[0], tuple(attrs["dims"])
    _need(sorted(dims) == list(range(len(x.shape))), "permute",
          f"dims {dims} is not a permutation of the {len(x.shape)} axes of {x.shape}")
    return [(tuple(x.shape[d] for d in dims), x.dtype)]


@vjp("permute")
def _permute_vjp(emit, node, dy, wants) -> list:
    inverse = tuple(int(i) for i in np.argsort(node.attrs["dims"]))
    return [emit("permute", [dy[0]], dims=inverse)[0]]


@impl("permute")
def _permute_impl(node, ins, outs, ctx):
    outs[0][...] = ins[0].transpose(tuple(node.attrs["dims"]))


@vjp("reduce_sum")
def _reduce_sum_vjp(emit, node, dy, wants) -> list:
    """dx = dy viewed with the summed axes kept as 1, then expanded to x's shape."""
    x = node.inputs[0]
    axes = {a % len(x.shape) for a in node.attrs["axes"]}
    kept = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    g = dy[0]
    if tuple(g.shape) != kept:
        g = emit("reshape", [g], shape=kept)[0]
    if kept != tuple(x.shape):
        g = emit("expand", [g], shape=tuple(x.shape))[0]
    return [g]
