"""cuBLASLt's configurations beyond its heuristic's (matmul/split_k.py) on the GPU: for a
weight gradient's deep, narrow product, cuBLASLt accepts some, each one's product matches
NumPy's float64 one under the fp32 and tf32 bounds of test_gemm_cuda.py, and the autotuner
times them beside the heuristic's own candidates, cutting them all short inside a timing the
product cannot win."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu("nvmath")

from stepgraph.backends.cuda.matmul import gemm, split_k  # noqa: E402
from tests.cuda.helpers import rel_err  # noqa: E402

TOL = {"fp32": 1e-5, "tf32": 3e-3}
M, N, K = 200, 72, 16384           # dw (M, N) = dy^T (M, K) @ x (K, N): K over the batch


def operands(seed, m=M):
    rng = np.random.default_rng(seed)
    dy_t = rng.standard_normal((K, m)).astype(np.float32)      # stored (K, m): trans_a
    x = rng.standard_normal((K, N)).astype(np.float32)
    return dy_t, x, dy_t.astype(np.float64).T @ x.astype(np.float64)


def planned(backend, seed, m=M):
    """An fp32 context, its operands and a NaN-poisoned product on its stream, the float64
    product and the GEMM's plan (a spec another m leaves unplanned in this process)."""
    ctx = backend.make_context("fp32")
    dy_t, x, want = operands(seed, m)
    with ctx.stream:
        a, b = cp.asarray(dy_t), cp.asarray(x)
        c = cp.full((m, N), np.nan, np.float32)
    return ctx, a, b, c, want, ctx.gemm.plan(gemm.matmul_spec(a, b, c, trans_a=True,
                                                                precision="fp32"))


def extra_configurations(ctx, a, b, c, poison):
    """(index, c on the host) after each configuration beyond cuBLASLt's heuristic's of
    c = a^T @ b at ctx's precision, c poisoned before each; cuBLASLt must accept some."""
    spec = gemm.matmul_spec(a, b, c, trans_a=True, precision=ctx.precision)
    assert split_k.wanted(spec)
    cache = gemm.GemmCache(autotune=False)
    try:
        p = cache.plan(spec)
        own = len(p.heuristic)
        rows = split_k.candidates(cache._lt, cache.handle, p, gemm.algo_types(spec))
        assert len(rows) > 0, "cuBLASLt accepted no configuration beyond its heuristic's"
        p.heuristic = np.concatenate([p.heuristic, rows])
        for i in range(own, len(p.heuristic)):
            if not gemm._usable(p, i, cache.workspace_bytes):
                continue
            with ctx.stream:
                c.fill(poison)
            p.algo_ptr = p.algo_address(i)
            cache.run(spec, ctx.stream.ptr, b.data.ptr, a.data.ptr, c.data.ptr)
            ctx.stream.synchronize()
            yield i, cp.asnumpy(c)
    finally:
        cache.close()


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_every_configuration_computes_the_product(backend, precision):
    ctx = backend.make_context(precision)
    dy_t, x, want = operands(1)
    with ctx.stream:        # every buffer made and poisoned on the stream the GEMMs run on
        a, b = cp.asarray(dy_t), cp.asarray(x)
        c = cp.full((M, N), np.nan, np.float32)
    for i, got in extra_configurations(ctx, a, b, c, np.nan):
        assert np.isfinite(got).all(), f"configuration {i}: not every element was written"
        assert rel_err(got, want) < TOL[precision], \
            f"configuration {i}: {rel_err(got, want):.2e}"


def test_the_autotuner_times_them_and_keeps_a_correct_choice(backend, monkeypatch):
    monkeypatch.setenv("STEPGRAPH_DISK_CACHE", "0")       # time here, not a stored choice
    ctx, a, b, c, want, p = planned(backend, 2)
    assert not p.tuned
    offered = len(p.heuristic)
    gemm.matmul(ctx, a, b, c, trans_a=True)             # plans nothing new: tunes p
    ctx.stream.synchronize()
    assert p.tuned and len(p.heuristic) > offered, "no configuration joined the candidates"
    assert rel_err(cp.asnumpy(c), want) < TOL["fp32"]


