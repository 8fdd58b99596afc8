"""The benchmark workloads of BENCHMARKS.md: model, batch, loss, optimizer, data, FLOPs.

Every peer builds its model from these descriptions, starts from the same initial parameters
(`initial_parameters`, PyTorch's default initialisation drawn once with NumPy) and trains on
the same batches (`make_batches`), so the only thing that differs between rows is the library.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

WORKLOAD_NAMES = ("mlp", "cnn", "big", "resnet", "convnet", "gpt")
# What `stepgraph bench` runs without --workloads: the vision workloads take minutes to compile
# in some peers, so they run when asked for.
DEFAULT_WORKLOADS = ("mlp", "cnn", "big")
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
class ResNet:
    """BENCHMARKS.md `resnet`, the CIFAR-10 ResNet of `stepgraph.models.resnet`.

    Stem Conv2d(in, widths[0], 3, padding=1, bias=False)-BatchNorm2d-ReLU; one stage per width
    of `blocks_per_stage` BasicBlocks (Conv3x3-BN-ReLU-Conv3x3-BN, plus the shortcut, ReLU), the
    first block of every stage after the first with stride 2; the shortcut is the identity, or
    Conv2d 1x1 (stride 2, no bias) + BatchNorm2d where the shape changes; global average pool,
    Linear(widths[-1], classes). Module names are torchvision's (conv1, bn1, layer1.0.conv1, ...,
    layer2.0.downsample.0, fc), so every peer shares the PyTorch state_dict keys.
    """

    widths: tuple[int, ...] = (64, 128, 256)
    blocks_per_stage: int = 1
    classes: int = 10
    bn_eps: float = 1e-5
    bn_momentum: float = 0.1


@dataclass(frozen=True)
class PlainConvNet:
    """BENCHMARKS.md `convnet`: a VGG-style conv stack without normalisation.

    For each stage, [Conv2d(prev, c, 3, padding=1)-ReLU] for every c in the stage, then
    MaxPool2d(2); then Flatten and Linear(flat, classes). The default at 3x32x32 is
    Conv(3,32)-ReLU-Conv(32,32)-ReLU-MaxPool2-Conv(32,64)-ReLU-Conv(64,64)-ReLU-MaxPool2-Flatten-
    Linear(64*8*8, 10); layer names are nn.Sequential indices (0, 2, 5, 7, 11).
    """

    stages: tuple[tuple[int, ...], ...] = ((32, 32), (64, 64))
    classes: int = 10


@dataclass(frozen=True)
class GPT:
    """BENCHMARKS.md `gpt`: nanoGPT's model at its shakespeare-char size (stepgraph.models.gpt).

    Token and position embeddings (`transformer.wte`, `transformer.wpe`), dropout, n_layer
    pre-norm blocks (`transformer.h.{i}`: ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
    GELU tanh, mlp.c_proj, with dropout after the attention softmax and after each block
    branch), `transformer.ln_f`, and `lm_head` (no bias) tied to `transformer.wte`. Input
    (batch, block_size) token indices; logits (batch, block_size, vocab_size), the loss is the
    cross-entropy over all batch * block_size positions. nanoGPT's state_dict keys.
    """

    vocab_size: int = 65
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.2
    bias: bool = True

    @property
    def classes(self) -> int:
        return self.vocab_size


Model = DenseNet | ConvNet | ResNet | PlainConvNet | GPT


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer and hyper-parameters with PyTorch semantics (AdamW decays every parameter
    unless decay_matrices_only, then only those of 2 or more dimensions, as nanoGPT's parameter
    groups; SGD's weight decay is added to the gradient of every parameter, BatchNorm's
    included). max_grad_norm: the gradients' global L2 norm is clipped to it before the update
    (torch.nn.utils.clip_grad_norm_)."""

    kind: str  # "adamw" or "sgd"
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    nesterov: bool = False
    decay_matrices_only: bool = False
    max_grad_norm: float | None = None


