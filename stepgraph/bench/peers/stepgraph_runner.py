"""stepgraph itself, eager (the plan run op by op) and graph (one CUDA Graph replay per step),
through the public API of DESIGN.md only: stepgraph.models / losses / optim and
`sg.compile_train_step`. Inputs are CuPy arrays already on the GPU (NumPy on the CPU backend).

The step compiles with its defaults (memory_format "auto": channels-last convolutions at tf32)
and deterministic kernels; STEPGRAPH_DETERMINISTIC=0 in the environment lets the autotuner pick
cuDNN's nondeterministic plans too (what the peers run), noted in the run's notes.
"""

from __future__ import annotations

import functools
import os

from stepgraph.bench.peers import KernelCensus, MemoryReading, PreparedStep, RunSpec, Unsupported
from stepgraph.bench.workloads import (
    ConvNet,
    DenseNet,
    GPT,
    LayerParams,
    OptimizerSpec,
    PlainConvNet,
    ResNet,
    Workload,
    named_parameters,
)
from stepgraph.errors import UnsupportedPrecisionError

# Ops that only move data between layouts: with channels-last convolutions (compile/layout.py),
# the input's conversion and the conv weights' permutes to (O, kh, kw, C) and back.
LAYOUT_OPS = ("permute", "transpose")
# The fused attention ops. On CUDA at fp32 their tensor-core products are 3xTF32 (float32-level
# accuracy, not float32 arithmetic: backends/cuda/attention/attention.py), and there is no strict
# float32 attention kernel, so such a row is labelled with its real arithmetic.
ATTENTION_OPS = ("sdpa", "sdpa_grad", "sdpa_qkv", "sdpa_qkv_grad")


def layout_notes(step) -> list[str]:
    """How a step's memory format was decided, where memory_format "auto" timed it
    (compile/layout_choice.py): "layout measured: channels_last 812.3 µs, contiguous 1104.9
    µs", "layout channels_last (cached)" or "layout channels_last (by rule)"."""
    choice = step.layout_choice
    if choice is None:
        return []
    if choice.source != "measured":
        how = "by rule" if choice.source == "rule" else "cached"
        return [f"layout {choice.memory_format} ({how})"]
    timed = ", ".join(f"{fmt} {us:.1f} µs" for fmt, us in choice.step_us.items())
    return [f"layout measured: {timed}"]


def precision_label(precision: str, device: str, ops: set[str]) -> str:
    """The row's arithmetic when it is not strict `precision` ("" when it is)."""
    if precision == "fp32" and device == "cuda" and ops & set(ATTENTION_OPS):
        return "fp32 (3xTF32 attention)"
    return ""


def prepare_eager(spec: RunSpec) -> PreparedStep:
    """stepgraph with graph=False: the compiled plan launched op by op each step."""
    return _prepare(spec, graph=False)


def prepare_graph(spec: RunSpec) -> PreparedStep:
    """stepgraph with graph=True: the compiled plan captured once, one replay per step."""
    if spec.device != "cuda":
        raise Unsupported("graph mode needs the cuda backend")
    return _prepare(spec, graph=True)


def prepare_graph_unguarded(spec: RunSpec) -> PreparedStep:
    """stepgraph graph with on_bad_batch="ignore": no device-side guard in the step, so that
    the guard's cost (the default rows run with "raise") is measured beside it. Without the
    guard, overlap_update="auto" also lets the update overlap the backward pass where it
    applies (no clipping, more than one bucket: compile/overlap.py); the row's notes say so."""
    if spec.device != "cuda":
        raise Unsupported("graph mode needs the cuda backend")
    return _prepare(spec, graph=True, on_bad_batch="ignore")


def build_model(workload: Workload):
    """The workload's model from stepgraph.models (its own default initialisation)."""
    from stepgraph import models
    model = workload.model
    if isinstance(model, GPT):
        return models.gpt(model.vocab_size, model.block_size, model.n_layer, model.n_head,
                          model.n_embd, model.dropout, model.bias)
    if isinstance(model, ResNet):
        return models.resnet(num_classes=model.classes, widths=model.widths,
                             blocks_per_stage=model.blocks_per_stage,
                             in_channels=workload.sample_shape[0])
    if isinstance(model, PlainConvNet):
        return models.convnet(stages=model.stages, classes=model.classes,
                              in_channels=workload.sample_shape[0],
                              image_size=workload.sample_shape[1])
    if isinstance(model, ConvNet):
        return models.cnn(dropout=model.dropout)
    if isinstance(model, DenseNet) and model.activation == "relu" and model.depth == 2:
        return models.mlp(in_features=model.in_features, hidden=model.hidden,
                          classes=model.classes, dropout=model.dropout)
    if isinstance(model, DenseNet) and model.activation == "gelu" and model.dropout == 0:
        return models.big(width=model.hidden, depth=model.depth, classes=model.classes)
    raise Unsupported(f"no stepgraph.models constructor for {model}")


