"""tinygrad: the training step under TinyJit, written as tinygrad's MNIST examples do:
zero_grad, loss.backward(), and `loss.realize(*opt.schedule_step())` so the optimizer update is
scheduled together with the backward; TinyJit captures it on the 2nd call and replays it after.
Written for tinygrad 0.14 (TRAINING via Context, device chosen with DEV=CUDA).

Kernels are searched with BEAM (spec.tinygrad_beam: 2 with `stepgraph bench --fair`, 0, no
search, in a default run; `--tinygrad-beam`), tinygrad's documented setting for fast kernels:
each kernel's optimisations are picked by timing a beam of candidates when the kernel is first
compiled, in the first two steps, so the search time is part of the row's setup time (and
tinygrad's disk cache keeps the result for later runs).
"""

from __future__ import annotations

import functools
import os

from stepgraph.bench.peers import KernelCensus, MemoryReading, PreparedStep, RunSpec, Unsupported
from stepgraph.bench.peers import tinygrad_gpt
from stepgraph.bench.workloads import (
    BlockSpec,
    ConvNet,
    DenseNet,
    GPT,
    LayerParams,
    OptimizerSpec,
    PlainConvNet,
    ResNet,
    Workload,
    named_parameters,
    plain_convnet_layers,
    resnet_blocks,
)

TINYGRAD_DEVICE = {"cuda": "CUDA", "cpu": "CPU"}


class _Layer:
    """One Linear/Conv2d layer's parameters as tinygrad Tensors (PyTorch layout)."""

    def __init__(self, init: LayerParams, device: str):
        from tinygrad import Tensor
        self.weight = Tensor(init.weight, device=device).realize()
        self.bias = Tensor(init.bias, device=device).realize()


class _DenseModel:
    def __init__(self, model: DenseNet, parameters: list[LayerParams], device: str, cast):
        self.spec, self.cast = model, cast
        self.layers = [_Layer(p, device) for p in parameters]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = self._linear(x, layer)
            x = x.relu() if self.spec.activation == "relu" else x.gelu(approximate="none")
            x = x.dropout(self.spec.dropout)
        return self._linear(x, self.layers[-1])

    def _linear(self, x, layer: _Layer):
        return x.linear(self.cast(layer.weight).transpose(), self.cast(layer.bias))


class _ConvModel:
    def __init__(self, model: ConvNet, parameters: list[LayerParams], device: str, cast):
        self.spec, self.cast = model, cast
        self.layers = [_Layer(p, device) for p in parameters]

    def __call__(self, x):
        from tinygrad import Tensor, dtypes
        conv1, conv2, fc1, fc2 = self.layers
        p = self.spec.dropout
        x = x.conv2d(self.cast(conv1.weight), self.cast(conv1.bias)).max_pool2d((2, 2)).relu()
        x = x.conv2d(self.cast(conv2.weight), self.cast(conv2.bias))
        # Dropout2d: one keep/drop draw per (sample, channel); tinygrad has no built-in.
        keep = Tensor.rand(x.shape[0], x.shape[1], 1, 1, device=x.device) >= p
        x = (keep.where(x, 0) / (1.0 - p)).max_pool2d((2, 2)).relu().flatten(1)
        x = x.linear(self.cast(fc1.weight).transpose(), self.cast(fc1.bias)).relu().dropout(p)
        x = x.linear(self.cast(fc2.weight).transpose(), self.cast(fc2.bias))
        return x.cast(dtypes.float32).log_softmax(axis=1)


class _BasicBlock:
    """tinygrad.nn Conv2d/BatchNorm BasicBlock, attributes named as torchvision's."""

    def __init__(self, block: BlockSpec, model: ResNet):
        from tinygrad import nn
        c_in, c_out, eps, momentum = (block.in_channels, block.out_channels, model.bn_eps,
                                      model.bn_momentum)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=block.stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm(c_out, eps=eps, momentum=momentum)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm(c_out, eps=eps, momentum=momentum)
        self.downsample = None
        if block.downsample:  # a list, so that its state_dict names are downsample.0 / .1
            self.downsample = [nn.Conv2d(c_in, c_out, 1, stride=block.stride, bias=False),
                               nn.BatchNorm(c_out, eps=eps, momentum=momentum)]

    def __call__(self, x):
        out = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))
        shortcut = x if self.downsample is None else self.downsample[1](self.downsample[0](x))
        return (out + shortcut).relu()


