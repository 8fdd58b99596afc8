"""CUDA graph capture and replay of a whole step.

The step is recorded once on the backend's private non-default stream (the default stream
cannot be captured), uploaded once, and replayed with one launch per call. Every buffer the
graph touches was allocated before capture and stays referenced by the Executable, so the
memory pool can never hand it to anyone else while the graph still writes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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
