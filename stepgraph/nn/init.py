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
