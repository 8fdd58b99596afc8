"""graph.time_on_device's early cut on the GPU: a candidate whose eager runs imply more device
time than give_up_above returns its eager time without a capture; one under it is captured and
timed as a replay, and so is a quick kernel behind a slow launch, whose eager time is mostly
the host's, while a slow kernel whose host work outlasts it is still cut: the eager runs wait
behind the host gate too (tests/unit/test_autotune_cutoff.py: the autotuner's use of it). The replay is
timed behind the host gate (runtime/host_gate.py): a host late to launch it is not timed, and
one later than the gate's timeout has it timed again."""
from __future__ import annotations

import time

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda
cp = require_gpu("nvmath")

from stepgraph.backends import get_backend  # noqa: E402
from stepgraph.backends.cuda.runtime import graph  # noqa: E402

SPIN = cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}""", "spin")


@pytest.fixture
def captures(monkeypatch):
    made = []
    real = graph.capture

    def counted(run, ctx):
        made.append(run)
        return real(run, ctx)

    monkeypatch.setattr(graph, "capture", counted)
    return made


def spinner(ctx, cycles: int):
    return lambda: SPIN((1,), (1,), (np.int64(cycles),), stream=ctx.stream)


def test_a_candidate_past_the_cut_is_not_captured(captures):
    ctx = get_backend("cuda").make_context("fp32")
    slow = spinner(ctx, 8_000_000)            # milliseconds at any H100/H200 clock
    ms = graph.time_on_device(ctx, slow, give_up_above=0.5)
    assert ms > 0.5 and isinstance(ms, graph.EagerMs) and captures == []


def test_a_candidate_under_the_cut_is_timed_as_a_replay(captures):
    ctx = get_backend("cuda").make_context("fp32")
    quick = spinner(ctx, 20_000)
    eager_cut = graph.time_on_device(ctx, quick, give_up_above=100.0)
    assert len(captures) == 1 and 0.0 < eager_cut < 100.0
    plain = graph.time_on_device(ctx, quick)
    assert len(captures) == 2 and plain == pytest.approx(eager_cut, rel=0.5)


def test_a_quick_kernel_behind_a_slow_launch_is_not_cut(captures):
    ctx = get_backend("cuda").make_context("fp32")
    quick = spinner(ctx, 20_000)

    def slow_launch():
        time.sleep(0.003)                     # 3 ms of host work before the launch
        quick()

    ms = graph.time_on_device(ctx, slow_launch, give_up_above=0.5)
    assert len(captures) == 1 and not isinstance(ms, graph.EagerMs), "cut for its host time"
    assert 0.0 < ms < 0.5, "the replay times the kernel, not the host"


def test_a_slow_kernel_whose_host_work_outlasts_it_is_cut(captures):
    """Host work after the launch (a cuDNN execute's Python) once hid the kernel's time from
    the bound (elapsed less host, near zero): behind the host gate the eager runs time the
    device alone."""
    ctx = get_backend("cuda").make_context("fp32")
    slow = spinner(ctx, 4_000_000)            # 1-3 ms at any H100/H200 clock

    def then_host_work():
        slow()
        time.sleep(0.008)                     # 8 ms of host work after the launch

    ms = graph.time_on_device(ctx, then_host_work, give_up_above=0.5)
    assert isinstance(ms, graph.EagerMs) and captures == [], "captured past the cut"
    assert 0.5 < ms < 8.0, "the eager figure is the kernel's, not the host's"


def test_a_replay_is_timed_without_the_host_late_to_launch_it(monkeypatch):
    """A host late to enqueue the replay (another thread holding the GIL on a first step) is
    not timed: the replay waits behind the host gate until it is enqueued."""
    from stepgraph.backends.cuda.runtime import host_gate

    monkeypatch.setattr(host_gate, "TIMEOUT_NS", 500_000_000)   # well past the 20 ms late
    ctx = get_backend("cuda").make_context("fp32")
    quick = spinner(ctx, 20_000)
    real_launch = graph.CapturedGraph.launch

    def late_launch(self):
        time.sleep(0.02)                      # 20 ms before every replay's launch
        real_launch(self)

    monkeypatch.setattr(graph.CapturedGraph, "launch", late_launch)
    ms = graph.time_on_device(ctx, quick, repeats=1)
    assert 0.0 < ms < 1.0, f"{ms} ms: the host's 20 ms were timed"


def test_the_gate_opens_by_itself(monkeypatch):
    """A gate never released opens after its timeout, so nothing waits on it forever."""
    from stepgraph.backends.cuda.runtime import host_gate

    monkeypatch.setattr(host_gate, "TIMEOUT_NS", 50_000_000)
    ctx = get_backend("cuda").make_context("fp32")
    gate = host_gate.gate(cp.cuda.runtime.getDevice())
    began = time.perf_counter()
    gate.hold(ctx.stream)
    ctx.stream.synchronize()
    waited = time.perf_counter() - began
    assert 0.04 < waited < 0.5, waited


def test_a_replay_enqueued_after_the_gate_opened_is_timed_again(monkeypatch):
    """Where the host took longer than the gate's timeout to enqueue the replay, the gate may
    have opened with the device idle before it: that replay is timed again."""
    from stepgraph.backends.cuda.runtime import host_gate

    monkeypatch.setattr(host_gate, "TIMEOUT_NS", 5_000_000)
    ctx = get_backend("cuda").make_context("fp32")
    quick = spinner(ctx, 20_000)
    real_launch, launches = graph.CapturedGraph.launch, []

    def once_late(self):
        launches.append(1)
        if len(launches) == 2:                # the first timed replay (after the upload's)
            time.sleep(0.02)                  # past the 5 ms timeout
        real_launch(self)

    monkeypatch.setattr(graph.CapturedGraph, "launch", once_late)
    ms = graph.time_on_device(ctx, quick, repeats=1)
    assert len(launches) == 3 and 0.0 < ms < 1.0, (launches, ms)
