"""Launchers of the recurrent family on the cuda backend, and its op table.

unstack copies each step of a sequence into its own contiguous output with shape.cu's slice
kernel (a slice of length one along the axis, viewed without it): no kernel of its own.
"""
from __future__ import annotations

from typing import Callable

from ...errors import ShapeError
from ...ops.recurrent import unstack_order
from .runtime.launch import _check
from .shape import slice_forward


def unstack_forward(ctx, x, ys, dim: int, reverse: bool) -> None:
    """ys[k] = x[..., position k, ...] along dim (positions reversed when `reverse`)."""
    _check("unstack input", x, dtype=None)
    if not 0 <= dim < x.ndim or len(ys) != x.shape[dim]:
        raise ShapeError(f"unstack: {len(ys)} outputs for axis {dim} of {tuple(x.shape)}")
    one = tuple(x.shape[:dim]) + (1,) + tuple(x.shape[dim + 1:])
    for y, position in zip(ys, unstack_order(x.shape[dim], reverse)):
        _check("unstack output", y, dtype=str(x.dtype))
        slice_forward(ctx, x, y.reshape(one), dim, position, position + 1)


IMPLS: dict[str, Callable] = {
    "unstack": lambda node, ins, outs, ctx: unstack_forward(
        ctx, ins[0], outs, int(node.attrs["dim"]), bool(node.attrs.get("reverse"))),
}
