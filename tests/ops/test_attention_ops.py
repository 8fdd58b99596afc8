"""The attention family (sdpa, sdpa_grad) on the NumPy backend: against PyTorch's
scaled_dot_product_attention (forward, logsumexp and gradients; causal and not, given scales,
L != S, E != Ev), and against the composed path it replaces (bmm, softmax, dropout, bmm)
with dropout on: the same mask, so the same outputs and gradients, through the functional
API and through a whole GPT train step. Finite differences of the VJP are in test_ops_fd.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import stepgraph as sg
from stepgraph import models, optim
from stepgraph.errors import ShapeError
from stepgraph.nn import functional as F
from stepgraph.ops.softmax import causal_mask
from stepgraph.autodiff import append_backward
from stepgraph.ir.trace import Tracer
from tests.reference import assert_close_to_reference
from tests.ops.helpers import (assert_close, op_forward, op_vjp, randn, run_graph, seeded,
                               trace_inputs)

RTOL = {np.float64: 1e-10, np.float32: 3e-5}
DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])

# (leading dims, L, S, E, Ev, causal, scale)
SHAPES = [((2, 3), 5, 5, 4, 4, True, None), ((2,), 7, 7, 8, 3, True, 0.3),
          ((2, 2), 3, 6, 4, 5, False, None), ((3,), 1, 1, 4, 4, False, 2.0),
          ((1, 2), 4, 9, 6, 6, True, None), ((2,), 9, 4, 3, 3, False, 0.5)]


def qkv(gen, lead, length, s, e, ev, dtype):
    return {"q": randn(gen, *lead, length, e, dtype=dtype),
            "k": randn(gen, *lead, s, e, dtype=dtype),
            "v": randn(gen, *lead, s, ev, dtype=dtype)}


def torch_reference(arrays, dout, causal, scale):
    """PyTorch's out, logsumexp rows and gradients; a causal mask with L < S aligned
    bottom-right, as the op's (PyTorch's is_causal aligns it top-left)."""
    q, k, v = (torch.tensor(arrays[n], requires_grad=True) for n in "qkv")
    x = q @ k.transpose(-2, -1) * scale
    if causal:
        x = x.masked_fill(torch.from_numpy(causal_mask(*x.shape[-2:])), float("-inf"))
        out = torch.softmax(x, -1) @ v
        if x.shape[-2] == x.shape[-1]:      # the library's own kernel agrees
            want = TF.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            np.testing.assert_allclose(out.detach().numpy(), want.detach().numpy(),
                                       rtol=1e-4, atol=1e-5)
    else:
        out = TF.scaled_dot_product_attention(q, k, v, scale=scale)
    grads = torch.autograd.grad(out, [q, k, v], torch.tensor(dout))
    lse = torch.logsumexp(x, -1)
    return [out.detach().numpy(), lse.detach().numpy()], [g.numpy() for g in grads]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-{s[1]}x{s[2]}-{s[5]}")
@DTYPES
def test_sdpa_matches_torch(shape, dtype):
    lead, length, s, e, ev, causal, scale = shape
    gen = seeded(f"sdpa{shape}{np.dtype(dtype)}")
    arrays = qkv(gen, lead, length, s, e, ev, dtype)
    scale = 1 / math.sqrt(e) if scale is None else scale
    attrs = dict(scale=scale, causal=causal, dropout_p=0.0)
    out, lse = op_forward("sdpa", arrays, **attrs)
    assert out.dtype == dtype and lse.dtype == dtype and lse.shape == (*lead, length)
    dout = randn(gen, *out.shape, dtype=dtype)
    (want_out, want_lse), want_grads = torch_reference(arrays, dout, causal, scale)
    assert_close(out, want_out, RTOL[dtype], "out")
    assert_close(lse, want_lse, RTOL[dtype], "lse")
    grads = op_vjp("sdpa", arrays, dout, ("q", "k", "v"), **attrs)
    for name, want in zip("qkv", want_grads):
        assert grads[name].dtype == dtype
        assert_close(grads[name], want, RTOL[dtype], f"grad of {name}")


def test_sdpa_saves_float32_logsumexp_and_checks_shapes():
    gen = seeded("sdpa-shapes")
    arrays = qkv(gen, (2,), 3, 4, 5, 2, np.float32)
    out, lse = op_forward("sdpa", arrays, scale=0.5, causal=True, dropout_p=0.0)
    assert out.shape == (2, 3, 2) and lse.shape == (2, 3) and lse.dtype == np.float32
    tracer, t = Tracer(), None
    t = trace_inputs(tracer, {"q": np.zeros((2, 5, 4), np.float32),
                              "k": np.zeros((2, 3, 4), np.float32),
                              "w": np.zeros((2, 3, 200), np.float32),
                              "s": np.zeros((), np.int64)})
    q, k, w, s = (t[n].value for n in "qkws")
    bad = [([q, k, k], dict(causal=True), "rows <= keys"),
           ([q, w, w], {}, "fit together"),
           ([k, k, w], {}, "head dims up to 128"),
           ([q, k, k], dict(dropout_p=0.2, seed=0, site=0), "step counter"),
           ([q, k, k, s], dict(dropout_p=1.0, seed=0, site=0), r"\[0, 1\)"),
           ([q, k], {}, "not enough values|fit|inputs")]
    for ins, attrs, match in bad:
        with pytest.raises((ShapeError, ValueError), match=match):
            tracer.emit("sdpa", ins, **attrs)


# ---- the composed path (bmm, softmax, dropout, bmm) and sdpa draw one dropout mask ---------

def attention_graph(arrays, dropout_p, causal, composed, monkeypatch, seed=3):
    """F.scaled_dot_product_attention traced in training mode (after one dropout op, so its
    site is 1), loss = sum(out * target); outputs out and the gradients of q, k, v."""
    if composed:
        monkeypatch.setattr(F, "MAX_HEAD_DIM", 0)
    tracer = Tracer(seed=seed, training=True)
    ins = trace_inputs(tracer, arrays)
    q = F.dropout(ins["q"], 0.1)                           # takes dropout site 0
    out = F.scaled_dot_product_attention(q, ins["k"], ins["v"], dropout_p=dropout_p,
                                         is_causal=causal)
    monkeypatch.undo()
    loss = (out * ins["target"]).sum()
    grads = append_backward(tracer, loss.value, [ins[n].value for n in "qkv"])
    tracer.graph.outputs = {"out": out.value, **{f"d{n}": g for n, g in zip("qkv", grads)}}
    ops = {n.op for n in tracer.graph.nodes}
    assert ("sdpa" in ops) != composed and ("softmax" in ops) == composed
    return tracer.graph


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("step", [0, 11, 2**32 + 5])
@DTYPES
def test_sdpa_dropout_is_the_composed_paths(monkeypatch, causal, step, dtype):
    gen = seeded(f"sdpa-drop{causal}{step}{np.dtype(dtype)}")
    arrays = qkv(gen, (2, 3), 7, 7, 4, 5, dtype)
    arrays["target"] = randn(gen, 2, 3, 7, 5, dtype=dtype)
    bound = lambda: {"optimizer.step": np.array(step, np.int64)}     # noqa: E731
    got = run_graph(attention_graph(arrays, 0.4, causal, False, monkeypatch), arrays, bound())
    want = run_graph(attention_graph(arrays, 0.4, causal, True, monkeypatch), arrays, bound())
    for name in want:
        assert_close(got[name], want[name], RTOL[dtype], name)
    # and the dropout did drop something
    assert not np.allclose(got["out"], run_graph(
        attention_graph(arrays, 0.0, causal, False, monkeypatch), arrays, bound())["out"])


def test_sdpa_forward_is_bitwise_the_composed_forward(monkeypatch):
    """The NumPy reference runs the composed ops' arithmetic: the forward matches bit for bit."""
    gen = seeded("sdpa-bitwise")
    arrays = qkv(gen, (2, 2), 6, 6, 4, 4, np.float32)
    arrays["target"] = randn(gen, 2, 2, 6, 4)
    bound = {"optimizer.step": np.array(3, np.int64)}
    got = run_graph(attention_graph(arrays, 0.25, True, False, monkeypatch), arrays, bound)
    want = run_graph(attention_graph(arrays, 0.25, True, True, monkeypatch), arrays, bound)
    np.testing.assert_array_equal(got["out"], want["out"])


