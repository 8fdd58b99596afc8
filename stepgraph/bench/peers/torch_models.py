"""The vision workloads (`resnet`, `convnet`) as torch.nn modules for the three PyTorch peers.

Module names are those of workloads.py (torchvision's for the ResNet, nn.Sequential indices for
the convnet), so the shared initial parameters load by state_dict key, and a state_dict of
these models loads into `stepgraph.models.resnet()` / `stepgraph.models.convnet()`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stepgraph.bench.workloads import (
    BlockSpec,
    LayerParams,
    PlainConvNet,
    ResNet,
    Workload,
    named_parameters,
    plain_convnet_layers,
    resnet_blocks,
)


class BasicBlock(nn.Module):
    """Conv3x3-BN-ReLU-Conv3x3-BN, plus the identity or a strided 1x1 conv + BN, then ReLU."""

    def __init__(self, block: BlockSpec, eps: float, momentum: float):
        super().__init__()
        c_in, c_out = block.in_channels, block.out_channels
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=block.stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out, eps=eps, momentum=momentum)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out, eps=eps, momentum=momentum)
        self.downsample = None
        if block.downsample:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=block.stride, bias=False),
                nn.BatchNorm2d(c_out, eps=eps, momentum=momentum))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNetModule(nn.Module):
    """workloads.ResNet: conv1-bn1-ReLU, layer1..layerK of BasicBlocks, average pool, fc."""

    def __init__(self, model: ResNet, in_channels: int):
        super().__init__()
        eps, momentum = model.bn_eps, model.bn_momentum
        self.conv1 = nn.Conv2d(in_channels, model.widths[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(model.widths[0], eps=eps, momentum=momentum)
        stages: dict[str, list[BasicBlock]] = {}
        for block in resnet_blocks(model):
            stages.setdefault(block.name.split(".")[0], []).append(
                BasicBlock(block, eps, momentum))
        self.stage_names = list(stages)
        for name, blocks in stages.items():
            setattr(self, name, nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(model.widths[-1], model.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        for name in self.stage_names:
            x = getattr(self, name)(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def plain_convnet(model: PlainConvNet, sample_shape: tuple[int, ...]) -> nn.Sequential:
    """workloads.PlainConvNet as the nn.Sequential its layer names index."""
    layers: list[nn.Module] = []
    for layer in plain_convnet_layers(model, sample_shape):
        if layer.kind == "conv":
            layers.append(nn.Conv2d(layer.in_features, layer.out_features, 3, padding=1))
        elif layer.kind == "relu":
            layers.append(nn.ReLU())
        elif layer.kind == "maxpool":
            layers.append(nn.MaxPool2d(2))
        elif layer.kind == "flatten":
            layers.append(nn.Flatten())
        else:
            layers.append(nn.Linear(layer.in_features, layer.out_features))
    return nn.Sequential(*layers)


def vision_model(workload: Workload, parameters: list[LayerParams]) -> nn.Module:
    """The resnet or convnet module (on the CPU) holding the shared initial parameters."""
    model = workload.model
    if isinstance(model, ResNet):
        module: nn.Module = ResNetModule(model, workload.sample_shape[0])
    elif isinstance(model, PlainConvNet):
        module = plain_convnet(model, workload.sample_shape)
    else:
        raise TypeError(f"not a vision model description: {model!r}")
    return load_shared_parameters(module, parameters)


def load_shared_parameters(module: nn.Module, parameters: list[LayerParams]) -> nn.Module:
    """`module` with the workload's shared initial parameters loaded by state_dict key; ValueError
    when they do not fit. Only buffers (BatchNorm's running statistics and batch counter) keep
    their own initial values."""
    state = {key: torch.from_numpy(value) for key, value in named_parameters(parameters).items()}
    missing, unexpected = module.load_state_dict(state, strict=False)
    buffers = {name for name, _ in module.named_buffers()}
    if unexpected or set(missing) - buffers:
        raise ValueError(f"shared parameters do not fit the torch {type(module).__name__}: "
                         f"missing {sorted(set(missing) - buffers)}, unexpected "
                         f"{sorted(unexpected)}")
    return module
