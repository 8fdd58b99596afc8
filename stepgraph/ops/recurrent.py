"""Recurrent family: unstack, the time steps of a sequence as separate values.

A recurrent layer projects the inputs of every time step at once (one matmul over (T, B, I))
and then walks the steps. Taking step t with `slice` would make each step's gradient a
zero-filled tensor of the whole sequence (slice_grad), and summing T of them costs T times
the sequence: quadratic in T. `unstack` gives all T steps from one node, and its gradient is
one concat of the steps' gradients: linear in T. Where the steps are contiguous ranges of x
(time on the leading axis), the planner makes them views of x and writes the steps' gradients
in place into the concat's output (compile/aliases.py): neither copies.
"""
from __future__ import annotations

import numpy as np

from ..ir.ops import _need, defop, impl, vjp


def unstack_order(n: int, reverse: bool) -> list[int]:
    """The positions along the unstacked axis, in the order of the outputs."""
    return list(range(n - 1, -1, -1) if reverse else range(n))


@defop("unstack")
def _unstack(ins, attrs):
    """ys = x's slices along axis attrs dim (non-negative), each without that axis: ys[k] =
    x[..., k, ...], or x[..., n - 1 - k, ...] when attrs reverse (a reverse-time walk takes
    its first step first). One output per position (at least one)."""
    x, dim = ins[0], int(attrs["dim"])
    _need(0 <= dim < len(x.shape), "unstack", f"dim {dim} out of range for {x.shape}")
    _need(x.shape[dim] >= 1, "unstack", f"axis {dim} of {x.shape} is empty")
    rest = x.shape[:dim] + x.shape[dim + 1:]
    return [(rest, x.dtype)] * x.shape[dim]


@vjp("unstack")
def _unstack_vjp(emit, node, dy, wants) -> list:
    x, dim = node.inputs[0], int(node.attrs["dim"])
    order = unstack_order(x.shape[dim], bool(node.attrs.get("reverse")))
    at = {position: k for k, position in enumerate(order)}
    one = x.shape[:dim] + (1,) + x.shape[dim + 1:]
    pieces = []
    for position in range(x.shape[dim]):
        g = dy[at[position]]
        pieces.append(emit("fill", [], value=0.0, shape=one, dtype=x.dtype)[0] if g is None
                      else emit("reshape", [g], shape=one)[0])
    return [pieces[0] if len(pieces) == 1 else emit("concat", pieces, dim=dim)[0]]


@impl("unstack")
def _unstack_impl(node, ins, outs, ctx):
    x, dim = ins[0], int(node.attrs["dim"])
    for out, position in zip(outs, unstack_order(x.shape[dim], bool(node.attrs.get("reverse")))):
        out[...] = np.take(x, position, axis=dim)
