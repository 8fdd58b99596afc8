"""LSTM cell family: one time step of an LSTM after its two products, and its gradient.

An unrolled LSTM step is two GEMMs (the step's slice of the input projection of the whole
sequence, and h_{t-1} @ W_hh^T) followed by the gates. As separate pointwise ops the gates
cost an add, a copy of each gate block, activations and three fused programs per step, and
the backward as many again; here they are one kernel forward (`lstm_cell`) and one backward
(`lstm_cell_grad`). Gates are torch's: the pre-activations (B, 4H) are the blocks i, f, g, o
of H columns each, and

    i, f, o = sigmoid(.),  g = tanh(.),  c' = f * c + i * g,  h' = o * tanh(c').

The forward saves the activated gates for the backward; tanh(c') is recomputed from c'. The
NumPy references compute in float64 and cast once.
"""
from __future__ import annotations

import numpy as np

from ..ir.ops import _need, defop, impl, vjp

FLOAT_DTYPES = ("float32", "float64")


def _check_gates(op: str, gates: list, c) -> int:
    """H, after checking the gate addends (B, 4H) and the cell state c (B, H)."""
    _need(len(c.shape) == 2, op, f"cell state must be (batch, hidden), got {c.shape}")
    b, h = c.shape
    _need(c.dtype in FLOAT_DTYPES, op, f"float32 or float64 values, got {c.dtype}")
    for k, v in enumerate(gates):
        _need(v.shape == (b, 4 * h) and v.dtype == c.dtype, op,
              f"gate pre-activations {k} must be ({b}, {4 * h}) {c.dtype} for a cell state "
              f"{c.shape}, got {v.shape} {v.dtype}")
    return h


@defop("lstm_cell")
def _lstm_cell(ins, attrs):
    """One LSTM step: ins (*addends, c) with one or two addends (B, 4H) whose sum is the
    gate pre-activations (e.g. x_t W_ih^T + b and h W_hh^T) and the cell state c (B, H), all
    float32 (or float64). Outputs h' (B, H), c' (B, H) and the activated gates (B, 4H) in
    the order i, f, g, o (sigmoid, sigmoid, tanh, sigmoid), which the backward reads."""
    _need(len(ins) in (2, 3), "lstm_cell", f"1 or 2 gate addends and c, got {len(ins)} inputs")
    *gates, c = ins
    h = _check_gates("lstm_cell", gates, c)
    state = (c.shape, c.dtype)
    return [state, state, ((c.shape[0], 4 * h), c.dtype)]


@defop("lstm_cell_grad")
def _lstm_cell_grad(ins, attrs):
    """Gradient of lstm_cell: ins (dh' addends (attrs dh of them: 0, 1 or 2; the
    fusion pass compile/gradient_sums.py hands in both terms of a sum), [dc' when attrs dc],
    gates (the forward's activated gates), c, c'); a gradient not given is zero (at least one
    is). With tc = tanh(c') and dc'' = dc' + dh' * o * (1 - tc^2): outputs
    d(pre-activations) (B, 4H) = (dc'' * g * i(1 - i), dc'' * c * f(1 - f),
    dc'' * i * (1 - g^2), dh' * tc * o(1 - o)) and dc = dc'' * f (B, H)."""
    dh, dc = int(attrs.get("dh", 0)), bool(attrs.get("dc"))
    _need(0 <= dh <= 2 and (dh or dc), "lstm_cell_grad",
          f"needs dh or dc (0 to 2 dh terms), got dh={dh}, dc={dc}")
    _need(len(ins) == dh + dc + 3, "lstm_cell_grad",
          f"{dh + dc + 3} inputs for dh={dh}, dc={dc}, got {len(ins)}")
    grads, (gates, c, c_new) = ins[:dh + dc], ins[dh + dc:]
    _check_gates("lstm_cell_grad", [gates], c)
    for v in (*grads, c_new):
        _need(v.shape == c.shape and v.dtype == c.dtype, "lstm_cell_grad",
              f"{v!r} must be {c.shape} {c.dtype}")
    return [(gates.shape, c.dtype), (c.shape, c.dtype)]


@vjp("lstm_cell")
def _lstm_cell_vjp(emit, node, dy, wants) -> list:
    dh, dc, dgates = dy
    _need(dgates is None, "lstm_cell", "its saved gates are read by the backward only")
    if dh is None and dc is None:
        return [None] * len(node.inputs)
    _, c_new, gates = node.outputs
    c = node.inputs[-1]
    ins = [g for g in (dh, dc) if g is not None] + [gates, c, c_new]
    d_pre, d_c = emit("lstm_cell_grad", ins, dh=int(dh is not None), dc=dc is not None)
    last = len(node.inputs) - 1
    return [d_pre if wants(k) else None for k in range(last)] + [d_c if wants(last) else None]


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


@impl("lstm_cell")
def _lstm_cell_impl(node, ins, outs, ctx):
    *addends, c = (a.astype(np.float64) for a in ins)
    pre = sum(addends[1:], addends[0])
    i, f, g, o = np.split(pre, 4, axis=1)
    i, f, g, o = _sigmoid(i), _sigmoid(f), np.tanh(g), _sigmoid(o)
    c_new = f * c + i * g
    outs[0][...] = o * np.tanh(c_new)
    outs[1][...] = c_new
    outs[2][...] = np.concatenate([i, f, g, o], axis=1)


@impl("lstm_cell_grad")
def _lstm_cell_grad_impl(node, ins, outs, ctx):
    dh_terms, dc_given = int(node.attrs.get("dh", 0)), bool(node.attrs.get("dc"))
    ins = [a.astype(np.float64) for a in ins]
    gates, c, c_new = ins[-3:]
    dh = sum(ins[:dh_terms], np.zeros_like(c))
    dc = ins[dh_terms] if dc_given else np.zeros_like(c)
    i, f, g, o = np.split(gates, 4, axis=1)
    tc = np.tanh(c_new)
    dc = dc + dh * o * (1.0 - tc * tc)
    outs[0][...] = np.concatenate([dc * g * i * (1.0 - i), dc * c * f * (1.0 - f),
                                   dc * i * (1.0 - g * g), dh * tc * o * (1.0 - o)], axis=1)
    outs[1][...] = dc * f
