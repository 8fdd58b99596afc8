"""MNIST from the original IDX files (raw or gzipped) in a local directory. Nothing is downloaded.

Expected files, each either as named or with a `.gz` suffix:
train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte.
They are looked for in the directory itself and in `<dir>/MNIST/raw` (torchvision's layout).
"""
from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

from ..errors import StepgraphError
from .digits import Dataset

MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}

# IDX type codes (third byte of the magic number) -> big-endian NumPy dtypes.
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


class DatasetNotFoundError(StepgraphError, FileNotFoundError):
    """Dataset files are missing; the message names each missing file and where it looked."""


class DatasetFormatError(StepgraphError, ValueError):
    """A dataset file exists but is not what it should be (bad magic, truncated, wrong shape)."""


def search_dirs(data_dir: Path) -> list[Path]:
    """Directories searched for the IDX files, in order."""
    return [data_dir, data_dir / "MNIST" / "raw"]


def find_file(data_dir: Path, name: str) -> Path | None:
    """The first existing `<name>` or `<name>.gz` under search_dirs(data_dir), else None."""
    for directory in search_dirs(data_dir):
        for candidate in (directory / name, directory / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped) into an array of its stored dtype."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:    # a cut-off or damaged download
        raise DatasetFormatError(f"{path}: truncated or corrupt gzip file ({err}); the file "
                                 "is left as it is: download it again") from err
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in IDX_DTYPES:
        raise DatasetFormatError(f"{path}: not an IDX file (magic bytes {data[:4]!r})")
    dtype, ndim = np.dtype(IDX_DTYPES[data[2]]), data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DatasetFormatError(f"{path}: truncated header ({len(data)} bytes)")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise DatasetFormatError(f"{path}: header says shape {shape} ({expected} bytes of data), "
                                 f"file holds {len(data) - header}")
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return array.astype(dtype.newbyteorder("="))    # native byte order, writable copy


def load_mnist(data_dir: str | Path) -> Dataset:
    """MNIST from IDX files in data_dir: images float32 in [0, 1], shape (N, 1, 28, 28)."""
    data_dir = Path(data_dir)
    paths = {key: find_file(data_dir, name) for key, name in MNIST_FILES.items()}
    missing = [MNIST_FILES[key] for key, path in paths.items() if path is None]
    if missing:
        looked = ", ".join(str(d) for d in search_dirs(data_dir))
        raise DatasetNotFoundError(
            f"MNIST files missing: {', '.join(missing)} (raw or .gz); looked in {looked}. "
            f"Put the four IDX files there or pass --data-dir")
    arrays = {key: read_idx(path) for key, path in paths.items()}
    for split in ("train", "test"):
        _check_pair(arrays[f"x_{split}"], arrays[f"y_{split}"], paths[f"x_{split}"])
    return Dataset("mnist", _images(arrays["x_train"]), arrays["y_train"].astype(np.int64),
                   _images(arrays["x_test"]), arrays["y_test"].astype(np.int64))


def _check_pair(images: np.ndarray, labels: np.ndarray, path: Path) -> None:
    if images.ndim != 3:
        raise DatasetFormatError(f"{path}: images must be (N, H, W), got shape {images.shape}")
    if labels.shape != (images.shape[0],):
        raise DatasetFormatError(f"{path}: {images.shape[0]} images but labels have shape "
                                 f"{labels.shape}")


def _images(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.float32) / 255.0)[:, None, :, :]
