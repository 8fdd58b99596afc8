"""Counter-based randomness of dropout and the random ops (ops/random.py): Philox4x32-10
(Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"), written with uint32
arithmetic so the CUDA kernels (`backends/cuda/include/philox.cuh`) produce the same bits.

Element i of dropout site `site` at step `step` uses counter (i >> 2, site, step lo, step hi),
key (seed lo, seed hi), and output word i & 3. An element is kept when (word >> 8) >= threshold,
threshold = keep_threshold(p): an integer comparison, so both backends agree bit for bit.
"""
from __future__ import annotations

import numpy as np

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10


def keep_threshold(p: float) -> int:
    """Drop an element when its 24-bit uniform is below this integer."""
    return int(p * (1 << 24))


def _mulhilo(m: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    prod = x.astype(np.uint64) * np.uint64(m)
    return (prod >> np.uint64(32)).astype(np.uint32), (prod & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def philox4x32(counter: list[np.ndarray], seed: int) -> list[np.ndarray]:
    """Philox4x32-10 on arrays of counters; returns the four output words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint32) for c in counter)
    k0 = np.uint32(seed & 0xFFFFFFFF)
    k1 = np.uint32((seed >> 32) & 0xFFFFFFFF)
    with np.errstate(over="ignore"):
        for r in range(ROUNDS):
            hi0, lo0 = _mulhilo(PHILOX_M0, c0)
            hi1, lo1 = _mulhilo(PHILOX_M1, c2)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
            if r < ROUNDS - 1:
                k0 = np.uint32(k0 + np.uint32(PHILOX_W0))
                k1 = np.uint32(k1 + np.uint32(PHILOX_W1))
    return [c0, c1, c2, c3]


def _group_words(groups: np.ndarray, seed: int, site: int, step: int) -> list[np.ndarray]:
    """The four Philox words of each counter (group, site, step lo, step hi)."""
    n = groups.size
    return philox4x32([groups.astype(np.uint32), np.full(n, site, np.uint32),
                       np.full(n, step & 0xFFFFFFFF, np.uint32),
                       np.full(n, (step >> 32) & 0xFFFFFFFF, np.uint32)], seed)


def element_words(n: int, seed: int, site: int, step: int) -> np.ndarray:
    """One uint32 word per element: element i takes word i & 3 of counter group i >> 2."""
    idx = np.arange(n, dtype=np.uint64)
    words = _group_words(idx >> np.uint64(2), seed, site, step)
    return np.choose((idx & np.uint64(3)).astype(np.intp), words)


def dropout_keep_mask(n: int, p: float, seed: int, site: int, step: int) -> np.ndarray:
    """uint8 mask of n elements: 1 where kept."""
    word = element_words(n, seed, site, step)
    return ((word >> np.uint32(8)) >= keep_threshold(p)).astype(np.uint8)


def uniform(n: int, seed: int, site: int, step: int) -> np.ndarray:
    """n float32 draws on [0, 1): element i's word (`element_words`) shifted to its top 24
    bits, times 2^-24 (exact in float32), as the CUDA kernel (random.cu)."""
    word = element_words(n, seed, site, step)
    return ((word >> np.uint32(8)).astype(np.float64) * 2.0 ** -24).astype(np.float32)


def normal(n: int, seed: int, site: int, step: int) -> np.ndarray:
    """n float32 standard normal draws: Box-Muller of the words 2 (i & 1) and 2 (i & 1) + 1 of
    counter group i >> 1, u1 = (top 24 bits + 1) 2^-24 in (0, 1], u2 = top 24 bits 2^-24,
    z = sqrt(-2 log u1) cos(2 pi u2) in float64, rounded once to float32 (as random.cu)."""
    idx = np.arange(n, dtype=np.uint64)
    words = _group_words(idx >> np.uint64(1), seed, site, step)
    lane = (idx & np.uint64(1)).astype(np.intp)
    a = np.choose(2 * lane, words) >> np.uint32(8)
    b = np.choose(2 * lane + 1, words) >> np.uint32(8)
    u1 = (a.astype(np.float64) + 1.0) * 2.0 ** -24
    u2 = b.astype(np.float64) * 2.0 ** -24
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).astype(np.float32)
