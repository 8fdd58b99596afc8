"""cuDNN's fused attention (backends/cuda/attention_cudnn.py), the path bf16 attention takes
where cuDNN runs it: sdpa_qkv, sdpa and their gradients against the numpy backend's bf16
emulation, outputs poisoned first; with dropout, the emulation is given the mask cuDNN drew
(read back through its rng dump), which also checks that the forward used that very mask; the
mask's keep rate and that it is fixed by the step and fresh at the next; a small GPT's bf16
steps without dropout against the emulation; graph replay == eager bit for bit with dropout.
Every test asserts that cuDNN ran (the own kernels' launcher is made to fail).

Tolerances: those of test_bf16_attention_cuda.py (outputs norm-wise within 4e-3, elementwise
within 2 bf16 ulps or 1% of the largest output). cuDNN rounds the probabilities (and in the
gradient dS) to bf16 before their products, where the emulation keeps them float32: a
relative error of up to 2^-9 per term, independent from term to term, so that a sum of many
carries much less than one output rounding."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu("nvmath")

from stepgraph.backends.cuda.attention import attention, attention_cudnn  # noqa: E402
from stepgraph.backends.cuda.conv import conv_cudnn  # noqa: E402

if not conv_cudnn.available():
    pytest.skip(f"cuDNN not usable: {conv_cudnn.unavailable_reason()}", allow_module_level=True)

from stepgraph.ir.graph import BF16  # noqa: E402
from stepgraph.ops import attention as attention_op  # noqa: E402
from tests.cuda.test_bf16_attention_cuda import (assert_close_bf16,  # noqa: E402
                                                  check_gpt_steps, check_sdpa_qkv,
                                                  gpt_steps)
from tests.cuda.test_bf16_cuda import bits, node_of, run_both  # noqa: E402
from tests.ops.helpers import seeded  # noqa: E402


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("bf16")


@pytest.fixture
def cudnn_only(monkeypatch):
    """Fail any launch of the own attention kernels: what passes ran on cuDNN."""
    def refuse(*args, **kwargs):
        raise AssertionError("the own attention kernels ran where cuDNN should have")
    monkeypatch.setattr(attention_cudnn, "USE_CUDNN", True)
    monkeypatch.setattr(attention, "_launch_tile", refuse)


def given_mask(monkeypatch, keep: np.ndarray | None, p: float) -> None:
    """Make the numpy reference drop with `keep` ((bh, L, S) bool) instead of its own rule."""
    if keep is not None:
        monkeypatch.setattr(attention_op, "dropout_keep", lambda node, shape, dtype, step:
                            keep.reshape(shape).astype(dtype) * np.dtype(dtype).type(1 / (1 - p)))


def drawn_mask(ctx, qkv: np.ndarray, heads: int, step, attrs) -> np.ndarray:
    with ctx.stream:       # on the device before the seed and attention kernels read them
        q, k, v = attention.qkv_heads(cp.asarray(qkv), heads)
        step = cp.asarray(step)
    attn = attention.Attn(attrs["scale"], attrs["causal"], attrs["dropout_p"], attrs["seed"],
                          attrs["site"])
    return attention.cudnn_keep_mask(ctx, q, k, v, step, attn)


@pytest.mark.parametrize("lead,t,heads,d,causal,p", [
    ((2,), 256, 3, 64, True, 0.2), ((3,), 7, 2, 32, False, 0.0), ((), 33, 2, 128, True, 0.1),
    ((2,), 100, 2, 16, True, 0.0), ((2,), 64, 2, 64, False, 0.3)])
def test_sdpa_qkv_on_cudnn_matches_the_numpy_emulation(backend, ctx, cudnn_only, monkeypatch,
                                                       lead, t, heads, d, causal, p, request):
    rng = seeded(request.node.name)
    qkv = bits(rng, *lead, t, 3 * heads * d)
    step = [np.array(21, np.int64)] if p else []
    attrs = dict(heads=heads, scale=d ** -0.5, causal=causal, dropout_p=p)
    if p:
        attrs.update(seed=8, site=1)
        given_mask(monkeypatch, drawn_mask(ctx, qkv, heads, step[0], attrs), p)
    check_sdpa_qkv(backend, ctx, rng, qkv, step, attrs)


def test_plain_sdpa_with_more_keys_than_queries_runs_on_cudnn(backend, ctx, cudnn_only,
                                                               request):
    """q, k, v as separate (N, H, rows, D) tensors, L != S, no mask."""
    rng = seeded(request.node.name)
    q, k, v = bits(rng, 2, 2, 24, 32), bits(rng, 2, 2, 80, 32), bits(rng, 2, 2, 80, 32)
    node = node_of("sdpa", [q, k, v], [BF16] * 3, scale=0.2, causal=False)
    (out_ref, lse_ref), (out, lse), _, _ = run_both(backend, ctx, node, [q, k, v])
    assert_close_bf16(out, out_ref, "out")
    np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=1e-4, err_msg="lse")
    dout = bits(rng, *out_ref.shape)
    grad = node_of("sdpa_grad", [dout, q, k, v, out_ref, lse_ref],
                   [BF16] * 5 + ["float32"], scale=0.2, causal=False)
    refs, gots, _, _ = run_both(backend, ctx, grad, [dout, q, k, v, out_ref, lse_ref])
    for name, got, want in zip(("dq", "dk", "dv"), gots, refs):
        assert_close_bf16(got, want, name)


def test_a_bottom_right_causal_mask_stays_on_the_own_kernels(backend, ctx, request):
    """L < S with causal: sdpa's diagonal is the bottom-right one, which cuDNN does not run
    with dropout; the own kernels run it, and draw the reference's very mask."""
    rng = seeded(request.node.name)
    q, k, v = bits(rng, 1, 2, 8, 32), bits(rng, 1, 2, 16, 32), bits(rng, 1, 2, 16, 32)
    step = np.array(4, np.int64)
    attrs = dict(scale=0.2, causal=True, dropout_p=0.1, seed=2, site=7)
    assert "bottom-right" in attention_cudnn.shape_reason(32, 32, True, 8, 16)
    node = node_of("sdpa", [q, k, v, step], [BF16] * 3 + ["int64"], **attrs)
    (out_ref, lse_ref), (out, lse), _, _ = run_both(backend, ctx, node, [q, k, v, step])
    assert_close_bf16(out, out_ref, "out")
    np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=1e-4, err_msg="lse")