def test_gpt_train_step_with_sdpa_matches_the_composed_path(monkeypatch):
    """Three train steps of a small GPT with attention dropout on: the sdpa emission and the
    composed one draw the same masks (sites and step counter included) and so give the same
    losses and parameters. (SGD: the key bias's gradient is zero up to rounding, which Adam
    would blow up to full-sized steps.)"""
    vocab, block, batch = 11, 8, 3
    base = models.gpt(vocab, block_size=block, n_layer=2, n_head=2, n_embd=16, dropout=0.3)
    gen = np.random.default_rng(5)
    data = [(gen.integers(0, vocab, (batch, block)), gen.integers(0, vocab, (batch, block)))
            for _ in range(3)]
    results = []
    for composed in (False, True):
        if composed:
            monkeypatch.setattr(F, "MAX_HEAD_DIM", 0)
        model = models.gpt(vocab, block_size=block, n_layer=2, n_head=2, n_embd=16,
                           dropout=0.3)
        model.load_state_dict(base.state_dict())
        step = sg.compile_train_step(model, loss=models.next_token_loss,
                                     optimizer=optim.SGD(lr=0.1, momentum=0.9),
                                     example_inputs=data[0],
                                     device="cpu", seed=7)
        losses = [float(step(x, y)) for x, y in data]
        results.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
    (got, got_params), (want, want_params) = results
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for key, value in want_params.items():
        assert_close(got_params[key], value, 1e-4, key)


def test_sdpa_gradients_of_large_scores_stay_near_float64():
    """Scores of size ~100 (inputs in [-9, 9], as OpInfo draws them): the backward's
    exp(s - lse) rows carry lse's float32 rounding; dq and dk must still be as close to float64
    as torch's float32 (they were 10x farther before the rows were renormalised)."""
    gen = seeded("sdpa-large-scores")
    for trial in range(3):
        arrays = {n: gen.uniform(-9, 9, s).astype(np.float32)
                  for n, s in (("q", (4, 3, 8)), ("k", (4, 6, 8)), ("v", (4, 6, 8)))}
        dout = gen.uniform(-9, 9, (4, 3, 8)).astype(np.float32)
        attrs = dict(scale=1 / math.sqrt(8), causal=False, dropout_p=0.0)
        grads = op_vjp("sdpa", arrays, dout, ("q", "k", "v"), **attrs)
        refs = {}
        for dtype in (torch.float64, torch.float32):
            q, k, v = (torch.tensor(arrays[n], dtype=dtype, requires_grad=True) for n in "qkv")
            out = TF.scaled_dot_product_attention(q, k, v)
            refs[dtype] = torch.autograd.grad(out, [q, k, v], torch.tensor(dout, dtype=dtype))
        for i, name in enumerate("qkv"):
            assert_close_to_reference(grads[name], refs[torch.float64][i].numpy(),
                                      refs[torch.float32][i].numpy(), f"{trial}: d{name}")
