"""backends/cuda/attention/attention_composed.py without a GPU: its GEMMs over the scores
buffer and its two row kernels run here on NumPy arrays (the GEMM as np.matmul on the very
views the launcher passes, the row kernels as the NumPy emulation below), so the operands'
strides, the batching of the GEMMs (one strided batch, one a head, one a batch entry) and
each product's transposes are checked against torch float64 by the tolerance policy; the
row kernels' launch arguments are checked against the parameters NVRTC compiled, and the
launcher offers the composed path only where it applies. The row kernels themselves are
checked on a GPU (tests/cuda/test_attention_composed_cuda.py)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("cupy")

from stepgraph.backends.cuda.attention import attention, attention_composed  # noqa: E402
from stepgraph.backends.cuda.attention.operands import Heads, Problem  # noqa: E402
from stepgraph.ir.graph import Node, Value  # noqa: E402
from tests.reference import assert_close_to_reference  # noqa: E402
from tests.unit.test_nvrtc_compile import Fake, _nvrtc_usable, assert_args_match  # noqa: E402

LN2, LOG2E = math.log(2.0), 1.0 / math.log(2.0)


def _visible(L: int, S: int, causal: bool) -> np.ndarray:
    keys, rows = np.arange(S)[None, :], np.arange(L)[:, None]
    return keys <= rows + (S - L) if causal else np.ones((L, S), bool)


def _element_view(a, strides, shape):
    return np.lib.stride_tricks.as_strided(a, shape, tuple(s * a.itemsize for s in strides))


def rows_forward(args) -> None:
    """attention.cu sdpa_rows_forward_kernel (no dropout, no mask) on NumPy arrays."""
    scores, lse, _, heads, bh, L, S, ld, scale_log2, causal = args[:10]
    assert int(args[14]) == 0 and int(args[15]) == 0, "the emulation has no dropout or mask"
    assert int(ld) % 4 == 0 and int(ld) >= int(S) and scores.shape[-1] == int(ld)
    s = scores.reshape(int(bh), int(L), int(ld))[..., :int(S)]
    x = np.where(_visible(int(L), int(S), bool(causal)), s * np.float32(scale_log2), -np.inf)
    m = x.max(-1, keepdims=True)
    p = np.exp2(x - m)
    total = p.sum(-1, keepdims=True)
    s[...] = p / total
    lse.reshape(int(bh), int(L))[...] = ((m + np.log2(total)) * LN2)[..., 0]


def rows_backward(args) -> None:
    """attention.cu sdpa_rows_backward_kernel (no dropout, no mask) on NumPy arrays."""
    scores, dscores, lse, out, dout, _, heads, bh, L, S, ld, Ev = args[:12]
    o_st, d_st = [int(x) for x in args[12:15]], [int(x) for x in args[15:18]]
    scale_log2, scale, causal = args[18:21]
    assert int(args[25]) == 0 and int(args[26]) == 0, "the emulation has no dropout or mask"
    bh, L, S, ld, heads = int(bh), int(L), int(S), int(ld), int(heads)
    shape = (bh // heads, heads, L, int(Ev))
    o = _element_view(out, o_st + [1], shape).reshape(bh, L, int(Ev))
    do = _element_view(dout, d_st + [1], shape).reshape(bh, L, int(Ev))
    delta = (o * do).sum(-1, keepdims=True)
    s, ds = scores.reshape(bh, L, ld)[..., :S], dscores.reshape(bh, L, ld)[..., :S]
    x = np.where(_visible(L, S, bool(causal)), s * np.float32(scale_log2), -np.inf)
    p = np.exp2(x - lse.reshape(bh, L, 1) * LOG2E)
    ds[...] = p * (ds - delta) * np.float32(scale)
    s[...] = p


def run_on_numpy(monkeypatch):
    """Point the launcher at NumPy: arrays, GEMMs and the row kernels; returns the launches
    (kernel name, grid, block, args)."""
    launched, memory = [], {}

    def matmul(ctx, a, b, c, trans_a=False, trans_b=False):
        ta = np.swapaxes(a, -1, -2) if trans_a else a
        tb = np.swapaxes(b, -1, -2) if trans_b else b
        c[...] = np.matmul(ta, tb)

    def kernel(source, name):
        assert source == attention.SOURCE

        def launch(grid, block, args, stream=None):
            launched.append((name, grid, block, args))
            (rows_forward if "forward" in name else rows_backward)(args)
        return launch

    def node_memory(node, key, ctx, build):
        if key not in memory:
            memory[key] = build()
        return memory[key]

    monkeypatch.setattr(attention_composed, "cp", np)
    monkeypatch.setattr(attention_composed.gemm, "matmul", matmul)
    monkeypatch.setattr(attention_composed, "_kernel", kernel)
    monkeypatch.setattr(attention_composed, "_node_memory", node_memory)
    return launched


def heads_of(a) -> Heads:
    st = [s // a.itemsize for s in a.strides]
    return Heads(st[0], st[1], st[2])


def operands(layout: str, B: int, H: int, L: int, E: int, rng):
    """q, k, v, out, dout, dq, dk, dv as (B, H, L, E) views (self-attention: S = L, Ev = E):
    "contiguous" arrays, or "packed" heads read out of (B, L, 3 H E) projections (q, k, v,
    and dq, dk, dv) and written into (B, L, H E) ones (out, dout)."""
    if layout == "contiguous":
        arrays = [rng.standard_normal((B, H, L, E)).astype(np.float32) for _ in range(5)]
        return arrays + [np.zeros((B, H, L, E), np.float32) for _ in range(3)]

    def packed(values):
        split = values.reshape(B, L, 3, H, E)
        return [split[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]

    def merged(values):
        return values.reshape(B, L, H, E).transpose(0, 2, 1, 3)
    qkv = packed(rng.standard_normal((B, L, 3 * H * E)).astype(np.float32))
    out, dout = merged(np.zeros((B, L, H * E), np.float32)), \
        merged(rng.standard_normal((B, L, H * E)).astype(np.float32))
    return qkv + [out, dout] + packed(np.zeros((B, L, 3 * H * E), np.float32))


def torch_sdpa(q, k, v, dout, scale, causal, dtype):
    ts = [torch.tensor(np.ascontiguousarray(a), dtype=dtype, requires_grad=True)
          for a in (q, k, v)]
    mask = torch.from_numpy(_visible(q.shape[-2], k.shape[-2], causal))
    out = torch.nn.functional.scaled_dot_product_attention(*ts, attn_mask=mask, scale=scale)
    out.backward(torch.tensor(np.ascontiguousarray(dout), dtype=dtype))
    return [out.detach().numpy()] + [t.grad.numpy() for t in ts]


def torch_lse(q, k, scale, causal, dtype) -> np.ndarray:
    """The logsumexp of each row of the scaled, causally masked scores, by torch in dtype."""
    tq, tk = (torch.tensor(np.ascontiguousarray(a), dtype=dtype) for a in (q, k))
    scores = (tq @ tk.transpose(-1, -2)) * scale
    mask = torch.from_numpy(_visible(q.shape[-2], k.shape[-2], causal))
    return torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1).numpy()


# (layout, B, H, L, E, causal): one strided batch; a GEMM a head (H <= B); a GEMM a batch
# entry (H > B); 65 tokens (a ViT's)
CASES = [("contiguous", 2, 3, 5, 8, False), ("packed", 3, 2, 6, 4, True),
         ("packed", 2, 5, 7, 8, False), ("contiguous", 2, 2, 65, 16, True)]


@pytest.mark.parametrize("layout,B,H,L,E,causal", CASES)
def test_composed_gemms_and_rows_give_torchs_attention(monkeypatch, layout, B, H, L, E,
                                                       causal):
    launched = run_on_numpy(monkeypatch)
    rng = np.random.default_rng(L * 100 + E)
    q, k, v, out, dout, dq, dk, dv = operands(layout, B, H, L, E, rng)
    pb = Problem(B * H, H, L, L, E, E)
    scale = 1.0 / math.sqrt(E)
    attn = attention.Attn(scale, causal)
    lse = np.zeros(B * H * L, np.float32)
    node = Node("sdpa", [], [], {})
    step = np.uint64(0)
    ctx = SimpleNamespace(stream=None)
    attention_composed.forward(ctx, node, pb, [heads_of(a) for a in (q, k, v, out)], q, k, v,
                               out, lse, step, attn.args(None, False) + attention.NO_MASK)
    attention_composed.backward(
        ctx, Node("sdpa_grad", [], [], {}), pb,
        [heads_of(a) for a in (q, k, v, out, dout, dq, dk, dv)], q, k, v, out, dout, lse, step,
        dq, dk, dv, attn.args(None, True) + attention.NO_MASK)
    ref64 = torch_sdpa(q, k, v, dout, scale, causal, torch.float64)
    ref32 = torch_sdpa(q, k, v, dout, scale, causal, torch.float32)
    for name, got, r64, r32 in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref64, ref32):
        assert_close_to_reference(got, r64, r32, f"{layout} {name}")
    lse64, lse32 = (torch_lse(q, k, scale, causal, dtype)
                    for dtype in (torch.float64, torch.float32))
    assert_close_to_reference(lse.reshape(B, H, L), lse64, lse32, f"{layout} lse")
    assert [name for name, *_ in launched] == [attention_composed.FORWARD,
                                               attention_composed.BACKWARD]
    for _, grid, block, _ in launched:
        assert block == (attention.THREADS,) and grid[0] * 4 >= B * H * L


def test_gemm_batches_follow_the_layout(monkeypatch):
    """One strided batch where every operand's (batch, head) strides collapse, else one GEMM
    a head (heads <= batch) or a batch entry."""
    run_on_numpy(monkeypatch)
    rng = np.random.default_rng(0)
    for layout, B, H, launches in (("contiguous", 4, 3, 1), ("packed", 4, 3, 3),
                                   ("packed", 2, 5, 2)):
        q, k = operands(layout, B, H, 5, 4, rng)[:2]
        assert attention_composed.gemm_launches(Problem(B * H, H, 5, 5, 4, 4),
                                                [heads_of(q), heads_of(k)]) == launches
        pb = Problem(B * H, H, 5, 5, 4, 4)
        ld = attention_composed.row_stride(pb)
        scores = np.zeros((B * H, 5, ld), np.float32)
        groups = attention_composed.batches(pb, [
            (q, heads_of(q), 5, 4), (k, heads_of(k), 5, 4),
            (scores, attention_composed._scores(pb), 5, 5)])
        assert len(groups) == launches, layout
        for qb, kb, sb in groups:
            sb[...] = np.matmul(qb, np.swapaxes(kb, -1, -2))
        want = np.einsum("bhld,bhsd->bhls", q, k).reshape(B * H, 5, 5)
        np.testing.assert_allclose(scores[..., :5], want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not _nvrtc_usable(), reason="libnvrtc is not loadable")
@pytest.mark.parametrize("p,masked", [(0.0, False), (0.2, True)])
def test_row_kernel_arguments_match_the_kernels(monkeypatch, p, masked):
    launched = []
    monkeypatch.setattr(attention_composed, "_kernel", lambda source, name: (
        lambda grid, block, args, stream=None: launched.append((name, args))))
    monkeypatch.setattr(attention_composed.gemm, "matmul", lambda *a, **k: None)
    monkeypatch.setattr(attention_composed, "_node_memory",
                        lambda node, key, ctx, build: Fake(key[1]))
    monkeypatch.setattr(attention_composed, "batches", lambda pb, ops: [])
    monkeypatch.setattr(attention, "_check_step", lambda step: None)
    pb = Problem(6, 3, 9, 9, 16, 16)
    lay = Heads(3 * 9 * 16, 9 * 16, 16)
    attn = attention.Attn(0.25, True, p, 7, 3)
    step = Fake((), "int64") if p else np.uint64(0)
    mask = attention.Mask(Fake((9, 9)), 0, 0, 9, 1) if masked else None
    tail = attention._mask_args(mask)
    x = Fake((2, 3, 9, 16))
    ctx = SimpleNamespace(stream=None)
    attention_composed.forward(ctx, None, pb, [lay] * 4, x, x, x, x, Fake((54,)), step,
                               attn.args(step, False) + tail)
    attention_composed.backward(ctx, None, pb, [lay] * 8, x, x, x, x, x, Fake((54,)), step,
                                x, x, x, attn.args(step, True) + tail)
    assert [name for name, _ in launched] == [attention_composed.FORWARD,
                                              attention_composed.BACKWARD]
    for name, args in launched:
        assert name in attention_composed.kernel_names()[attention.SOURCE]
        assert_args_match(attention.SOURCE, name, args)


def _paths(monkeypatch, dtype, q_shape, k_shape, capturing=False):
    """The candidates (and key) _run_path hands the autotuner for one sdpa problem."""
    offered = []
    monkeypatch.setattr(attention.autotune, "run_fastest",
                        lambda ctx, key, paths, default: offered.append((key, set(paths))))
    pb = attention.problem(Fake(q_shape, dtype), Fake(k_shape, dtype), Fake(k_shape, dtype))
    ctx = SimpleNamespace(precision="fp32")
    ran = []
    layouts = [Heads(q_shape[1] * q_shape[2] * q_shape[3], q_shape[2] * q_shape[3],
                     q_shape[3])] * 4
    attention._run_path(ctx, Node("sdpa", [], [], {}), True, pb, attention.STORAGE[
        np.dtype(dtype)], attention.Attn(0.1, False), False, layouts,
        lambda: ran.append("fused"), lambda: ran.append("composed"))
    return offered, ran


def test_the_composed_path_is_offered_where_it_applies(monkeypatch):
    offered, ran = _paths(monkeypatch, "float32", (2, 4, 65, 64), (2, 4, 65, 64))
    assert [names for _, names in offered] == [{"fused", "composed"}] and not ran
    assert offered[0][0][0] == "sdpa-path" and offered[0][0][-2:] == (1, ("fused", "composed"))
    for args in (("uint16", (2, 4, 65, 64), (2, 4, 65, 64)),     # bf16: cuDNN or fused
                 ("float32", (2, 4, 65, 64), (2, 2, 65, 64)),    # grouped heads
                 ("float32", (64, 16, 2048, 64), (64, 16, 2048, 64))):   # 16 GiB of scores
        offered, ran = _paths(monkeypatch, *args)
        assert not offered and ran == ["fused"], args


def test_kernels_ahead_add_the_row_kernel_where_the_composed_path_applies(monkeypatch):
    monkeypatch.setenv("STEPGRAPH_DISK_CACHE", "0")
    attrs = dict(scale=0.1, causal=False)

    def ahead(op, dtype, shape, precision="fp32"):
        values = [Value(shape, dtype)] * (3 if op == "sdpa" else 5)
        return attention.kernels_ahead(Node(op, values, [], attrs), precision)

    rows = attention_composed.kernels(True)[0]
    assert rows in ahead("sdpa", "float32", (2, 4, 65, 64))
    assert attention_composed.kernels(False)[0] in ahead("sdpa_grad", "float32", (2, 4, 65, 64))
    assert rows not in ahead("sdpa", "bfloat16", (2, 4, 65, 20), "bf16")
