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
