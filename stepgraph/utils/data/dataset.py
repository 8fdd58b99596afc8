"""torch.utils.data datasets: Dataset (map-style), IterableDataset, TensorDataset, Subset,
ConcatDataset, ChainDataset and random_split, with torch's semantics and argument checks.

Where torch asserts (TensorDataset's sizes, an empty ConcatDataset) stepgraph raises
LoaderError, a ValueError that says what mismatched.
"""
from __future__ import annotations

import bisect
import itertools
import math
import warnings
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

import numpy as np

from ...data.loader import LoaderError
from ...functions.factories import as_tensor
from ...functions.generator import default_generator, host_rng
from ...ir.trace import Tensor, tensor_of

T_co = TypeVar("T_co", covariant=True)


class Dataset(Generic[T_co]):
    """A map-style dataset: subclasses define `__getitem__(index)` (and usually `__len__`).
    `a + b` is ConcatDataset([a, b])."""

    def __getitem__(self, index) -> T_co:
        raise NotImplementedError("Subclasses of Dataset should implement __getitem__.")

    def __add__(self, other: Dataset) -> ConcatDataset:
        return ConcatDataset([self, other])


class IterableDataset(Dataset[T_co]):
    """A dataset read as a stream: subclasses define `__iter__`. The DataLoader reads it in
    the main process (get_worker_info() is None), so it is read once per epoch, unsharded.
    `a + b` is ChainDataset([a, b])."""

    def __iter__(self):
        raise NotImplementedError("Subclasses of IterableDataset should implement __iter__.")

    def __add__(self, other: IterableDataset) -> ChainDataset:
        return ChainDataset([self, other])


def eager_tensor(data, what: str) -> Tensor:
    """`data` (an eager stepgraph Tensor or a NumPy array, shared, not copied) as a Tensor."""
    if isinstance(data, Tensor):
        if not data.is_eager:
            raise TypeError(f"{what}: a traced tensor has no values; give eager tensors or "
                            "NumPy arrays")
        return data
    if isinstance(data, np.ndarray):
        return as_tensor(data)
    raise TypeError(f"{what}: expected tensors or NumPy arrays, got {type(data).__name__}")


class TensorDataset(Dataset[tuple]):
    """Samples are rows of the given tensors (stepgraph eager Tensors or NumPy arrays, held as
    Tensors that share the arrays' memory): `dataset[i]` is `(t[i] for t in tensors)`. All must
    have the same first dimension. A DataLoader with the default collate gathers a whole batch
    of them with one NumPy index per tensor."""

    def __init__(self, *tensors):
        self.tensors = tuple(eager_tensor(t, "TensorDataset") for t in tensors)
        if any(t.ndim == 0 for t in self.tensors):
            raise LoaderError("TensorDataset: every tensor needs a first (sample) dimension, "
                              f"got shapes {[tuple(t.shape) for t in self.tensors]}")
        sizes = [t.shape[0] for t in self.tensors]
        if len(set(sizes)) > 1:
            raise LoaderError(f"TensorDataset: size mismatch between tensors: first "
                              f"dimensions {sizes} (each tensor holds one row per sample)")

    def __getitem__(self, index) -> tuple:
        if isinstance(index, Tensor):
            index = index.array
        return tuple(tensor_of(t.array[index]) for t in self.tensors)

    def __len__(self) -> int:
        return self.tensors[0].shape[0] if self.tensors else 0


class Subset(Dataset[T_co]):
    """The samples of `dataset` at `indices`, in that order."""

    def __init__(self, dataset: Dataset, indices: Sequence[int]):
        self.dataset, self.indices = dataset, indices
        if type(self).__getitem__ is not Subset.__getitem__ \
                and type(self).__getitems__ is Subset.__getitems__:
            raise NotImplementedError(f"{type(self).__name__} overrides __getitem__ but not "
                                      "__getitems__, which the DataLoader calls: define both")

    def __getitem__(self, idx):
        if isinstance(idx, list):
            return self.dataset[[self.indices[i] for i in idx]]
        return self.dataset[self.indices[idx]]

    def __getitems__(self, indices: list[int]) -> list:
        rows = [self.indices[i] for i in indices]
        if callable(getattr(self.dataset, "__getitems__", None)):
            return self.dataset.__getitems__(rows)
        return [self.dataset[i] for i in rows]

    def __len__(self) -> int:
        return len(self.indices)


class ConcatDataset(Dataset[T_co]):
    """Map-style datasets one after another: index i of the first len(datasets[0]) samples is
    in datasets[0], and so on. Negative indices count from the end, as in a list."""

    def __init__(self, datasets: Iterable[Dataset]):
        self.datasets = list(datasets)
        if not self.datasets:
            raise LoaderError("ConcatDataset: datasets should not be an empty iterable")
        if any(isinstance(d, IterableDataset) for d in self.datasets):
            raise LoaderError("ConcatDataset does not support IterableDataset (use "
                              "ChainDataset)")
        self.cumulative_sizes = list(itertools.accumulate(len(d) for d in self.datasets))

    def __len__(self) -> int:
        return self.cumulative_sizes[-1]

    def __getitem__(self, idx):
        if idx < 0:
            if -idx > len(self):
                raise ValueError("absolute value of index should not exceed dataset length")
            idx += len(self)
        which = bisect.bisect_right(self.cumulative_sizes, idx)
        start = self.cumulative_sizes[which - 1] if which > 0 else 0
        return self.datasets[which][idx - start]


class ChainDataset(IterableDataset):
    """Iterable datasets read one after another."""

    def __init__(self, datasets: Iterable[Dataset]):
        self.datasets = datasets

    def __iter__(self):
        for d in self.datasets:
            if not isinstance(d, IterableDataset):
                raise LoaderError("ChainDataset only supports IterableDataset")
            yield from d

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)


def split_lengths(n: int, lengths: Sequence[int | float]) -> list[int]:
    """Lengths of the splits of n samples: `lengths` itself, or fractions summing to 1 as
    floor(n * f) each, the remainder dealt one by one from the first split on."""
    if not (math.isclose(sum(lengths), 1) and sum(lengths) <= 1):
        return list(lengths)
    for i, frac in enumerate(lengths):
        if not 0 <= frac <= 1:
            raise ValueError(f"Fraction at index {i} is not between 0 and 1")
    sizes = [math.floor(n * frac) for frac in lengths]
    for i in range(n - sum(sizes)):
        sizes[i % len(sizes)] += 1
    for i, size in enumerate(sizes):
        if size == 0:
            warnings.warn(f"Length of split at index {i} is 0. This might result in an "
                          "empty dataset.", stacklevel=3)
    return sizes


def random_split(dataset: Dataset, lengths: Sequence[int | float],
                 generator=default_generator) -> list[Subset]:
    """Split `dataset` into non-overlapping random Subsets of the given lengths (or fractions
    summing to 1), as torch: one permutation from `generator` (the host generator by default,
    seeded by torch.manual_seed), cut in order. Same seed, same split; not torch's split."""
    sizes = split_lengths(len(dataset), lengths)
    if sum(sizes) != len(dataset):
        raise ValueError("Sum of input lengths does not equal the length of the input "
                         f"dataset! ({sum(sizes)} != {len(dataset)})")
    order = host_rng(generator, "random_split").permutation(sum(sizes)).tolist()
    ends = itertools.accumulate(sizes)
    return [Subset(dataset, order[end - size:end]) for end, size in zip(ends, sizes)]