def test_the_mask_keeps_one_minus_p_is_fixed_by_the_step_and_fresh_at_the_next(ctx, request):
    rng = seeded(request.node.name)
    qkv = bits(rng, 4, 128, 3 * 4 * 64)
    attrs = dict(scale=0.125, causal=False, dropout_p=0.2, seed=5, site=3)
    first = drawn_mask(ctx, qkv, 4, np.array(9, np.int64), attrs)
    again = drawn_mask(ctx, qkv, 4, np.array(9, np.int64), attrs)
    later = drawn_mask(ctx, qkv, 4, np.array(10, np.int64), attrs)
    other_site = drawn_mask(ctx, qkv, 4, np.array(9, np.int64), attrs | {"site": 4})
    assert np.array_equal(first, again)
    # 262144 elements: the kept fraction's standard deviation is 0.0008
    assert abs(first.mean() - 0.8) < 0.004, first.mean()
    for other in (later, other_site):
        assert abs((first == other).mean() - (0.8 ** 2 + 0.2 ** 2)) < 0.004


def test_bf16_gpt_steps_on_cudnn_match_the_numpy_emulation(cudnn_only):
    """As test_bf16_attention_cuda's GPT test, without dropout (cuDNN's mask is its own)."""
    check_gpt_steps(dropout=0.0)


def test_bf16_gpt_graph_replay_on_cudnn_is_bit_identical_to_eager(cudnn_only):
    from tests.cuda.test_step_cuda import assert_replay_matches_eager

    (eager, graph), data = gpt_steps(["cuda", "cuda"], seed=3, dropout=0.1)
    ops = assert_replay_matches_eager(eager, graph, data)
    assert ops.count("sdpa_qkv") == 2 and ops.count("sdpa_qkv_grad") == 2