@dataclass(frozen=True)
class Workload:
    """One benchmark row group: a model, a batch, a loss and an optimizer."""

    name: str
    model: Model
    batch: int
    sample_shape: tuple[int, ...]  # one input sample; x is (batch, *sample_shape) float32
    # (gpt: int32 token indices, y the next tokens, same shape)
    loss: str  # "cross_entropy" (logits) or "nll_loss" (log-probabilities)
    optimizer: OptimizerSpec
    label_smoothing: float = 0.0  # cross_entropy only, PyTorch semantics

    @property
    def classes(self) -> int:
        return self.model.classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.batch, *self.sample_shape)

    @property
    def tokens_per_step(self) -> int | None:
        """Tokens one step trains on (gpt); None for the other workloads."""
        return self.batch * self.model.block_size if isinstance(self.model, GPT) else None


ADAMW = OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01)
SGD_MOMENTUM = OptimizerSpec("sgd", lr=0.01, momentum=0.5)
RESNET_SGD = OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)
CONVNET_SGD = OptimizerSpec("sgd", lr=0.01, momentum=0.9)
GPT_ADAMW = OptimizerSpec("adamw", lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1,
                          decay_matrices_only=True, max_grad_norm=1.0)
RESNET_LABEL_SMOOTHING = 0.2

WORKLOADS: dict[str, Workload] = {
    "mlp": Workload("mlp", DenseNet(784, 512, 2, 10, "relu", 0.1), 128, (784,),
                    "cross_entropy", ADAMW),
    "cnn": Workload("cnn", ConvNet(), 64, (1, 28, 28), "nll_loss", SGD_MOMENTUM),
    "big": Workload("big", DenseNet(4096, 4096, 4, 10, "gelu", 0.0), 4096, (4096,),
                    "cross_entropy", ADAMW),
    "resnet": Workload("resnet", ResNet(), 512, (3, 32, 32), "cross_entropy", RESNET_SGD,
                       RESNET_LABEL_SMOOTHING),
    "convnet": Workload("convnet", PlainConvNet(), 128, (3, 32, 32), "cross_entropy",
                        CONVNET_SGD),
    "gpt": Workload("gpt", GPT(), 64, (256,), "cross_entropy", GPT_ADAMW),
}

# CPU smoke-test sizes: same structure and hyper-parameters, a few thousand parameters.
TINY_WORKLOADS: dict[str, Workload] = {
    "mlp": Workload("mlp", DenseNet(64, 32, 2, 10, "relu", 0.1), 16, (64,),
                    "cross_entropy", ADAMW),
    "cnn": Workload("cnn", ConvNet(), 8, (1, 28, 28), "nll_loss", SGD_MOMENTUM),
    "big": Workload("big", DenseNet(64, 64, 4, 10, "gelu", 0.0), 32, (64,),
                    "cross_entropy", ADAMW),
    "resnet": Workload("resnet", ResNet(widths=(4, 8, 16)), 8, (3, 8, 8), "cross_entropy",
                       RESNET_SGD, RESNET_LABEL_SMOOTHING),
    "convnet": Workload("convnet", PlainConvNet(stages=((4, 4), (8, 8))), 8, (3, 8, 8),
                        "cross_entropy", CONVNET_SGD),
    "gpt": Workload("gpt", GPT(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16),
                    4, (8,), "cross_entropy", GPT_ADAMW),
}


def get_workload(name: str, tiny: bool = False) -> Workload:
    """The workload called `name` (one of WORKLOAD_NAMES); `tiny` gives the CPU smoke-test
    size."""
    table = TINY_WORKLOADS if tiny else WORKLOADS
    if name not in table:
        raise ValueError(f"unknown workload {name!r}; expected one of {', '.join(table)}")
    return table[name]


# ---------------------------------------------------------------- model structure


@dataclass(frozen=True)
class BlockSpec:
    """One BasicBlock of a ResNet: its module name and shape."""

    name: str  # "layer2.0"
    in_channels: int
    out_channels: int
    stride: int

    @property
    def downsample(self) -> bool:
        """Whether the shortcut is a strided 1x1 conv + BN rather than the identity."""
        return self.stride != 1 or self.in_channels != self.out_channels