class _ResNetModel:
    """workloads.ResNet with tinygrad.nn layers (NCHW, tinygrad's layout)."""

    def __init__(self, workload: Workload):
        from tinygrad import nn
        model = workload.model
        self.conv1 = nn.Conv2d(workload.sample_shape[0], model.widths[0], 3, padding=1,
                               bias=False)
        self.bn1 = nn.BatchNorm(model.widths[0], eps=model.bn_eps, momentum=model.bn_momentum)
        self.stage_names: list[str] = []
        for block in resnet_blocks(model):
            stage = block.name.split(".")[0]
            if stage not in self.stage_names:
                self.stage_names.append(stage)
                setattr(self, stage, [])
            getattr(self, stage).append(_BasicBlock(block, model))
        self.fc = nn.Linear(model.widths[-1], model.classes)

    def __call__(self, x):
        x = self.bn1(self.conv1(x)).relu()
        for stage in self.stage_names:
            for block in getattr(self, stage):
                x = block(x)
        return self.fc(x.mean(axis=(2, 3)))


class _PlainConvModel:
    """workloads.PlainConvNet; `layers[i]` is the nn.Sequential's entry i."""

    def __init__(self, workload: Workload):
        from tinygrad import nn
        self.layers: list = []
        for layer in plain_convnet_layers(workload.model, workload.sample_shape):
            if layer.kind == "conv":
                self.layers.append(nn.Conv2d(layer.in_features, layer.out_features, 3,
                                             padding=1))
            elif layer.kind == "linear":
                self.layers.append(nn.Linear(layer.in_features, layer.out_features))
            else:
                self.layers.append(layer.kind)

    def __call__(self, x):
        for layer in self.layers:
            if layer == "relu":
                x = x.relu()
            elif layer == "maxpool":
                x = x.max_pool2d((2, 2))
            elif layer == "flatten":
                x = x.flatten(1)
            else:
                x = layer(x)
        return x


def _model_with_shared_parameters(workload: Workload, parameters: list[LayerParams],
                                  device: str):
    """The resnet, convnet or gpt model with the shared parameters loaded by state_dict key
    (the GPT's tied classifier is its token embedding: loaded once, tied again after)."""
    from tinygrad import Tensor
    from tinygrad.nn.state import get_state_dict, load_state_dict
    prefix, leave_out = "", ()
    if isinstance(workload.model, GPT):
        model, leave_out = tinygrad_gpt.GPTModel(workload.model), (tinygrad_gpt.TIED,)
    elif isinstance(workload.model, ResNet):
        model = _ResNetModel(workload)
    else:
        model, prefix = _PlainConvModel(workload), "layers."
    state = {prefix + key: Tensor(value, device=device)
             for key, value in named_parameters(parameters).items() if key not in leave_out}
    unknown = sorted(set(state) - set(get_state_dict(model)))
    if unknown:
        raise ValueError(f"shared parameters the tinygrad {type(model).__name__} lacks: "
                         f"{unknown}")
    load_state_dict(model, state, strict=False, verbose=False)
    if isinstance(model, tinygrad_gpt.GPTModel):
        model.tie_weights()
    return model


def _optimizer(spec: OptimizerSpec, params):
    """tinygrad's AdamW or SGD with the workload's hyper-parameters; decay_matrices_only:
    nanoGPT's parameter groups, an OptimizerGroup of two AdamWs (weight decay on the
    parameters of 2 or more dims only)."""
    from tinygrad import nn
    if spec.kind == "adamw":
        adamw = functools.partial(nn.optim.AdamW, lr=spec.lr, b1=spec.betas[0],
                                  b2=spec.betas[1], eps=spec.eps)
        if not spec.decay_matrices_only:
            return adamw(params, weight_decay=spec.weight_decay)
        return nn.optim.OptimizerGroup(
            adamw([p for p in params if p.ndim >= 2], weight_decay=spec.weight_decay),
            adamw([p for p in params if p.ndim < 2], weight_decay=0.0))
    if spec.kind == "sgd":
        return nn.optim.SGD(params, lr=spec.lr, momentum=spec.momentum,
                            weight_decay=spec.weight_decay, nesterov=spec.nesterov)
    raise ValueError(f"unknown optimizer kind {spec.kind!r}")


