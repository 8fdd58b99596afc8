"""cuda vs numpy for the own attention kernels in bf16 (precision="bf16"; cuDNN's path, taken
where it runs, is switched off here): sdpa_qkv and sdpa_qkv_grad on bf16
q, k, v (the packed ops a GPT's attention becomes), causal and not, with dropout, against the
numpy backend's emulation (float32 arithmetic, each bf16 output rounded once); a small GPT's
bf16 steps on cuda against the emulation's; graph replay against eager, bit for bit.

The kernels read bf16 q, k, v exactly (a bf16 value is a TF32 value) and round to TF32 only
what they compute themselves, the probabilities and dS, before the products that take them:
a relative error of up to 2^-11 per factor, below the 2^-9 of the bf16 rounding of every
output. A bf16 output may then land one ulp from the emulation's, and where a sum cancels
(an output far below the sum of its terms' magnitudes) the TF32 error is larger relative to
the output: outputs compare norm-wise within 4e-3 (one bf16 ulp, 2^-8 = 3.9e-3, of every
element would be that much) and elementwise within 2 ulp or 1% of the largest output."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu("nvmath")

import stepgraph as sg  # noqa: E402
from stepgraph import models, optim  # noqa: E402
from stepgraph.backends.cuda.attention import attention_cudnn  # noqa: E402
from stepgraph.backends.numpy import bf16  # noqa: E402
from stepgraph.ir.graph import BF16  # noqa: E402
from tests.cuda.test_attention_cuda import assert_took, force_tile, tiles_of  # noqa: E402
from tests.cuda.test_bf16_cuda import (POISON, bits, node_of, ordered, rel,  # noqa: E402
                                       run_both)
from tests.ops.helpers import seeded  # noqa: E402


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("bf16")


@pytest.fixture(autouse=True)
def own_kernels(monkeypatch):
    """These tests are the own kernels' (attention.cu); cuDNN's path, which bf16 attention
    takes where cuDNN runs it, is tests/cuda/test_cudnn_attention_cuda.py's."""
    monkeypatch.setattr(attention_cudnn, "USE_CUDNN", False)


def assert_close_bf16(got, want, what):
    assert got.dtype == np.uint16 and got.shape == want.shape, what
    assert not np.any(got == POISON[BF16]), f"{what}: elements left unwritten"
    g, w = bf16.from_bits(got), bf16.from_bits(want)
    assert np.isfinite(g).all(), what
    assert rel(g, w) < 4e-3, (what, rel(g, w))
    far = (np.abs(ordered(got) - ordered(want)) > 2) & \
        (np.abs(g - w) > 1e-2 * np.abs(w).max())
    assert not far.any(), f"{what}: {far.sum()} of {far.size} elements off"


@pytest.mark.parametrize("lead,t,heads,d,causal,p", [
    ((2,), 256, 3, 64, True, 0.2), ((3,), 7, 2, 32, False, 0.0), ((), 33, 2, 128, True, 0.1),
    ((2,), 100, 2, 20, True, 0.0)])
def test_bf16_sdpa_qkv_matches_the_numpy_emulation(backend, ctx, lead, t, heads, d, causal, p,
                                                  request):
    rng = seeded(request.node.name)
    qkv = bits(rng, *lead, t, 3 * heads * d)
    step = [np.array(21, np.int64)] if p else []
    attrs = dict(heads=heads, scale=d ** -0.5, causal=causal, dropout_p=p)
    if p:
        attrs.update(seed=8, site=1)
    check_sdpa_qkv(backend, ctx, rng, qkv, step, attrs)


def check_sdpa_qkv(backend, ctx, rng, qkv, step: list, attrs: dict) -> None:
    """sdpa_qkv and then sdpa_qkv_grad (on a fresh dout) on cuda against the numpy emulation:
    out, lse and dqkv."""
    node = node_of("sdpa_qkv", [qkv] + step, [BF16] + ["int64"] * len(step), **attrs)
    (out_ref, lse_ref), (out, lse), _, _ = run_both(backend, ctx, node, [qkv] + step)
    assert_close_bf16(out, out_ref, "out")
    np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=1e-4, err_msg="lse")
    dout = bits(rng, *out_ref.shape)
    grad = node_of("sdpa_qkv_grad", [dout, qkv, out_ref, lse_ref] + step,
                   [BF16, BF16, BF16, "float32"] + ["int64"] * len(step), **attrs)
    (dqkv_ref,), (dqkv,), _, _ = run_both(backend, ctx, grad,
                                          [dout, qkv, out_ref, lse_ref] + step)
    assert_close_bf16(dqkv, dqkv_ref, "dqkv")


