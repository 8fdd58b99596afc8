"""The benchmark workloads of docs/BENCHMARKS.md as stepgraph models, and the GPT."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import stepgraph as sg

from . import losses, nn, optim
from .errors import ShapeError
from .nn import functional as F
from .nn import init as nn_init


def mlp(in_features: int = 784, hidden: int = 512, classes: int = 10,
        dropout: float = 0.1) -> nn.Sequential:
    """Linear-ReLU-Dropout x2, then Linear: the `mlp` workload (use losses.cross_entropy)."""
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(hidden, classes))


def cnn(dropout: float = 0.5, classes: int = 10) -> nn.Sequential:
    """The PyTorch MNIST example net for (N, 1, 28, 28) input, ending in LogSoftmax
    (use losses.nll_loss): the `cnn` workload."""
    return nn.Sequential(nn.Conv2d(1, 10, 5), nn.MaxPool2d(2), nn.ReLU(),
                         nn.Conv2d(10, 20, 5), nn.Dropout2d(dropout), nn.MaxPool2d(2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(320, 50), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(50, classes), nn.LogSoftmax(dim=1))


def big(width: int = 4096, depth: int = 4, classes: int = 10) -> nn.Sequential:
    """depth x [Linear(width, width)-GELU], then Linear(width, classes): the `big` workload."""
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual shortcut, then ReLU (torchvision's BasicBlock).

    The shortcut is the identity, or a strided 1x1 conv + BN (`downsample`) where the block
    changes the resolution or the width.
    """

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNet(nn.Module):
    """A CIFAR ResNet: 3x3 conv stem + BN + ReLU, one stage of BasicBlocks per width (stride 2
    into every stage after the first), global average pool, Linear.

    Module names follow torchvision's ResNet (conv1, bn1, layer1.., fc), so the state_dict keys
    are those of the same network written in PyTorch.
    """

    def __init__(self, num_classes: int = 10, widths: tuple[int, ...] = (64, 128, 256),
                 blocks_per_stage: int = 1, in_channels: int = 3):
        super().__init__()
        if not widths or blocks_per_stage < 1:
            raise ValueError(f"need at least one stage and one block per stage, got widths "
                             f"{widths}, blocks_per_stage {blocks_per_stage}")
        self.widths, self.blocks_per_stage = tuple(widths), blocks_per_stage
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        in_planes = widths[0]
        for i, planes in enumerate(widths):
            blocks = [BasicBlock(in_planes, planes, 1 if i == 0 else 2)]
            blocks += [BasicBlock(planes, planes) for _ in range(blocks_per_stage - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            in_planes = planes
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        for i in range(len(self.widths)):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(self.avgpool(x).flatten(1))

    def extra_repr(self) -> str:
        return f"widths={self.widths}, blocks_per_stage={self.blocks_per_stage}"


def resnet(num_classes: int = 10, widths: tuple[int, ...] = (64, 128, 256),
           blocks_per_stage: int = 1, in_channels: int = 3) -> ResNet:
    """The `resnet` workload for (N, 3, 32, 32) CIFAR-10 images (use cross_entropy with
    label_smoothing 0.2): stem 3->64, stages at 64/128/256 channels, Linear(256, 10).

    blocks_per_stage=1 (the default, the benchmark's) is ResNet-8-style: the stem, 3 blocks of
    2 convs and the classifier; blocks_per_stage=2 is ResNet-14. Smaller `widths` make the same
    shape of network cheaper (tests).
    """
    return ResNet(num_classes, widths, blocks_per_stage, in_channels)


def convnet(stages: tuple[tuple[int, ...], ...] = ((32, 32), (64, 64)), classes: int = 10,
            in_channels: int = 3, image_size: int = 32) -> nn.Sequential:
    """The `convnet` workload, a VGG-style stack for (N, 3, 32, 32) images (use cross_entropy):
    per stage, [Conv2d(prev, c, 3, padding=1)-ReLU] for each width c, then MaxPool2d(2); then
    Flatten and Linear. The default is Conv(3,32)-ReLU-Conv(32,32)-ReLU-MaxPool2-Conv(32,64)-
    ReLU-Conv(64,64)-ReLU-MaxPool2-Flatten-Linear(64*8*8, 10)."""
    layers, channels, size = [], in_channels, image_size
    for stage in stages:
        for width in stage:
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
            channels = width
        layers.append(nn.MaxPool2d(2))
        size //= 2
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(channels * size * size, classes))


# ---- GPT ------------------------------------------------------------------------------------
# nanoGPT's model (github.com/karpathy/nanoGPT, model.py), written with stepgraph's modules:
# same module tree, so the same state_dict keys, and the same initialisation.


@dataclass(frozen=True)
class GPTConfig:
    """A GPT's size (nanoGPT's GPTConfig; the defaults are its shakespeare-char model)."""

    vocab_size: int = 65
    block_size: int = 256       # the longest context, in tokens
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.2
    bias: bool = True           # biases in the Linears and LayerNorms

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} must be a multiple of n_head {self.n_head}")
        if min(self.vocab_size, self.block_size, self.n_layer, self.n_head) < 1:
            raise ValueError(f"every size must be >= 1, got {self}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t attends to positions <= t."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        # q, k and v for all heads in one Linear
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)   # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)   # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Linear to 4x the width, GELU (tanh approximation, as GPT-2), Linear back, dropout."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model: token indices (B, T) -> logits (B, T, V).

    Token and position embeddings, dropout, n_layer Blocks, a final LayerNorm, and a
    bias-free classifier whose weight is the token embedding's (weight tying: one parameter
    under the keys `transformer.wte.weight` and `lm_head.weight`). Train it with
    `next_token_loss`; `configure_optimizers` gives nanoGPT's AdamW parameter groups.
    """

    # Alike bench/peers/torch_gpt.py on purpose: the PyTorch peer stays independent of this one.
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self._init_weights(config)

    def _init_weights(self, config: GPTConfig) -> None:
        """GPT-2's initialisation as nanoGPT does it: N(0, 0.02) for Linear and Embedding
        weights, zero biases, LayerNorm at (1, 0), and the projections into the residual
        stream (c_proj) at std 0.02/sqrt(2 n_layer)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn_init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn_init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn_init.normal_(p, 0.0, 0.02 / math.sqrt(2 * config.n_layer))

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameters, the tied weight counted once; without the position embedding unless
        non_embedding is False (nanoGPT's count)."""
        unique = {id(p): p for _, p in self.named_parameters()}
        n = sum(int(np.prod(p.shape)) for p in unique.values())
        return n - (int(np.prod(self.transformer.wpe.weight.shape)) if non_embedding else 0)

    def forward(self, idx):
        B, T = idx.size()
        if T > self.config.block_size:
            raise ShapeError(f"GPT: a sequence of {T} tokens is longer than the block size "
                             f"{self.config.block_size}")
        pos = sg.arange(T)                               # (T,)
        tok_emb = self.transformer.wte(idx)              # (B, T, C)
        pos_emb = self.transformer.wpe(pos)              # (T, C), broadcast over the batch
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)                           # (B, T, vocab_size)

    def configure_optimizers(self, weight_decay: float, learning_rate: float,
                             betas: tuple[float, float] = (0.9, 0.999), schedule=None,
                             max_grad_norm: float | None = None) -> optim.AdamW:
        """AdamW with weight decay on the matrices (Linear and Embedding weights) only, no
        decay on biases and LayerNorm parameters: nanoGPT's configure_optimizers."""
        return optim.AdamW(optimizer_groups(self, weight_decay), lr=learning_rate, betas=betas,
                           schedule=schedule, max_grad_norm=max_grad_norm)

    def extra_repr(self) -> str:
        c = self.config
        return f"n_layer={c.n_layer}, n_head={c.n_head}, n_embd={c.n_embd}"


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """PyTorch-style parameter groups: every parameter of 2 or more dimensions (matrices,
    embeddings) decays by `weight_decay`, the others (biases, norm weights) do not. A shared
    parameter is listed once."""
    decay, no_decay, seen = [], [], set()
    for _, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            (decay if len(p.shape) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": float(weight_decay)},
            {"params": no_decay, "weight_decay": 0.0}]


def next_token_loss(logits, targets):
    """Mean cross-entropy of logits (B, T, V) against next-token targets (B, T), over all
    B*T positions (targets of -1 are ignored, as nanoGPT's)."""
    return losses.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                ignore_index=-1)


def gpt(vocab_size: int, block_size: int = 256, n_layer: int = 6, n_head: int = 6,
        n_embd: int = 384, dropout: float = 0.2, bias: bool = True) -> GPT:
    """A GPT (nanoGPT's model) for `vocab_size` tokens and contexts of up to `block_size`:
    the `gpt` workload at its defaults (vocab_size 65). Use `next_token_loss`."""
    return GPT(GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias))