def build_optimizer(spec: OptimizerSpec, model=None):
    """The workload's stepgraph optimizer (PyTorch semantics and defaults); with
    decay_matrices_only, AdamW over `model`'s two parameter groups (models.optimizer_groups)."""
    from stepgraph import models, optim
    if spec.kind == "adamw" and spec.decay_matrices_only:
        return optim.AdamW(models.optimizer_groups(model, spec.weight_decay), lr=spec.lr,
                           betas=spec.betas, eps=spec.eps, max_grad_norm=spec.max_grad_norm)
    if spec.kind == "adamw":
        # betas/eps left at their defaults, which are PyTorch's (0.9, 0.999) and 1e-8.
        return optim.AdamW(lr=spec.lr, weight_decay=spec.weight_decay)
    if spec.kind == "sgd":
        return optim.SGD(lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay,
                         nesterov=spec.nesterov)
    raise ValueError(f"unknown optimizer kind {spec.kind!r}")


def build_loss(workload: Workload):
    """The workload's stepgraph loss, label smoothing bound in; the GPT's over all tokens."""
    from stepgraph import losses, models
    if isinstance(workload.model, GPT):
        return models.next_token_loss
    loss = getattr(losses, workload.loss)
    if workload.label_smoothing:
        return functools.partial(loss, label_smoothing=workload.label_smoothing)
    return loss


def _load_shared_parameters(model, parameters: list[LayerParams]) -> str:
    """Load the peers' shared initial values: by state_dict key where the workload names its
    layers, else when the state_dict lines up layer by layer; otherwise keep stepgraph's own
    PyTorch-default init (same distribution, other draw)."""
    state = model.state_dict()
    if parameters and parameters[0].name:
        named = named_parameters(parameters)
        if any(key not in state or tuple(state[key].shape) != value.shape
               for key, value in named.items()):
            return "own PyTorch-default init (state_dict keys or shapes differ)"
        model.load_state_dict({**state, **named})
        return "shared initial parameters (by state_dict key)"
    prefixes = [key[:-len(".weight")] for key in state if key.endswith(".weight")]
    if len(prefixes) != len(parameters):
        return "own PyTorch-default init (state_dict layers do not line up)"
    update = {}
    for prefix, init in zip(prefixes, parameters):
        weight, bias = state.get(prefix + ".weight"), state.get(prefix + ".bias")
        if weight is None or bias is None or tuple(weight.shape) != init.weight.shape \
                or tuple(bias.shape) != init.bias.shape:
            return "own PyTorch-default init (state_dict shapes differ)"
        update[prefix + ".weight"], update[prefix + ".bias"] = init.weight, init.bias
    model.load_state_dict({**state, **update})
    return "shared initial parameters"


def _array_module(device: str):
    if device == "cuda":
        import cupy
        return cupy
    import numpy
    return numpy


def _memory_reader(device: str):
    """Bytes the CuPy pool holds for this peer after the steps (stepgraph allocates through it)."""
    if device != "cuda":
        return lambda: None
    import cupy
    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()

    def read() -> MemoryReading | None:
        used = pool.used_bytes() - before
        # Nothing through the pool means stepgraph allocated elsewhere: no figure, not zero.
        return MemoryReading(used, "resident") if used > 0 else None

    return read


def _synchronizer(device: str):
    if device != "cuda":
        return lambda: None
    import cupy
    # stepgraph runs on its own stream: a device-wide sync waits for it too.
    return cupy.cuda.runtime.deviceSynchronize


def _release(device: str) -> None:
    import gc
    gc.collect()
    if device == "cuda":
        import cupy
        cupy.cuda.runtime.deviceSynchronize()
        cupy.get_default_memory_pool().free_all_blocks()


