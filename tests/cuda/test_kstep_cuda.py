"""K steps per graph launch on the GPU (api.py TrainStep.run, compile/executable.py
StepsReplay): one CUDA graph of K steps, each after one device-to-device copy per input of
its slice of the staged batches, trains exactly as K single graph replays, bit for bit, and
holds exactly K copies of the step's graph plus the copies."""
from __future__ import annotations

import numpy as np
import pytest

from stepgraph.errors import NonFiniteError
from tests.cuda.gpu import require_gpu
from tests.unit.test_kstep import assert_same_state, stacked, twins

pytestmark = pytest.mark.cuda
cp = require_gpu()

STEPS = 4


@pytest.mark.parametrize("case, precision, on_device", [
    ("mlp-adam-warmup-cosine", "fp32", False),
    ("mlp-adam-warmup-cosine", "bf16", True),
    ("batchnorm-sgd-step-decay", "fp32", True),
], ids=["mlp-fp32-numpy-feed", "mlp-bf16-cupy-feed", "batchnorm-fp32-cupy-feed"])
def test_graph_of_k_steps_matches_single_steps(case, precision, on_device):
    (kstep, single), shape = twins(case, device="cuda", graph=True, precision=precision)
    x, y = stacked(case, 3 * STEPS, shape)
    if on_device:
        x, y = cp.asarray(x), cp.asarray(y)
    got = kstep.run((x[:STEPS], y[:STEPS]), steps=STEPS)     # the step's eager warm-up
    got += kstep.run((x[STEPS:], y[STEPS:]), steps=STEPS)    # captured, then replayed
    want = [single(xi, yi) for xi, yi in zip(x, y)]          # eager, captured, replays
    assert [h.step for h in got] == [h.step for h in want] == list(range(1, 3 * STEPS + 1))
    assert [float(h) for h in got] == [float(h) for h in want]
    assert len(set(float(h) for h in got)) > 1
    assert_same_state(kstep, single)

    (exe,) = kstep.executables.values()
    (one,) = single.executables.values()
    captured = exe.replays[STEPS].captured
    assert captured is not None and one.captured is not None
    if one.captured.node_count is not None:    # cuda-python present: count the graph's nodes
        assert captured.node_count == STEPS * (one.captured.node_count + len(exe.input_buffers))


def test_graph_of_k_steps_holds_the_updates_after_a_bad_step():
    (kstep, single), shape = twins("mlp-adam-warmup-cosine", device="cuda", graph=True)
    x, y = stacked("bad-step", 2 * STEPS, shape)
    x[STEPS + 2, 1, 3] = np.nan
    kstep.run((x[:STEPS], y[:STEPS]), steps=STEPS)
    got = kstep.run((x[STEPS:], y[STEPS:]), steps=STEPS)    # the captured graph's third step
    for xi, yi in zip(x[:STEPS + 2], y[:STEPS + 2]):
        single(xi, yi)
    with pytest.raises(NonFiniteError, match=f"step {STEPS + 3}") as err:
        float(got[-1])
    assert err.value.step == STEPS + 3
    assert_same_state(kstep, single)
