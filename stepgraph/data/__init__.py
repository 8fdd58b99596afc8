"""Datasets (bundled digits, MNIST IDX files, CIFAR-10 batches, character-level text),
augmentation and the mini-batch loader."""
from __future__ import annotations

from pathlib import Path

from .augment import RandomCropFlip, apply_crop_flip, draw_crop_flip
from .cifar10 import load_cifar10
from .digits import Dataset, load_digits
from .loader import (BatchLoader, LoaderError, epoch_order, shard_order, to_device,
                     with_layout)
from .mnist import DatasetFormatError, DatasetNotFoundError, load_mnist, read_idx
from .text import TextDataset, TokenBatches, load_text

DATASETS = ("digits", "mnist", "cifar10")
# Datasets read from files: what the files are, and their loader.
FILE_DATASETS = {"mnist": ("MNIST IDX files", load_mnist),
                 "cifar10": ("CIFAR-10 batch files", load_cifar10)}


def load_dataset(name: str, data_dir: str | Path | None = None) -> Dataset:
    """Load a dataset by name: `digits` (bundled), `mnist` (IDX files in data_dir) or
    `cifar10` (either release of the batch files in data_dir)."""
    if name == "digits":
        return load_digits()
    if name in FILE_DATASETS:
        what, loader = FILE_DATASETS[name]
        if data_dir is None:
            raise DatasetNotFoundError(f"{name} needs a data directory holding its {what}")
        return loader(data_dir)
    raise DatasetNotFoundError(f"unknown dataset {name!r}; choose one of {DATASETS}")


__all__ = [
    "DATASETS", "BatchLoader", "Dataset", "DatasetFormatError", "DatasetNotFoundError",
    "LoaderError", "RandomCropFlip", "apply_crop_flip", "draw_crop_flip", "epoch_order",
    "load_cifar10", "load_dataset", "load_digits", "load_mnist", "read_idx", "shard_order",
    "to_device",
    "with_layout", "TextDataset", "TokenBatches", "load_text",
]
