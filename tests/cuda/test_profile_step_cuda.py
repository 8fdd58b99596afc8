"""step.profile(): the per-op table of the user's own step, and the step's state put back
afterwards (profiling replays every op many times, updates included)."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import losses, models, nn, optim

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda
cp = require_gpu()


def test_profile_of_a_users_step_restores_its_state():
    nn.manual_seed(0)
    model = models.mlp(64, 128, 10)
    gen = np.random.default_rng(0)
    x = cp.asarray(gen.standard_normal((32, 64), dtype=np.float32))
    y = cp.asarray(gen.integers(0, 10, 32))
    step = sg.compile_train_step(model, losses.cross_entropy, optim.AdamW(lr=1e-3), (x, y),
                                 device="cuda")
    for _ in range(3):
        step(x, y)
    before = step.state_dict()
    profile = step.profile(x, y, iters=5)
    ops = {o.op for o in profile.ops}
    assert {"guard_check", "guard_advance", "adam_update"} <= ops
    assert profile.graph_nodes and "sum of op times" in profile.table()
    after = step.state_dict()
    for k in before:
        assert np.array_equal(before[k], after[k]), k
    loss = step(x, y)
    assert loss.step == 4 and np.isfinite(float(loss))


def test_profile_and_load_state_dict_of_a_batchnorm_model_on_the_gpu():
    """BatchNorm's num_batches_tracked is a 0-d buffer: putting it back on the device kept
    failing with a (1,)-shaped copy (step.profile, model.load_state_dict)."""
    nn.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    gen = np.random.default_rng(0)
    x = cp.asarray(gen.standard_normal((4, 3, 8, 8), dtype=np.float32))
    y = cp.asarray(gen.integers(0, 10, 4))
    step = sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1), (x, y),
                                 device="cuda")
    step(x, y)
    before = step.state_dict()
    step.profile(x, y, iters=2)
    after = step.state_dict()
    assert np.shape(after["1.num_batches_tracked"]) == ()
    for k in before:
        assert np.array_equal(before[k], after[k]), k
    model.load_state_dict(model.state_dict())
    assert int(model.state_dict()["1.num_batches_tracked"]) == 1
