"""bfloat16 on NumPy, which has no such dtype: values are held as their raw bits (uint16, the
storage of IR dtype "bfloat16", ir/graph.py) and computed on as float32 arrays.

The conversions are the ones every bf16 kernel of stepgraph uses (backends/cuda/cast.cu does the
same bit arithmetic), and PyTorch's (c10::BFloat16's round_to_nearest_even):
- float32 -> bf16: round to nearest, ties to even, on the bits: add 0x7FFF plus the lowest kept
  bit, keep the upper 16 bits. Values beyond the largest bf16 round to +-inf; subnormals round
  like any other value (bf16 has float32's exponent range); every NaN becomes 0x7FC0 (a quiet
  NaN; PyTorch's scalar conversion gives the same, its vectorised CPU one 0xFFFF).
- bf16 -> float32: exact (the bits shifted up by 16).
"""
from __future__ import annotations

import numpy as np

STORAGE = np.dtype(np.uint16)
QUIET_NAN_BITS = np.uint16(0x7FC0)


def to_bits(x) -> np.ndarray:
    """float32 values (any float array) rounded to bf16, as uint16 bits of x's shape."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))))
               >> np.uint32(16)).astype(np.uint16)
    return np.where(np.isnan(x), QUIET_NAN_BITS, rounded)


def from_bits(bits) -> np.ndarray:
    """The float32 values of bf16 bits (uint16), exactly."""
    wide = np.asarray(bits, dtype=np.uint16).astype(np.uint32)   # a new contiguous array
    return (wide << np.uint32(16)).view(np.float32)


def round_bf16(x) -> np.ndarray:
    """x rounded to the nearest bf16 value, as float32 (what a bf16 store then load gives)."""
    return from_bits(to_bits(x))


def round_to(x, dtype: str) -> np.ndarray:
    """float32 x as a node of IR dtype `dtype` stores it: rounded once for bfloat16 and
    float16 (as float32 values), unchanged otherwise."""
    x = np.asarray(x, dtype=np.float32)
    if dtype == "bfloat16":
        return round_bf16(x)
    return x.astype(np.float16).astype(np.float32) if dtype == "float16" else x


def is_bf16(array) -> bool:
    """Whether a backend array holds bf16 bits (the storage no other IR dtype uses)."""
    return getattr(array, "dtype", None) == STORAGE
