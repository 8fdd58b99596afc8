"""A small residual BatchNorm network against its PyTorch twin: a 20-step training trajectory
(train mode, SGD with Nesterov momentum and weight decay, cross-entropy with label smoothing),
then the running statistics, eval-mode predictions and the state_dict both ways.

The network: conv-BN-ReLU stem, then one residual block (conv-BN-ReLU-conv-BN plus a 1x1
stride-2 conv+BN downsample shortcut, ReLU), adaptive average pool, Linear; 8x3x8x8 inputs.
Labels come from a random linear teacher, and each batch is drawn away from ReLU kinks of
torch's forward (as in test_trajectories.py), so rounding cannot flip a ReLU's side.

Tolerances. The trajectory is judged by the policy (docs/TESTING.md, tests/reference.py):
losses and every state entry's change over the run (parameters and running statistics)
against the twin trained in float64, within 4x the float32 twin's own error. Predictions:
1e-5 of the largest logit.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch import nn as tnn

import stepgraph as sg
from stepgraph import losses, nn, optim
from stepgraph.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from stepgraph.nn import functional as F
from tests.models.test_trajectories import samples_near_a_kink
from tests.ops.helpers import assert_close, seeded
from tests.reference import assert_close_to_reference, assert_state_changes_close

STEPS, BATCH, X_SHAPE, CLASSES = 20, 8, (3, 8, 8), 10
LR, MOMENTUM, WEIGHT_DECAY, LABEL_SMOOTHING = 0.05, 0.9, 5e-4, 0.2
PREDICT_RTOL = 1e-5


class TorchNet(tnn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = tnn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = tnn.BatchNorm2d(8)
        self.conv2 = tnn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.bn2 = tnn.BatchNorm2d(16)
        self.conv3 = tnn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.bn3 = tnn.BatchNorm2d(16)
        self.downsample = tnn.Sequential(tnn.Conv2d(8, 16, 1, stride=2, bias=False),
                                         tnn.BatchNorm2d(16))
        self.relu = tnn.ReLU()           # a module: samples_near_a_kink hooks it
        self.pool = tnn.AdaptiveAvgPool2d(1)
        self.fc = tnn.Linear(16, CLASSES)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(x)))
        out = self.bn3(self.conv3(out))
        out = self.relu(out + self.downsample(x))
        return self.fc(torch.flatten(self.pool(out), 1))


class Net(nn.Module):
    """The same network in stepgraph, written the same way on purpose: the two are compared."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.conv3 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.bn3 = nn.BatchNorm2d(16)
        self.downsample = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2, bias=False),
                                        nn.BatchNorm2d(16))
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(x)))
        out = self.bn3(self.conv3(out))
        out = self.relu(out + self.downsample(x))
        return self.fc(F.flatten(self.pool(out), 1))


def torch_twin(seed: int) -> TorchNet:
    """torch's init, with BatchNorm weight and bias moved off 1 and 0 (a swapped or ignored
    affine parameter then shows)."""
    torch.manual_seed(seed)
    tmodel = TorchNet()
    with torch.no_grad():
        for m in tmodel.modules():
            if isinstance(m, tnn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.3)
    return tmodel


def numpy_state(tmodel: tnn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in tmodel.state_dict().items()}


def sg_loss(out, target):
    return losses.cross_entropy(out, target, label_smoothing=LABEL_SMOOTHING)


def sg_optimizer() -> optim.SGD:
    return optim.SGD(lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY)


class Batches:
    """Fresh random batches with teacher labels, drawn away from ReLU kinks of `tmodel`'s
    train-mode forward (checked on a copy: a train-mode forward moves the running stats)."""

    def __init__(self, name: str):
        self.gen = seeded(name)
        self.teacher = self.gen.standard_normal((int(np.prod(X_SHAPE)), CLASSES))

    def draw(self, tmodel: tnn.Module | None = None):
        x = self.gen.standard_normal((BATCH, *X_SHAPE)).astype(np.float32)
        while tmodel is not None and (near := samples_near_a_kink(copy.deepcopy(tmodel),
                                                                  x)).any():
            x[near] = self.gen.standard_normal((int(near.sum()), *X_SHAPE))
        return x, (x.reshape(BATCH, -1) @ self.teacher).argmax(axis=1).astype(np.int64)


def torch_step(tmodel, topt, x, y) -> float:
    topt.zero_grad()
    loss = TF.cross_entropy(tmodel(torch.tensor(x)), torch.tensor(y),
                            label_smoothing=LABEL_SMOOTHING)
    loss.backward()
    topt.step()
    return loss.item()


def torch_predict(tmodel, x) -> np.ndarray:
    with torch.no_grad():
        return tmodel.eval()(torch.tensor(x)).numpy()


