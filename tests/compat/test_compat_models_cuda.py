"""The compatibility suite's model files on the GPU: the same 20 steps run eagerly and as
CUDA Graph replays agree bit for bit (losses and every state_dict entry), and the graph's
trajectory is judged against torch float64 as on the CPU (test_compat_models.py)."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from tests.compat.test_compat_models import (CASES, check_against_torch, frozen_names, setup,
                                             stepgraph_run, torch_references)

pytestmark = pytest.mark.cuda
pytest.importorskip("cupy")
if not sg.cuda_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("name", CASES)
def test_model_file_graph_replays_match_eager_bit_for_bit(name, request):
    s = setup(name, request.node.name)
    runs = {}
    for graph in (False, True):
        model = s.stepgraph_model()
        losses = stepgraph_run(model, s.case, s.batches, device="cuda", graph=graph)
        runs[graph] = losses, {k: np.asarray(v) for k, v in model.state_dict().items()}
    (eager_losses, eager), (graph_losses, replayed) = runs[False], runs[True]
    assert eager_losses == graph_losses
    for k, v in eager.items():
        assert np.array_equal(replayed[k], v), f"{k}: graph replay differs from eager"

    losses, finals = torch_references(s)
    losses["stepgraph"], finals["stepgraph"] = graph_losses, replayed
    check_against_torch(s.initial, losses, finals, frozen_names(model))
