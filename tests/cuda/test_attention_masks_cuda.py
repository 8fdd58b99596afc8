"""cuda vs numpy for the attention kernels' mask and grouped-head paths and head dims 80 / 96:
additive masks (from bool ones: 0 / -inf, and finite values) broadcast over batch, heads,
queries or keys and read through their strides (a strided view, and leading dims that need
the launcher's copy), rows blocked wholly (out 0, lse -inf, no gradient, as the numpy
reference and torch's sdpa), grouped heads (k, v shared by 2 or all query heads; dk, dv summed
per kv head in one block), with causal and dropout on top, in float32 (3xTF32) and bf16 (the
own kernels: cuDNN takes neither). Fresh random inputs, outputs poisoned first. Then a step:
hand-written attention with a runtime key-padding mask and repeat_interleave'd k, v trains on
CUDA as on numpy, its plan one masked grouped sdpa."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu("nvmath")

import stepgraph as sg  # noqa: E402
from stepgraph import optim  # noqa: E402
from stepgraph.ops.attention import seen_inputs  # noqa: E402
from tests.cuda.helpers import make_node, random, reference, run_cuda  # noqa: E402
from tests.cuda.test_attention_cuda import assert_matches  # noqa: E402


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("fp32")


def mask_of(rng, shape, kind):
    """An additive float32 mask: 'bool' 0 / -inf (a third blocked, key 0 always open),
    'finite' normal values, 'blocked' 0 / -inf with some rows blocked wholly."""
    if kind == "finite":
        return random(rng, *shape)
    keep = rng.random(shape) > 0.35
    if kind == "blocked":
        keep[..., 1, :] = False           # query row 1 of every head sees no key
    else:
        keep[..., 0] = True
    return np.where(keep, 0.0, -np.inf).astype(np.float32)


def assert_rows(got, want, what):
    """lse: -inf exactly where the reference has it (blocked rows), the rest close."""
    blocked = np.isneginf(want)
    np.testing.assert_array_equal(np.isneginf(got), blocked, err_msg=what)
    assert_matches(np.where(blocked, 0, got), np.where(blocked, 0, want).astype(want.dtype),
                   what)


def run_case(ctx, impls, rng, lead, kv_lead, length, s, e, mask, causal=False, p=0.0,
             dtype="float32", tol=2e-5, view=None):
    """sdpa and sdpa_grad on cuda and numpy with the same inputs (the backward on numpy's
    out and lse); `view` turns the device mask into a strided view first."""
    ins = [random(rng, *lead, length, e), random(rng, *kv_lead, s, e),
           random(rng, *kv_lead, s, e)]
    attrs = dict(scale=1.0 / np.sqrt(e), causal=causal, dropout_p=p)
    if mask is not None:
        ins.append(mask)
        attrs["mask"] = True
    if p:
        ins.append(np.array(4321, np.int64))
        attrs.update(seed=2**35 + 1, site=2)
    node = make_node("sdpa", ins, **attrs)
    want = reference(node, ins)
    got = run_cuda(ctx, node, ins, impls)
    assert_matches(got[0], want[0], "out", tol=tol)
    assert_rows(got[1], want[1], "lse")
    grad_ins = [random(rng, *want[0].shape)] + ins[:3] + want + ins[3:]
    grad = make_node("sdpa_grad", grad_ins, **attrs)
    got_g, want_g = run_cuda(ctx, grad, grad_ins, impls), reference(grad, grad_ins)
    for name, g, w in zip(("dq", "dk", "dv"), got_g, want_g):
        assert g.shape == w.shape, name
        assert_matches(g, w, name, tol=tol)
    return got, want


# (q lead, kv lead, L, S, E, mask shape or None, mask kind, causal, dropout p)
CASES = {
    "keys-pad": ((2, 3), (2, 3), 37, 70, 64, (2, 1, 1, 70), "bool", False, 0.0),
    "LS-finite": ((2, 2), (2, 2), 64, 64, 32, (64, 64), "finite", False, 0.0),
    "per-head": ((2, 3), (2, 3), 33, 65, 128, (1, 3, 33, 65), "bool", False, 0.0),
    "per-query": ((2, 2), (2, 2), 40, 40, 64, (2, 2, 40, 1), "finite", True, 0.0),
    "blocked": ((2, 2), (2, 2), 20, 31, 64, (2, 2, 20, 31), "blocked", False, 0.0),
    "mask-drop": ((2, 2), (2, 2), 65, 65, 64, (2, 1, 65, 65), "bool", True, 0.2),
    "gqa-2": ((2, 8), (2, 4), 64, 64, 64, None, None, False, 0.0),
    "mqa": ((2, 4), (2, 1), 50, 77, 32, None, None, True, 0.0),
    "gqa-mask-drop": ((2, 6), (2, 2), 70, 70, 64, (2, 1, 1, 70), "bool", True, 0.3),
    "gqa-blocked": ((1, 4), (1, 2), 17, 17, 32, (1, 4, 17, 17), "blocked", False, 0.0),
    "head-80": ((2, 3), (2, 3), 255, 255, 80, None, None, True, 0.0),
    "head-96": ((2, 2), (2, 2), 64, 100, 96, (2, 1, 1, 100), "bool", False, 0.1),
    "head-72-gqa": ((2, 4), (2, 2), 33, 33, 72, None, None, True, 0.0),
    "head-40": ((3,), (3,), 9, 12, 40, (9, 12), "finite", False, 0.0),
}


@pytest.mark.parametrize("name", CASES)
def test_masked_and_grouped_sdpa_matches_numpy(ctx, impls, name):
    lead, kv_lead, length, s, e, mshape, kind, causal, p = CASES[name]
    rng = np.random.default_rng(list(name.encode()))
    mask = None if mshape is None else mask_of(rng, mshape, kind)
    got, _ = run_case(ctx, impls, rng, lead, kv_lead, length, s, e, mask, causal, p)
    if kind == "blocked":
        assert (got[0][..., 1, :] == 0).all()


def test_grouped_heads_of_3d_operands(ctx, impls):
    """(heads, rows, dim) operands of grouped heads: the launcher's (1, heads, ...) views."""
    rng = np.random.default_rng(811)
    run_case(ctx, impls, rng, (6,), (2,), 21, 30, 64, mask_of(rng, (1, 30), "bool"))


