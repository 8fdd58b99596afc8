"""Random draws in a CUDA predictor (compile_predict, graph replay): Monte-Carlo dropout and
torch.rand / randn / bernoulli_ give the numpy backend's masks and values bit for bit at every
call, the warm-up, the capture and each replay drawing anew from the counter the graph
advances itself (no re-capture, the graph holding exactly its ops' kernels)."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import nn
from stepgraph.nn import functional as F
from tests.cuda.gpu import require_gpu
from tests.unit.test_predict_random import MCDropout, Noisy

pytestmark = pytest.mark.cuda
cp = require_gpu()

from tests.cuda.test_step_cuda import kernels_of_ops  # noqa: E402

CALLS = 6


class ExpDropout(nn.Module):
    """A linear layer, exp (positive: a 0 out is a dropped element), dropout, a scale: the
    pointwise programs draw the mask on CUDA."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 40)

    def forward(self, x):
        return F.dropout(self.fc(x).mul(0.1).exp(), 0.35, training=True) * 2.0


def _twins(make, x, seed: int):
    """The same model's cpu and cuda (graph) predictors, the cuda one's outputs per call."""
    model = make()
    cpu = sg.compile_predict(model, (x,), device="cpu", seed=seed)
    gpu = sg.compile_predict(model, (x,), device="cuda", graph=True, seed=seed)
    want = [np.asarray(cpu(x)) for _ in range(CALLS)]
    xd = cp.asarray(x)
    got, captured = [], []
    for _ in range(CALLS):
        got.append(cp.asnumpy(gpu(xd)))
        captured.append(gpu.executable(gpu.signature).captured)
    assert captured[0] is None and captured[1] is not None
    assert all(c is captured[1] for c in captured[1:]), "a call must not re-capture"
    exe = gpu.executable(gpu.signature)
    assert exe.captured.node_count == kernels_of_ops(exe)
    assert int(gpu.backend.to_numpy(gpu._rng_counter)) == CALLS
    return want, got


@pytest.mark.parametrize("make", [lambda: MCDropout(0.3), lambda: MCDropout(0.4, True)])
def test_mc_dropout_masks_equal_numpy_at_every_replay(make):
    x = np.random.default_rng(0).uniform(0.5, 2.0, (64, 48, 2, 2)).astype(np.float32)
    want, got = _twins(make, x, seed=5)
    for k, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_array_equal(g != 0, w != 0, err_msg=f"call {k + 1}")
        np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=f"call {k + 1}")
    for a, b in zip(got, got[1:]):
        assert not np.array_equal(a != 0, b != 0)


def test_fused_dropout_masks_equal_numpy_at_every_replay():
    x = np.random.default_rng(1).standard_normal((128, 24)).astype(np.float32)
    want, got = _twins(ExpDropout, x, seed=2)
    for k, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_array_equal(g != 0, w != 0, err_msg=f"call {k + 1}")
        np.testing.assert_allclose(g, w, rtol=1e-5, err_msg=f"call {k + 1}")
    for a, b in zip(got, got[1:]):
        assert not np.array_equal(a != 0, b != 0)


def test_random_draws_equal_numpy_at_every_replay():
    x = np.zeros((96, 70), np.float32)
    want, got = _twins(Noisy, x, seed=9)
    for k, (w, g) in enumerate(zip(want, got)):
        np.testing.assert_array_equal(g, w, err_msg=f"call {k + 1}")
    for a, b in zip(got, got[1:]):
        assert not np.array_equal(a, b)
