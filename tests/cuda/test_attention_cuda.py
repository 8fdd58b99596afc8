"""cuda vs numpy for the attention family (sdpa, sdpa_grad): causal and not, T in {1, 7, 64,
255, 256}, head dims 32 / 64 / 128 (and odd ones, zero padded, on the scalar path), L != S,
dropout on and off (the same Philox mask as the dropout op), fresh random inputs, outputs
poisoned first; the packed ops (sdpa_qkv, sdpa_qkv_grad) likewise. The kernels are
deterministic: reruns and captured replays give the same bits, strided operands (heads read
straight out of a packed qkv projection, outputs written in (B, T, heads, hd) order) the same
bits as contiguous ones, and a GPT train step replayed as a graph with attention dropout on
matches eager steps bit for bit (and the NumPy backend's steps to rounding)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu("nvmath")

import stepgraph as sg  # noqa: E402
from stepgraph import models, optim  # noqa: E402
from stepgraph.backends.cuda.attention import attention  # noqa: E402
from stepgraph.backends.cuda.runtime.context import CudaContext  # noqa: E402
from stepgraph.errors import CaptureError  # noqa: E402
from tests.cuda.helpers import (  # noqa: E402
    capture, make_node, poisoned, random, reference, rel_err, run_cuda, to_device, to_host)
from tests.cuda.test_step_cuda import assert_replay_matches_eager  # noqa: E402


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("fp32")


def attrs_of(e: int, causal: bool, p: float) -> dict:
    attrs = dict(scale=1.0 / np.sqrt(e), causal=causal, dropout_p=p)
    if p:
        attrs.update(seed=2**33 + 17, site=3)
    return attrs


def inputs(rng, lead, length, s, e, ev, p, step=12345):
    arrays = [random(rng, *lead, length, e), random(rng, *lead, s, e), random(rng, *lead, s, ev)]
    return arrays + ([np.array(step, np.int64)] if p else [])


def assert_matches(got, want, what, tol=2e-5, floor=0.1):
    """Norm-wise within tol, elementwise within 50 tol of the largest element: float32 sums
    over up to 256 keys and 128 dims, in another order than numpy's. Magnitudes are floored
    at `floor` per element (the inputs' scale is 1): with one key, dq and dk are rounding
    noise around an exact 0."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert np.isfinite(got).all(), f"{what}: not every element written (NaN left)"
    diff = np.linalg.norm((got.astype(np.float64) - want).ravel())
    size = max(np.linalg.norm(want.astype(np.float64).ravel()), floor * np.sqrt(want.size))
    assert diff < tol * size, (what, diff / size)
    np.testing.assert_allclose(got, want, rtol=0, atol=50 * tol * max(np.abs(want).max(), floor),
                               err_msg=what)


def forward_and_backward(ctx, impls, rng, lead, length, s, e, ev, causal, p):
    """The sdpa node and its gradient node, each run by numpy and cuda on the same inputs
    (the backward on the numpy forward's out and lse); asserts they agree."""
    ins = inputs(rng, lead, length, s, e, ev, p)
    attrs = attrs_of(e, causal, p)
    node = make_node("sdpa", ins, **attrs)
    want = reference(node, ins)
    got = run_cuda(ctx, node, ins, impls)
    assert_matches(got[0], want[0], "out")
    assert_matches(got[1], want[1], "lse")
    dout = random(rng, *want[0].shape)
    grad_ins = [dout] + ins[:3] + want + ins[3:]
    grad = make_node("sdpa_grad", grad_ins, **attrs)
    want_g = reference(grad, grad_ins)
    got_g = run_cuda(ctx, grad, grad_ins, impls)
    for name, g, w in zip(("dq", "dk", "dv"), got_g, want_g):
        assert_matches(g, w, name)
    return node, ins, grad, grad_ins


@pytest.mark.parametrize("p", [0.0, 0.2], ids=["nodrop", "drop"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("hd", [32, 64, 128])
@pytest.mark.parametrize("t", [1, 7, 64, 255, 256])
def test_sdpa_matches_numpy(ctx, impls, t, hd, causal, p):
    rng = np.random.default_rng([401, t, hd, causal, int(p * 10)])
    forward_and_backward(ctx, impls, rng, (2, 3), t, t, hd, hd, causal, p)


@pytest.mark.parametrize("lead,length,s,e,ev,causal", [
    ((3,), 5, 9, 20, 12, False),        # L != S, odd dims: the scalar (not float4) path
    ((2, 2), 33, 70, 64, 48, True),     # causal aligned bottom-right, Ev < E
    ((2, 1), 70, 33, 100, 128, False),  # more queries than keys, hd 128 template
    ((4,), 17, 17, 3, 5, True),
    ((), 40, 40, 64, 64, True),         # no leading dims
])
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["nodrop", "drop"])
def test_sdpa_shapes_matches_numpy(ctx, impls, lead, length, s, e, ev, causal, p):
    rng = np.random.default_rng([409, length, s, e, ev, int(p * 10)])
    forward_and_backward(ctx, impls, rng, lead, length, s, e, ev, causal, p)


@pytest.mark.parametrize("t,hd,causal,p", [(256, 64, True, 0.2), (255, 128, False, 0.0),
                                           (7, 32, True, 0.0), (64, 64, False, 0.3)])
def test_sdpa_tf32_matches_numpy(backend, impls, t, hd, causal, p):
    """precision="tf32": the tile products take TF32 inputs (10 explicit mantissa bits, a
    relative rounding of up to 2^-11 = 4.9e-4 per input), as the GEMMs do. Each output is a
    sum of products of two rounded inputs, so errors of a few 1e-4 of its norm are TF32's;
    2e-3 bounds them while a wrong index or a lost tile (errors of order 1) fails."""
    rng = np.random.default_rng([457, t, hd, causal, int(p * 10)])
    ins = inputs(rng, (2, 3), t, t, hd, hd, p)
    attrs = attrs_of(hd, causal, p)
    tf32 = backend.make_context("tf32")
    node = make_node("sdpa", ins, **attrs)
    want = reference(node, ins)
    got = run_cuda(tf32, node, ins, impls)
    for name, g, w in zip(("out", "lse"), got, want):
        assert_matches(g, w, name, tol=2e-3)
    grad_ins = [random(rng, *want[0].shape)] + ins[:3] + want + ins[3:]
    grad = make_node("sdpa_grad", grad_ins, **attrs)
    for name, g, w in zip(("dq", "dk", "dv"), run_cuda(tf32, grad, grad_ins, impls),
                          reference(grad, grad_ins)):
        assert_matches(g, w, name, tol=2e-3)


def test_sdpa_dropout_drops_what_the_dropout_op_drops(ctx, impls):
    """With v = identity rows, out's entries are the dropped probabilities themselves: zero
    exactly where the dropout op's mask (same seed, site, step) is zero."""
    rng = np.random.default_rng(419)
    t = 32
    q, k = random(rng, 2, t, 32), random(rng, 2, t, 32)
    v = np.tile(np.eye(t, 32, dtype=np.float32), (2, 1, 1))
    step = np.array(77, np.int64)
    node = make_node("sdpa", [q, k, v, step], scale=0.2, causal=False, dropout_p=0.5,
                     seed=9, site=4)
    out, _ = run_cuda(ctx, node, [q, k, v, step], impls)
    drop = make_node("dropout", [np.ones((2, t, t), np.float32), step], p=0.5, seed=9, site=4,
                     per_channel=False)
    mask = reference(drop, [np.ones((2, t, t), np.float32), step])[1]
    np.testing.assert_array_equal(out == 0, mask == 0)


def assert_reruns_and_replays_are_bit_identical(ctx, impls, rng, lead, t, hd, causal, p,
                                                 replays=5, fresh_node_raises=False):
    """Forward then gradient (reading the forward's out and lse, as in a step): two eager
    runs, and a captured graph replayed on fresh inputs, against eager runs on the same.
    fresh_node_raises: a gradient node never run eagerly refuses a capture first (its
    scratch is made at the first eager run)."""
    node, ins, grad, grad_ins = forward_and_backward(ctx, impls, rng, lead, t, t, hd, hd,
                                                     causal, p)
    dev = to_device(ctx, ins + [grad_ins[0]])            # q, k, v [, step], dout

    def program(outs, grads):
        impls["sdpa"](node, dev[:-1], outs, ctx)
        impls["sdpa_grad"](grad, [dev[-1]] + dev[:3] + outs + dev[3:-1], grads, ctx)

    if fresh_node_raises:
        cold = CudaContext(stream=ctx.stream, capturing=True, gemm=ctx.gemm)
        fresh_node = make_node("sdpa_grad", grad_ins, **grad.attrs)
        with pytest.raises(CaptureError):             # delta scratch: warm up eagerly first
            impls["sdpa_grad"](fresh_node, to_device(ctx, grad_ins), poisoned(ctx, grad),
                               cold)
    outs, grads = poisoned(ctx, node), poisoned(ctx, grad)
    program(outs, grads)
    first = to_host(ctx, outs + grads)
    assert all(np.isfinite(a).all() for a in first)
    program(outs, grads)
    assert all(np.array_equal(a, b) for a, b in zip(first, to_host(ctx, outs + grads)))
    graph = capture(ctx, lambda: program(outs, grads))
    for step in range(replays):
        fresh = inputs(rng, lead, t, t, hd, hd, p, step=1000 + step)
        fresh.append(random(rng, *lead, t, hd))
        for d, h in zip(dev, fresh):
            d.set(h, stream=ctx.stream)
        eager, eager_grads = poisoned(ctx, node), poisoned(ctx, grad)
        program(eager, eager_grads)
        with ctx.stream:
            for o in outs + grads:
                o.fill(np.nan)
        graph.launch(ctx.stream)
        got, want = to_host(ctx, outs + grads), to_host(ctx, eager + eager_grads)
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.isfinite(w).all()
            np.testing.assert_array_equal(g, w, err_msg=f"replay {step} output {i}")


@pytest.mark.parametrize("causal,p", [(True, 0.2), (False, 0.0)])
def test_sdpa_reruns_and_replays_are_bit_identical(ctx, impls, causal, p):
    rng = np.random.default_rng([421, causal])
    assert_reruns_and_replays_are_bit_identical(ctx, impls, rng, (2, 3), 255, 64, causal, p,
                                                fresh_node_raises=True)


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_strided_heads_give_the_contiguous_bits(ctx, p):
    """q, k, v read as head views of one (B, T, 3C) projection and out written into a
    (B, T, C) buffer in (B, T, heads, hd) order: the bits of contiguous operands."""
    rng = np.random.default_rng([431, int(p * 10)])
    b, t, heads, hd = 3, 100, 4, 64
    c = heads * hd
    qkv = cp.asarray(random(rng, b, t, 3 * c))
    views = [qkv[:, :, i * c:(i + 1) * c].reshape(b, t, heads, hd).transpose(0, 2, 1, 3)
             for i in range(3)]
    dense = [cp.ascontiguousarray(x) for x in views]
    step = cp.asarray(np.array(5, np.int64))
    attn = attention.Attn(0.125, True, p, 11, 2)
    lse, lse_d = cp.empty((b, heads, t), np.float32), cp.empty((b, heads, t), np.float32)
    out_btc = cp.full((b, t, c), np.nan, np.float32)
    out_view = out_btc.reshape(b, t, heads, hd).transpose(0, 2, 1, 3)
    out_d = cp.full((b, heads, t, hd), np.nan, np.float32)
    with ctx.stream:
        attention.sdpa_forward(ctx, *views, out_view, lse, step, attn)
        attention.sdpa_forward(ctx, *dense, out_d, lse_d, step, attn)
    ctx.stream.synchronize()      # asnumpy reads on CuPy's stream, not ordered after ctx's
    np.testing.assert_array_equal(cp.asnumpy(out_view), cp.asnumpy(out_d))
    np.testing.assert_array_equal(cp.asnumpy(lse), cp.asnumpy(lse_d))
    dout = cp.asarray(random(rng, b, t, c))
    dout_view = dout.reshape(b, t, heads, hd).transpose(0, 2, 1, 3)
    dqkv = cp.full((b, t, 3 * c), np.nan, np.float32)
    grads = [dqkv[:, :, i * c:(i + 1) * c].reshape(b, t, heads, hd).transpose(0, 2, 1, 3)
             for i in range(3)]
    grads_d = [cp.full(x.shape, np.nan, np.float32) for x in dense]
    delta, delta_d = cp.empty(b * heads * t, np.float32), cp.empty(b * heads * t, np.float32)
    with ctx.stream:
        attention.sdpa_backward_dq(ctx, *views, out_view, dout_view, lse, step, grads[0],
                                   delta, attn)
        attention.sdpa_backward_dkdv(ctx, *views, dout_view, lse, delta, step, grads[1],
                                     grads[2], attn)
        dout_d = cp.ascontiguousarray(dout_view)
        attention.sdpa_backward_dq(ctx, *dense, out_d, dout_d, lse_d, step, grads_d[0],
                                   delta_d, attn)
        attention.sdpa_backward_dkdv(ctx, *dense, dout_d, lse_d, delta_d, step, grads_d[1],
                                     grads_d[2], attn)
    ctx.stream.synchronize()
    assert np.isfinite(cp.asnumpy(dqkv)).all()
    for g, w in zip(grads, grads_d):
        np.testing.assert_array_equal(cp.asnumpy(g), cp.asnumpy(w))


# ---- a GPT step with attention dropout: graph replay == eager, bit for bit ------------------

def test_gpt_step_graph_replay_is_bit_identical_to_eager_with_dropout():
    vocab, block, batch = 65, 64, 4
    base = models.gpt(vocab, block_size=block, n_layer=2, n_head=2, n_embd=64, dropout=0.2)
    rng = np.random.default_rng(433)
    data = [(rng.integers(0, vocab, (batch, block)), rng.integers(0, vocab, (batch, block)))
            for _ in range(6)]
    steps = []
    for graph in (False, True):
        model = models.gpt(vocab, block_size=block, n_layer=2, n_head=2, n_embd=64,
                           dropout=0.2)
        model.load_state_dict(base.state_dict())
        steps.append(sg.compile_train_step(model, loss=models.next_token_loss,
                                           optimizer=optim.AdamW(lr=1e-3),
                                           example_inputs=data[0], device="cuda", graph=graph,
                                           seed=3))
    ops = assert_replay_matches_eager(*steps, data)    # heads read from the projection
    assert ops.count("sdpa_qkv") == 2 and ops.count("sdpa_qkv_grad") == 2
    assert not {"sdpa", "sdpa_grad", "permute", "slice", "slice_grad"} & set(ops)


def test_gpt_steps_with_dropout_match_numpy():
    """The same GPT trained 3 steps on cpu and cuda with attention dropout on: the same
    masks, so the same losses and parameters to float32 rounding (SGD: Adam would blow the
    key bias's zero-up-to-rounding gradient up to full steps)."""
    vocab, block, batch = 65, 32, 4
    base = models.gpt(vocab, block_size=block, n_layer=2, n_head=2, n_embd=64, dropout=0.2)
    rng = np.random.default_rng(439)
    data = [(rng.integers(0, vocab, (batch, block)), rng.integers(0, vocab, (batch, block)))
            for _ in range(3)]
    runs = []
    for device in ("cpu", "cuda"):
        model = models.gpt(vocab, block_size=block, n_layer=2, n_head=2, n_embd=64,
                           dropout=0.2)
        model.load_state_dict(base.state_dict())
        step = sg.compile_train_step(model, loss=models.next_token_loss,
                                     optimizer=optim.SGD(lr=0.1, momentum=0.9),
                                     example_inputs=data[0], device=device, seed=5)
        losses = [float(step(x, y)) for x, y in data]
        runs.append((losses, {k: np.array(v) for k, v in model.state_dict().items()}))
    (want, want_params), (got, got_params) = runs
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for k, v in want_params.items():
        assert rel_err(got_params[k], v) < 1e-4, k


@pytest.mark.parametrize("lead,t,heads,d,causal,p", [
    ((2,), 255, 3, 64, True, 0.2), ((3,), 7, 2, 32, False, 0.0), ((), 33, 2, 128, True, 0.1),
    ((2, 2), 16, 1, 20, True, 0.3)])
def test_sdpa_qkv_matches_numpy(ctx, impls, lead, t, heads, d, causal, p):
    """The packed ops on the kernels' strided views against the NumPy reference."""
    rng = np.random.default_rng([443, t, heads, d])
    qkv = random(rng, *lead, t, 3 * heads * d)
    step = [np.array(21, np.int64)] if p else []
    attrs = dict(heads=heads, scale=0.3, causal=causal, dropout_p=p)
    if p:
        attrs.update(seed=8, site=1)
    node = make_node("sdpa_qkv", [qkv] + step, **attrs)
    want = reference(node, [qkv] + step)
    got = run_cuda(ctx, node, [qkv] + step, impls)
    for name, g, w in zip(("out", "lse"), got, want):
        assert_matches(g, w, name)
    grad_ins = [random(rng, *want[0].shape), qkv] + want + step
    grad = make_node("sdpa_qkv_grad", grad_ins, **attrs)
    assert_matches(run_cuda(ctx, grad, grad_ins, impls)[0], reference(grad, grad_ins)[0],
                   "dqkv")


def tiles_of(hd: int) -> list[tuple[int, int]]:
    """Every candidate tile of head dim template hd, of any kernel."""
    return sorted({tile for per_hd in attention.CANDIDATES.values() for tile in per_hd[hd]})


def force_tile(monkeypatch, hd: int, tile: tuple[int, int]) -> list:
    """Make `tile` the only candidate of each kernel that has it (the others keep theirs) for
    head dim template hd; return the log of (kind, tile) the launches then take. The fused
    kernels only: the composed path (timed against them) is not a candidate."""
    monkeypatch.setattr(attention, "PATH", "fused")
    for kind, per_hd in attention.CANDIDATES.items():
        if tile in per_hd[hd]:
            monkeypatch.setitem(per_hd, hd, (tile,))
    taken = []
    launch = attention._launch_tile

    def logged(ctx, kind, hd, arith, ctype, tile, pb, args):
        taken.append((kind, tile))
        launch(ctx, kind, hd, arith, ctype, tile, pb, args)

    monkeypatch.setattr(attention, "_launch_tile", logged)
    return taken


def assert_took(taken: list, hd: int, tile: tuple[int, int]) -> None:
    """Every kernel with `tile` among its candidates ran on it, the others on their default."""
    want = {kind: tile if tile in attention.CANDIDATES[kind][hd] else attention.TILES[kind][hd]
            for kind in attention.CANDIDATES}
    assert taken and all(t == want[kind] for kind, t in taken), (taken, want)
    assert {kind for kind, _ in taken} == set(want)


@pytest.mark.parametrize("t,causal,p", [(65, False, 0.0), (100, True, 0.0), (100, True, 0.2)])
@pytest.mark.parametrize("hd,tile", [(hd, tile) for hd in (64, 128) for tile in tiles_of(hd)])
def test_every_candidate_tile_matches_numpy(ctx, impls, monkeypatch, hd, tile, t, causal, p):
    """Each tile the autotuner may choose, forced: forward and both gradients against the
    reference (float32, 3xTF32), at lengths just above a tile multiple (65: a last query
    tile of one row) and causal ones that end mid-tile."""
    taken = force_tile(monkeypatch, hd, tile)
    rng = np.random.default_rng([461, hd, *tile, t, int(p * 10)])
    forward_and_backward(ctx, impls, rng, (2, 3), t, t, hd, hd, causal, p)
    assert_took(taken, hd, tile)
