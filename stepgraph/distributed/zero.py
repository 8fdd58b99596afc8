"""ZeRO stage 1's partition of the optimizer state: which rank updates which elements.

Each bucket of gradients (buckets.py) is seen as one flat buffer of its gradients in bucket
order, padded to a multiple of the world size, and cut into `world_size` equal chunks: rank r
owns chunk r. That is the layout NCCL's reduce-scatter and all-gather need (equal counts per
rank): the reduce-scatter leaves each rank the averaged gradients of its chunk, the rank
updates those elements alone (keeping optimizer state for them only: 1/world of it), and the
all-gather hands every rank the updated parameters. A parameter may straddle chunks; a chunk
is then a list of slices of parameters. Planning only, for now: a pure function of the
bucket plan.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .buckets import Bucket


@dataclass(frozen=True)
class ShardSlice:
    """Elements [start, stop) of parameter `index` (flattened), at `offset` in the bucket's
    flat buffer."""

    index: int
    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class BucketShards:
    """One bucket's partition: `chunk` elements a rank, `padded` = chunk * world elements in
    the flat buffer (the tail past the gradients is padding), ranks[r] the slices rank r
    owns, in buffer order."""

    bucket: int
    chunk: int
    padded: int
    ranks: tuple[tuple[ShardSlice, ...], ...]


def plan_shards(buckets: Sequence[Bucket], elements: Mapping[int, int],
                world_size: int) -> list[BucketShards]:
    """The ZeRO-1 partition of every bucket over `world_size` ranks; `elements` gives each
    parameter index's element count."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    out = []
    for b, bucket in enumerate(buckets):
        missing = [i for i in bucket.indices if i not in elements]
        if missing:
            raise ValueError(f"bucket {b}: no element count for parameters {missing}")
        total = sum(elements[i] for i in bucket.indices)
        chunk = -(-total // world_size)
        out.append(BucketShards(b, chunk, chunk * world_size,
                                tuple(_owned(bucket.indices, elements, r * chunk,
                                             (r + 1) * chunk) for r in range(world_size))))
    return out


def _owned(indices: Sequence[int], elements: Mapping[int, int], low: int,
           high: int) -> tuple[ShardSlice, ...]:
    """The slices of the parameters laid out in `indices` order that fall in [low, high)."""
    slices, offset = [], 0
    for i in indices:
        start, stop = max(low, offset), min(high, offset + elements[i])
        if start < stop:
            slices.append(ShardSlice(i, start - offset, stop - offset, start))
        offset += elements[i]
    return tuple(slices)
