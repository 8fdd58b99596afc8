"""CIFAR-10 from the original batch files in a local directory. Nothing is downloaded.

Either release works, as extracted from its archive:
- the python version (`cifar-10-batches-py/`): data_batch_1..5 and test_batch, each a pickled
  dict with b"data" (N, 3072) uint8 and b"labels" (N integers);
- the binary version (`cifar-10-batches-bin/`): data_batch_1.bin..5.bin and test_batch.bin,
  each a run of 3073-byte records (1 label byte, then 3072 pixel bytes).
A row of 3072 pixels is the red, green and blue 32x32 planes in turn, row-major: NCHW as is.
Files are looked for in the directory itself, then in its `cifar-10-batches-py` and
`cifar-10-batches-bin` subdirectories.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .digits import Dataset
from .mnist import DatasetFormatError, DatasetNotFoundError

CIFAR10_SHAPE = (3, 32, 32)
CIFAR10_CLASSES = 10
RECORD_BYTES = 1 + 3 * 32 * 32
# The per-channel statistics of the 50,000 training images (pixels scaled to [0, 1]).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"


@dataclass(frozen=True)
class Layout:
    """One release of the files: its subdirectory name, file suffix and reader."""

    name: str
    subdir: str
    suffix: str

    def files(self) -> list[str]:
        return [name + self.suffix for name in (*TRAIN_BATCHES, TEST_BATCH)]


PYTHON = Layout("python version", "cifar-10-batches-py", "")
BINARY = Layout("binary version", "cifar-10-batches-bin", ".bin")
LAYOUTS = (PYTHON, BINARY)


def search_dirs(data_dir: Path) -> list[Path]:
    """Directories searched for the batch files, in order."""
    return [data_dir] + [data_dir / layout.subdir for layout in LAYOUTS]


def find_batches(data_dir: Path) -> tuple[Layout, Path]:
    """The first (layout, directory) holding all six files of a release.

    Raises DatasetNotFoundError naming the missing files of the most complete candidate, or
    every file of both releases when none is there at all.
    """
    best: tuple[int, Layout, Path] | None = None
    for directory in search_dirs(data_dir):
        for layout in LAYOUTS:
            present = sum((directory / name).is_file() for name in layout.files())
            if present == len(layout.files()):
                return layout, directory
            if present and (best is None or present > best[0]):
                best = (present, layout, directory)
    looked = ", ".join(str(d) for d in search_dirs(data_dir))
    if best is not None:
        _, layout, directory = best
        missing = [n for n in layout.files() if not (directory / n).is_file()]
        raise DatasetNotFoundError(f"CIFAR-10 files missing ({layout.name}) in {directory}: "
                                   f"{', '.join(missing)}")
    raise DatasetNotFoundError(
        f"CIFAR-10 files missing: {', '.join(PYTHON.files())} (python version) or "
        f"{', '.join(BINARY.files())} (binary version); looked in {looked}. Extract "
        f"cifar-10-python.tar.gz or cifar-10-binary.tar.gz there or pass --data-dir")


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles plain containers and NumPy arrays only: a batch file cannot run code."""

    # _codecs.encode: how protocol-2 pickles written by Python 3 store bytes.
    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

    def find_class(self, module, name):
        if module.startswith("numpy.core"):     # pickles written by NumPy 1.x
            module = "numpy._core" + module[len("numpy.core"):]
        if (module, name) in self.ALLOWED or (module == "numpy._core.multiarray"
                                              and name in ("_reconstruct", "scalar")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_python_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One pickled batch: (pixels (N, 3072) uint8, labels (N,) int64)."""
    try:
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError) as err:
        raise DatasetFormatError(f"{path}: not a CIFAR-10 python batch ({err})") from err
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise DatasetFormatError(f"{path}: expected a dict with b'data' and b'labels', "
                                 f"got {keys}")
    pixels, labels = np.asarray(batch[b"data"]), np.asarray(batch[b"labels"])
    if pixels.dtype != np.uint8 or pixels.ndim != 2 or pixels.shape[1] != RECORD_BYTES - 1:
        raise DatasetFormatError(f"{path}: b'data' must be uint8 (N, {RECORD_BYTES - 1}), "
                                 f"got {pixels.dtype} {pixels.shape}")
    if labels.shape != (len(pixels),) or not np.issubdtype(labels.dtype, np.integer):
        raise DatasetFormatError(f"{path}: {len(pixels)} images but b'labels' is "
                                 f"{labels.dtype} {labels.shape}")
    return pixels, labels.astype(np.int64)


def read_binary_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One binary batch of 3073-byte records: (pixels (N, 3072) uint8, labels (N,) int64)."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % RECORD_BYTES:
        raise DatasetFormatError(f"{path}: {raw.size} bytes is not a whole number of "
                                 f"{RECORD_BYTES}-byte records")
    records = raw.reshape(-1, RECORD_BYTES)
    return records[:, 1:].copy(), records[:, 0].astype(np.int64)


def normalize(pixels: np.ndarray) -> np.ndarray:
    """uint8 rows (N, 3072) -> float32 (N, 3, 32, 32), standardised per channel."""
    images = pixels.reshape(-1, *CIFAR10_SHAPE).astype(np.float32) / np.float32(255.0)
    mean = np.asarray(CIFAR10_MEAN, dtype=np.float32).reshape(1, 3, 1, 1)
    std = np.asarray(CIFAR10_STD, dtype=np.float32).reshape(1, 3, 1, 1)
    return (images - mean) / std


def _read_split(layout: Layout, directory: Path, names) -> tuple[np.ndarray, np.ndarray]:
    reader = read_python_batch if layout is PYTHON else read_binary_batch
    parts = [reader(directory / (name + layout.suffix)) for name in names]
    for (_, labels), name in zip(parts, names):
        if labels.size and (labels.min() < 0 or labels.max() >= CIFAR10_CLASSES):
            raise DatasetFormatError(f"{directory / (name + layout.suffix)}: labels must be "
                                     f"in [0, {CIFAR10_CLASSES}), got {labels.min()}.."
                                     f"{labels.max()}")
    pixels = np.concatenate([p for p, _ in parts])
    return normalize(pixels), np.concatenate([y for _, y in parts])


def load_cifar10(data_dir: str | Path) -> Dataset:
    """CIFAR-10 from either release in data_dir: images float32 (N, 3, 32, 32) standardised
    with CIFAR10_MEAN and CIFAR10_STD (not in [0, 1]), labels int64."""
    layout, directory = find_batches(Path(data_dir))
    x_train, y_train = _read_split(layout, directory, TRAIN_BATCHES)
    x_test, y_test = _read_split(layout, directory, (TEST_BATCH,))
    return Dataset("cifar10", x_train, y_train, x_test, y_test, classes=CIFAR10_CLASSES)
