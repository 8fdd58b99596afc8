"""Default initialisation, as torch.nn does it (kaiming_uniform(a=sqrt(5)) and its bias rule).

Both reduce to U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and biases alike.
"""
from __future__ import annotations

import math

import numpy as np

_generator = np.random.default_rng(0)


def manual_seed(seed: int) -> None:
    """Seed the generator that module constructors draw initial weights from."""
    global _generator
    _generator = np.random.default_rng(seed)


def uniform_fan_in(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return _generator.uniform(-bound, bound, size=shape).astype(np.float32)


def normal(shape: tuple[int, ...], mean: float = 0.0, std: float = 1.0) -> np.ndarray:
    """float32 N(mean, std^2) draws from the module generator."""
    return _generator.normal(mean, std, size=shape).astype(np.float32)


def normal_(param, mean: float = 0.0, std: float = 1.0):
    """Refill a Parameter in place with N(mean, std^2) draws from the module generator
    (torch.nn.init.normal_); returns it."""
    param.assign(normal(param.shape, mean, std))
    return param


def zeros_(param):
    """Refill a Parameter in place with zeros (torch.nn.init.zeros_); returns it."""
    param.assign(np.zeros(param.shape, np.float32))
    return param
