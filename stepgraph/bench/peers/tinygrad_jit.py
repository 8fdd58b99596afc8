"""tinygrad: the training step under TinyJit, written as tinygrad's MNIST examples do:
zero_grad, loss.backward(), and `loss.realize(*opt.schedule_step())` so the optimizer update is
scheduled together with the backward; TinyJit captures it on the 2nd call and replays it after.
Written for tinygrad 0.14 (TRAINING via Context, device chosen with DEV=CUDA).
"""

from __future__ import annotations

import os

from stepgraph.bench.peers import MemoryReading, PreparedStep, RunSpec
from stepgraph.bench.workloads import ConvNet, DenseNet, LayerParams, OptimizerSpec

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


def _optimizer(spec: OptimizerSpec, params):
    from tinygrad import nn
    if spec.kind == "adamw":
        return nn.optim.AdamW(params, lr=spec.lr, b1=spec.betas[0], b2=spec.betas[1],
                              eps=spec.eps, weight_decay=spec.weight_decay)
    if spec.kind == "sgd":
        return nn.optim.SGD(params, lr=spec.lr, momentum=spec.momentum,
                            weight_decay=spec.weight_decay)
    raise ValueError(f"unknown optimizer kind {spec.kind!r}")


def prepare(spec: RunSpec) -> PreparedStep:
    """TinyJit of zero_grad + forward + loss + backward + optimizer schedule_step."""
    device = TINYGRAD_DEVICE[spec.device]
    os.environ.setdefault("DEV", device)  # read at tinygrad's import; data is placed explicitly
    from tinygrad import Context, Device, GlobalCounters, Tensor, TinyJit, dtypes
    from tinygrad.helpers import ALLOW_TF32
    from tinygrad.nn.state import get_parameters

    previous_tf32 = ALLOW_TF32.value
    ALLOW_TF32.value = 1 if spec.precision == "tf32" else 0  # read when kernels are generated
    Tensor.manual_seed(spec.seed)
    compute = dtypes.bfloat16 if spec.precision == "bf16" else dtypes.float32
    used_before = GlobalCounters.mem_used_per_device[device]
    model_type = _DenseModel if isinstance(spec.workload.model, DenseNet) else _ConvModel
    model = model_type(spec.workload.model, spec.parameters, device, lambda t: t.cast(compute))
    optimizer = _optimizer(spec.workload.optimizer, get_parameters(model))
    batches = [(Tensor(b.x, device=device).cast(compute).realize(),
                Tensor(b.y, device=device).realize()) for b in spec.batches]
    cross_entropy = spec.workload.loss == "cross_entropy"

    @TinyJit
    def train_step(x, y):
        with Context(TRAINING=1):
            optimizer.zero_grad()
            out = model(x).cast(dtypes.float32)
            loss = out.sparse_categorical_crossentropy(y) if cross_entropy else out.nll_loss(y)
            loss.backward()
            return loss.realize(*optimizer.schedule_step())

    def run_step(i: int):
        return train_step(*batches[i])

    def memory() -> MemoryReading:
        used = GlobalCounters.mem_used_per_device[device] - used_before
        return MemoryReading(used, "resident")

    def close() -> None:
        batches.clear()
        train_step.reset()
        ALLOW_TF32.value = previous_tf32

    notes = [f"ALLOW_TF32={ALLOW_TF32.value}", "default (unfused) optimizer"]
    if spec.precision == "bf16":
        notes.append("bf16: params cast to bfloat16 in the step, inputs stored bf16, "
                     "float32 master params, loss and optimizer state")
    return PreparedStep(run_step, Device[device].synchronize, lambda loss: float(loss.item()),
                        memory, close, notes)
