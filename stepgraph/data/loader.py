"""Mini-batches over in-memory arrays, optionally resident on the GPU.

The order of epoch e is a pure function of (seed, e), so a run resumed at epoch e sees exactly
the batches an uninterrupted run would have seen. Each epoch gathers the dataset once into its
shuffled order; batches are then contiguous slices (views, no copy). On cuda the whole dataset is
put on the GPU once and the gather and slicing happen there. An optional `transform(x, epoch,
batch)` (augmentation, see augment.py) rewrites each batch of inputs when the epoch is gathered,
on the device that holds them.

Data-parallel runs shard each epoch as PyTorch's DistributedSampler does: every rank draws the
same permutation (same seed), pads it by repeating its start to a multiple of the world size,
and takes every world_size-th sample from its rank on. The ranks' i-th batches together are
then the i-th batch of a single process with a world_size times larger batch.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import StepgraphError

LAYOUTS = ("flat", "image")


class LoaderError(StepgraphError, ValueError):
    """Loader arguments that cannot work (mismatched lengths, bad batch size or seed)."""


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The sample order of one epoch: a permutation of range(n) fixed by (seed, epoch)."""
    if seed < 0 or epoch < 0:
        raise LoaderError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    return np.random.default_rng((seed, epoch)).permutation(n)


def shard_order(order: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank `rank`'s part of an epoch's `order` (DistributedSampler's): padded by repeating
    its start to a multiple of world_size, then every world_size-th sample from `rank` on."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise LoaderError(f"rank must be in [0, world_size), got rank={rank}, "
                          f"world_size={world_size}")
    n = len(order)
    total = -(-n // world_size) * world_size
    if total > n:
        if n == 0:
            raise LoaderError("cannot shard an empty dataset")
        order = np.concatenate([order, np.resize(order, total - n)])
    return order[rank:total:world_size]


def with_layout(x: np.ndarray, layout: str) -> np.ndarray:
    """Images (N, C, H, W) as `flat` (N, C*H*W) or unchanged as `image`."""
    if layout not in LAYOUTS:
        raise LoaderError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return x.reshape(x.shape[0], -1) if layout == "flat" else x


def cupy_or_none():
    """The cupy module if it imports, else None."""
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def to_device(array: np.ndarray, device: str) -> Any:
    """`array` on `device`: unchanged on cpu; a CuPy copy on cuda when CuPy is installed."""
    cp = cupy_or_none() if device == "cuda" else None
    return array if cp is None else cp.asarray(array)


@dataclass
class BatchLoader:
    """Yields (x, y) batches of `batch_size`; the last, smaller batch is kept unless drop_last.

    `device="cuda"` keeps x and y on the GPU (when CuPy is available) and yields CuPy views.
    `transform(x_batch, epoch, batch_index)` returns a batch's inputs transformed (same shape
    and dtype); it must be a pure function of its arguments for a resume to be exact.
    `rank` of `world_size` > 1: this process's shard of every epoch (the module docstring);
    its batch i is transformed as batch i * world_size + rank, so ranks draw differently.

    `for x, y in loader:` iterates the next epoch: the first loop epoch 0, the next epoch 1,
    and so on (each iteration started takes the next, as a torch DataLoader draws a new order
    per iteration). `set_epoch(e)` makes the next loop epoch e (a resumed run); `epoch(e)`
    gives any epoch without moving the counter.
    """

    x: Any
    y: Any
    batch_size: int
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    device: str = "cpu"
    transform: Callable[[Any, int, int], Any] | None = None
    rank: int = 0
    world_size: int = 1
    next_epoch: int = field(default=0, init=False)

    def __post_init__(self):
        if len(self.x) != len(self.y):
            raise LoaderError(f"x has {len(self.x)} samples but y has {len(self.y)}")
        if self.batch_size < 1:
            raise LoaderError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise LoaderError(f"rank must be in [0, world_size), got rank={self.rank}, "
                              f"world_size={self.world_size}")
        if self.world_size > 1 and len(self.x) == 0:
            raise LoaderError("cannot shard an empty dataset")
        self.x = to_device(self.x, self.device)
        self.y = to_device(self.y, self.device)

    @property
    def samples(self) -> int:
        """Samples this rank sees per epoch (its shard, padding included)."""
        return -(-len(self.x) // self.world_size)

    def __len__(self) -> int:
        n = self.samples
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def on_gpu(self) -> bool:
        return not isinstance(self.x, np.ndarray)

    def epoch(self, epoch: int) -> Iterator[tuple[Any, Any]]:
        """The batches of epoch `epoch` (0-based), in that epoch's order."""
        x, y = self._ordered(epoch)
        for i in range(len(self)):
            sl = slice(i * self.batch_size, (i + 1) * self.batch_size)
            yield x[sl], y[sl]

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        """The batches of epoch `next_epoch`, which then advances by one."""
        epoch, self.next_epoch = self.next_epoch, self.next_epoch + 1
        return self.epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Make the next `for ... in loader` iterate epoch `epoch`."""
        if epoch < 0:
            raise LoaderError(f"epoch must be >= 0, got {epoch}")
        self.next_epoch = int(epoch)

    def order(self, epoch: int) -> np.ndarray | None:
        """This rank's sample indices in epoch `epoch`; None: all samples as stored."""
        if not self.shuffle and self.world_size == 1:
            return None
        n = len(self.x)
        order = epoch_order(self.seed, epoch, n) if self.shuffle else np.arange(n)
        return shard_order(order, self.rank, self.world_size)

    def _ordered(self, epoch: int) -> tuple[Any, Any]:
        if not self.shuffle and self.world_size == 1 and self.transform is None:
            return self.x, self.y
        if not self.on_gpu:
            return self._gathered(epoch)
        cp = cupy_or_none()
        # Steps may run on their own stream: let the previous epoch's reads of the old gathered
        # arrays finish before the pool can reuse them (for the gather or the transform's
        # temporaries), and the gather finish before they start.
        cp.cuda.Device().synchronize()
        gathered = self._gathered(epoch)
        cp.cuda.Device().synchronize()
        return gathered

    def _gathered(self, epoch: int) -> tuple[Any, Any]:
        """A new copy of x and y in epoch order, each batch of x transformed in place."""
        order = self.order(epoch)
        if order is not None:
            index = order if not self.on_gpu else cupy_or_none().asarray(order)
            x, y = self.x[index], self.y[index]
        else:
            x, y = self.x.copy(), self.y
        if self.transform is not None:
            for i in range(len(self)):
                sl = slice(i * self.batch_size, (i + 1) * self.batch_size)
                x[sl] = self.transform(x[sl], epoch, i * self.world_size + self.rank)
        return x, y
