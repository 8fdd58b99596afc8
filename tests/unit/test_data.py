"""Datasets and the batch loader (no device needed)."""
from __future__ import annotations

import gzip

import numpy as np
import pytest

from stepgraph.data import (BatchLoader, DatasetFormatError, DatasetNotFoundError, LoaderError,
                            epoch_order, load_dataset, load_digits, load_mnist, read_idx,
                            with_layout)


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def test_digits_shapes_dtypes_and_range(digits):
    assert digits.x_train.shape == (1437, 1, 8, 8)
    assert digits.x_test.shape == (360, 1, 8, 8)
    assert digits.x_train.dtype == np.float32 and digits.y_train.dtype == np.int64
    assert digits.x_train.min() == 0.0 and digits.x_train.max() == 1.0
    assert set(np.unique(digits.y_train)) == set(range(10))
    assert set(np.unique(digits.y_test)) == set(range(10))     # stratified split
    assert digits.image_shape == (1, 8, 8) and digits.features == 64


def test_digits_split_is_deterministic(digits):
    again = load_digits()
    np.testing.assert_array_equal(digits.x_train, again.x_train)
    np.testing.assert_array_equal(digits.y_test, again.y_test)


def test_load_dataset_by_name(digits):
    assert load_dataset("digits").x_train.shape == digits.x_train.shape
    with pytest.raises(DatasetNotFoundError, match="unknown dataset 'cifar'"):
        load_dataset("cifar")


def test_layouts(digits):
    assert with_layout(digits.x_train, "flat").shape == (1437, 64)
    assert with_layout(digits.x_train, "image").shape == (1437, 1, 8, 8)
    with pytest.raises(LoaderError, match="layout"):
        with_layout(digits.x_train, "nhwc")


def test_mnist_reads_raw_and_gzipped_idx(fake_mnist):
    directory, arrays = fake_mnist
    data = load_mnist(directory)
    assert data.x_train.shape == (120, 1, 28, 28) and data.x_test.shape == (40, 1, 28, 28)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    np.testing.assert_allclose(data.x_train[:, 0], arrays["train"][0] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(data.y_test, arrays["t10k"][1])
    assert data.image_shape == (1, 28, 28)


def test_mnist_finds_torchvision_layout(fake_mnist, tmp_path):
    directory, _ = fake_mnist
    raw = tmp_path / "root" / "MNIST" / "raw"
    raw.parent.mkdir(parents=True)
    directory.rename(raw)
    assert load_mnist(tmp_path / "root").x_train.shape == (120, 1, 28, 28)


def test_mnist_error_names_exactly_the_missing_files(fake_mnist):
    directory, _ = fake_mnist
    (directory / "t10k-labels-idx1-ubyte").unlink()
    (directory / "train-images-idx3-ubyte.gz").unlink()
    with pytest.raises(DatasetNotFoundError) as info:
        load_mnist(directory)
    message = str(info.value)
    assert "train-images-idx3-ubyte" in message and "t10k-labels-idx1-ubyte" in message
    assert "train-labels" not in message and "t10k-images" not in message
    assert str(directory) in message and str(directory / "MNIST" / "raw") in message
    assert isinstance(info.value, FileNotFoundError)


def test_mnist_empty_directory_lists_all_four(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="train-images.*train-labels.*t10k-images"):
        load_mnist(tmp_path)


def test_read_idx_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x1f\x00\x08\x01")
    with pytest.raises(DatasetFormatError, match="not an IDX file"):
        read_idx(bad)
    short = tmp_path / "short.gz"
    header = bytes([0, 0, 8, 2]) + np.array([3, 3], dtype=">u4").tobytes()
    with gzip.open(short, "wb") as f:
        f.write(header + bytes(5))
    with pytest.raises(DatasetFormatError, match=r"shape \(3, 3\)"):
        read_idx(short)


def test_read_idx_multibyte_big_endian(tmp_path):
    path = tmp_path / "ints"
    values = np.arange(6, dtype=">i4").reshape(2, 3)
    path.write_bytes(bytes([0, 0, 0x0C, 2]) + np.array([2, 3], ">u4").tobytes() + values.tobytes())
    np.testing.assert_array_equal(read_idx(path), np.arange(6).reshape(2, 3))


def _loader(n=10, batch_size=4, **kw):
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    return BatchLoader(x, np.arange(n), batch_size, **kw)


def test_loader_covers_every_sample_once_with_ragged_last_batch():
    loader = _loader(seed=3)
    batches = list(loader.epoch(0))
    assert len(loader) == 3 and [len(y) for _, y in batches] == [4, 4, 2]
    ys = np.concatenate([y for _, y in batches])
    assert sorted(ys) == list(range(10))
    for x, y in batches:    # rows stay paired with their labels
        np.testing.assert_array_equal(x[:, 0], y * 3)


def test_loader_drop_last():
    loader = _loader(drop_last=True)
    assert len(loader) == 2 and [len(y) for _, y in loader.epoch(0)] == [4, 4]


def test_loader_order_is_a_pure_function_of_seed_and_epoch():
    def order(loader, epoch):
        return np.concatenate([y for _, y in loader.epoch(epoch)])

    a, b = _loader(n=50, seed=7), _loader(n=50, seed=7)
    np.testing.assert_array_equal(order(a, 3), order(b, 3))       # no hidden RNG state
    np.testing.assert_array_equal(order(a, 3), epoch_order(7, 3, 50))
    assert not np.array_equal(order(a, 0), order(a, 1))
    assert not np.array_equal(order(a, 0), order(_loader(n=50, seed=8), 0))


def test_loader_without_shuffle_keeps_order():
    ys = np.concatenate([y for _, y in _loader(shuffle=False).epoch(5)])
    np.testing.assert_array_equal(ys, np.arange(10))


def test_loader_rejects_bad_arguments():
    with pytest.raises(LoaderError, match="x has 3 samples but y has 2"):
        BatchLoader(np.zeros((3, 2)), np.zeros(2), 1)
    with pytest.raises(LoaderError, match="batch_size must be >= 1"):
        _loader(batch_size=0)
    with pytest.raises(LoaderError, match="seed and epoch must be >= 0"):
        epoch_order(-1, 0, 5)


@pytest.mark.cuda
def test_loader_keeps_data_on_the_gpu():
    import cupy as cp

    loader = _loader(n=50, batch_size=16, seed=1, device="cuda")
    batches = list(loader.epoch(2))
    assert loader.on_gpu and all(isinstance(x, cp.ndarray) for x, _ in batches)
    ys = np.concatenate([cp.asnumpy(y) for _, y in batches])
    np.testing.assert_array_equal(ys, epoch_order(1, 2, 50))
