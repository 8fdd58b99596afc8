"""Holding a stream until the host has enqueued a timed section, so that the events around
it time the device's work and never the host's gaps.

A replay timed between two events measures the host too when the host is late to enqueue
the replay after the first event: the device idles between them. Any thread holding the GIL
then makes the timing late (NVRTC's pool threads, the garbage collector; the ahead lane's
cuDNN builds did, before it paused for timings: runtime/ahead.py). The gate is a one-thread
kernel enqueued first that spins until the host writes a word of mapped host memory, once
every launch of the section is enqueued: the first event then records when the gate opens,
with the section already queued behind it.

The gate opens by itself after TIMEOUT_NS. Another thread may wait for the device while the
gate holds it, and the host for that thread (a module loaded lazily may synchronize the
context, and the driver's lock then keeps the host from launching): the gate then costs its
timeout, so it is short. With a one-second timeout, an H200 run stalled about a second for
each of several candidates in the conv files' setups; a host that was later than the timeout
has its replay timed again (graph._replay_ms). Only launches that never synchronize may run
inside a gate (a graph replay).
"""
from __future__ import annotations

import ctypes
import functools

from . import compiler

TIMEOUT_NS = 20_000_000              # the gate opens by itself after 20 ms
NAME = "hold_until_released"
SOURCE = r"""
#include "launch_order.cuh"
extern "C" __global__ void hold_until_released(const volatile int* released,
                                               long long timeout_ns) {
    await_previous_kernel();
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (*released == 0 && now - start < (unsigned long long)timeout_ns);
}
"""


class HostGate:
    """One word of mapped, page-locked host memory and the kernel that waits on it."""

    def __init__(self):
        import cupy as cp

        runtime = cp.cuda.runtime
        # mapped: with unified addressing the device reads it at its host address
        self._ptr = runtime.hostAlloc(4, runtime.hostAllocMapped | runtime.hostAllocPortable)
        self._word = ctypes.c_int.from_address(self._ptr)
        self._kernel = compiler.generated_kernel(SOURCE, NAME)

    def hold(self, stream) -> None:
        """Enqueue the gate on `stream`: what is enqueued after it waits for release()."""
        import numpy as np

        self._word.value = 0
        self._kernel((1,), (1,), (self._ptr, np.int64(TIMEOUT_NS)), stream=stream)

    def release(self) -> None:
        self._word.value = 1


def held_throughout(host_ms: float) -> bool:
    """Whether a section the host took `host_ms` to enqueue behind a gate stayed behind it
    (the gate opened when released, not by its timeout)."""
    return host_ms * 1e6 < TIMEOUT_NS


@functools.cache
def gate(device: int) -> HostGate | None:
    """The gate of `device` (made once), None where its memory cannot be mapped."""
    import cupy as cp

    if not cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrCanMapHostMemory,
                                              device):
        return None
    return HostGate()


def start_compile() -> None:
    """Start compiling the gate's kernel on the compile pool (the backend does it at start,
    so the first autotuned launch finds it built)."""
    compiler.prefetch((), generated=[(SOURCE, NAME)])
