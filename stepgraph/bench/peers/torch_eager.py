"""PyTorch eager: the ordinary training loop, with the fused AdamW/SGD kernels PyTorch's optim
docs call the fastest implementation, and for conv nets the faster of the two memory formats
(NCHW or channels_last, timed here once per workload and precision). Also the model/optimizer/
precision/census helpers that the other two PyTorch peers (torch_graph, torch_compile) share, so
all three train the identical model in the same layout.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stepgraph.bench.census import kernel_name_census
from stepgraph.bench.peers import KernelCensus, MemoryReading, PreparedStep, RunSpec
from stepgraph.bench.workloads import (
    ConvNet,
    DenseNet,
    GPT,
    LayerParams,
    OptimizerSpec,
    PlainConvNet,
    ResNet,
    Workload,
)

NCHW, CHANNELS_LAST = "NCHW", "channels_last"
MEMORY_FORMATS = {NCHW: torch.contiguous_format, CHANNELS_LAST: torch.channels_last}
CONV_MODELS = (ConvNet, ResNet, PlainConvNet)
LAYOUT_TRIAL_SECONDS = 0.15  # timed per memory format, after the cuDNN benchmark steps
LAYOUT_TRIAL_STEPS = 200  # at most, per memory format
CUDNN_BENCHMARK_LIMIT = 0  # cudnn.benchmark tries every algorithm (torch.backends.cudnn docs)
# Layout chosen by torch eager's trial per (workload, precision); torch graph and torch compile
# use it, so all three PyTorch rows run the same kernels' layout.
_chosen_layouts: dict[tuple[str, str], str] = {}


def build_model(workload: Workload, parameters: list[LayerParams], device: str,
                layout: str = NCHW) -> nn.Module:
    """The workload's module, loaded with the shared initial parameters, in `layout`."""
    model = workload.model
    if isinstance(model, GPT):
        from stepgraph.bench.peers.torch_gpt import gpt_model
        return gpt_model(workload, parameters).to(device)
    if isinstance(model, (ResNet, PlainConvNet)):
        from stepgraph.bench.peers.torch_models import vision_model
        return vision_model(workload, parameters).to(device, memory_format=MEMORY_FORMATS[layout])
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
    return module.to(device, memory_format=MEMORY_FORMATS[layout])


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
    """F.cross_entropy on logits (with the workload's label smoothing) or F.nll_loss on
    log-probabilities, mean reduction; the GPT's cross-entropy over all its positions."""
    if isinstance(workload.model, GPT):
        from stepgraph.bench.peers.torch_gpt import next_token_loss
        return next_token_loss
    if workload.loss == "cross_entropy" and workload.label_smoothing:
        return functools.partial(F.cross_entropy, label_smoothing=workload.label_smoothing)
    return {"cross_entropy": F.cross_entropy, "nll_loss": F.nll_loss}[workload.loss]


def make_optimizer(spec: OptimizerSpec, params, **implementation) -> torch.optim.Optimizer:
    """torch.optim.AdamW or SGD with the workload's hyper-parameters; `implementation` picks
    fused / foreach / capturable. decay_matrices_only: nanoGPT's two parameter groups."""
    if spec.decay_matrices_only:
        params = list(params)
        params = [{"params": [p for p in params if p.dim() >= 2],
                   "weight_decay": spec.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if spec.kind == "adamw":
        return torch.optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                 weight_decay=spec.weight_decay, **implementation)
    if spec.kind == "sgd":
        implementation.pop("capturable", None)  # SGD keeps no step counter: always capturable
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum,
                               weight_decay=spec.weight_decay, nesterov=spec.nesterov,
                               **implementation)
    raise ValueError(f"unknown optimizer kind {spec.kind!r}")


