"""Gradient buckets: which gradients are averaged together, and when.

The backward pass finalises gradients roughly in the reverse of the forward order of their
parameters. Taking them in the order they become final, consecutive gradients of one dtype
(per_dtype: the gradients of each dtype apart) are grouped into buckets of about `cap_bytes`
(PyTorch DDP's 25 MiB by default; a gradient larger than the cap is a bucket of its own). A
bucket's all-reduce can start as soon as its last gradient is final, while the backward pass
goes on computing the next ones.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

BUCKET_CAP_MB = 25.0        # MiB, as DDP's bucket_cap_mb


@dataclass(frozen=True)
class GradientInfo:
    """One gradient as the bucketing sees it."""

    index: int        # its parameter's position in forward order
    nbytes: int
    dtype: str
    ready: int        # program position of the node that finalises it


@dataclass(frozen=True)
class Bucket:
    """Gradients averaged by one all-reduce, in the order they become final."""

    indices: tuple[int, ...]
    nbytes: int
    dtype: str
    ready: int        # the position after which the bucket can launch: its last gradient's


def plan_buckets(grads: Sequence[GradientInfo], cap_bytes: int,
                 per_dtype: bool = False) -> list[Bucket]:
    """Buckets of consecutive gradients in finalisation order (ready, then the later
    parameter first), each at most `cap_bytes` unless a single gradient is larger, one dtype
    per bucket, in the order they can launch. per_dtype: each dtype fills a bucket of its
    own, so a gradient of another dtype in between no longer closes it (DDP buckets by
    dtype): a bf16 model's float32 LayerNorm gradients, a few KiB each between megabytes of
    bf16 weight gradients, then share all-reduces instead of one apiece."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    order = sorted(grads, key=lambda g: (g.ready, -g.index))
    buckets: list[Bucket] = []
    filling: dict[str, list[GradientInfo]] = {}     # dtype -> the bucket it is filling

    def close(dtype: str):
        current = filling.pop(dtype, [])
        if current:
            buckets.append(Bucket(tuple(g.index for g in current),
                                  sum(g.nbytes for g in current), dtype,
                                  max(g.ready for g in current)))

    for g in order:
        if not per_dtype:
            for other in [d for d in filling if d != g.dtype]:
                close(other)
        current = filling.get(g.dtype, [])
        if current and sum(c.nbytes for c in current) + g.nbytes > cap_bytes:
            close(g.dtype)
        filling.setdefault(g.dtype, []).append(g)
    for dtype in list(filling):
        close(dtype)
    return sorted(buckets, key=lambda b: b.ready)


def cap_bytes_of(bucket_cap_mb: float) -> int:
    """DDP's bucket_cap_mb (MiB) in bytes."""
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    return int(bucket_cap_mb * 2**20)