def resnet_blocks(model: ResNet) -> list[BlockSpec]:
    """The blocks in forward order, with torchvision's names (layer{stage}.{index})."""
    blocks, channels = [], model.widths[0]
    for stage, width in enumerate(model.widths):
        for index in range(model.blocks_per_stage):
            stride = 2 if stage > 0 and index == 0 else 1
            blocks.append(BlockSpec(f"layer{stage + 1}.{index}", channels, width, stride))
            channels = width
    return blocks


@dataclass(frozen=True)
class SequentialLayer:
    """One entry of the PlainConvNet's nn.Sequential: kind "conv" (3x3, padding 1, bias),
    "relu", "maxpool" (2x2), "flatten" or "linear"."""

    index: int  # position in the nn.Sequential: its state_dict name
    kind: str
    in_features: int = 0  # channels for conv, features for linear
    out_features: int = 0


def plain_convnet_layers(model: PlainConvNet, sample_shape: tuple[int, ...]
                         ) -> list[SequentialLayer]:
    """The nn.Sequential of the PlainConvNet for (C, H, W) inputs, layer by layer."""
    channels, height, width = sample_shape
    kinds: list[tuple[str, int, int]] = []
    for stage in model.stages:
        for out in stage:
            kinds += [("conv", channels, out), ("relu", 0, 0)]
            channels = out
        kinds.append(("maxpool", 0, 0))
        height, width = height // 2, width // 2
    kinds += [("flatten", 0, 0), ("linear", channels * height * width, model.classes)]
    return [SequentialLayer(i, kind, n_in, n_out) for i, (kind, n_in, n_out) in enumerate(kinds)]


# Layer kinds whose weights are GEMM operands (FLOPs); "tied": a weight used again.
GEMM_KINDS = ("linear", "conv", "tied")


@dataclass(frozen=True)
class LayerShape:
    """Weight and bias shape of one parameterised layer, in PyTorch layout."""

    weight: tuple[int, ...]
    bias: tuple[int, ...] | None
    name: str = ""  # state_dict prefix ("layer1.0.conv1"); empty for the mlp/cnn/big layers
    kind: str = "linear"  # "linear", "conv", "batchnorm"; gpt: "embedding", "layernorm", "tied"
    out_pixels: int = 1  # output positions (gpt: tokens) per sample the GEMM runs over (FLOPs)

    @property
    def fan_in(self) -> int:
        return math.prod(self.weight[1:])


def _conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _resnet_shapes(model: ResNet, sample_shape: tuple[int, ...]) -> list[LayerShape]:
    channels, height, width = sample_shape

    def conv(name, c_in, c_out, k):
        return LayerShape((c_out, c_in, k, k), None, name, "conv", height * width)

    def bn(name, c):
        return LayerShape((c,), (c,), name, "batchnorm", 0)

    stem = model.widths[0]
    shapes = [conv("conv1", channels, stem, 3), bn("bn1", stem)]
    for block in resnet_blocks(model):
        height = _conv_out(height, 3, block.stride, 1)
        width = _conv_out(width, 3, block.stride, 1)
        c_in, c_out = block.in_channels, block.out_channels
        shapes += [conv(f"{block.name}.conv1", c_in, c_out, 3), bn(f"{block.name}.bn1", c_out),
                   conv(f"{block.name}.conv2", c_out, c_out, 3), bn(f"{block.name}.bn2", c_out)]
        if block.downsample:
            shapes += [conv(f"{block.name}.downsample.0", c_in, c_out, 1),
                       bn(f"{block.name}.downsample.1", c_out)]
    shapes.append(LayerShape((model.classes, model.widths[-1]), (model.classes,), "fc"))
    return shapes


