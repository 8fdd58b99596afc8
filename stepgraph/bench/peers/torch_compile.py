"""torch.compile(mode="reduce-overhead"): Inductor kernels replayed through CUDA graphs
(cudagraph trees) for forward + loss and the AOTAutograd backward, as the torch.compile docs
recommend for small, launch-bound models; the optimizer step compiled on its own, as in the
"Compiling the optimizer with torch.compile" tutorial.
"""

from __future__ import annotations

import torch

from stepgraph.bench.peers import PreparedStep, RunSpec
from stepgraph.bench.peers.torch_eager import (
    autocast,
    build_model,
    device_batches,
    loss_function,
    make_optimizer,
    release,
    set_precision,
    start_memory_count,
    synchronizer,
)


def prepare(spec: RunSpec) -> PreparedStep:
    """Compile forward+loss with mode="reduce-overhead" and optimizer.step with torch.compile."""
    notes = set_precision(spec.precision)
    memory = start_memory_count(spec.device)
    torch.manual_seed(spec.seed)
    torch._dynamo.reset()  # a fresh cache per run: earlier workloads must not count as warm-up
    model = build_model(spec.workload, spec.parameters, spec.device).train()
    loss_fn = loss_function(spec.workload)
    # foreach (the default) rather than fused: Inductor generates its own fused update kernels.
    optimizer = make_optimizer(spec.workload.optimizer, model.parameters())
    batches = device_batches(spec)

    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast(spec.precision, spec.device):
            return loss_fn(model(x), y)

    compiled_loss = torch.compile(forward_loss, mode="reduce-overhead")

    @torch.compile(fullgraph=False)
    def optimizer_step() -> None:
        optimizer.step()

    def run_step(i: int) -> torch.Tensor:
        x, y = batches[i]
        # Tells cudagraph trees a new iteration starts, so the previous step's graph outputs
        # may be overwritten (the documented call for training loops).
        torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        loss = compiled_loss(x, y)
        loss.backward()
        optimizer_step()
        return loss

    def read_loss(loss: torch.Tensor) -> float:
        return float(loss.detach().clone())

    def close() -> None:
        batches.clear()
        torch._dynamo.reset()
        release(spec.device)

    notes.append('forward+loss torch.compile(mode="reduce-overhead"); optimizer.step compiled')
    return PreparedStep(run_step, synchronizer(spec.device), read_loss, memory, close, notes)
