"""Reduce family: reduce_sum over given axes (bias gradients, broadcast operands' gradients)."""
from __future__ import annotations

from ..ir.graph import Node
from ..ir.ops import defop, impl, vjp


@defop("reduce_sum")
def _reduce_sum(ins, attrs):
    """y = x.sum(axis=attrs["axes"]) (no keepdims)."""
    x = ins[0]
    axes = tuple(attrs["axes"])
    return [(tuple(d for i, d in enumerate(x.shape) if i not in axes), x.dtype)]


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


@impl("reduce_sum")
def reduce_sum(node: Node, ins, outs, ctx):
    outs[0][...] = ins[0].sum(axis=tuple(node.attrs["axes"]))
