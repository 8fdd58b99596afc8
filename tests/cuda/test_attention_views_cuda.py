"""cuda vs numpy for sdpa and sdpa_grad reading their operands through views and writing their
results permuted (compile/attention_views.py; ops/attention.py attrs views and out_perms):
q, k and v the heads of a packed (B, T, 3C) projection, dout and out read in (B, T, H, D)
order, out, dq, dk and dv written in it; both float32 paths (the fused kernels and the
composed GEMMs), dropout on and off; fresh random inputs, outputs poisoned first. Then
attention as a model file writes it with a Linear each for q, k and v: no transpose left in
the plan, graph replay == eager bit for bit at fp32 and bf16, and fp32 steps == the NumPy
backend's to rounding."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu("nvmath")

import stepgraph as sg  # noqa: E402
from stepgraph import models, optim  # noqa: E402
from stepgraph.backends.cuda.attention import attention  # noqa: E402
from tests.cuda.helpers import make_node, random, reference, rel_err, run_cuda  # noqa: E402
from tests.cuda.test_attention_cuda import assert_matches  # noqa: E402
from tests.cuda.test_step_cuda import assert_replay_matches_eager  # noqa: E402

B, H, D = 2, 3, 64
C = H * D
MERGE = (0, 2, 1, 3)


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("fp32")


def merged(t: int, width: int, offset: int = 0) -> tuple:
    """The (B, H, T, D) heads of a (B, T, width) array starting at column `offset`."""
    return ((B, H, t, D), (t * width, D, width, 1), offset)


@pytest.mark.parametrize("p", [0.0, 0.2], ids=["nodrop", "drop"])
@pytest.mark.parametrize("path", attention.PATHS)
@pytest.mark.parametrize("t", [7, 65, 128])
def test_views_and_permuted_results_match_numpy(ctx, impls, monkeypatch, path, t, p):
    monkeypatch.setattr(attention, "PATH", path)
    rng = np.random.default_rng([821, t, int(p * 10), len(path)])
    packed = random(rng, B, t, 3 * C)
    attrs = dict(scale=0.125, causal=True, dropout_p=p)
    step = [np.array(77, np.int64)] if p else []
    if p:
        attrs.update(seed=2**33 + 5, site=1)
    ins = [packed] * 3 + step
    node = make_node("sdpa", ins, views=tuple(merged(t, 3 * C, i * C) for i in range(3))
                     + (None,) * len(step), out_perms=(MERGE,), **attrs)
    want, got = reference(node, ins), run_cuda(ctx, node, ins, impls)
    assert want[0].shape == (B, t, H, D)
    assert_matches(got[0], want[0], "out")
    assert_matches(got[1], want[1], "lse")
    dout = random(rng, B, t, C)
    grad_ins = [dout] + [packed] * 3 + want + step
    grad = make_node("sdpa_grad", grad_ins,
                     views=(merged(t, C),) + tuple(merged(t, 3 * C, i * C) for i in range(3))
                     + (merged(t, C),) + (None,) * (1 + len(step)), out_perms=(MERGE,) * 3,
                     **attrs)
    want_g, got_g = reference(grad, grad_ins), run_cuda(ctx, grad, grad_ins, impls)
    for name, g, w in zip(("dq", "dk", "dv"), got_g, want_g):
        assert w.shape == (B, t, H, D)
        assert_matches(g, w, name)


class SeparateProjections(sg.nn.Module):
    """One attention block as model files write it: a Linear each for q, k and v, the heads
    split and merged with view and transpose."""

    def __init__(self, vocab: int, heads: int = 2, dim: int = 128):
        super().__init__()
        self.heads = heads
        self.embed = sg.nn.Embedding(vocab, dim)
        self.q, self.k, self.v, self.o = (sg.nn.Linear(dim, dim) for _ in range(4))
        self.head = sg.nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        y = sg.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + self.o(y.transpose(1, 2).reshape(b, t, c)))


def batches(vocab: int, n: int, seed: int):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, (4, 64)), rng.integers(0, vocab, (4, 64)))
            for _ in range(n)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_separate_projections_replay_their_eager_bits_without_copies(precision):
    vocab = 97
    data = batches(vocab, 4, 823)
    sg.manual_seed(0)
    base = SeparateProjections(vocab)
    steps = []
    for graph in (False, True):
        model = SeparateProjections(vocab)
        model.load_state_dict(base.state_dict())
        steps.append(sg.compile_train_step(model, loss=models.next_token_loss,
                                           optimizer=optim.SGD(lr=0.1, momentum=0.9),
                                           example_inputs=data[0], device="cuda",
                                           graph=graph, precision=precision))
    ops = assert_replay_matches_eager(*steps, data)
    assert ops.count("sdpa") == 1 and ops.count("sdpa_grad") == 1
    assert "permute" not in ops and "layout_copy" not in ops


def test_separate_projections_train_like_numpy():
    vocab = 97
    data = batches(vocab, 3, 827)
    sg.manual_seed(0)
    base = SeparateProjections(vocab)
    initial = {k: np.array(v) for k, v in base.state_dict().items()}
    runs = []
    for device in ("cpu", "cuda"):
        model = SeparateProjections(vocab)
        model.load_state_dict(base.state_dict())
        step = sg.compile_train_step(model, loss=models.next_token_loss,
                                     optimizer=optim.SGD(lr=0.1, momentum=0.9),
                                     example_inputs=data[0], device=device)
        losses = [float(step(x, y)) for x, y in data]
        runs.append((losses, {k: np.array(v) for k, v in model.state_dict().items()}))
    (want, want_params), (got, got_params) = runs
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for k, v in want_params.items():     # the changes, so that a missing update shows
        assert rel_err(got_params[k] - initial[k], v - initial[k]) < 1e-4, k
