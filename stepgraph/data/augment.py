"""Batch augmentation on the device: random crop with zero padding and horizontal flip.

The random draws are a pure function of (seed, epoch, batch index): they come from a NumPy
Generator on the host (a few numbers per image), so a resumed run augments exactly as an
uninterrupted one. The pixels never leave the device: the same array code runs on NumPy
arrays on the CPU and on CuPy arrays on the GPU (through the array's own module), as one
vectorised gather per batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ShapeError

# Keeps augmentation draws apart from the shuffle order, which is seeded with (seed, epoch).
AUGMENT_STREAM = 0x41554730


def array_module(x: Any):
    """numpy for NumPy arrays, cupy for CuPy arrays (CuPy is only imported when needed)."""
    if isinstance(x, np.ndarray):
        return np
    import cupy

    return cupy.get_array_module(x)


@dataclass(frozen=True)
class CropFlipDraws:
    """Per-image choices: crop offsets into the padded image and whether to mirror it."""

    top: np.ndarray      # (N,) int64 in [0, 2 * padding]
    left: np.ndarray     # (N,) int64 in [0, 2 * padding]
    flip: np.ndarray     # (N,) bool


def draw_crop_flip(seed: int, epoch: int, batch: int, n: int, padding: int,
                   flip: bool = True) -> CropFlipDraws:
    """The crop offsets and flips of batch `batch` of epoch `epoch`, for n images."""
    rng = np.random.default_rng((AUGMENT_STREAM, seed, epoch, batch))
    top = rng.integers(0, 2 * padding + 1, size=n)
    left = rng.integers(0, 2 * padding + 1, size=n)
    mirror = rng.random(n) < 0.5 if flip else np.zeros(n, dtype=bool)
    return CropFlipDraws(top, left, mirror)


def apply_crop_flip(x: Any, draws: CropFlipDraws, padding: int) -> Any:
    """Crop each (C, H, W) image of x at its offsets in the zero-padded image, then mirror
    the flipped ones: torchvision's RandomCrop(H, padding) then RandomHorizontalFlip."""
    if x.ndim != 4:
        raise ShapeError(f"crop/flip expects images (N, C, H, W), got shape {tuple(x.shape)}")
    if len(draws.top) != x.shape[0]:
        raise ShapeError(f"crop/flip draws are for {len(draws.top)} images, batch has "
                         f"{x.shape[0]}")
    xp = array_module(x)
    n, _, h, w = x.shape
    p = padding
    padded = xp.pad(x, ((0, 0), (0, 0), (p, p), (p, p))) if p else x
    top, left, mirror = (xp.asarray(a) for a in (draws.top, draws.left, draws.flip))
    rows = top[:, None] + xp.arange(h)[None, :]                            # (N, H)
    cols = xp.arange(w)[None, :]
    cols = left[:, None] + xp.where(mirror[:, None], w - 1 - cols, cols)   # (N, W)
    index = xp.arange(n)[:, None, None, None]
    return padded[index, xp.arange(x.shape[1])[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]


@dataclass(frozen=True)
class RandomCropFlip:
    """A BatchLoader transform: random crop of the image size from the image padded by
    `padding` zeros on each side (zero in normalised units: the mean colour), then a
    horizontal flip with probability 1/2 when `flip`. Draws are seeded by (seed, epoch, batch).
    """

    padding: int = 4
    flip: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.padding < 0 or self.seed < 0:
            raise ValueError(f"padding and seed must be >= 0, got {self.padding}, {self.seed}")

    def __call__(self, x: Any, epoch: int, batch: int) -> Any:
        draws = draw_crop_flip(self.seed, epoch, batch, x.shape[0], self.padding, self.flip)
        return apply_crop_flip(x, draws, self.padding)
