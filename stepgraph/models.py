"""The benchmark workloads of docs/BENCHMARKS.md as stepgraph models."""
from __future__ import annotations

from . import nn


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