def test_inside_a_timing_it_cannot_win_its_search_is_cut_short(backend, monkeypatch):
    """A conv's GEMM path timed after a kernel already faster (autotune.enclosing_cut): every
    configuration gets that cut, the first included. Where all of them are past it (here the
    timing says so, as graph.time_on_device does for a candidate past its cut: an eager
    figure), nothing is captured, the product is still right, and the first call outside
    such a timing tunes in full, on the device."""
    from stepgraph.backends.cuda.runtime import autotune, graph

    monkeypatch.setenv("STEPGRAPH_DISK_CACHE", "0")
    real, cuts, timed_in_full = graph.time_on_device, [], []

    def past_every_cut(ctx, run, repeats=5, give_up_above=None):
        cuts.append(give_up_above)
        return graph.EagerMs(1.0)

    def recording(*args, **kwargs):
        ms = real(*args, **kwargs)
        timed_in_full.append(not isinstance(ms, graph.EagerMs))
        return ms

    ctx, a, b, c, want, p = planned(backend, 3, m=136)
    monkeypatch.setattr(graph, "time_on_device", past_every_cut)
    monkeypatch.setattr(autotune._enclosing, "cut", 1e-3, raising=False)
    gemm.matmul(ctx, a, b, c, trans_a=True)
    ctx.stream.synchronize()
    assert len(cuts) > 1 and all(cut == 1e-3 for cut in cuts)
    assert p.tuned and p.cut_short
    assert rel_err(cp.asnumpy(c), want) < TOL["fp32"]
    calls = len(cuts)
    gemm.matmul(ctx, a, b, c, trans_a=True)         # within the same timing: no new search
    assert len(cuts) == calls
    monkeypatch.setattr(graph, "time_on_device", recording)
    monkeypatch.setattr(autotune._enclosing, "cut", None)
    with ctx.stream:
        c.fill(np.nan)
    gemm.matmul(ctx, a, b, c, trans_a=True)
    ctx.stream.synchronize()
    assert len(cuts) == calls and p.tuned and not p.cut_short and any(timed_in_full)
    assert rel_err(cp.asnumpy(c), want) < TOL["fp32"]


def test_a_light_search_keeps_to_the_heuristic_and_a_later_call_searches_in_full(
        backend, monkeypatch):
    """A conv's GEMM path timed the first time (autotune.light_search): only the heuristic's
    candidates are timed; the first call outside that timing joins the split-K
    configurations and times them; the one after searches nothing."""
    from stepgraph.backends.cuda.runtime import autotune, graph

    monkeypatch.setenv("STEPGRAPH_DISK_CACHE", "0")
    real, timings = graph.time_on_device, []

    def counted(*args, **kwargs):
        timings.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(graph, "time_on_device", counted)
    ctx, a, b, c, want, p = planned(backend, 4, m=152)
    offered = len(p.heuristic)
    monkeypatch.setattr(autotune._enclosing, "light", True, raising=False)
    gemm.matmul(ctx, a, b, c, trans_a=True)
    ctx.stream.synchronize()
    assert p.tuned and p.light and not p.extended and len(p.heuristic) == offered
    assert 0 < len(timings) <= offered
    assert rel_err(cp.asnumpy(c), want) < TOL["fp32"]
    monkeypatch.setattr(autotune._enclosing, "light", False)
    timings.clear()
    with ctx.stream:
        c.fill(np.nan)
    gemm.matmul(ctx, a, b, c, trans_a=True)
    ctx.stream.synchronize()
    assert p.tuned and not p.light and p.extended and len(p.heuristic) > offered
    assert len(timings) > offered
    assert rel_err(cp.asnumpy(c), want) < TOL["fp32"]
    timings.clear()
    gemm.matmul(ctx, a, b, c, trans_a=True)
    assert timings == []


def test_a_bf16_narrow_products_splits_add_their_parts_in_float32(backend):
    """A tied LM head's weight gradient at bf16 (dw (65, 384) over 16384 tokens): cuBLASLt
    accepts split configurations beyond its heuristic's, and each adds its parts in float32,
    so every product is NumPy's float64 one within a bf16 ulp and the float32 sum's error
    (about 1e-3 for 16384 unit products; a sum of parts added in bf16, one rounding at the
    running sum's ulp per part, strays by several ulps)."""
    from stepgraph.backends.numpy import bf16

    rng = np.random.default_rng(3)
    g = bf16.to_bits(rng.standard_normal((K, 65)).astype(np.float32))      # (tokens, vocab)
    x = bf16.to_bits(rng.standard_normal((K, 384)).astype(np.float32))
    want = bf16.from_bits(g).astype(np.float64).T @ bf16.from_bits(x).astype(np.float64)
    ctx = backend.make_context("bf16")
    with ctx.stream:
        a, b = cp.asarray(g), cp.asarray(x)
        c = cp.full((65, 384), 0x7FC0, np.uint16)                          # NaN bits
    for i, bits in extra_configurations(ctx, a, b, c, 0x7FC0):
        got = bf16.from_bits(bits).astype(np.float64)
        ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)   # bf16's at want
        far = np.abs(got - want) > ulp + 2e-3
        assert not far.any(), f"configuration {i}: {int(far.sum())} elements off"
