"""The CIFAR ResNet of stepgraph.models against the same network written in PyTorch (CPU).

Small widths and 16x16 images keep it fast; the structure (stem, stages, strided shortcuts,
pool, classifier) is the benchmark's.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch import nn as tnn

import stepgraph as sg
from stepgraph import losses, models, optim
from tests.reference import assert_changes_close

WIDTHS = (8, 16, 32)
LABEL_SMOOTHING = 0.2


class TorchBlock(tnn.Module):
    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = tnn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = tnn.BatchNorm2d(planes)
        self.conv2 = tnn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = tnn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = tnn.Sequential(
                tnn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                tnn.BatchNorm2d(planes))

    def forward(self, x):
        out = TF.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return TF.relu(out + (x if self.downsample is None else self.downsample(x)))


class TorchResNet(tnn.Module):
    # Alike stepgraph.models.ResNet on purpose: the oracle is written for torch, independently.
    def __init__(self, widths, blocks_per_stage, num_classes=10, in_channels=3):
        super().__init__()
        self.conv1 = tnn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        self.bn1 = tnn.BatchNorm2d(widths[0])
        in_planes = widths[0]
        for i, planes in enumerate(widths):
            blocks = [TorchBlock(in_planes, planes, 1 if i == 0 else 2)]
            blocks += [TorchBlock(planes, planes) for _ in range(blocks_per_stage - 1)]
            setattr(self, f"layer{i + 1}", tnn.Sequential(*blocks))
            in_planes = planes
        self.avgpool = tnn.AdaptiveAvgPool2d(1)
        self.fc = tnn.Linear(widths[-1], num_classes)

    def forward(self, x):
        x = TF.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def twins(blocks_per_stage=1):
    """(stepgraph model, torch model holding the same values)."""
    model = models.resnet(widths=WIDTHS, blocks_per_stage=blocks_per_stage)
    twin = TorchResNet(WIDTHS, blocks_per_stage).double()
    twin.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in
                          model.state_dict().items()}, strict=True)
    return model, twin


def batch(n=8, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 3, 16, 16)).astype(np.float32),
            rng.integers(0, 10, size=n).astype(np.int64))


@pytest.mark.parametrize("blocks_per_stage", [1, 2])
def test_state_dict_keys_are_pytorchs(blocks_per_stage):
    model = models.resnet(widths=WIDTHS, blocks_per_stage=blocks_per_stage)
    want = TorchResNet(WIDTHS, blocks_per_stage).state_dict()
    got = model.state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        assert tuple(np.shape(got[key])) == tuple(value.shape), key
    n_convs = sum(k.endswith("conv1.weight") or k.endswith("conv2.weight") for k in got)
    assert n_convs == 1 + 6 * blocks_per_stage          # the stem, then 2 per block
    assert "layer2.0.downsample.1.running_var" in got and "layer1.0.downsample.0.weight" not in got


def test_default_is_the_benchmark_network():
    sd = models.resnet().state_dict()
    assert sd["conv1.weight"].shape == (64, 3, 3, 3) and sd["fc.weight"].shape == (10, 256)
    assert sd["layer3.0.conv2.weight"].shape == (256, 256, 3, 3)
    assert "layer1.1.conv1.weight" not in sd                        # one block per stage


def test_predict_matches_torch_eval():
    model, twin = twins()
    x, _ = batch()
    predict = sg.compile_predict(model, example_inputs=(x,), device="cpu")
    with torch.no_grad():
        want = twin.eval()(torch.from_numpy(x).double()).numpy()
    np.testing.assert_allclose(sg.to_numpy(predict(x)), want, rtol=1e-4, atol=1e-4)


def torch_steps(twin, batches, lr):
    opt = torch.optim.SGD(twin.parameters(), lr=lr, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)
    twin.train()
    out = []
    for x, y in batches:
        opt.zero_grad()
        x = torch.from_numpy(x).to(next(twin.parameters()).dtype)
        loss = TF.cross_entropy(twin(x), torch.from_numpy(y),
                                label_smoothing=LABEL_SMOOTHING)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("blocks_per_stage", [1, 2])
def test_training_steps_match_torch(blocks_per_stage):
    """Three SGD steps: losses agree, and the changes of parameters and BatchNorm running
    statistics are as close to a float64 run's as torch float32's (docs/TESTING.md)."""
    model, twin = twins(blocks_per_stage)
    twin32 = copy.deepcopy(twin).float()
    before = {k: np.array(v, copy=True) for k, v in model.state_dict().items()}
    batches = [batch(seed=i) for i in range(3)]
    loss = lambda logits, y: losses.cross_entropy(logits, y, label_smoothing=LABEL_SMOOTHING)
    step = sg.compile_train_step(
        model, loss=loss, example_inputs=batches[0], device="cpu",
        optimizer=optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4))
    got = [float(step(x, y)) for x, y in batches]
    want = torch_steps(twin, batches, lr=0.05)
    torch_steps(twin32, batches, lr=0.05)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    sd, sd32 = model.state_dict(), twin32.state_dict()
    for key, value in twin.state_dict().items():
        if not key.endswith("num_batches_tracked"):
            assert_changes_close(before[key], sd[key], value.numpy(), sd32[key].numpy(), key)
    assert int(sd["bn1.num_batches_tracked"]) == 3
