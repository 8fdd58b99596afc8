"""torch.utils.data samplers: which indices a DataLoader reads, in which order, in which
batches. Argument checks and their exception types are torch's.

The random ones draw from their `generator` (a torch.Generator, i.e. stepgraph.Generator, or
a numpy.random.Generator) or, without one, from the host generator that torch.manual_seed
seeds, so a seeded script shuffles the same way on every run. Each iteration draws anew (a new
order every epoch). The orders are not torch's for the same seed.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Generic, TypeVar

import numpy as np

from ...functions.generator import host_rng

T_co = TypeVar("T_co", covariant=True)


def positive_int(value, name: str) -> None:
    """torch's check of batch_size / num_samples: a positive int that is not a bool."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} should be a positive integer value, but got {name}={value}")


class Sampler(Generic[T_co]):
    """Base class of samplers: `__iter__` yields indices (or, for a batch sampler, lists of
    them); `__len__` where the count is known."""

    def __init__(self, data_source: Sized | None = None) -> None:
        pass

    def __iter__(self) -> Iterator[T_co]:
        raise NotImplementedError


class SequentialSampler(Sampler[int]):
    """0, 1, ..., len(data_source) - 1."""

    def __init__(self, data_source: Sized):
        self.data_source = data_source

    def index_array(self) -> np.ndarray:
        return np.arange(len(self.data_source))

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)


class RandomSampler(Sampler[int]):
    """Indices in random order: a new permutation each iteration, or `num_samples` of them
    (whole permutations one after another, the last cut short); with `replacement`,
    `num_samples` independent uniform draws."""

    def __init__(self, data_source: Sized, replacement: bool = False,
                 num_samples: int | None = None, generator=None):
        self.data_source, self.replacement = data_source, replacement
        self._num_samples, self.generator = num_samples, generator
        if not isinstance(replacement, bool):
            raise TypeError("replacement should be a boolean value, but got "
                            f"replacement={replacement}")
        positive_int(self.num_samples, "num_samples")

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def index_array(self) -> np.ndarray:
        """This iteration's indices, drawn at once."""
        rng, n = host_rng(self.generator, "RandomSampler"), len(self.data_source)
        if self.replacement:
            return rng.integers(n, size=self.num_samples)
        whole, part = divmod(self.num_samples, n)
        perms = [rng.permutation(n) for _ in range(whole)] + [rng.permutation(n)[:part]]
        return np.concatenate(perms)

    def __iter__(self) -> Iterator[int]:
        return iter(self.index_array().tolist())

    def __len__(self) -> int:
        return self.num_samples


class SubsetRandomSampler(Sampler[int]):
    """The given indices in a random order (a new one each iteration)."""

    def __init__(self, indices: Sequence[int], generator=None):
        self.indices, self.generator = indices, generator

    def __iter__(self) -> Iterator[int]:
        order = host_rng(self.generator, "SubsetRandomSampler").permutation(len(self.indices))
        return (self.indices[i] for i in order.tolist())

    def __len__(self) -> int:
        return len(self.indices)


class WeightedRandomSampler(Sampler[int]):
    """`num_samples` indices of range(len(weights)), drawn with probability proportional to
    the weights (with or without replacement)."""

    def __init__(self, weights: Sequence[float], num_samples: int, replacement: bool = True,
                 generator=None):
        positive_int(num_samples, "num_samples")
        if not isinstance(replacement, bool):
            raise ValueError("replacement should be a boolean value, but got "
                             f"replacement={replacement}")
        self.weights = np.asarray(weights, dtype=np.float64)
        if self.weights.ndim != 1:
            raise ValueError("weights should be a 1d sequence but given weights have shape "
                             f"{self.weights.shape}")
        self.num_samples, self.replacement, self.generator = num_samples, replacement, generator

    def __iter__(self) -> Iterator[int]:
        w = self.weights
        if not (np.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
            raise RuntimeError("WeightedRandomSampler: weights must be finite, non-negative "
                               "and not all zero")
        if not self.replacement and self.num_samples > np.count_nonzero(w):
            raise RuntimeError(f"WeightedRandomSampler: cannot draw {self.num_samples} samples "
                               f"without replacement from {np.count_nonzero(w)} nonzero weights")
        rng = host_rng(self.generator, "WeightedRandomSampler")
        drawn = rng.choice(len(w), size=self.num_samples, replace=self.replacement, p=w / w.sum())
        return iter(drawn.tolist())

    def __len__(self) -> int:
        return self.num_samples


class BatchSampler(Sampler[list[int]]):
    """Lists of `batch_size` indices from `sampler` (any iterable of indices); the last,
    shorter list is dropped when `drop_last`."""

    def __init__(self, sampler: Sampler[int] | Iterable[int], batch_size: int,
                 drop_last: bool):
        positive_int(batch_size, "batch_size")
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last should be a boolean value, but got "
                             f"drop_last={drop_last}")
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __iter__(self) -> Iterator[list[int]]:
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def index_arrays(self) -> Iterator:
        """The batches __iter__ gives, as NumPy index arrays cut from the sampler's
        index_array() where it has one (Sequential and RandomSampler): no per-index loop."""
        if type(self.sampler) not in (SequentialSampler, RandomSampler):
            yield from self
            return
        order = self.sampler.index_array()
        end = len(order) - len(order) % self.batch_size if self.drop_last else len(order)
        for start in range(0, end, self.batch_size):
            yield order[start:start + self.batch_size]

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
