"""PyTorch whole-step CUDA graph, the "whole network capture" pattern of PyTorch's CUDA Graphs
docs: warm up on a side stream, set grads to None, capture forward + loss + backward +
AdamW(capturable=True) / SGD step once, then per step copy the batch into the static inputs and
`graph.replay()`. Conv nets run in the memory format torch eager measured faster.
"""

from __future__ import annotations

import torch

from stepgraph.bench.peers import KernelCensus, PreparedStep, RunSpec, Unsupported
from stepgraph.bench.peers.torch_eager import (
    autocast,
    build_model,
    device_batches,
    gradient_clipper,
    layout_for,
    loss_function,
    make_optimizer,
    profiler_census,
    release,
    set_precision,
    start_memory_count,
)

WARMUP_STEPS = 3  # the docs' value; it also creates the optimizer state before capture


def prepare(spec: RunSpec) -> PreparedStep:
    """Capture one whole training step into a torch.cuda.CUDAGraph and replay it per step."""
    if spec.device != "cuda":
        raise Unsupported("CUDA graphs need a CUDA device")
    notes = set_precision(spec.precision)
    layout = layout_for(spec)
    memory = start_memory_count(spec.device)
    torch.manual_seed(spec.seed)
    model = build_model(spec.workload, spec.parameters, spec.device, layout).train()
    loss_fn = loss_function(spec.workload)
    optimizer = make_optimizer(spec.workload.optimizer, model.parameters(), capturable=True)
    clip = gradient_clipper(spec.workload.optimizer, model)
    batches = device_batches(spec, layout)
    static_x, static_y = (t.clone() for t in batches[0])

    def whole_step() -> torch.Tensor:
        # cache_enabled=False: autocast's weight-cast cache must not outlive a capture.
        with autocast(spec.precision, spec.device, cache_enabled=False):
            loss = loss_fn(model(static_x), static_y)
        loss.backward()
        clip()
        optimizer.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_STEPS):
            optimizer.zero_grad(set_to_none=True)
            whole_step()
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    # Grads are None at capture, so backward allocates them from the graph's private pool and
    # every replay rewrites them instead of accumulating: that is the captured zero_grad.
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = whole_step()

    def run_step(i: int) -> torch.Tensor:
        x, y = batches[i]
        static_x.copy_(x, non_blocking=True)
        static_y.copy_(y, non_blocking=True)
        graph.replay()
        return static_loss

    def census() -> KernelCensus:
        return profiler_census(lambda: run_step(0), torch.cuda.synchronize)

    def close() -> None:
        batches.clear()
        release(spec.device)

    notes.append(f"optimizer capturable=True; {WARMUP_STEPS} side-stream warm-up steps; "
                 f"memory format {layout}")
    return PreparedStep(run_step, torch.cuda.synchronize, lambda loss: float(loss.detach()), memory,
                        close, notes, census)
