"""Frozen parameters and models that compute their own loss on the GPU: a captured graph
replays with the frozen weights untouched bit for bit, and the trained ones follow the NumPy
backend's trajectory."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import losses, nn, optim
from stepgraph.nn import functional as F
from tests.cuda.gpu import require_gpu
from tests.ops.helpers import relative_error, seeded

pytestmark = pytest.mark.cuda
require_gpu()

STEPS = 6
FROZEN = ("0.weight", "0.bias", "4.bias")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 10))


def batches(name: str):
    gen = seeded(name)
    return [(gen.standard_normal((16, 32)).astype(np.float32), gen.integers(0, 10, 16))
            for _ in range(STEPS)]


@pytest.mark.parametrize("opt", ["sgd-momentum", "adamw"])
def test_frozen_parameters_stay_bit_identical_across_graph_replays(opt):
    make = (lambda: optim.SGD(lr=0.05, momentum=0.9)) if opt == "sgd-momentum" else \
        (lambda: optim.AdamW(lr=1e-3, weight_decay=0.1))
    data = batches(opt)
    nn.init.manual_seed(0)
    base = mlp()
    results = {}
    for device in ("cpu", "cuda"):
        model = mlp()
        model.load_state_dict(base.state_dict())
        for name in FROZEN:
            model.get_parameter(name).requires_grad_(False)
        step = sg.compile_train_step(model, losses.cross_entropy, make(),
                                     example_inputs=data[0], device=device, seed=0)
        for x, y in data:
            step(x, y)
        results[device] = {k: v.numpy() for k, v in model.state_dict().items()}
        assert not any(name in key for name in FROZEN for key in step.state)
    initial = {k: v.numpy() for k, v in base.state_dict().items()}
    for name in FROZEN:
        assert results["cuda"][name].tobytes() == initial[name].tobytes(), name
    for name in ("2.weight", "4.weight"):
        change = results["cuda"][name] - initial[name]
        want = results["cpu"][name] - initial[name]
        assert np.abs(want).max() > 0
        assert relative_error(change, want) < 1e-4, name


class OwnLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x, targets=None):
        logits = self.net(x)
        return logits, None if targets is None else F.cross_entropy(logits, targets)


def test_own_loss_model_replays_like_loss_cross_entropy():
    data = batches("own-loss")
    nn.init.manual_seed(1)
    own, plain = OwnLoss(), mlp()
    plain.load_state_dict({k.removeprefix("net."): v for k, v in own.state_dict().items()})
    step_own = sg.compile_train_step(own, optimizer=optim.AdamW(lr=1e-3),
                                     example_inputs=data[0], device="cuda")
    step_plain = sg.compile_train_step(plain, losses.cross_entropy, optim.AdamW(lr=1e-3),
                                       example_inputs=data[0], device="cuda")
    for x, y in data:
        assert float(step_own(x, y)) == float(step_plain(x, y))
    for k, v in plain.state_dict().items():
        assert np.array_equal(own.state_dict()["net." + k], v), k