def test_resnet_trajectory_predictions_and_state_dict_match_torch(request):
    tmodel = torch_twin(0)
    model = Net()
    assert list(model.state_dict()) == list(tmodel.state_dict())      # torch's key order
    model.load_state_dict(numpy_state(tmodel))                        # torch -> stepgraph
    initial = model.state_dict()
    topt = torch.optim.SGD(tmodel.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True,
                           weight_decay=WEIGHT_DECAY)
    batches = Batches(request.node.name)
    step = sg.compile_train_step(model, sg_loss, sg_optimizer(), example_inputs=batches.draw())
    x_eval, _ = batches.draw()
    predict = sg.compile_predict(model, (x_eval,))   # compiled before training: shares buffers

    nodes = step.executable(step.signature).plan.graph.nodes
    bn = [n for n in nodes if n.op == "batch_norm_train"]
    # bn1, bn2 with their ReLUs; bn3 with the residual add and ReLU after it, applying the
    # downsample's BatchNorm too, whose statistics alone stay a node
    assert sorted((n.attrs["act"], bool(n.attrs.get("residual")),
                   bool(n.attrs.get("residual_norm"))) for n in bn) == \
        [("relu", False, False), ("relu", False, False), ("relu", True, True)]
    assert [n.op for n in nodes].count("batch_norm_stats") == 1

    t64 = copy.deepcopy(tmodel).double()
    topt64 = torch.optim.SGD(t64.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True,
                             weight_decay=WEIGHT_DECAY)
    got, want, want64 = [], [], []
    for i in range(STEPS):
        x, y = batches.draw(tmodel)
        got.append(float(step(x, y)))
        want.append(torch_step(tmodel.train(), topt, x, y))
        want64.append(torch_step(t64.train(), topt64, x.astype(np.float64), y))
    # the tolerance policy (tests/reference.py): losses and every state entry's change over
    # the run against the float64 twin, with the float32 twin's error as the measure
    assert_close_to_reference(got, want64, want, f"losses\nstepgraph {got}\ntorch     {want}")
    final, t_final = model.state_dict(), numpy_state(tmodel)
    assert list(final) == list(t_final)
    for k, v in t_final.items():
        assert final[k].dtype == v.dtype and final[k].shape == v.shape, k
    assert_state_changes_close(initial, final, numpy_state(t64), t_final, counters=STEPS)

    # eval mode: the running statistics the train step updated, through the earlier predictor
    want_pred = torch_predict(tmodel, x_eval)
    assert_close(predict(x_eval), want_pred, PREDICT_RTOL, "eval predictions")

    # stepgraph -> torch: a fresh torch model loads the trained state strictly, predicts alike
    reloaded = TorchNet()
    reloaded.load_state_dict({k: torch.tensor(v.numpy()) for k, v in model.state_dict().items()})
    assert reloaded.bn1.num_batches_tracked.dtype == torch.int64
    assert_close(torch_predict(reloaded, x_eval), want_pred, PREDICT_RTOL, "torch reloaded")
    # torch -> stepgraph again, into a fresh model
    fresh = Net()
    fresh.load_state_dict(numpy_state(tmodel))
    assert_close(sg.compile_predict(fresh, (x_eval,))(x_eval), want_pred, PREDICT_RTOL,
                 "stepgraph reloaded")


def test_train_step_checkpoint_holds_buffers_once_and_resumes_bitwise(request, tmp_path):
    batches = Batches(request.node.name)
    data = [batches.draw() for _ in range(8)]

    def fresh_step():
        model = Net()
        model.load_state_dict(numpy_state(torch_twin(1)))
        return sg.compile_train_step(model, sg_loss, sg_optimizer(), example_inputs=data[0])

    step = fresh_step()
    for x, y in data[:5]:
        step(x, y)
    state = step.state_dict()
    model_keys = list(step.model.state_dict())
    assert list(state)[:len(model_keys)] == model_keys
    assert all(k.startswith("optimizer.") for k in list(state)[len(model_keys):])
    assert not any("running" in k or "num_batches" in k for k in list(state)[len(model_keys):])
    assert int(state["bn1.num_batches_tracked"]) == 5
    path = save_checkpoint(tmp_path / "ckpt.safetensors", Checkpoint(state, 1, 0))
    want = [float(step(x, y)) for x, y in data[5:]]

    resumed = fresh_step()
    resumed.load_state_dict(load_checkpoint(path).state)
    assert int(resumed.model.state_dict()["bn1.num_batches_tracked"]) == 5
    assert [float(resumed(x, y)) for x, y in data[5:]] == want
    final, resumed_final = step.state_dict(), resumed.state_dict()
    assert list(resumed_final) == list(final)
    for k in final:
        np.testing.assert_array_equal(resumed_final[k], final[k], err_msg=k)


def test_missing_buffer_is_rejected_and_nothing_written():
    model = Net()
    before = model.state_dict()
    bad = {k: v + 1 for k, v in before.items()}
    del bad["downsample.1.running_var"]
    with pytest.raises(sg.StateDictError, match="downsample.1.running_var"):
        model.load_state_dict(bad)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
