"""cuda vs numpy for the `random` op (bit for bit: random.cu computes Box-Muller in double and
rounds once, as rng.normal does), a captured graph that
draws anew from the device step counter at every replay, and a compiled train step with the
model-zoo idioms (torchvision's stochastic depth, randn_like noise, an index-put in forward,
torch.utils.checkpoint): eager CUDA and graph replays against the numpy backend's losses."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu("nvmath")

import stepgraph as torch  # noqa: E402
from stepgraph import nn, optim, rng  # noqa: E402
from tests.cuda.helpers import capture, make_node, poisoned, run_both, to_host  # noqa: E402
from tests.unit.test_zoo_random import stochastic_depth  # noqa: E402


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("fp32")


@pytest.mark.parametrize("kind", ["uniform", "normal"])
@pytest.mark.parametrize("shape", [(), (1,), (3,), (7, 5), (1000, 37)])
def test_random_matches_numpy(ctx, impls, kind, shape):
    step = np.array((5 << 32) | 17, np.int64)
    node = make_node("random", [step], kind=kind, shape=shape, seed=(3 << 40) | 9, site=4)
    ref, got = run_both(ctx, node, [step], impls)
    # bit for bit, normal draws too (seen on an H200: Box-Muller in double, rounded once)
    np.testing.assert_array_equal(got[0], ref[0])


def test_random_draws_anew_at_every_replay(ctx, impls):
    step = cp.zeros((), cp.int64)
    node = make_node("random", [np.zeros((), np.int64)], kind="normal", shape=(64, 33),
                     seed=1, site=0)
    out = poisoned(ctx, node)
    graph = capture(ctx, lambda: impls["random"](node, [step], out, ctx))
    for k in range(3):
        with ctx.stream:
            step.fill(k)
        graph.launch(ctx.stream)
        np.testing.assert_allclose(to_host(ctx, out)[0],
                                   rng.normal(64 * 33, 1, 0, k).reshape(64, 33), rtol=1e-6,
                                   atol=1e-6)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 10)

    def branch(self, x):
        h = self.fc1(x).relu()
        h[:, 5:9] = h[:, 5:9] * 2.0 + 1.0
        h[h > 3.0] = 3.0
        return self.fc2(nn.functional.dropout(h, 0.2))

    def forward(self, x):
        from stepgraph.utils.checkpoint import checkpoint
        x = x + stochastic_depth(checkpoint(self.branch, x, use_reentrant=False), 0.3, "row",
                                 self.training)
        return self.head(x + torch.randn_like(x) * 0.1)


@pytest.mark.parametrize("device,graph", [("cuda", False), ("cuda", True)])
def test_stochastic_depth_step_on_cuda_equals_numpy(device, graph):
    data = np.random.default_rng(0)
    xs = data.standard_normal((5, 16, 32)).astype(np.float32)
    ys = data.integers(0, 10, (5, 16))
    losses = {}
    for dev, g in (("cpu", False), (device, graph)):
        torch.manual_seed(0)
        model = Net()
        step = torch.compile_train_step(model, torch.nn.functional.cross_entropy,
                                        optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                        (xs[0], ys[0]), device=dev, graph=g, seed=4)
        losses[dev] = [float(step(x, y)) for x, y in zip(xs, ys)]
    np.testing.assert_allclose(losses[device], losses["cpu"], rtol=2e-5)