def set_precision(precision: str) -> list[str]:
    """Set PyTorch's global float32 matmul/conv mode for this run; returns notes for the report."""
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    # cudnn.benchmark is PyTorch's tuning-guide advice for fixed input shapes; benchmark_limit
    # 0 has it time every cuDNN algorithm (its default stops at 10), as stepgraph's autotuner
    # times every plan.
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.benchmark_limit = CUDNN_BENCHMARK_LIMIT
    limit = f"cudnn.benchmark_limit={CUDNN_BENCHMARK_LIMIT} (every algorithm timed)"
    if precision == "bf16":
        return ["bf16: torch.autocast(bfloat16) forward+loss, float32 params/grads/AdamW state",
                limit]
    return [f"{precision}: allow_tf32={tf32} (matmul and cuDNN)", limit]


def autocast(precision: str, device: str, cache_enabled: bool = True):
    """torch.autocast to bfloat16 for "bf16", otherwise a no-op context."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=torch.bfloat16, cache_enabled=cache_enabled)


def device_batches(spec: RunSpec, layout: str = NCHW) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The shared batches copied to the device (labels int64, as torch's losses want), images
    in `layout` (converted here, before timing, as a data loader would hand them over)."""
    batches = []
    for b in spec.batches:
        x = torch.from_numpy(b.x).to(spec.device)
        if x.dim() == 4:
            x = x.contiguous(memory_format=MEMORY_FORMATS[layout])
        batches.append((x, torch.from_numpy(b.y).long().to(spec.device)))
    return batches


def layout_for(spec: RunSpec) -> str:
    """The memory format the torch peers use: NCHW for models without convs and on the CPU;
    for conv nets what torch eager measured faster, or, when it has not run, channels_last
    where cuDNN's tensor-core kernels want NHWC (tf32, bf16) and NCHW in strict fp32."""
    if spec.device != "cuda" or not isinstance(spec.workload.model, CONV_MODELS):
        return NCHW
    default = NCHW if spec.precision == "fp32" else CHANNELS_LAST
    return _chosen_layouts.get((spec.workload.name, spec.precision), default)


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


KERNEL_ACTIVITY = re.compile(r"kernel", re.IGNORECASE)  # Kineto's activity type of a launch
NOT_KERNELS = ("Memcpy", "Memset")


def profiler_census(run_step, synchronize) -> KernelCensus:
    """Count the device kernels of one step with torch.profiler (CUPTI also reports the kernels
    a CUDA graph replay launches); copies, memsets and annotations are not kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_step()
        synchronize()
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    names = [e.name for e in device_events
             if KERNEL_ACTIVITY.search(str(getattr(e, "activity_type", "") or ""))]
    if not names:  # a profiler without activity types: tell kernels by name
        names = [e.name for e in device_events if not e.name.startswith(NOT_KERNELS)]
    if not names:
        raise RuntimeError("the profiler saw no device kernels")
    return kernel_name_census(names, "torch.profiler kernels of one step")


def gradient_clipper(spec: OptimizerSpec, model: nn.Module):
    """clip_grad_norm_(model.parameters(), spec.max_grad_norm) as a function of no arguments
    (no host sync: the norm and the scale stay on the device); a no-op without clipping."""
    if spec.max_grad_norm is None:
        return lambda: None
    params = list(model.parameters())
    return lambda: torch.nn.utils.clip_grad_norm_(params, spec.max_grad_norm)


@dataclass
class Training:
    """What the three PyTorch peers train, built the same way for each (`build_training`)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    clip: Callable[[], object]

    def step_body(self, precision: str, device: str, cache_enabled: bool = True):
        """(x, y) -> loss: forward + loss (under autocast for bf16), backward, clipping and
        optimizer.step. Zeroing the gradients is the caller's: eager does it before every call,
        the CUDA graph once before capture, torch.compile outside its compiled region."""
        model, loss_fn, clip, optimizer = self.model, self.loss_fn, self.clip, self.optimizer

        def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with autocast(precision, device, cache_enabled):
                loss = loss_fn(model(x), y)
            loss.backward()
            clip()
            optimizer.step()
            return loss
        return body


