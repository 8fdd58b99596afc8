"""The compatibility suite's model files on the GPU: the same 20 steps run eagerly and as
CUDA Graph replays agree bit for bit (losses and every state_dict entry), and the graph's
trajectory is judged against torch float64 as on the CPU (test_compat_models.py). The files
with attention written out by hand also train at precision="bf16" (bf16 bmm) as the NumPy
backend's bf16 emulation does."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import optim
from tests.compat.test_compat_models import (CASES, LR, MOMENTUM, check_against_torch,
                                             frozen_names, setup, stepgraph_run,
                                             torch_references)
from tests.ops.helpers import relative_error

pytestmark = pytest.mark.cuda
cp = pytest.importorskip("cupy")
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


@pytest.mark.parametrize("name", ["gpt", "vit"])
def test_hand_written_attention_trains_in_bf16_as_the_numpy_emulation(name, request):
    """The files that write attention out by hand (q @ k^T, softmax, att @ v) run their batched
    products as bf16 `bmm` at precision="bf16"; a few steps of the CUDA graph follow the NumPy
    backend's bf16 emulation (the same roundings but for the order of the GEMMs' sums) within
    bf16's resolution, as tests/cuda/test_bf16_cuda.py's dense steps do."""
    s = setup(name, request.node.name)
    loss = getattr(sg.nn.functional, s.case.loss) if s.case.loss else None
    steps = []
    for device in ("cpu", "cuda"):
        model = s.stepgraph_model()
        steps.append(sg.compile_train_step(model, loss, optim.SGD(lr=LR, momentum=MOMENTUM),
                                           example_inputs=s.batches[0], device=device,
                                           precision="bf16"))
    cpu, gpu = steps
    calls = gpu.executable(gpu.signature).calls
    assert any(n.op == "bmm" and n.outputs[0].dtype == "bfloat16" for n, _, _ in calls)
    for batch in s.batches[:4]:
        lc, lg = float(cpu(*batch)), float(gpu(*(cp.asarray(a) for a in batch)))
        assert np.isfinite(lg) and abs(lg - lc) <= 1e-2 * abs(lc) + 1e-3, (lc, lg)
    ref, got = cpu.model.state_dict(), gpu.model.state_dict()
    for k in ref:
        # A parameter that starts at zero (GPT's biases) is the sum of its updates alone, whose
        # one-ulp differences in bf16 (2^-8) are not diluted by a starting value: the bound is
        # bf16's resolution there (gpt's c_attn.bias: 1.2e-3 on an H200).
        bound = 2.0 ** -8 if k in s.initial and not np.any(s.initial[k]) else 1e-3
        assert relative_error(np.asarray(got[k]), np.asarray(ref[k])) < bound, k
