"""A build worker of cudnn_compiled's pool (`python -m` this module): it answers each request
(a problem, and which plan) with that runtime-compiled plan built and serialized."""
from __future__ import annotations

from typing import Any

from stepgraph.backends.cuda.conv import conv_cudnn
from stepgraph.backends.cuda.conv.cudnn_compiled import CompiledPlan
from stepgraph.backends.cuda.runtime.worker_pool import serve

_handles: dict[int, Any] = {}           # this worker's cuDNN handle per device


def build_requested(request) -> CompiledPlan | None:
    """The plan a `cudnn_compiled.prefetch` asked for, built: p's first runtime-compiled plan
    in the order conv_cudnn._build takes candidates (`want` given: the plan at that
    (modes, index), if it is one); None where none builds."""
    import cupy as cp

    p, want = request
    cudnn = conv_cudnn._load()[0]
    cp.cuda.Device(p.device).use()
    handle = _handles.get(p.device)
    if handle is None:
        handle = _handles[p.device] = cudnn.create_handle()
    order = ([(want[0], [want[1]])] if want is not None
             else [(modes, None) for _, modes in conv_cudnn.heuristics()])
    for modes, indices in order:
        try:
            graph, _, count = conv_cudnn._ranked(cudnn, p, handle, tuple(modes))
        except Exception:   # as in _build: this list does not rank the problem
            continue
        for index in indices if indices is not None else range(count):
            if index >= count or not conv_cudnn._runtime_compiled(cudnn, graph, index):
                continue
            try:
                name, workspace = conv_cudnn._build_plan(graph, index)
            except Exception:   # as in _build: the next one that builds is taken
                continue
            blob = bytes(graph.serialize(as_bytes=True))
            return CompiledPlan(tuple(modes), index, name, workspace, blob)
    return None


if __name__ == "__main__":
    serve(build_requested)