def _plain_convnet_shapes(model: PlainConvNet, sample_shape: tuple[int, ...]
                          ) -> list[LayerShape]:
    _, height, width = sample_shape
    shapes = []
    for layer in plain_convnet_layers(model, sample_shape):
        if layer.kind == "conv":
            shapes.append(LayerShape((layer.out_features, layer.in_features, 3, 3),
                                     (layer.out_features,), str(layer.index), "conv",
                                     height * width))
        elif layer.kind == "maxpool":
            height, width = height // 2, width // 2
        elif layer.kind == "linear":
            shapes.append(LayerShape((layer.out_features, layer.in_features),
                                     (layer.out_features,), str(layer.index)))
    return shapes


def _gpt_shapes(model: GPT) -> list[LayerShape]:
    c, t, bias = model.n_embd, model.block_size, model.bias

    def linear(name, n_in, n_out):
        return LayerShape((n_out, n_in), (n_out,) if bias else None, name, "linear", t)

    def norm(name):
        return LayerShape((c,), (c,) if bias else None, name, "layernorm", 0)

    shapes = [LayerShape((model.vocab_size, c), None, "transformer.wte", "embedding", 0),
              LayerShape((t, c), None, "transformer.wpe", "embedding", 0)]
    for i in range(model.n_layer):
        block = f"transformer.h.{i}"
        shapes += [norm(f"{block}.ln_1"), linear(f"{block}.attn.c_attn", c, 3 * c),
                   linear(f"{block}.attn.c_proj", c, c), norm(f"{block}.ln_2"),
                   linear(f"{block}.mlp.c_fc", c, 4 * c), linear(f"{block}.mlp.c_proj", 4 * c, c)]
    # The classifier: the token embedding's weight used again (no parameters of its own).
    return shapes + [norm("transformer.ln_f"),
                     LayerShape((model.vocab_size, c), None, "lm_head", "tied", t)]


def layer_shapes(workload: Workload) -> list[LayerShape]:
    """Parameterised layers in forward (state_dict) order: Linear weight (out, in), Conv2d
    (out, in, k, k), BatchNorm2d weight and bias (C,); for the GPT embeddings (V, C), LayerNorm
    weight and bias (C,), and the tied classifier (kind "tied": the embedding's weight)."""
    model = workload.model
    if isinstance(model, GPT):
        return _gpt_shapes(model)
    if isinstance(model, DenseNet):
        return [LayerShape((n_out, n_in), (n_out,)) for n_in, n_out in model.linear_shapes()]
    if isinstance(model, ResNet):
        return _resnet_shapes(model, workload.sample_shape)
    if isinstance(model, PlainConvNet):
        return _plain_convnet_shapes(model, workload.sample_shape)
    c1, c2 = model.conv_channels
    k, in_channels = model.kernel, workload.sample_shape[0]
    (h1, w1), (h2, w2) = conv_output_sizes(workload)
    return [LayerShape((c1, in_channels, k, k), (c1,), kind="conv", out_pixels=h1 * w1),
            LayerShape((c2, c1, k, k), (c2,), kind="conv", out_pixels=h2 * w2),
            LayerShape((model.fc_hidden, model.flat_features), (model.fc_hidden,)),
            LayerShape((model.classes, model.fc_hidden), (model.classes,))]


@dataclass
class LayerParams:
    """Initial weight and bias of one layer (float32 NumPy, PyTorch layout); bias None for a
    bias-free conv. `name` is the layer's state_dict prefix where the model names its layers."""

    weight: np.ndarray
    bias: np.ndarray | None
    name: str = ""
    kind: str = "linear"


