"""The composed layers and losses on the GPU: the layer zoo (tests/models/test_layer_zoo.py)
and a weighted, ignore_index cross-entropy plus BCE-with-logits model, trained three steps by
cuda eager and cuda graph replay (and, on the CPU, the numpy backend), judged against the
models' torch twins in float64 by the policy (losses and parameter changes).
Their resampling matrices are built on the device from arange, float64 arithmetic and
comparisons, which this also exercises on the generated pointwise kernels."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import optim
from stepgraph.nn import functional as F
from tests.models.test_layer_zoo import make_zoo, zoo_data
from tests.reference import assert_close_to_reference, assert_state_changes_close



def make_heads(torch_ns):
    """Logits and a multi-label score over `torch_ns` (stepgraph or torch); the class weights
    are a buffer of the model."""
    nn = torch_ns.nn

    class WeightedHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(12, 7)
            weight = np.array([0.5, 1, 2, 1.5, 1], np.float32)
            self.register_buffer("class_weight", torch_ns.tensor(weight))

        def forward(self, x):
            return self.body(x)

    return WeightedHeads()


def weighted_loss(F):
    """The loss over the functional namespace F (stepgraph's or torch's), of a model."""
    def of(model):
        def loss(out, y):
            ce = F.cross_entropy(out.narrow(1, 0, 5), y, model.class_weight, ignore_index=3,
                                 label_smoothing=0.05)
            bce = F.binary_cross_entropy_with_logits(out.narrow(1, 5, 2), out.narrow(1, 5, 2)
                                                     .sigmoid() * 0.5, reduction="sum")
            return ce + bce
        return loss
    return of


def make_transposed(torch_ns):
    """ConvTranspose2d as U-Nets and decoders use it (k2 s2), and with padding, groups,
    dilation and an output_padding of a stride or more (reaching past the input's taps)."""
    nn = torch_ns.nn

    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.ConvTranspose2d(4, 6, kernel_size=2, stride=2)
            self.odd = nn.ConvTranspose2d(6, 4, kernel_size=(3, 4), stride=(2, 1), padding=1,
                                          output_padding=(1, 0), groups=2, bias=False)
            self.far = nn.ConvTranspose2d(4, 2, kernel_size=3, stride=(3, 2), padding=(1, 2),
                                          output_padding=(2, 2), dilation=3)

        def forward(self, x):
            return self.far(torch_ns.relu(self.odd(self.up(x)))).mean((2, 3))

    return Transposed()


# name -> (model over a namespace, loss of a model over a functional namespace, batches)
CASES = {
    "zoo": (lambda ns: make_zoo(ns.nn), lambda F: lambda m: (
        lambda pred, y: F.cross_entropy(pred, y, label_smoothing=0.1, reduction="sum")),
        zoo_data(3)),
    "transposed": (make_transposed, lambda F: lambda m: (
        lambda pred, y: F.cross_entropy(pred, y)),
        [(np.random.default_rng(i).standard_normal((3, 4, 5, 4)).astype(np.float32),
          np.random.default_rng(i).integers(0, 2, 3).astype(np.int64)) for i in range(3)]),
    "weighted": (make_heads, weighted_loss,
                 [(np.random.default_rng(i).standard_normal((9, 12)).astype(np.float32),
                   np.random.default_rng(i).integers(0, 5, 9).astype(np.int64))
                  for i in range(3)]),
}


def torch_run(twin, loss_of, data, dtype):
    """Three SGD steps of a copy of the torch twin at `dtype`: (losses, float64 state)."""
    twin = copy.deepcopy(twin).to(dtype)
    loss_fn = loss_of(torch.nn.functional)(twin)
    opt = torch.optim.SGD(twin.parameters(), lr=0.05)
    out = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(twin(torch.from_numpy(x).to(dtype)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out, {k: v.double().numpy() for k, v in twin.state_dict().items()}


def check_steps(case: str, device: str, graph: bool):
    """Three SGD steps on `device`, judged by the tolerance policy (docs/TESTING.md): losses
    and every parameter's change against the torch twin in float64, bound 4x the twin's own
    float32 error."""
    make, loss_of, data = CASES[case]
    twin = make(torch)
    model = make(sg)
    model.load_state_dict({k: v.numpy() for k, v in twin.state_dict().items()})
    step = sg.compile_train_step(model, loss=loss_of(F)(model), optimizer=optim.SGD(lr=0.05),
                                 example_inputs=data[0], device=device, graph=graph)
    before = {k: np.array(v, copy=True) for k, v in model.state_dict().items()}
    losses = [float(step(x, y)) for x, y in data]
    losses64, after64 = torch_run(twin, loss_of, data, torch.float64)
    losses32, after32 = torch_run(twin, loss_of, data, torch.float32)
    assert_close_to_reference(losses, losses64, losses32, f"{case} {device} losses")
    after = {k: np.asarray(sg.to_numpy(v)) for k, v in model.state_dict().items()}
    assert_state_changes_close(before, after, after64, after32, f"{case} {device} ",
                               trained=[k for k, _ in model.named_parameters()])


@pytest.mark.parametrize("case", list(CASES))
def test_composed_layers_and_losses_on_the_numpy_backend_as_torch(case):
    """The same judgement on the CPU, where it runs in CI."""
    check_steps(case, "cpu", False)


@pytest.mark.cuda
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("case", list(CASES))
def test_composed_layers_and_losses_cuda_match_a_float64_run(case, graph):
    check_steps(case, "cuda", graph)
