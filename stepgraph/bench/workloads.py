"""The three benchmark workloads of BENCHMARKS.md: model, batch, loss, optimizer, data, FLOPs.

Every peer builds its model from these descriptions, starts from the same initial parameters
(`initial_parameters`, PyTorch's default initialisation drawn once with NumPy) and trains on
the same batches (`make_batches`), so the only thing that differs between rows is the library.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

WORKLOAD_NAMES = ("mlp", "cnn", "big")
PRECISIONS = ("fp32", "tf32", "bf16")


@dataclass(frozen=True)
class DenseNet:
    """`depth` x [Linear(prev, hidden)-activation-Dropout], then Linear(hidden, classes)."""

    in_features: int
    hidden: int
    depth: int
    classes: int
    activation: str  # "relu" or "gelu" (exact erf GELU, as torch.nn.GELU())
    dropout: float

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in_features, out_features) of every Linear layer, input to output."""
        widths = [self.in_features] + [self.hidden] * self.depth + [self.classes]
        return list(itertools.pairwise(widths))


@dataclass(frozen=True)
class ConvNet:
    """The PyTorch MNIST example net (BENCHMARKS.md `cnn`), ending in LogSoftmax.

    Conv2d(1,10,5)-MaxPool2d(2)-ReLU-Conv2d(10,20,5)-Dropout2d-MaxPool2d(2)-ReLU-Flatten-
    Linear(320,50)-ReLU-Dropout-Linear(50,10)-LogSoftmax, for 1x28x28 inputs.
    """

    dropout: float = 0.5
    classes: int = 10
    conv_channels: tuple[int, int] = (10, 20)
    kernel: int = 5
    fc_hidden: int = 50
    flat_features: int = 320


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer and hyper-parameters with PyTorch semantics (AdamW decays every parameter)."""

    kind: str  # "adamw" or "sgd"
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0


@dataclass(frozen=True)
class Workload:
    """One benchmark row group: a model, a batch, a loss and an optimizer."""

    name: str
    model: DenseNet | ConvNet
    batch: int
    sample_shape: tuple[int, ...]  # one input sample; x is (batch, *sample_shape) float32
    loss: str  # "cross_entropy" (logits) or "nll_loss" (log-probabilities)
    optimizer: OptimizerSpec

    @property
    def classes(self) -> int:
        return self.model.classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.batch, *self.sample_shape)


ADAMW = OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01)
SGD_MOMENTUM = OptimizerSpec("sgd", lr=0.01, momentum=0.5)

WORKLOADS: dict[str, Workload] = {
    "mlp": Workload("mlp", DenseNet(784, 512, 2, 10, "relu", 0.1), 128, (784,),
                    "cross_entropy", ADAMW),
    "cnn": Workload("cnn", ConvNet(), 64, (1, 28, 28), "nll_loss", SGD_MOMENTUM),
    "big": Workload("big", DenseNet(4096, 4096, 4, 10, "gelu", 0.0), 4096, (4096,),
                    "cross_entropy", ADAMW),
}

# CPU smoke-test sizes: same structure and hyper-parameters, a few thousand parameters.
TINY_WORKLOADS: dict[str, Workload] = {
    "mlp": Workload("mlp", DenseNet(64, 32, 2, 10, "relu", 0.1), 16, (64,),
                    "cross_entropy", ADAMW),
    "cnn": Workload("cnn", ConvNet(), 8, (1, 28, 28), "nll_loss", SGD_MOMENTUM),
    "big": Workload("big", DenseNet(64, 64, 4, 10, "gelu", 0.0), 32, (64,),
                    "cross_entropy", ADAMW),
}


def get_workload(name: str, tiny: bool = False) -> Workload:
    """The workload called `name` ("mlp", "cnn", "big"); `tiny` gives the CPU smoke-test size."""
    table = TINY_WORKLOADS if tiny else WORKLOADS
    if name not in table:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(table)}")
    return table[name]


@dataclass(frozen=True)
class LayerShape:
    """Weight and bias shape of one parameterised layer, in PyTorch layout."""

    weight: tuple[int, ...]
    bias: tuple[int, ...]

    @property
    def fan_in(self) -> int:
        return math.prod(self.weight[1:])


def layer_shapes(workload: Workload) -> list[LayerShape]:
    """Parameterised layers in forward order (Linear weight (out, in), Conv2d (out, in, k, k))."""
    model = workload.model
    if isinstance(model, DenseNet):
        return [LayerShape((n_out, n_in), (n_out,)) for n_in, n_out in model.linear_shapes()]
    c1, c2 = model.conv_channels
    k, in_channels = model.kernel, workload.sample_shape[0]
    return [LayerShape((c1, in_channels, k, k), (c1,)), LayerShape((c2, c1, k, k), (c2,)),
            LayerShape((model.fc_hidden, model.flat_features), (model.fc_hidden,)),
            LayerShape((model.classes, model.fc_hidden), (model.classes,))]


@dataclass
class LayerParams:
    """Initial weight and bias of one layer (float32 NumPy, PyTorch layout)."""

    weight: np.ndarray
    bias: np.ndarray


def initial_parameters(workload: Workload, seed: int = 0) -> list[LayerParams]:
    """PyTorch's default init for Linear/Conv2d: weight and bias ~ U(-1/sqrt(fan_in), +...).

    kaiming_uniform_(a=sqrt(5)) reduces to that bound, so every peer starts from the same values.
    """
    rng = np.random.default_rng(seed)
    params = []
    for shape in layer_shapes(workload):
        bound = 1.0 / math.sqrt(shape.fan_in)
        weight = rng.uniform(-bound, bound, size=shape.weight).astype(np.float32)
        bias = rng.uniform(-bound, bound, size=shape.bias).astype(np.float32)
        params.append(LayerParams(weight, bias))
    return params


def parameter_count(workload: Workload) -> int:
    """Number of trainable scalars."""
    return sum(math.prod(s.weight) + math.prod(s.bias) for s in layer_shapes(workload))


@dataclass
class Batch:
    """One training batch in host memory; each peer copies it to its device once, before timing."""

    x: np.ndarray  # float32 (batch, *sample_shape)
    y: np.ndarray  # int32 (batch,) class labels


def make_batches(workload: Workload, count: int, seed: int = 0) -> list[Batch]:
    """`count` random batches (standard-normal inputs, uniform labels), the same for every peer."""
    rng = np.random.default_rng(seed + 1)
    return [Batch(rng.standard_normal(workload.input_shape, dtype=np.float32),
                  rng.integers(0, workload.classes, size=workload.batch, dtype=np.int32))
            for _ in range(count)]


def conv_output_sizes(workload: Workload) -> list[tuple[int, int]]:
    """(height, width) after each convolution of the ConvNet (valid padding, stride 1)."""
    k = workload.model.kernel
    h, w = workload.sample_shape[1:]
    h1, w1 = h - k + 1, w - k + 1
    h2, w2 = h1 // 2 - k + 1, w1 // 2 - k + 1
    return [(h1, w1), (h2, w2)]


def flops_per_step(workload: Workload) -> int:
    """Multiply-add FLOPs of one training step: forward 2*N*K*M per GEMM, backward 4*N*K*M.

    Convolutions count as GEMMs over output pixels (K = in_channels * k * k). Element-wise ops,
    the loss and the optimizer are left out, as is usual for TFLOP/s figures (6 * params * batch).
    """
    n = workload.batch
    shapes = layer_shapes(workload)
    if isinstance(workload.model, DenseNet):
        return sum(6 * n * s.weight[0] * s.weight[1] for s in shapes)
    conv_pixels = [h * w for h, w in conv_output_sizes(workload)]
    conv = sum(6 * n * p * s.weight[0] * s.fan_in for p, s in zip(conv_pixels, shapes[:2]))
    dense = sum(6 * n * s.weight[0] * s.weight[1] for s in shapes[2:])
    return conv + dense