def initial_parameters(workload: Workload, seed: int = 0) -> list[LayerParams]:
    """PyTorch's default init: Linear/Conv2d weight and bias ~ U(-1/sqrt(fan_in), +...)
    (kaiming_uniform_(a=sqrt(5)) reduces to that bound); BatchNorm weight 1, bias 0.

    Drawn in state_dict order from one generator, so every peer starts from the same values.
    The GPT gets nanoGPT's init instead (`_gpt_parameters`).
    """
    rng = np.random.default_rng(seed)
    if isinstance(workload.model, GPT):
        return _gpt_parameters(workload.model, rng)
    params = []
    for shape in layer_shapes(workload):
        if shape.kind == "batchnorm":
            params.append(LayerParams(np.ones(shape.weight, np.float32),
                                      np.zeros(shape.bias, np.float32), shape.name, shape.kind))
            continue
        bound = 1.0 / math.sqrt(shape.fan_in)
        weight = rng.uniform(-bound, bound, size=shape.weight).astype(np.float32)
        bias = None if shape.bias is None else \
            rng.uniform(-bound, bound, size=shape.bias).astype(np.float32)
        params.append(LayerParams(weight, bias, shape.name, shape.kind))
    return params


def _gpt_parameters(model: GPT, rng: np.random.Generator) -> list[LayerParams]:
    """nanoGPT's init: Linear and Embedding weights ~ N(0, 0.02), the residual projections
    (c_proj) ~ N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm (1, 0); the tied classifier
    holds the token embedding's array itself."""
    params: list[LayerParams] = []
    for shape in _gpt_shapes(model):
        bias = None if shape.bias is None else np.zeros(shape.bias, np.float32)
        if shape.kind == "layernorm":
            weight = np.ones(shape.weight, np.float32)
        elif shape.kind == "tied":
            weight = params[0].weight
        else:
            std = 0.02 / math.sqrt(2 * model.n_layer) if shape.name.endswith("c_proj") else 0.02
            weight = rng.normal(0.0, std, size=shape.weight).astype(np.float32)
        params.append(LayerParams(weight, bias, shape.name, shape.kind))
    return params


def named_parameters(parameters: list[LayerParams]) -> dict[str, np.ndarray]:
    """The parameters as a state_dict ({"layer1.0.conv1.weight": array, ...}); only for
    workloads whose layers carry names (resnet, convnet)."""
    state = {}
    for p in parameters:
        if not p.name:
            raise ValueError("these parameters carry no layer names")
        state[f"{p.name}.weight"] = p.weight
        if p.bias is not None:
            state[f"{p.name}.bias"] = p.bias
    return state


def parameter_count(workload: Workload) -> int:
    """Number of trainable scalars (a tied weight counted once)."""
    return sum(math.prod(s.weight) + (math.prod(s.bias) if s.bias else 0)
               for s in layer_shapes(workload) if s.kind != "tied")


@dataclass
class Batch:
    """One training batch in host memory; each peer copies it to its device once, before timing."""

    x: np.ndarray  # float32 (batch, *sample_shape); gpt: int32 tokens (batch, block_size)
    y: np.ndarray  # int32 (batch,) class labels; gpt: int32 next tokens (batch, block_size)


def make_batches(workload: Workload, count: int, seed: int = 0) -> list[Batch]:
    """`count` random batches (standard-normal inputs, uniform labels; gpt: windows of
    block_size + 1 uniform tokens, y being x shifted by one), the same for every peer."""
    rng = np.random.default_rng(seed + 1)
    if isinstance(workload.model, GPT):
        windows = [rng.integers(0, workload.classes, size=(workload.batch, workload.model.block_size
                                                           + 1), dtype=np.int32)
                   for _ in range(count)]
        return [Batch(np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:]))
                for w in windows]
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

    Convolutions count as GEMMs over output pixels (K = in_channels * k * k), the first layer's
    unneeded input gradient included; the GPT's Linears over its tokens (and its attention
    as nanoGPT's MFU estimate does: 12 * n_layer * batch * T^2 * n_embd, the masked half
    included). Element-wise ops, normalisation, pooling, embedding lookups, the loss and the
    optimizer are left out, as is usual for TFLOP/s figures (6 * params * batch).
    """
    gemms = sum(6 * workload.batch * s.out_pixels * s.weight[0] * s.fan_in
                for s in layer_shapes(workload) if s.kind in GEMM_KINDS)
    model = workload.model
    if isinstance(model, GPT):
        gemms += 12 * model.n_layer * workload.batch * model.block_size ** 2 * model.n_embd
    return gemms
