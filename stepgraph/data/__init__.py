"""Datasets (bundled digits, MNIST IDX files) and the mini-batch loader."""
from __future__ import annotations

from pathlib import Path

from .digits import Dataset, load_digits
from .loader import BatchLoader, LoaderError, epoch_order, to_device, with_layout
from .mnist import DatasetFormatError, DatasetNotFoundError, load_mnist, read_idx

DATASETS = ("digits", "mnist")


def load_dataset(name: str, data_dir: str | Path | None = None) -> Dataset:
    """Load a dataset by name: `digits` (bundled) or `mnist` (IDX files in data_dir)."""
    if name == "digits":
        return load_digits()
    if name == "mnist":
        if data_dir is None:
            raise DatasetNotFoundError("mnist needs a data directory holding its IDX files")
        return load_mnist(data_dir)
    raise DatasetNotFoundError(f"unknown dataset {name!r}; choose one of {DATASETS}")


__all__ = [
    "DATASETS", "BatchLoader", "Dataset", "DatasetFormatError", "DatasetNotFoundError",
    "LoaderError", "epoch_order", "load_dataset", "load_digits", "load_mnist", "read_idx",
    "to_device", "with_layout",
]