def test_mask_leading_dims_the_launcher_copies(ctx, impls):
    """A mask broadcast inside a flattened batch (A, 1, H of (A, B, H)): copied into the
    node's memory, broadcast, then read as any other."""
    rng = np.random.default_rng(823)
    run_case(ctx, impls, rng, (2, 3, 2), (2, 3, 2), 16, 24, 32,
             mask_of(rng, (2, 1, 2, 16, 24), "finite"))


def test_a_strided_mask_is_read_in_place(ctx, impls, monkeypatch):
    """A mask whose rows and keys are strided (a slice of a larger one) is read through its
    strides, no copy: the launcher's copy path is made to fail."""
    from stepgraph.backends.cuda.attention import attention

    rng = np.random.default_rng(829)
    big = mask_of(rng, (2, 1, 2 * 24, 2 * 31), "finite")
    lead, length, s, e = (2, 2), 24, 31, 64
    q, k, v = (random(rng, *lead, n, e) for n in (length, s, s))
    node = make_node("sdpa", [q, k, v, big[:, :, ::2, ::2].copy()], scale=0.125,
                     causal=False, dropout_p=0.0, mask=True)
    monkeypatch.setattr(attention, "_node_memory", lambda *a, **k: pytest.fail("copied"))
    with ctx.stream:
        dev = [cp.asarray(a) for a in (q, k, v)] + [cp.asarray(big)[:, :, ::2, ::2]]
        outs = [cp.full(o.shape, np.nan, o.dtype) for o in node.outputs]
    impls["sdpa"](node, dev, outs, ctx)
    ctx.stream.synchronize()
    want = reference(node, [q, k, v, big[:, :, ::2, ::2].copy()])
    assert_matches(cp.asnumpy(outs[0]), want[0], "out")


