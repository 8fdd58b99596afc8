"""compile/pointwise_recompute.py: saved elementwise values recomputed by their readers, and
the pointwise groups that merge where one node reads from several (compile/pointwise.py)."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
import stepgraph.api
from stepgraph import nn, optim
from stepgraph.compile import fuse as fuse_module
from stepgraph.compile.fuse import PASSES, recompute_saved_pointwise

WITHOUT = tuple(p for p in PASSES if p is not recompute_saved_pointwise)


class ConvAct(nn.Module):
    """conv -> BatchNorm -> activation -> conv: the activation's input is BatchNorm's output,
    which the activation's gradient reads anyway (Hardswish's x * ... needs x)."""

    def __init__(self, act: nn.Module):
        super().__init__()
        self.c1, self.bn, self.act = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), act
        self.c2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        return self.c2(self.act(self.bn(self.c1(x))))


class ShiftSquare(nn.Module):
    """conv -> (z = y + 1; z * z) -> conv: the gradient reads z but not y, so recomputing z
    would keep y for the backward only; z stays saved."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        z = self.c1(x) + 1.0
        return self.c2(z * z)


def run(monkeypatch, make, passes, precision, steps=3):
    """Losses (bits), parameters and plan graph of `steps` SGD steps on numpy, from the
    model kind's one initialisation."""
    monkeypatch.setattr(stepgraph.api, "fuse", lambda g: fuse_module.fuse(g, passes=passes))
    gen = np.random.default_rng(7)
    batch = (gen.standard_normal((4, 3, 6, 6)).astype(np.float32),
             gen.standard_normal((4, 4, 6, 6)).astype(np.float32))
    model = make()
    model.load_state_dict(_INITIAL.setdefault(make, make().state_dict()))
    step = sg.compile_train_step(model, nn.functional.mse_loss, optim.SGD(lr=0.05, momentum=0.9),
                                 batch, precision=precision, memory_format="channels_last")
    losses = [np.float32(step(*batch)).tobytes() for _ in range(steps)]
    graph = next(iter(step.executables.values())).plan.graph
    return losses, model.state_dict(), graph


_INITIAL: dict = {}


def hardswish():
    return ConvAct(nn.Hardswish())


def relu6():
    return ConvAct(nn.ReLU6())


def pointwise(graph, label: str) -> list:
    return [n for n in graph.nodes if n.op == "pointwise" and label in n.label]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("make", [hardswish, relu6])
def test_activation_intermediates_are_recomputed_not_saved(monkeypatch, make, precision):
    """Without the pass the forward kernel writes the activation's intermediates for the
    backward (Hardswish: x + 3 and both clamps) and comparison kernels read them back; with
    it the forward writes y alone and one backward kernel reads dy and x. Same bits."""
    want = run(monkeypatch, make, WITHOUT, precision)
    got = run(monkeypatch, make, PASSES, precision)
    assert got[0] == want[0]
    for key in want[1]:
        np.testing.assert_array_equal(got[1][key], want[1][key], err_msg=key)
    label = "Hardswish" if make is hardswish else "ReLU6"
    fused = pointwise(got[2], label)
    assert len(fused) == 2, fused
    forward, backward = fused
    assert len(forward.outputs) == 1
    assert len(backward.inputs) == 2 and {v.shape for v in backward.inputs} == \
        {forward.outputs[0].shape}
    assert not [n for n in got[2].nodes if n.op in ("compare_scalar", "compare")]
    saved = sum(len(n.outputs) for n in pointwise(want[2], label))
    assert saved > sum(len(n.outputs) for n in fused)


def test_a_value_whose_source_only_it_needs_stays_saved(monkeypatch):
    """z = y + 1 is read by the gradient of z * z; y is not. Recomputing z would keep y alive
    for the backward in z's place: no gain, so the graph is the one without the pass."""
    want = run(monkeypatch, ShiftSquare, WITHOUT, "fp32")
    got = run(monkeypatch, ShiftSquare, PASSES, "fp32")
    assert got[0] == want[0]
    ops = lambda graph: [(n.op, len(n.inputs), len(n.outputs)) for n in graph.nodes]  # noqa
    assert ops(got[2]) == ops(want[2])


class StatisticBeforeItsUpdate(nn.Module):
    """y * clamp(y + bn.running_mean, 0, 6), y = conv(x), then BatchNorm (which updates
    running_mean in place) and conv: the backward reads y anyway, but the clamp's masks must
    come from the statistic as it was before the update, so they stay saved rather than
    recomputed there."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        y = self.c1(x)
        r = (y + self.bn.running_mean.reshape(1, 8, 1, 1)).clamp(0.0, 6.0) * y
        return self.c2(self.bn(r))


def test_a_source_written_in_place_before_the_reader_is_not_read_again(monkeypatch):
    want = run(monkeypatch, StatisticBeforeItsUpdate, WITHOUT, "fp32")
    got = run(monkeypatch, StatisticBeforeItsUpdate, PASSES, "fp32")
    assert got[0] == want[0]
    for key in want[1]:
        np.testing.assert_array_equal(got[1][key], want[1][key], err_msg=key)
