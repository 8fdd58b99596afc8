"""Dependent launches inside a capture (runtime/dependent_launch.py) keep the stream's order: a
chain of kernels, each reading what the one before wrote, large grids alternating with
one-block kernels, captured and replayed, gives the serial result; eager calls stay on CuPy's
launch."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

from stepgraph.backends.cuda.runtime import compiler, dependent_launch  # noqa: E402

SOURCE = r"""
#include "launch_order.cuh"
extern "C" __global__ void chain_double(const float* __restrict__ x, float* __restrict__ y,
                                        int n) {
    await_previous_kernel();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = 2.0f * x[i];
}
extern "C" __global__ void chain_note(const float* __restrict__ y, float* __restrict__ notes,
                                      int n, int at) {
    await_previous_kernel();
    // one block: every thread reads its share of the whole of y, the sum is noted
    __shared__ float part[256];
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += y[i] == y[0] ? 1.0f : 0.0f;
    part[threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int t = 0; t < blockDim.x; ++t) total += part[t];
        notes[2 * at] = y[n - 1];
        notes[2 * at + 1] = total;
    }
}
"""
N = 1 << 23                   # 32 MiB a buffer: the doubling takes a few waves of blocks
STEPS = 12


def run_chain(stream, a, b, notes):
    double = compiler.generated_kernel(SOURCE, "chain_double")
    note = compiler.generated_kernel(SOURCE, "chain_note")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    for step in range(STEPS):
        x, y = (a, b) if step % 2 == 0 else (b, a)
        double((4 * sms,), (256,), (x, y, np.int32(N)), stream=stream)
        note((1,), (256,), (y, notes, np.int32(N), np.int32(step)), stream=stream)


def expected_notes() -> np.ndarray:
    return np.array([[2.0 ** (s + 1), N] for s in range(STEPS)], np.float32).ravel()


def test_sm90_takes_dependent_launches():
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip("dependent launches need sm_90")
    assert dependent_launch.supported(cp.cuda.runtime.getDevice())


def test_a_captured_chain_of_dependent_launches_keeps_the_stream_order(monkeypatch):
    launched = []
    real = dependent_launch.launch
    monkeypatch.setattr(dependent_launch, "launch",
                        lambda *args: launched.append(args[0]) or real(*args))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a, b = cp.ones(N, cp.float32), cp.full(N, np.nan, cp.float32)
        notes = cp.full(2 * STEPS, np.nan, cp.float32)
        run_chain(stream, a, b, notes)             # eager: CuPy's launch
        stream.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(notes), expected_notes())
        assert launched == []
        stream.begin_capture()
        run_chain(stream, a, b, notes)
        graph = stream.end_capture()
        dependent = int(cp.cuda.Device().compute_capability) >= 90
        assert len(launched) == (2 * STEPS if dependent else 0)
        for _ in range(3):
            a.fill(1.0)
            b.fill(np.nan)
            notes.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            np.testing.assert_array_equal(cp.asnumpy(notes), expected_notes())


def test_the_switch_turns_dependent_launches_off(monkeypatch):
    monkeypatch.setenv(dependent_launch.ENV, "0")
    dependent_launch.supported.cache_clear()
    try:
        assert not dependent_launch.supported(cp.cuda.runtime.getDevice())
    finally:
        monkeypatch.delenv(dependent_launch.ENV)
        dependent_launch.supported.cache_clear()
