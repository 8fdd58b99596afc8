"""CUDA graph capture and replay of a whole step.

The step is recorded once on the backend's private non-default stream (the default stream
cannot be captured), uploaded once, and replayed with one launch per call. Every buffer the
graph touches was allocated before capture and stays referenced by the Executable, so the
memory pool can never hand it to anyone else while the graph still writes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ...errors import CaptureError


@dataclass
class CapturedGraph:
    graph: Any           # cupy.cuda.graph.Graph (instantiated and uploaded)
    stream: Any
    node_count: int | None

    def launch(self) -> None:
        self.graph.launch(self.stream)


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
    graph = stream.end_capture()
    graph.upload(stream)
    return CapturedGraph(graph, stream, count_nodes(graph))


def time_on_device(ctx, run: Callable[[], None], repeats: int = 5, cold: bool = False) -> float:
    """Device ms of one `run()`, without host launch gaps: one eager run first (it compiles,
    plans and takes scratch), then `repeats` runs captured into one graph and timed as one
    replay. Eager timings of short launches measure the host, which favours fewer launches.
    cold: each run follows an L2 flush (a memset over twice the L2 cache), the flushes' own
    time subtracted, so a run reads its inputs from memory, as a step's kernel mostly does,
    not from the cache its previous repeat filled. Syncs the stream: never call it while a
    step is being captured."""
    run()
    flush = _l2_flush(ctx) if cold else None

    def repeated():
        for _ in range(repeats):
            if flush is not None:
                flush()
            run()

    elapsed = _replay_ms(ctx, repeated)
    if flush is not None:
        elapsed -= _replay_ms(ctx, lambda: [flush() for _ in range(repeats)])
    return elapsed / repeats


def _replay_ms(ctx, program: Callable[[], None]) -> float:
    """Device ms of one replay of `program` captured as a graph (after one warm replay)."""
    import cupy as cp

    captured = capture(program, ctx)
    captured.launch()                    # first replay: upload and caches
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(ctx.stream)
    captured.launch()
    end.record(ctx.stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end)


def _l2_flush(ctx) -> Callable[[], None]:
    """A launch that evicts the L2 cache: a memset of a buffer twice its size (made once per
    context)."""
    import cupy as cp

    buf = ctx.extras.get("l2_flush")
    if buf is None:
        size = 2 * cp.cuda.Device().attributes["L2CacheSize"]
        buf = ctx.extras["l2_flush"] = cp.empty(size // 4, np.int32)
    return lambda: buf.fill(0)
