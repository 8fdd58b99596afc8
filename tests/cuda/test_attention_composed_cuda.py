"""cuda vs numpy for sdpa's composed path (attention_composed.py: cuBLASLt GEMMs over a scores
buffer and attention.cu's two row kernels), forced with attention.PATH = "composed": causal
and not, 65 tokens (three 32-row tiles' waste for the fused kernels), L != S, head dims
32 / 64 / 80, dropout (the dropout op's very mask), additive masks with rows blocked wholly,
fp32 (exact FP32 GEMMs) and tf32; the packed ops (heads read out of a (B, T, 3C) projection:
one GEMM a head); fresh random inputs, outputs poisoned first. A composed forward's lse
feeds the fused backward and the reverse (the backward here always reads numpy's). Reruns and
captured replays give the same bits. Then the autotuner's own choice (PATH "auto") for a
ViT-sized problem runs whichever it picked and matches numpy."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu("nvmath")

from stepgraph.backends.cuda.attention import attention  # noqa: E402
from tests.cuda.helpers import make_node, random, reference, run_cuda  # noqa: E402
from tests.cuda.test_attention_cuda import (  # noqa: E402
    assert_matches, assert_reruns_and_replays_are_bit_identical, forward_and_backward, inputs)
from tests.cuda.test_attention_masks_cuda import mask_of, run_case  # noqa: E402


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("fp32")


@pytest.fixture
def composed(monkeypatch):
    monkeypatch.setattr(attention, "PATH", "composed")


@pytest.mark.parametrize("p", [0.0, 0.2], ids=["nodrop", "drop"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("hd", [32, 64, 80])
@pytest.mark.parametrize("t", [1, 7, 65, 256])
def test_composed_sdpa_matches_numpy(ctx, impls, composed, t, hd, causal, p):
    rng = np.random.default_rng([601, t, hd, causal, int(p * 10)])
    forward_and_backward(ctx, impls, rng, (2, 3), t, t, hd, hd, causal, p)


@pytest.mark.parametrize("lead,length,s,e,ev,causal", [
    ((3,), 5, 9, 20, 12, False),        # L != S, odd head dims
    ((2, 2), 33, 70, 64, 48, True),     # causal aligned bottom-right, Ev < E
    ((2, 1), 70, 33, 100, 128, False),  # more queries than keys
    ((), 40, 40, 64, 64, True),         # no leading dims
])
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["nodrop", "drop"])
def test_composed_sdpa_shapes_match_numpy(ctx, impls, composed, lead, length, s, e, ev,
                                          causal, p):
    rng = np.random.default_rng([607, length, s, e, ev, int(p * 10)])
    forward_and_backward(ctx, impls, rng, lead, length, s, e, ev, causal, p)


@pytest.mark.parametrize("kind,shape", [("bool", (2, 1, 1, 65)), ("finite", (1, 3, 65, 65)),
                                        ("blocked", (2, 3, 65, 65))])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_composed_masked_sdpa_matches_numpy(ctx, impls, composed, kind, shape, p):
    rng = np.random.default_rng([613, len(kind), int(p * 10)])
    run_case(ctx, impls, rng, (2, 3), (2, 3), 65, 65, 64, mask_of(rng, shape, kind), p=p)


def test_composed_sdpa_tf32_matches_numpy(backend, impls, composed):
    """TF32 GEMMs (the inputs rounded to 10 mantissa bits): errors of a few 1e-4 of the
    norm, bounded at 2e-3 as the fused kernels' tf32 test."""
    rng = np.random.default_rng(617)
    tf32 = backend.make_context("tf32")
    ins = inputs(rng, (2, 3), 65, 65, 64, 64, 0.0)
    attrs = dict(scale=0.125, causal=True, dropout_p=0.0)
    node = make_node("sdpa", ins, **attrs)
    want = reference(node, ins)
    for name, g, w in zip(("out", "lse"), run_cuda(tf32, node, ins, impls), want):
        assert_matches(g, w, name, tol=2e-3)
    grad_ins = [random(rng, *want[0].shape)] + ins + want
    grad = make_node("sdpa_grad", grad_ins, **attrs)
    for name, g, w in zip(("dq", "dk", "dv"), run_cuda(tf32, grad, grad_ins, impls),
                          reference(grad, grad_ins)):
        assert_matches(g, w, name, tol=2e-3)


@pytest.mark.parametrize("b,heads", [(3, 2), (2, 5)])     # a GEMM a head; a batch entry
def test_composed_packed_sdpa_qkv_matches_numpy(ctx, impls, composed, b, heads):
    rng = np.random.default_rng([619, b, heads])
    t, d = 65, 32
    qkv = random(rng, b, t, 3 * heads * d)
    attrs = dict(heads=heads, scale=1.0 / np.sqrt(d), causal=True, dropout_p=0.0)
    node = make_node("sdpa_qkv", [qkv], **attrs)
    want = reference(node, [qkv])
    got = run_cuda(ctx, node, [qkv], impls)
    assert_matches(got[0], want[0], "out")
    assert_matches(got[1], want[1], "lse")
    grad_ins = [random(rng, *want[0].shape), qkv] + want
    grad = make_node("sdpa_qkv_grad", grad_ins, **attrs)
    assert_matches(run_cuda(ctx, grad, grad_ins, impls)[0], reference(grad, grad_ins)[0],
                   "dqkv")


def test_composed_reruns_and_replays_are_bit_identical(ctx, impls, composed):
    rng = np.random.default_rng(631)
    assert_reruns_and_replays_are_bit_identical(ctx, impls, rng, (2, 3), 65, 64, True, 0.2,
                                                replays=3)


def test_the_timed_choice_runs_and_matches_numpy(backend, impls):
    """PATH "auto": the first eager call times the fused kernels against the composed GEMMs
    for a ViT's problem (128 x 4 heads, 65 tokens, head dim 64) and runs the faster."""
    rng = np.random.default_rng(641)
    ctx = backend.make_context("fp32")
    forward_and_backward(ctx, impls, rng, (128, 4), 65, 65, 64, 64, False, 0.0)
    chosen = {key[1]: ctx.paths[key] for key in ctx.paths if key[0] == "sdpa-path"}
    assert set(chosen) == {"forward", "backward"}
    assert set(chosen.values()) <= set(attention.PATHS)
    print("chosen:", chosen)
