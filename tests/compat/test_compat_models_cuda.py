"""The compatibility suite's model files on the GPU: the same 20 steps run eagerly and as
CUDA Graph replays agree bit for bit (losses and every state_dict entry), and the graph's
trajectory is judged against torch float64 as on the CPU (test_compat_models.py), the bound
scaled by torch float32's own error on the GPU (cuDNN's float32 convolutions sum in other
orders than the CPU's: torch_references). The files with attention written out by hand also
train at precision="bf16" (bf16 bmm) as the NumPy backend's bf16 emulation does, judged
against torch float64 by the policy with the emulation's own error as the measure."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import optim
from tests.compat.test_compat_models import (LR, MOMENTUM, check_against_torch, running,
                                             frozen_names, setup, state, stepgraph_run,
                                             torch_references, torch_run, trained_names)
from tests.reference import assert_close_to_reference, assert_state_changes_close

pytestmark = pytest.mark.cuda
cp = pytest.importorskip("cupy")
if not sg.cuda_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

BF16_STEPS = 4


@pytest.mark.parametrize("name", running())
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

    losses, finals = torch_references(s, device="cuda")
    losses["stepgraph"], finals["stepgraph"] = graph_losses, replayed
    check_against_torch(s.initial, losses, finals, frozen_names(model), trained_names(model),
                        s.case.steps)


@pytest.mark.parametrize("name", ["gpt", "vit"])
def test_hand_written_attention_trains_in_bf16_as_the_numpy_emulation(name, request):
    """The files that write attention out by hand (q @ k^T, softmax, att @ v) run it in bf16
    at precision="bf16": as the fused attention op where the rewrite takes it
    (compile/attention_rewrite.py), else as bf16 `bmm`. Four steps of the CUDA graph are judged
    by the policy against torch float64, with the NumPy backend's bf16 emulation (the same
    roundings but for the order of the GEMMs' sums) as the measure of what bf16 rounding does:
    losses, and every parameter's change (values would hide a LayerNorm weight's whole change,
    4.6e-5 to 6.3e-4 after four steps, under a bound of bf16's resolution)."""
    s = setup(name, request.node.name)
    batches = s.batches[:BF16_STEPS]
    loss = getattr(sg.nn.functional, s.case.loss) if s.case.loss else None
    steps = []
    for device in ("cpu", "cuda"):
        model = s.stepgraph_model()
        steps.append(sg.compile_train_step(model, loss, optim.SGD(lr=LR, momentum=MOMENTUM),
                                           example_inputs=batches[0], device=device,
                                           precision="bf16"))
    cpu, gpu = steps
    calls = gpu.executable(gpu.signature).calls
    assert any(n.op in ("bmm", "sdpa", "sdpa_qkv") and n.inputs[0].dtype == "bfloat16"
               for n, _, _ in calls)
    emulated = [float(cpu(*batch)) for batch in batches]
    got = [float(gpu(*(cp.asarray(a) for a in batch))) for batch in batches]
    t64 = copy.deepcopy(s.torch_model)
    want = torch_run(t64, s.case, batches, torch.float64)
    assert_close_to_reference(got, want, emulated, "bf16 losses")
    assert_state_changes_close(s.initial, {k: np.asarray(v) for k, v in
                                           gpu.model.state_dict().items()}, state(t64),
                               {k: np.asarray(v) for k, v in cpu.model.state_dict().items()},
                               frozen=frozen_names(gpu.model),
                               trained=trained_names(gpu.model), counters=BF16_STEPS)
