"""CUDA graph capture and replay of a whole step.

The step is recorded once on the backend's private non-default stream (the default stream
cannot be captured), uploaded once, and replayed with one launch per call. Every buffer the
graph touches was allocated before capture and stays referenced by the Executable, so the
memory pool can never hand it to anyone else while the graph still writes it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ....errors import CaptureError
from . import ahead, host_gate

# ctx.extras key: the ids of the process groups whose NCCL work the capture in progress holds
# (backends/cuda/collective.py adds them).
NCCL_GROUPS_KEY = "captured_nccl_groups"


@dataclass
class CapturedGraph:
    graph: Any           # cupy.cuda.graph.Graph (instantiated and uploaded); None: released
    stream: Any
    node_count: int | None

    def launch(self) -> None:
        if self.graph is None:
            raise CaptureError("this step's CUDA graph was released when its process group "
                               "was destroyed; compile the step again in a new group")
        self.graph.launch(self.stream)

    def release(self) -> None:
        """Destroy the graph now. NCCL's communicator destroy waits until every graph holding
        its work is gone, so a process group releases its graphs first (group.destroy)."""
        self.graph = None


def count_nodes(graph) -> int | None:
    """Number of nodes in the captured cudaGraph_t, through cuda-python when it is there."""
    handle = getattr(graph, "graph", 0)
    if not handle:
        return None
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return None
    err, _, count = cudart.cudaGraphGetNodes(cudart.cudaGraph_t(init_value=handle), numNodes=0)
    return int(count) if err == cudart.cudaError_t.cudaSuccess else None


def capture(run: Callable[[], None], ctx) -> CapturedGraph:
    """Record `run()` (a whole step of launches on ctx.stream) as one CUDA graph."""
    stream = ctx.stream
    ctx.capturing = True
    ctx.extras[NCCL_GROUPS_KEY] = set()
    stream.begin_capture()
    try:
        with stream:
            run()
    except Exception as err:
        try:
            stream.end_capture()
        except Exception:  # the capture is already invalid; report the original error
            pass
        raise CaptureError(f"capturing the step failed: {err}") from err
    finally:
        ctx.capturing = False
        groups = ctx.extras.pop(NCCL_GROUPS_KEY)
    graph = stream.end_capture()
    graph.upload(stream)
    captured = CapturedGraph(graph, stream, count_nodes(graph))
    if groups:
        from ....distributed.group import lookup_group

        for group_id in sorted(groups):
            lookup_group(group_id).hold_graph(captured)
    return captured


def _eager_ms(ctx, run: Callable[[], None], gate=None) -> tuple[float, float]:
    """(ms between events recorded on ctx's stream around `run()`, host ms enqueuing it). The
    device can idle between the events only while the host has not yet enqueued the rest, so
    run()'s device time is at least the first less the second, whatever the host's gaps
    (launch costs, a thread holding the GIL). With a host gate (host_gate.py), the stream
    waits behind it until everything is enqueued, so the first is device time alone."""
    import cupy as cp

    start, end = cp.cuda.Event(), cp.cuda.Event()
    began = time.perf_counter()
    if gate is not None:
        gate.hold(ctx.stream)
    try:
        start.record(ctx.stream)
        run()
        end.record(ctx.stream)
    finally:
        if gate is not None:
            gate.release()
    host_ms = (time.perf_counter() - began) * 1e3
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end), host_ms


def _current_gate() -> host_gate.HostGate | None:
    import cupy as cp

    return host_gate.gate(cp.cuda.runtime.getDevice())


def _device_ms_at_least(elapsed_ms: float, host_ms: float, gate) -> float:
    """A lower bound of the device time of a run timed by _eager_ms: its elapsed time where a
    gate held the stream until the host had enqueued it all, else its elapsed time less the
    host's."""
    if gate is not None and host_gate.held_throughout(host_ms):
        return elapsed_ms
    return elapsed_ms - host_ms


class EagerMs(float):
    """What time_on_device returns for a candidate past its cut: an eager run's elapsed ms,
    no capture made."""


def time_on_device(ctx, run: Callable[[], None], repeats: int = 5,
                   give_up_above: float | None = None) -> float:
    """Device ms of one `run()`, without host launch gaps: one eager run first (it compiles,
    plans and takes scratch), then `repeats` runs captured into one graph and timed as one
    replay, behind a host gate (_replay_ms), with the ahead lane paused. Eager timings of
    short launches measure the host, which favours fewer launches.
    give_up_above (ms of device time): two more eager runs are timed first, behind the host
    gate, and where the device time each implies at least (_device_ms_at_least) is past the
    cut in both, the faster's elapsed time is returned (as an EagerMs) without the capture
    (a candidate that cannot win; that figure is its device time, or more where the gate
    opened by itself). Syncs the stream: never call it while a step is being captured."""
    with ahead.timing_on_device():        # the ahead lane builds nothing meanwhile
        return _time_on_device(ctx, run, repeats, give_up_above)


def _time_on_device(ctx, run: Callable[[], None], repeats: int,
                    give_up_above: float | None) -> float:
    run()
    if give_up_above is not None:
        # Two eager runs must both be past the cut: one alone may have shared the device
        # with other work. (With one run cut on its elapsed time, an H200 run of the ConvNeXt
        # file kept a 4x slower plan for one depthwise conv that the next run did not, most
        # likely after a host wait, which the bound now leaves out as well.) They run behind
        # the host gate: without it, a launch whose host work outlasts its kernel (a cuDNN
        # plan's execute, 0.1-0.3 ms of Python) left a bound near zero, and 262 candidates
        # of the U-Net and MobileNet files at fp32 were captured and replayed past the cut.
        gate = _current_gate()
        eager = [_eager_ms(ctx, run, gate) for _ in range(2)]
        if min(_device_ms_at_least(elapsed, host, gate) for elapsed, host in eager) \
                > give_up_above:
            return EagerMs(min(elapsed for elapsed, _ in eager))

    def repeated():
        for _ in range(repeats):
            run()

    captured = capture(repeated, ctx)
    captured.launch()                    # first replay: upload and caches
    return _replay_ms(ctx, captured) / repeats


def _replay_ms(ctx, captured: CapturedGraph, attempts: int = 3) -> float:
    """Device ms of one replay of `captured`: timed behind a host gate (host_gate.py), so a
    host late to enqueue it (another thread holding the GIL) is not timed with it. Where the
    host took longer than the gate's timeout to enqueue it, the gate may have opened first:
    it is timed again (at most `attempts` times, the least kept)."""
    gate = _current_gate()
    best = float("inf")
    for _ in range(attempts):
        elapsed, host_ms = _eager_ms(ctx, captured.launch, gate)
        best = min(best, elapsed)
        if gate is None or host_gate.held_throughout(host_ms):
            break
    return best
