"""memory_format="auto" decided by timing the step both ways (compile/layout_choice.py), on the
NumPy backend with "auto" let through (on the CPU it resolves to contiguous): by default only
where the rule is unsure (mixed channel counts); the faster layout is kept and set for every
later step; the timing leaves parameters, optimizer state and running statistics as they were
(the trajectory is that of a step built in the chosen layout from the start); the decision is
stored and reused by a later step; a model without convolutions, STEPGRAPH_LAYOUT_MEASURE=0
and a second layout that does not fit in memory are left to the rule."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
import stepgraph.api as api
from stepgraph import models, nn, optim
from stepgraph.cache import ChoiceCache
from stepgraph.compile import layout_choice
from stepgraph.nn import functional as F
from tests.ops.helpers import seeded


def ce(logits, y):
    return F.cross_entropy(logits, y)


def resnet():
    sg.nn.manual_seed(0)
    return models.resnet(widths=(8, 16))


def batch(seed):
    gen = seeded(f"layout_choice{seed}")
    return (gen.standard_normal((4, 3, 8, 8)).astype(np.float32),
            gen.integers(0, 10, 4).astype(np.int64))


@pytest.fixture
def auto_on_cpu(monkeypatch, tmp_path):
    """"auto" kept on the CPU, decisions stored under tmp_path; yields the stored cache."""
    monkeypatch.setattr(api, "resolve_memory_format", lambda fmt, device, precision: fmt)
    # every step with convolutions timed (tests/conftest.py turns the timing off)
    monkeypatch.setenv(layout_choice.MEASURE_ENV, "always")
    disk = ChoiceCache(layout_choice.NAMESPACE, {"device": "test"}, tmp_path)
    monkeypatch.setattr(layout_choice, "_disk", lambda compiled: disk)
    return disk


def timed_as(monkeypatch, step_us: dict[str, float]) -> list:
    """Make the timing report `step_us` (after running the real one, so its state handling
    is exercised); returns the list each call appends to."""
    calls, real = [], layout_choice._time

    def fake(exes, use_graph):
        real(exes, use_graph)
        calls.append(sorted(exes))
        return {fmt: step_us[fmt] for fmt in exes}
    monkeypatch.setattr(layout_choice, "_time", fake)
    return calls


def train(memory_format, steps=3, precision="fp32"):
    model = resnet()
    step = sg.compile_train_step(model, ce, optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                 example_inputs=batch(0), memory_format=memory_format,
                                 precision=precision)
    losses = [float(step(*batch(i))) for i in range(steps)]
    return step, losses, {k: v.numpy().copy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("faster", ["channels_last", "contiguous"])
def test_the_faster_layout_is_kept_and_the_timing_leaves_no_trace(auto_on_cpu, monkeypatch,
                                                                   faster, precision):
    """bf16: each layout's weight copies (a 1x1 conv's in channels-last order is a reshape
    of its parameter) have names of their own, and the dropped layout's are freed."""
    other = "contiguous" if faster == "channels_last" else "channels_last"
    calls = timed_as(monkeypatch, {faster: 1.0, other: 2.0})
    step, losses, state = train("auto", precision=precision)
    assert calls == [["channels_last", "contiguous"]]
    assert step.memory_format == faster
    assert step.layout_choice == layout_choice.LayoutChoice(faster, "measured",
                                                            {faster: 1.0, other: 2.0})
    # the same trajectory as a step built in that layout from the start: the timed steps
    # changed no parameter, momentum, running statistic or step counter
    monkeypatch.undo()
    want, want_losses, want_state = train(faster, precision=precision)
    assert sorted(step.state) == sorted(want.state)
    assert losses == want_losses
    for k, v in want_state.items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)


def test_a_later_step_reuses_the_stored_decision(auto_on_cpu, monkeypatch):
    calls = timed_as(monkeypatch, {"channels_last": 2.0, "contiguous": 1.0})
    first, _, _ = train("auto", steps=1)
    second, _, _ = train("auto", steps=1)
    assert len(calls) == 1
    assert first.layout_choice.source == "measured"
    assert second.layout_choice == layout_choice.LayoutChoice("contiguous", "cached")
    assert second.memory_format == "contiguous"
    assert auto_on_cpu.hits == 1


def test_a_step_of_another_shape_follows_the_choice(auto_on_cpu, monkeypatch):
    calls = timed_as(monkeypatch, {"channels_last": 1.0, "contiguous": 2.0})
    step, _, _ = train("auto", steps=1)
    x, y = batch(5)
    step(x[:3], y[:3])                         # a partial batch: its own plan, no timing
    assert len(calls) == 1 and len(step.executables) == 2
    assert all(any(n.op == "conv2d" and n.attrs.get("layout") == "NHWC"
                   for n in exe.plan.graph.nodes) for exe in step.executables.values())


def mixed_net():
    """Convolutions of 16 and of 12 channels (the 12s run no NHWC tensor-core kernel), the
    tensor-core ones carrying about half the FLOPs: the rule is unsure."""
    sg.nn.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 12, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(12, 12, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 10))


@pytest.mark.parametrize("model, timed", [(resnet, False), (mixed_net, True)])
def test_by_default_only_an_unsure_rule_is_timed(auto_on_cpu, monkeypatch, model, timed):
    """The ResNet's convolutions all run on tensor-core channel counts: the rule stands. The
    mixed net's split: both layouts are timed."""
    monkeypatch.setenv(layout_choice.MEASURE_ENV, "1")
    calls = timed_as(monkeypatch, {"channels_last": 2.0, "contiguous": 1.0})
    net = model()
    step = sg.compile_train_step(net, ce, optim.SGD(net.parameters(), lr=0.1),
                                 example_inputs=batch(0), memory_format="auto")
    assert len(calls) == timed
    assert step.layout_choice == (
        layout_choice.LayoutChoice("contiguous", "measured", {"channels_last": 2.0,
                                                              "contiguous": 1.0})
        if timed else layout_choice.LayoutChoice("channels_last", "rule"))


def test_without_convolutions_the_rule_decides(auto_on_cpu, monkeypatch):
    calls = timed_as(monkeypatch, {})
    sg.nn.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    gen = seeded("layout_choice_mlp")
    x, y = gen.standard_normal((4, 6)).astype(np.float32), gen.integers(0, 3, 4)
    step = sg.compile_train_step(model, ce, optim.SGD(model.parameters(), lr=0.1),
                                 example_inputs=(x, y), memory_format="auto")
    assert calls == []
    assert step.layout_choice == layout_choice.LayoutChoice("contiguous", "rule")


def test_measuring_can_be_switched_off(auto_on_cpu, monkeypatch):
    calls = timed_as(monkeypatch, {})
    monkeypatch.setenv(layout_choice.MEASURE_ENV, "0")
    step, _, _ = train("auto", steps=1)
    assert calls == [] and step.layout_choice is None and step.memory_format == "auto"


def test_a_second_layout_that_does_not_fit_leaves_the_rules(auto_on_cpu, monkeypatch):
    calls = timed_as(monkeypatch, {})
    real, built = api.TrainStep.executable_of, []

    def tight(self, plan, key):
        if built:
            raise MemoryError("out of device memory")
        built.append(plan)
        return real(self, plan, key)
    monkeypatch.setattr(api.TrainStep, "executable_of", tight)
    step, losses, _ = train("auto", steps=2)
    assert calls == []
    # the rule: the ResNet's convolutions (8 and 16 channels) pay channels-last
    assert step.layout_choice == layout_choice.LayoutChoice("channels_last", "rule")
    assert all(np.isfinite(losses))
