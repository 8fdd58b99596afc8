"""Launchers of lstm_cell.cu (lstm_cell, lstm_cell_grad) and their cuda op table.

One thread per (batch row, hidden column) over (B, H), reading that column of the four gate
blocks of the (B, 4H) pre-activations: float32 values (precision="bf16" runs the cell in
float32, as autocast does for an op on no list). Launchers check their preconditions and
launch on ctx.stream: no host sync, no allocation.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ...errors import ShapeError
from .runtime.launch import BLOCK, _check, _check_int32, _grid, _launch, _or_null

SOURCE = "lstm_cell.cu"


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    return {SOURCE: {"lstm_cell_forward_kernel", "lstm_cell_backward_kernel"}}


def _cell_shape(what: str, c) -> tuple[int, int]:
    """(B, H) of a cell state, checked float32, contiguous, 2-D."""
    _check(f"{what} c", c)
    if c.ndim != 2:
        raise ShapeError(f"{what}: cell state must be (batch, hidden), got {tuple(c.shape)}")
    _check_int32(what, 4 * c.size)
    return int(c.shape[0]), int(c.shape[1])


def lstm_cell_forward(ctx, xg, hg, c, h_out, c_out, gates) -> None:
    """pre = xg [+ hg] (B, 4H); gates = (sigmoid(i), sigmoid(f), tanh(g), sigmoid(o));
    c_out = f * c + i * g; h_out = o * tanh(c_out). hg may be None."""
    b, h = _cell_shape("lstm_cell", c)
    for what, a in (("xg", xg), ("hg", hg), ("gates", gates)):
        if a is not None:
            _check(f"lstm_cell {what}", a, shape=(b, 4 * h))
    for what, a in (("h'", h_out), ("c'", c_out)):
        _check(f"lstm_cell {what}", a, shape=(b, h))
    if not c.size:
        return
    _launch(ctx, SOURCE, "lstm_cell_forward_kernel", _grid(c.size), (BLOCK,),
            (xg, _or_null(hg), c, h_out, c_out, gates, np.int32(b), np.int32(h)))


def lstm_cell_backward(ctx, dh: list, dc, gates, c, c_new, dpre, dc_prev) -> None:
    """d(pre-activations) (B, 4H) and dc_prev (B, H) from dh' (the sum of the 0 to 2 arrays
    in the list dh) and dc' (None: zero), the forward's activated gates, c and c'."""
    b, h = _cell_shape("lstm_cell_grad", c)
    if not dh and dc is None or len(dh) > 2:
        raise ShapeError(f"lstm_cell_grad: needs dh or dc, and at most 2 dh terms (got "
                         f"{len(dh)} dh terms, dc {'given' if dc is not None else 'None'})")
    for what, a in (*(("dh", t) for t in dh), ("dc", dc), ("c'", c_new), ("dc_prev", dc_prev)):
        if a is not None:
            _check(f"lstm_cell_grad {what}", a, shape=(b, h))
    for what, a in (("gates", gates), ("dpre", dpre)):
        _check(f"lstm_cell_grad {what}", a, shape=(b, 4 * h))
    if not c.size:
        return
    dh1, dh2 = (list(dh) + [None, None])[:2]
    _launch(ctx, SOURCE, "lstm_cell_backward_kernel", _grid(c.size), (BLOCK,),
            (_or_null(dh1), _or_null(dh2), _or_null(dc), gates, c, c_new, dpre, dc_prev,
             np.int32(b), np.int32(h)))


def _forward_impl(node, ins, outs, ctx) -> None:
    *addends, c = ins
    lstm_cell_forward(ctx, addends[0], addends[1] if len(addends) == 2 else None, c, *outs)


def _backward_impl(node, ins, outs, ctx) -> None:
    dh_terms, given_dc = int(node.attrs.get("dh", 0)), bool(node.attrs.get("dc"))
    dc = ins[dh_terms] if given_dc else None
    lstm_cell_backward(ctx, list(ins[:dh_terms]), dc, *ins[-3:], *outs)


IMPLS: dict[str, Callable] = {
    "lstm_cell": _forward_impl,
    "lstm_cell_grad": _backward_impl,
}
