"""torch.utils.data.distributed.DistributedSampler: each rank's part of the dataset, in
torch's order.

torch's order, index for index: a shuffled epoch is torch.randperm(len(dataset)) drawn from
a torch.Generator seeded with seed + epoch, which is a Fisher-Yates shuffle driven by the
Mersenne Twister (MT19937, seeded with the low 32 bits of the seed): `torch_randperm`
reproduces it (tests/unit/test_ddp_script.py checks it against torch). The list is padded
by repeating its start to a multiple of num_replicas (or, drop_last, cut to one), and rank r
takes every num_replicas-th index from r on. stepgraph's own BatchLoader shards the same way
(data/loader.py shard_order) over its own permutation.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import numpy as np

from .sampler import Sampler

MT_SEED_MASK = 0xFFFFFFFF       # torch's mt19937 is seeded with the low 32 bits


def torch_randperm(n: int, seed: int) -> list[int]:
    """torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist(): for i in
    0..n-2, swap r[i] with r[i + u_i % (n - i)], u_i the i-th 32-bit MT19937 output."""
    draws = np.random.RandomState(int(seed) & MT_SEED_MASK).randint(
        0, 2**32, size=max(n - 1, 0), dtype=np.uint64).tolist()
    order = list(range(n))
    for i, u in enumerate(draws):
        j = i + u % (n - i)
        order[i], order[j] = order[j], order[i]
    return order


class DistributedSampler(Sampler[int]):
    """torch.utils.data.distributed.DistributedSampler: this rank's indices of `dataset`
    (num_replicas / rank default to the process group's; get_world_size() / get_rank()),
    shuffled by seed + epoch (set_epoch) when `shuffle`, padded to equal length or cut
    (`drop_last`); the same order as torch's for the same seed and epoch."""

    def __init__(self, dataset: Sized, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        from ...distributed import get_group

        if num_replicas is None or rank is None:
            group = get_group()
            if group is None:
                raise RuntimeError("Requires distributed package to be available")
            num_replicas = group.world_size if num_replicas is None else num_replicas
            rank = group.rank if rank is None else rank
        if rank >= num_replicas or rank < 0:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval "
                             f"[0, {num_replicas - 1}]")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.epoch, self.drop_last, self.shuffle, self.seed = 0, drop_last, shuffle, seed
        n = len(dataset)
        if drop_last and n % num_replicas != 0:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def index_array(self) -> np.ndarray:
        n = len(self.dataset)
        indices = torch_randperm(n, self.seed + self.epoch) if self.shuffle else \
            list(range(n))
        padding = self.total_size - len(indices)
        if padding > 0:
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        else:
            indices = indices[:self.total_size]
        return np.asarray(indices[self.rank:self.total_size:self.num_replicas], np.int64)

    def __iter__(self) -> Iterator[int]:
        return iter(self.index_array().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration gives (shuffle: seed + epoch)."""
        self.epoch = epoch


__all__ = ["DistributedSampler"]