def kernel_settings(spec: RunSpec) -> dict[str, int]:
    """tinygrad.helpers context variables the step's kernels are generated under: TF32 only
    at tf32, and the BEAM search width."""
    return {"ALLOW_TF32": 1 if spec.precision == "tf32" else 0, "BEAM": spec.tinygrad_beam}


def prepare(spec: RunSpec) -> PreparedStep:
    """TinyJit of zero_grad + forward + loss + backward + optimizer schedule_step."""
    device = TINYGRAD_DEVICE[spec.device]
    os.environ.setdefault("DEV", device)  # read at tinygrad's import; data is placed explicitly
    from tinygrad import Context, Device, GlobalCounters, Tensor, TinyJit, dtypes
    from tinygrad import helpers
    from tinygrad.nn.state import get_parameters

    vision = isinstance(spec.workload.model, (ResNet, PlainConvNet))
    gpt = isinstance(spec.workload.model, GPT)
    if (vision or gpt) and spec.precision == "bf16":
        raise Unsupported("the vision and gpt workloads are timed in fp32 and tf32")
    settings = kernel_settings(spec)
    previous = {name: getattr(helpers, name).value for name in settings}
    for name, value in settings.items():  # read when kernels are generated and searched
        getattr(helpers, name).value = value
    Tensor.manual_seed(spec.seed)
    compute = dtypes.bfloat16 if spec.precision == "bf16" else dtypes.float32
    used_before = GlobalCounters.mem_used_per_device[device]
    if vision or gpt:
        model = _model_with_shared_parameters(spec.workload, spec.parameters, device)
    else:
        model_type = _DenseModel if isinstance(spec.workload.model, DenseNet) else _ConvModel
        model = model_type(spec.workload.model, spec.parameters, device,
                           lambda t: t.cast(compute))
    params = tinygrad_gpt.parameters_of(model) if gpt else get_parameters(model)
    optimizer = _optimizer(spec.workload.optimizer, params)
    max_norm = spec.workload.optimizer.max_grad_norm
    # Token indices stay integers; images are stored in the compute dtype.
    batches = [(Tensor(b.x, device=device).cast(dtypes.int32 if gpt else compute).realize(),
                Tensor(b.y, device=device).realize()) for b in spec.batches]
    cross_entropy = spec.workload.loss == "cross_entropy"
    smoothing = spec.workload.label_smoothing

    @TinyJit
    def train_step(x, y):
        with Context(TRAINING=1):
            optimizer.zero_grad()
            out = model(x).cast(dtypes.float32)
            loss = out.sparse_categorical_crossentropy(y, label_smoothing=smoothing) \
                if cross_entropy else out.nll_loss(y)
            loss.backward()
            if max_norm is not None:
                tinygrad_gpt.clip_grad_norm(params, max_norm)
            return loss.realize(*optimizer.schedule_step())

    # Kernels launched by the first call (run as is) and the second (captured by TinyJit).
    kernels_per_call: list[int] = []

    def run_step(i: int):
        if len(kernels_per_call) >= 2:
            return train_step(*batches[i])
        before = GlobalCounters.kernel_count
        loss = train_step(*batches[i])
        kernels_per_call.append(GlobalCounters.kernel_count - before)
        return loss

    def census() -> KernelCensus | None:
        counted = [n for n in kernels_per_call[1:] + kernels_per_call[:1] if n > 0]
        if not counted:
            return None
        # tinygrad has no layout: views and permutes are folded into the kernels' indexing.
        return KernelCensus(counted[0], None, "tinygrad GlobalCounters.kernel_count of the "
                                              "step TinyJit captured")

    def memory() -> MemoryReading:
        used = GlobalCounters.mem_used_per_device[device] - used_before
        return MemoryReading(used, "resident")

    def close() -> None:
        batches.clear()
        train_step.reset()
        for name, value in previous.items():
            getattr(helpers, name).value = value

    notes = [", ".join(f"{name}={value}" for name, value in settings.items()),
             "default (unfused) optimizer"]
    if settings["BEAM"]:
        notes.append(f"BEAM={settings['BEAM']} kernel search inside the setup time")
    if spec.precision == "bf16":
        notes.append("bf16: params cast to bfloat16 in the step, inputs stored bf16, "
                     "float32 master params, loss and optimizer state")
    return PreparedStep(run_step, Device[device].synchronize, lambda loss: float(loss.item()),
                        memory, close, notes, census)
