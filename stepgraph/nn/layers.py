"""Layers with torch.nn's names, constructor arguments, parameter shapes and initialisation."""
from __future__ import annotations

from . import functional as F
from .init import uniform_fan_in
from .module import Module, Parameter


class Linear(Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(uniform_fan_in((out_features, in_features), in_features))
        self.bias = Parameter(uniform_fan_in((out_features,), in_features)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"{self.in_features},{self.out_features}"


class Conv2d(Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 bias: bool = True):
        super().__init__()
        kh, kw = F._pair(kernel_size)
        fan_in = in_channels * kh * kw
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding = (kh, kw), F._pair(stride), F._pair(padding)
        self.weight = Parameter(uniform_fan_in((out_channels, in_channels, kh, kw), fan_in))
        self.bias = Parameter(uniform_fan_in((out_channels,), fan_in)) if bias else None

    def forward(self, x):
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding)

    def extra_repr(self):
        return f"{self.in_channels},{self.out_channels},{self.kernel_size[0]}"


class MaxPool2d(Module):
    def __init__(self, kernel_size, stride=None):
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride

    def forward(self, x):
        return F.max_pool2d(x, self.kernel_size, self.stride)

    def extra_repr(self):
        return f"{self.kernel_size}"


class Flatten(Module):
    def __init__(self, start_dim: int = 1):
        super().__init__()
        self.start_dim = start_dim

    def forward(self, x):
        return F.flatten(x, self.start_dim)


class Dropout(Module):
    per_channel = False

    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x):
        return F.dropout(x, self.p, self.training, self.per_channel)

    def extra_repr(self):
        return f"p={self.p}"


class Dropout2d(Dropout):
    """Zeroes whole channels of an (N, C, H, W) input."""
    per_channel = True


class _Activation(Module):
    kind = ""

    def forward(self, x):
        return F.activation(x, self.kind)


class ReLU(_Activation):
    kind = "relu"


class Sigmoid(_Activation):
    kind = "sigmoid"


class Tanh(_Activation):
    kind = "tanh"


class LeakyReLU(Module):
    def __init__(self, negative_slope: float = 0.01):
        super().__init__()
        self.negative_slope = negative_slope

    def forward(self, x):
        return F.activation(x, "leaky_relu", self.negative_slope)


class GELU(Module):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        return F.activation(x, "gelu" if self.approximate == "none" else "gelu_tanh")


class LogSoftmax(Module):
    def __init__(self, dim: int = 1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return F.log_softmax(x, self.dim)


class Sequential(Module):
    def __init__(self, *modules: Module):
        super().__init__()
        for i, m in enumerate(modules):
            setattr(self, str(i), m)

    def __len__(self):
        return len(self._modules)

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def forward(self, x):
        for name, m in self._modules.items():
            extra = m.extra_repr()
            x.tracer.label = type(m).__name__ + (f"({extra})" if extra else "")
            x = m(x)
        return x
