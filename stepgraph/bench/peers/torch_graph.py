"""PyTorch whole-step CUDA graph, the "whole network capture" pattern of PyTorch's CUDA Graphs
docs: warm up on a side stream, set grads to None, capture forward + loss + backward +
AdamW / SGD step once, then per step copy the batch into the static inputs and `graph.replay()`.
The optimizer is the fused one torch eager runs (`fused=True`), with `capturable=True`: PyTorch's
optim docs list the fused AdamW among the capturable implementations (its step counter lives on
the device), and fused SGD keeps no step counter. Conv nets run in the memory format torch eager
measured faster.
"""

from __future__ import annotations

import torch

from stepgraph.bench.peers import KernelCensus, PreparedStep, RunSpec, Unsupported
from stepgraph.bench.peers.torch_eager import (
    build_training,
    device_batches,
    layout_for,
    profiler_census,
    release,
    set_precision,
    start_memory_count,
)

WARMUP_STEPS = 3  # the docs' value; it also creates the optimizer state before capture
OPTIMIZER_IMPLEMENTATION = {"fused": True, "capturable": True}


def capture_whole_step(step_body, optimizer: torch.optim.Optimizer,
                       static_inputs: tuple[torch.Tensor, ...]):
    """Warm `step_body(*static_inputs)` (forward, loss, backward, optimizer.step; returns the
    loss) up on a side stream, then capture it once. Returns the torch.cuda.CUDAGraph and the
    loss tensor each replay rewrites; replays read whatever is copied into `static_inputs`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_STEPS):
            optimizer.zero_grad(set_to_none=True)
            step_body(*static_inputs)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    # Grads are None at capture, so backward allocates them from the graph's private pool and
    # every replay rewrites them instead of accumulating: that is the captured zero_grad.
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = step_body(*static_inputs)
    return graph, static_loss


def prepare(spec: RunSpec) -> PreparedStep:
    """Capture one whole training step into a torch.cuda.CUDAGraph and replay it per step."""
    if spec.device != "cuda":
        raise Unsupported("CUDA graphs need a CUDA device")
    notes = set_precision(spec.precision)
    layout = layout_for(spec)
    memory = start_memory_count(spec.device)
    training = build_training(spec, layout, **OPTIMIZER_IMPLEMENTATION)
    # cache_enabled=False: autocast's weight-cast cache must not outlive a capture.
    step_body = training.step_body(spec.precision, spec.device, cache_enabled=False)
    batches = device_batches(spec, layout)
    static_x, static_y = (t.clone() for t in batches[0])
    graph, static_loss = capture_whole_step(step_body, training.optimizer, (static_x, static_y))

    def run_step(i: int) -> torch.Tensor:
        x, y = batches[i]
        static_x.copy_(x, non_blocking=True)
        static_y.copy_(y, non_blocking=True)
        graph.replay()
        return static_loss

    def census() -> KernelCensus:
        return profiler_census(lambda: run_step(0), torch.cuda.synchronize)

    def close() -> None:
        # Held until here: the replays read and write the parameters and the optimizer state,
        # allocated outside the graph's pool, which nothing else keeps alive.
        nonlocal training
        training = None
        batches.clear()
        release(spec.device)

    notes.append(f"optimizer fused=True, capturable=True; {WARMUP_STEPS} side-stream warm-up "
                 f"steps; memory format {layout}")
    return PreparedStep(run_step, torch.cuda.synchronize, lambda loss: float(loss.detach()), memory,
                        close, notes, census)