def gpt_steps(devices, graph=False, seed=0, dropout=0.1):
    vocab, block, batch = 65, 32, 4
    base = models.gpt(vocab, block_size=block, n_layer=2, n_head=2, n_embd=64, dropout=dropout)
    rng = np.random.default_rng(seed)
    data = [(rng.integers(0, vocab, (batch, block)), rng.integers(0, vocab, (batch, block)))
            for _ in range(4)]
    steps = []
    for device in devices:
        model = models.gpt(vocab, block_size=block, n_layer=2, n_head=2, n_embd=64,
                           dropout=dropout)
        model.load_state_dict(base.state_dict())
        steps.append(sg.compile_train_step(
            model, loss=models.next_token_loss, optimizer=optim.SGD(lr=0.1, momentum=0.9),
            example_inputs=data[0], device=device, precision="bf16", seed=seed,
            graph=graph if device == "cuda" else False))
    return steps, data


def test_bf16_gpt_steps_match_the_numpy_emulation():
    """Three steps with attention dropout on (the same masks): losses within 1%, and each
    parameter's change over the steps within 2% of the emulation's. The changes are what the
    bf16 gradients made (LayerNorm biases start at 0: they are nothing else), and a gradient
    summed in another order than the emulation's carries a few bf16 roundings (2^-8 = 0.4%
    each) of its terms; a wrong kernel is off by its whole size. SGD, as the float32 GPT
    test: Adam would blow a zero-up-to-rounding gradient up to full steps."""
    check_gpt_steps(dropout=0.1)


def check_gpt_steps(dropout: float) -> None:
    """A small GPT's three bf16 steps on cuda against the emulation's (the test above says
    why these bounds)."""
    (cpu, gpu), data = gpt_steps(["cpu", "cuda"], dropout=dropout)
    start = {k: np.array(v) for k, v in cpu.model.state_dict().items()}
    for x, y in data[:3]:
        lc, lg = float(cpu(x, y)), float(gpu(cp.asarray(x), cp.asarray(y)))
        assert np.isfinite(lg) and abs(lg - lc) <= 1e-2 * abs(lc), (lc, lg)
    ref, got = cpu.model.state_dict(), gpu.model.state_dict()
    for k in ref:
        assert rel(got[k].numpy() - start[k], ref[k].numpy() - start[k]) < 2e-2, k


def test_bf16_gpt_graph_replay_is_bit_identical_to_eager():
    from tests.cuda.test_step_cuda import assert_replay_matches_eager

    (eager, graph), data = gpt_steps(["cuda", "cuda"], seed=3)
    ops = assert_replay_matches_eager(eager, graph, data)
    assert ops.count("sdpa_qkv") == 2 and ops.count("sdpa_qkv_grad") == 2


@pytest.mark.parametrize("t,causal", [(65, False), (100, True)])
@pytest.mark.parametrize("d,tile", [(d, tile) for d in (64, 128) for tile in tiles_of(d)])
def test_bf16_every_candidate_tile_matches_the_numpy_emulation(backend, ctx, monkeypatch, d,
                                                               tile, t, causal, request):
    """Each tile the autotuner may choose, forced, on bf16 storage (the packed ops, own
    kernels): out, lse and dqkv against the emulation at 65 tokens and a causal 100."""
    taken = force_tile(monkeypatch, d, tile)
    rng = seeded(request.node.name)
    check_sdpa_qkv(backend, ctx, rng, bits(rng, 2, t, 3 * 2 * d), [],
                   dict(heads=2, scale=d ** -0.5, causal=causal, dropout_p=0.0))
    assert_took(taken, d, tile)
