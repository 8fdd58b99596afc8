"""GradScaler in a captured loop on the GPU: the scale, its growth counter and the skip are
device state of the one CUDA graph a step replays, following torch's GradScaler step for step
(tests/unit/test_grad_scaler.py runs the same loops on the NumPy backend)."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph.loop import hooks
from tests.cuda.gpu import require_gpu
from tests.reference import state_float64
from tests.unit.test_grad_scaler import (batches, float64_reference, judge, scaled_loop, skipped,
                                         twins)

pytestmark = pytest.mark.cuda
require_gpu()


def test_scaled_loop_on_cuda_follows_torch_in_one_graph():
    import torch

    t32, t64, ours = twins(norm=True)
    start = state_float64(t32)
    data = batches(12)
    args = dict(init_scale=2.0 ** 127, growth_interval=3, growth_factor=2.0 ** 16,
                backoff_factor=2.0 ** -16)
    want, _ = scaled_loop(torch, t32, data, 64.0, **args)
    got, _ = scaled_loop(sg, ours, data, 64.0, **args)
    assert hooks.SESSION.device == "cuda"
    assert got == want
    skips = skipped(want, args["init_scale"])
    float64_reference(t64, data, 64.0, [not s for s in skips])
    judge(start, t32, t64, ours, untrained=("0.bias",))
    exe = hooks.SESSION.last_executable
    assert exe.captured is not None
    assert [n.op for n in exe.plan.graph.nodes].count("loss_scale_update") == 1


def test_scaled_loop_on_cuda_equals_the_numpy_backend():
    """The same scaled loop on the GPU and on the NumPy backend (a fresh session each):
    the same skips and scales, parameters within float32 rounding of each other."""
    from stepgraph.loop import session as loop_session

    results = {}
    for device in ("cpu", "cuda"):
        loop_session._SESSION, hooks.SESSION = None, None
        s = loop_session.session()
        s.device = device
        _, _, ours = twins(norm=True)
        data = batches(8)
        data[4] = (np.full_like(data[4][0], np.inf), data[4][1])
        history, _ = scaled_loop(sg, ours, data, 1.0, init_scale=1024.0, growth_interval=2)
        results[device] = (history, state_float64(ours))
    assert results["cuda"][0] == results["cpu"][0]
    for k, v in results["cpu"][1].items():     # running statistics: NaN after the inf batch
        np.testing.assert_allclose(results["cuda"][1][k], v, rtol=1e-4, atol=1e-5, err_msg=k)
