"""A model of the torch layers and losses stepgraph composes (ConvTranspose2d, GroupNorm,
max_pool2d with ceil_mode, adaptive max/avg pooling to sizes that do not divide, bilinear
Upsample, Conv1d, RMSNorm, MultiheadAttention, LayerNorm without affine, a summed,
label-smoothed cross-entropy), written once against either `torch.nn` or `stepgraph.nn`: three
SGD steps of a compiled train step against the same steps in PyTorch."""
from __future__ import annotations

import copy

import numpy as np
import torch

import stepgraph as sg
from stepgraph import nn as snn
from stepgraph import optim
from stepgraph.nn import functional as SF
from tests.reference import assert_close_to_reference, assert_state_changes_close


def make_zoo(nn):
    """The model over the namespace `nn` (torch.nn or stepgraph.nn): (N, 3, 8, 8) -> (N, 5)."""

    class Zoo(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1)
            self.norm = nn.GroupNorm(2, 4)
            self.act = nn.ReLU()
            self.pool = nn.MaxPool2d(3, 2, 1, ceil_mode=True)
            self.amax = nn.AdaptiveMaxPool2d((5, 5))
            self.resize = nn.Upsample(scale_factor=2, mode="bilinear")
            self.aavg = nn.AdaptiveAvgPool2d((3, 3))
            self.conv = nn.Conv1d(4, 8, 3, padding=1)
            self.rms = nn.RMSNorm(8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.ln = nn.LayerNorm(8, elementwise_affine=False)
            self.head = nn.Linear(8, 5)

        def forward(self, x):
            x = self.aavg(self.resize(self.amax(self.pool(self.act(self.norm(self.up(x)))))))
            x = self.rms(self.conv(x.reshape(x.shape[0], 4, 9)).transpose(1, 2))
            x = self.ln(x + self.attn(x, x, x, need_weights=False)[0])
            return self.head(x.mean(1))

    return Zoo()


def zoo_data(steps: int, batch: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 3, 8, 8)).astype(np.float32),
             rng.integers(0, 5, batch).astype(np.int64)) for _ in range(steps)]


def zoo_loss(pred, y):
    return SF.cross_entropy(pred, y, label_smoothing=0.1, reduction="sum")


def torch_zoo_run(ref, data, dtype):
    """Three SGD steps of the torch model at `dtype`: (losses, state_dict as float64 arrays)."""
    ref = copy.deepcopy(ref).to(dtype)
    topt = torch.optim.SGD(ref.parameters(), lr=0.05)
    out = []
    for x, y in data:
        topt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(torch.from_numpy(x).to(dtype)),
                                                 torch.from_numpy(y), label_smoothing=0.1,
                                                 reduction="sum")
        loss.backward()
        topt.step()
        out.append(loss.item())
    return out, {k: v.double().numpy() for k, v in ref.state_dict().items()}


def test_layer_zoo_trains_like_torch():
    """Losses and parameter changes judged by the tolerance policy (docs/TESTING.md) against
    PyTorch float64 from the same start, bound 4x PyTorch float32's own error."""
    model, ref = make_zoo(snn), make_zoo(torch.nn)
    model.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
    data = zoo_data(3)
    step = sg.compile_train_step(model, loss=zoo_loss, optimizer=optim.SGD(lr=0.05),
                                 example_inputs=data[0], device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = [float(step(x, y)) for x, y in data]
    losses64, after64 = torch_zoo_run(ref, data, torch.float64)
    losses32, after32 = torch_zoo_run(ref, data, torch.float32)
    assert_close_to_reference(got, losses64, losses32, "losses")
    assert_state_changes_close(before, model.state_dict(), after64, after32)