@pytest.mark.parametrize("name", ["keys-pad", "gqa-mask-drop", "head-96"])
def test_bf16_masked_and_grouped_sdpa_runs_the_own_kernels(backend, name, monkeypatch):
    """bf16 q, k, v and mask (the autocast lowers the mask with them) on the own kernels,
    cuDNN's path left available (it must decline masks and groups): out, lse and the
    gradients against the numpy backend's bf16 emulation (tests/cuda/
    test_bf16_attention_cuda.py's bound: one bf16 ulp norm-wise)."""
    from stepgraph.backends.cuda.attention import attention_cudnn
    from stepgraph.backends.numpy import bf16
    from stepgraph.ir.graph import BF16
    from tests.cuda.test_bf16_attention_cuda import assert_close_bf16
    from tests.cuda.test_bf16_cuda import bits, node_of, run_both

    monkeypatch.setattr(attention_cudnn, "forward", lambda *a: pytest.fail("cuDNN forward"))
    monkeypatch.setattr(attention_cudnn, "backward", lambda *a: pytest.fail("cuDNN backward"))
    lead, kv_lead, length, s, e, mshape, kind, causal, p = CASES[name]
    rng = np.random.default_rng(list(name.encode()) + [16])
    ins = [bits(rng, *lead, length, e), bits(rng, *kv_lead, s, e), bits(rng, *kv_lead, s, e),
           bf16.to_bits(mask_of(rng, mshape, kind))]
    step = [np.array(99, np.int64)] if p else []
    attrs = dict(scale=1.0 / np.sqrt(e), causal=causal, dropout_p=p, mask=True)
    if p:
        attrs.update(seed=5, site=1)
    ctx = backend.make_context("bf16")
    dtypes = [BF16] * 4 + ["int64"] * len(step)
    node = node_of("sdpa", ins + step, dtypes, **attrs)
    (out_ref, lse_ref), (out, lse), _, _ = run_both(backend, ctx, node, ins + step)
    assert_close_bf16(out, out_ref, "out")
    assert_rows(lse, lse_ref, "lse")
    dout = bits(rng, *out.shape)
    grad_ins = [dout] + ins[:3] + [out_ref, lse_ref] + ins[3:] + step
    grad = node_of("sdpa_grad", grad_ins, [BF16] * 5 + ["float32"] + [BF16]
                   + ["int64"] * len(step), **attrs)
    want, got, _, _ = run_both(backend, ctx, grad, grad_ins)
    for label, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close_bf16(g, w, label)


class PaddedGroupedAttention(sg.nn.Module):
    """Hand-written attention: 4 query heads, 2 kv heads repeat_interleave'd, a key-padding
    mask given with each batch."""

    def __init__(self, c=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, c // heads
        self.q = sg.nn.Linear(c, c)
        self.kv = sg.nn.Linear(c, 2 * kv_heads * self.d)
        self.proj = sg.nn.Linear(c, c)

    def forward(self, x, keep):
        b, t, c = x.shape
        q = self.q(x).view(b, t, self.heads, self.d).transpose(1, 2)
        k, v = self.kv(x).split(self.kv_heads * self.d, dim=2)
        k, v = (a.view(b, t, self.kv_heads, self.d).transpose(1, 2)
                .repeat_interleave(self.heads // self.kv_heads, dim=1) for a in (k, v))
        att = (q @ k.transpose(-2, -1)) * self.d ** -0.5
        att = sg.nn.functional.softmax(att.masked_fill(~keep, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


def test_padded_grouped_attention_trains_on_cuda_as_on_numpy():
    """Five steps, fresh batches (masks included): the CUDA plan runs one masked, grouped sdpa
    (no softmax, no repeat copies) and its losses and weights follow the numpy run's."""
    rng = np.random.default_rng(907)
    batches = []
    for _ in range(5):
        keep = rng.random((4, 1, 1, 24)) > 0.3
        keep[..., 0] = True
        batches.append((random(rng, 4, 24, 64), keep, random(rng, 4, 24, 64)))
    results = {}
    start = PaddedGroupedAttention().state_dict()
    for device in ("cpu", "cuda"):
        model = PaddedGroupedAttention()
        model.load_state_dict(start)
        step = sg.compile_train_step(model, sg.nn.functional.mse_loss, optim.SGD(lr=0.1),
                                     example_inputs=batches[0], device=device)
        ops = [n.op for n in step.plan(step.signature).graph.nodes]
        fused = [n for n in step.plan(step.signature).graph.nodes if n.op == "sdpa"]
        assert len(fused) == 1 and fused[0].attrs["mask"] and "softmax" not in ops, ops
        # k read as its two kv heads (no repeat), through its view of the kv projection
        assert seen_inputs("sdpa", fused[0].inputs, fused[0].attrs)[1].shape == (4, 2, 24, 16)
        losses = [float(step(*b)) for b in batches]
        results[device] = losses, {k: np.asarray(v) for k, v in model.state_dict().items()}
    np.testing.assert_allclose(results["cuda"][0], results["cpu"][0], rtol=1e-4)
    for name, want in results["cpu"][1].items():
        np.testing.assert_allclose(results["cuda"][1][name], want, rtol=1e-4, atol=1e-5,
                                   err_msg=name)
