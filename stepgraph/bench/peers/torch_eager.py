"""PyTorch eager: the ordinary training loop, with the fused AdamW/SGD kernels PyTorch's optim
docs call the fastest implementation. Also the model/optimizer/precision helpers that the other
two PyTorch peers (torch_graph, torch_compile) share, so all three train the identical model.
"""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.nn.functional as F
from torch import nn

from stepgraph.bench.peers import MemoryReading, PreparedStep, RunSpec
from stepgraph.bench.workloads import ConvNet, DenseNet, LayerParams, OptimizerSpec, Workload


def build_model(workload: Workload, parameters: list[LayerParams], device: str) -> nn.Module:
    """The workload's nn.Sequential, loaded with the shared initial parameters."""
    model = workload.model
    if isinstance(model, DenseNet):
        module = _dense_net(model)
    elif isinstance(model, ConvNet):
        module = _conv_net(model, workload.sample_shape[0])
    else:
        raise TypeError(f"unknown model description {model!r}")
    layers = [m for m in module if isinstance(m, (nn.Linear, nn.Conv2d))]
    with torch.no_grad():
        for layer, init in zip(layers, parameters, strict=True):
            layer.weight.copy_(torch.from_numpy(init.weight))
            layer.bias.copy_(torch.from_numpy(init.bias))
    return module.to(device)


def _dense_net(model: DenseNet) -> nn.Sequential:
    activation = {"relu": nn.ReLU, "gelu": nn.GELU}[model.activation]
    layers: list[nn.Module] = []
    shapes = model.linear_shapes()
    for n_in, n_out in shapes[:-1]:
        layers += [nn.Linear(n_in, n_out), activation()]
        if model.dropout > 0:
            layers.append(nn.Dropout(model.dropout))
    layers.append(nn.Linear(*shapes[-1]))
    return nn.Sequential(*layers)


def _conv_net(model: ConvNet, in_channels: int) -> nn.Sequential:
    c1, c2 = model.conv_channels
    return nn.Sequential(
        nn.Conv2d(in_channels, c1, model.kernel), nn.MaxPool2d(2), nn.ReLU(),
        nn.Conv2d(c1, c2, model.kernel), nn.Dropout2d(model.dropout), nn.MaxPool2d(2), nn.ReLU(),
        nn.Flatten(), nn.Linear(model.flat_features, model.fc_hidden), nn.ReLU(),
        nn.Dropout(model.dropout), nn.Linear(model.fc_hidden, model.classes),
        nn.LogSoftmax(dim=1))


def loss_function(workload: Workload):
    """F.cross_entropy on logits or F.nll_loss on log-probabilities, mean reduction."""
    return {"cross_entropy": F.cross_entropy, "nll_loss": F.nll_loss}[workload.loss]


def make_optimizer(spec: OptimizerSpec, params, **implementation) -> torch.optim.Optimizer:
    """torch.optim.AdamW or SGD with the workload's hyper-parameters; `implementation` picks
    fused / foreach / capturable."""
    if spec.kind == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                 weight_decay=spec.weight_decay, **implementation)
    if spec.kind == "sgd":
        implementation.pop("capturable", None)  # SGD keeps no step counter: always capturable
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum,
                               weight_decay=spec.weight_decay, **implementation)
    raise ValueError(f"unknown optimizer kind {spec.kind!r}")


def set_precision(precision: str) -> list[str]:
    """Set PyTorch's global float32 matmul/conv mode for this run; returns notes for the report."""
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    # cudnn.benchmark is PyTorch's tuning-guide advice for fixed input shapes.
    torch.backends.cudnn.benchmark = True
    if precision == "bf16":
        return ["bf16: torch.autocast(bfloat16) forward+loss, float32 params/grads/AdamW state"]
    return [f"{precision}: allow_tf32={tf32} (matmul and cuDNN)"]


def autocast(precision: str, device: str, cache_enabled: bool = True):
    """torch.autocast to bfloat16 for "bf16", otherwise a no-op context."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=torch.bfloat16, cache_enabled=cache_enabled)


def device_batches(spec: RunSpec) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The shared batches copied to the device (labels int64, as torch's losses want)."""
    return [(torch.from_numpy(b.x).to(spec.device), torch.from_numpy(b.y).long().to(spec.device))
            for b in spec.batches]


def start_memory_count(device: str):
    """Begin measuring this peer's peak CUDA memory; returns a reader giving a MemoryReading."""
    if device != "cuda":
        return lambda: None
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    return lambda: MemoryReading(torch.cuda.max_memory_allocated() - baseline, "peak")


def synchronizer(device: str):
    """A function that waits for all queued device work."""
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def release(device: str) -> None:
    """Free the caching allocator's blocks so the next peer starts from an empty device."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def prepare(spec: RunSpec) -> PreparedStep:
    """PyTorch eager: zero_grad(set_to_none) + forward + loss + backward + fused optimizer step."""
    notes = set_precision(spec.precision)
    memory = start_memory_count(spec.device)
    torch.manual_seed(spec.seed)
    model = build_model(spec.workload, spec.parameters, spec.device).train()
    loss_fn = loss_function(spec.workload)
    optimizer = make_optimizer(spec.workload.optimizer, model.parameters(), fused=True)
    batches = device_batches(spec)

    def run_step(i: int) -> torch.Tensor:
        x, y = batches[i]
        optimizer.zero_grad(set_to_none=True)
        with autocast(spec.precision, spec.device):
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    def close() -> None:
        batches.clear()
        release(spec.device)

    return PreparedStep(run_step, synchronizer(spec.device), lambda loss: float(loss.detach()),
                        memory, close, notes + ["optimizer fused=True"])