def build_training(spec: RunSpec, layout: str, **implementation) -> Training:
    """Seed torch's RNG (dropout), then the workload's model in train mode and `layout`, its
    optimizer (`implementation`: fused / capturable, see make_optimizer), loss and clipping."""
    torch.manual_seed(spec.seed)
    model = build_model(spec.workload, spec.parameters, spec.device, layout).train()
    optimizer = make_optimizer(spec.workload.optimizer, model.parameters(), **implementation)
    return Training(model, optimizer, loss_function(spec.workload),
                    gradient_clipper(spec.workload.optimizer, model))


def eager_step(training: Training, precision: str, device: str):
    """The ordinary eager step on (x, y): zero_grad(set_to_none) + Training.step_body."""
    body = training.step_body(precision, device)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        training.optimizer.zero_grad(set_to_none=True)
        return body(x, y)
    return step


def seconds_per_step(run_step: Callable[[int], object], n_batches: int, synchronize,
                     seconds: float, max_steps: int, setup_steps: int = 3) -> float:
    """Seconds per step over about `seconds` (3 to max_steps steps, one sync at the end),
    after `setup_steps` untimed ones (cudnn.benchmark's search, compiles, graph recording)."""
    for i in range(setup_steps):
        run_step(i % n_batches)
    synchronize()
    start = time.perf_counter()
    run_step(0)
    synchronize()
    steps = max(3, min(max_steps, int(seconds / max(time.perf_counter() - start, 1e-6))))
    start = time.perf_counter()
    for i in range(steps):
        run_step(i % n_batches)
    synchronize()
    return (time.perf_counter() - start) / steps


def _layout_trial(spec: RunSpec, layout: str) -> float:
    """µs per eager step in `layout`, after the steps in which cudnn.benchmark picks kernels;
    the trial's model and batches are freed before the next one."""
    seconds = _eager_seconds_per_step(spec, layout)
    release(spec.device)
    return seconds * 1e6


def _eager_seconds_per_step(spec: RunSpec, layout: str) -> float:
    step = eager_step(build_training(spec, layout, fused=True), spec.precision, spec.device)
    batches = device_batches(spec, layout)
    return seconds_per_step(lambda i: step(*batches[i]), len(batches), torch.cuda.synchronize,
                            LAYOUT_TRIAL_SECONDS, LAYOUT_TRIAL_STEPS)


def choose_layout(spec: RunSpec) -> tuple[str, str]:
    """Time the eager step in NCHW and channels_last (conv nets on CUDA); remember the faster
    for the other torch peers. Returns (layout, note)."""
    if spec.device != "cuda" or not isinstance(spec.workload.model, CONV_MODELS):
        return NCHW, ""
    times = {layout: _layout_trial(spec, layout) for layout in (NCHW, CHANNELS_LAST)}
    best = min(times, key=times.get)
    _chosen_layouts[(spec.workload.name, spec.precision)] = best
    trial = ", ".join(f"{layout} {us:.0f} µs" for layout, us in times.items())
    return best, f"memory format {best} (eager trial: {trial})"


def prepare(spec: RunSpec) -> PreparedStep:
    """PyTorch eager: zero_grad(set_to_none) + forward + loss + backward + fused optimizer step,
    in the faster memory format."""
    notes = set_precision(spec.precision)
    layout, layout_note = choose_layout(spec)
    memory = start_memory_count(spec.device)
    step = eager_step(build_training(spec, layout, fused=True), spec.precision, spec.device)
    batches = device_batches(spec, layout)
    synchronize = synchronizer(spec.device)

    def run_step(i: int) -> torch.Tensor:
        return step(*batches[i])

    def census() -> KernelCensus | None:
        if spec.device != "cuda":
            return None
        return profiler_census(lambda: run_step(0), synchronize)

    def close() -> None:
        batches.clear()
        release(spec.device)

    notes += ["optimizer fused=True"] + ([layout_note] if layout_note else [])
    return PreparedStep(run_step, synchronize, lambda loss: float(loss.detach()), memory, close,
                        notes, census)
