"""The benchmark workloads of docs/BENCHMARKS.md as stepgraph models."""
from __future__ import annotations

from . import nn
from .nn import functional as F


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