def _prepare(spec: RunSpec, graph: bool, on_bad_batch: str = "raise") -> PreparedStep:
    if spec.precision not in ("fp32", "tf32", "bf16"):
        raise Unsupported(f"stepgraph has no {spec.precision}")
    import stepgraph as sg
    xp = _array_module(spec.device)
    memory = _memory_reader(spec.device)
    model = build_model(spec.workload)
    init_note = _load_shared_parameters(model, spec.parameters)
    batches = [(xp.asarray(b.x), xp.asarray(b.y)) for b in spec.batches]
    deterministic = os.environ.get("STEPGRAPH_DETERMINISTIC", "1") != "0"
    try:        # a bf16 plan holding an op without a bf16 kernel is refused at compile
        step = sg.compile_train_step(model, loss=build_loss(spec.workload),
                                     optimizer=build_optimizer(spec.workload.optimizer, model),
                                     example_inputs=batches[0], device=spec.device, graph=graph,
                                     seed=spec.seed, precision=spec.precision,
                                     deterministic=deterministic, on_bad_batch=on_bad_batch)
    except UnsupportedPrecisionError as error:
        raise Unsupported(str(error).splitlines()[0]) from error

    def run_step(i: int):
        return step(*batches[i])

    def census() -> KernelCensus:
        return _plan_census(step)

    def close() -> None:
        batches.clear()
        _release(spec.device)

    calls = step.executable(step.signature).calls
    nhwc = any(node.attrs.get("layout") == "NHWC" for node, _, _ in calls)
    notes = [f"graph={graph}", f"layout={'NHWC' if nhwc else 'NCHW'}", init_note,
             f"on_bad_batch={on_bad_batch}", *layout_notes(step)]
    overlapped = sum(bool(node.attrs.get("update_stream")) for node, _, _ in calls)
    if overlapped:
        notes.append(f"update overlapping the backward in {overlapped} buckets")
    if not deterministic:
        notes.append("deterministic=False")
    label = precision_label(spec.precision, spec.device, {node.op for node, _, _ in calls})
    if label:
        notes.append(f"{label}: the attention products are 3xTF32, the GEMMs strict float32")
    return PreparedStep(run_step, _synchronizer(spec.device), lambda loss: float(loss), memory,
                        close, notes, census, precision_label=label)


def build_script_optimizer(spec: OptimizerSpec, model):
    """The workload's optimizer as a training script makes it: over model.parameters() (or
    nanoGPT's two groups), torch's constructor."""
    from stepgraph import models, optim
    if spec.kind == "adamw":
        params = models.optimizer_groups(model, spec.weight_decay) \
            if spec.decay_matrices_only else model.parameters()
        return optim.AdamW(params, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                           weight_decay=spec.weight_decay)
    if spec.kind == "sgd":
        return optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum,
                         weight_decay=spec.weight_decay, nesterov=spec.nesterov)
    raise ValueError(f"unknown optimizer kind {spec.kind!r}")


def prepare_loop(spec: RunSpec) -> PreparedStep:
    """The workload as a PyTorch training script runs it: optimizer.zero_grad(), forward and
    loss (under torch.autocast at bf16, TF32 matmuls allowed at tf32), loss.backward(),
    clip_grad_norm_ where the workload clips, optimizer.step(); captured by the loop
    (stepgraph/loop) into one compiled step per iteration. No value is read per step."""
    import contextlib

    import stepgraph as sg
    from stepgraph.backends import flags
    from stepgraph.loop.passes import as_feed_tensor
    from stepgraph.loop.session import session

    if spec.device == "cuda" and spec.precision not in ("fp32", "tf32", "bf16"):
        raise Unsupported(f"stepgraph has no {spec.precision}")
    xp = _array_module(spec.device)
    memory = _memory_reader(spec.device)
    model = build_model(spec.workload)
    init_note = _load_shared_parameters(model, spec.parameters)
    batches = [(as_feed_tensor(xp.asarray(b.x)), as_feed_tensor(xp.asarray(b.y)))
               for b in spec.batches]
    opt = build_script_optimizer(spec.workload.optimizer, model)
    loss_fn, clip = build_loss(spec.workload), spec.workload.optimizer.max_grad_norm
    session().seed = spec.seed
    autocast = (lambda: sg.autocast(spec.device, dtype=sg.bfloat16)) \
        if spec.precision == "bf16" else contextlib.nullcontext
    flags.matmul.allow_tf32 = spec.precision == "tf32"

    def run_step(i: int):
        x, y = batches[i]
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            sg.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return loss

    def census() -> KernelCensus:
        exe = session().last_executable
        nodes = getattr(exe.captured, "node_count", None) if exe is not None else None
        if nodes is not None:
            return KernelCensus(nodes, None, "CUDA graph nodes of the captured step")
        return KernelCensus(len(exe.calls) if exe else None, None, "ops of the compiled plan")

    def close() -> None:
        batches.clear()
        flags.matmul.allow_tf32 = False
        _release(spec.device)

    notes = ["training script, loop capture", init_note, "on_bad_batch=ignore (torch's)"]
    return PreparedStep(run_step, _synchronizer(spec.device), lambda loss: float(loss), memory,
                        close, notes, census)


def _plan_census(step) -> KernelCensus:
    """Graph nodes of the captured step (graph mode) or ops of the plan (eager), and the
    layout-moving ops among them."""
    exe = step.executable(step.signature)
    layout = sum(1 for node, _, _ in exe.calls if node.op in LAYOUT_OPS)
    captured = getattr(exe, "captured", None)
    nodes = getattr(captured, "node_count", None)
    if nodes is not None:
        return KernelCensus(nodes, layout, "CUDA graph nodes of the captured step")
    return KernelCensus(len(exe.calls), layout,
                        "ops of the compiled plan (one or more kernels each)")
