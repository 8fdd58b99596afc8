"""Host work a plan's first step would do op after op, started ahead on one thread.

When a plan is bound to its buffers (CudaBackend.prepare), the families that build something
on the host at a node's first launch start it here (their BUILDS_AHEAD hooks): today the
cuDNN plans of the convolutions (conv/conv_cudnn.py), the first step's largest host cost on
a cold start. The NVRTC compiles started at the same time have their own pool (compiler.py).

One thread, the lane: the cuDNN frontend's bindings hold the GIL for the whole of each call
(its pybind11 methods release nothing: python/pygraph/pygraph.cpp of NVIDIA/cudnn-frontend,
whose build_plans still says "TODO: Add multithreaded support in python"). Two builds on two
threads would interleave, not overlap, and each would finish later; one thread builds them in
the order the step first launches them. What overlaps them is the work that runs without the
GIL: NVRTC's compiles on their pool, the device work the first step's autotuner times, and
the main thread waiting for either (a launch waiting for a module or a build releases the GIL).

While the device times a candidate (graph.time_on_device holds `timing_on_device`), the lane
starts no job: a build beside a timing made the timing wait for the GIL, a whole build at a
time. (On an H200, the first problem MobileNet's bf16 step timed, its stem convolution, took
1-6 s of host time a candidate while the lane built the other problems' plans, and a 22 µs
plan was timed at 12-47 ms, with or without the host gate of host_gate.py; with the lane
paused it timed at 22 µs.)

A job waiting for work done in another process (a cuDNN build worker's plan) lets timings run
meanwhile (`waiting_elsewhere`): on an H200, the stem convolutions' timings of the MobileNet
and ConvNeXt files waited 1.9 s and 3.7 s for the lane while it waited for a worker.

A launch that needs a job waits for that job alone: if the lane has not taken it up yet, the
launch runs it itself, so it never waits behind the jobs queued before it. A job's failure is
kept for whoever asks for its result (the launch that needs it), never raised when started.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable

_lane: ThreadPoolExecutor | None = None
_lock = threading.Lock()
# held by a thread timing on the device (timing_on_device); the lane holds it for each job it
# runs. Reentrant: a timed launch may run a job the lane has not taken up, on the timing thread.
_timing = threading.RLock()
_timers_waiting = 0               # threads waiting for _timing to time: the lane lets them first


class Job:
    """One piece of host work, run once: by a pool thread (the lane here, compiler.py's NVRTC
    pool), or by the first caller that needs its result before a thread has taken it up.
    `device`: the GPU it is for, made current on the lane (the current device is per thread;
    a caller runs it on its own), None for any."""

    def __init__(self, build: Callable[[], object], device: int | None = None):
        self.build, self.device = build, device
        self.future: Future = Future()
        self._taken = threading.Lock()

    def run(self) -> None:
        if not self._taken.acquire(blocking=False):
            return                        # running or done elsewhere
        self.future.set_running_or_notify_cancel()
        build, self.build = self.build, None    # what it holds (a context) is not kept
        try:
            self.future.set_result(build())
        except BaseException as err:      # kept for whoever asks for the result
            self.future.set_exception(err)

    def result(self):
        """The job's result: computed here if nobody has started it, else waited for (without
        the GIL); its failure is raised here."""
        self.run()
        return self.future.result()

    def started(self) -> bool:
        return self._taken.locked()

    def done(self) -> bool:
        return self.future.done()


def start(job: Job) -> Job:
    """Queue `job` on the lane (a job that is running or done stays as it is)."""
    global _lane
    with _lock:
        if _lane is None:
            _lane = ThreadPoolExecutor(1, thread_name_prefix="ahead")
        if not job.started():
            _lane.submit(_run_on_lane, job)
    return job


@contextmanager
def timing_on_device():
    """Held while the device times something: the lane starts no job meanwhile, and a job it
    is running is waited for."""
    global _timers_waiting
    with _lock:
        _timers_waiting += 1
    try:
        _timing.acquire()
    finally:
        with _lock:
            _timers_waiting -= 1
    try:
        yield
    finally:
        _timing.release()


@contextmanager
def waiting_elsewhere():
    """Held by a job while it waits for work done outside this process (a build worker's
    answer, cudnn_compiled.py) and so holds no GIL: on the lane, timings may run meanwhile
    (it lets go of `_timing` until the wait ends). Elsewhere it changes nothing."""
    if not getattr(_on_lane, "holding", False):
        yield
        return
    _timing.release()
    try:
        yield
    finally:
        _timing.acquire()


_on_lane = threading.local()       # .holding: this thread is the lane, holding _timing for a job


def _run_on_lane(job: Job) -> None:
    # A lock's release does not hand it to a waiting thread: the lane, going from job to job,
    # would take it again and again before a waiting timer ran, so it lets waiting timers go first.
    while _timers_waiting:
        time.sleep(0.001)
    with _timing:                         # never beside a timing on the device
        _on_lane.holding = True
        try:
            on_device(job.device, job.run)
        finally:
            _on_lane.holding = False


def on_device(device: int | None, build: Callable[[], object]):
    """build() with `device` current on this thread (None: as it is)."""
    if device is None:
        return build()
    import cupy as cp

    with cp.cuda.Device(device):
        return build()
