"""torch.nn-shaped layers."""
from .init import manual_seed
from .layers import (GELU, Conv2d, Dropout, Dropout2d, Flatten, LeakyReLU, Linear, LogSoftmax,
                     MaxPool2d, ReLU, Sequential, Sigmoid, Tanh)
from .module import Module, Parameter

__all__ = ["Module", "Parameter", "Linear", "Conv2d", "MaxPool2d", "Flatten", "Dropout",
           "Dropout2d", "ReLU", "LeakyReLU", "Sigmoid", "Tanh", "GELU", "LogSoftmax",
           "Sequential", "manual_seed"]
