"""CIFAR-10 batch files (both releases) and the crop/flip augmentation (no device needed)."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from stepgraph.data import (BatchLoader, DatasetFormatError, DatasetNotFoundError,
                            RandomCropFlip, apply_crop_flip, draw_crop_flip, load_cifar10,
                            load_dataset)
from stepgraph.data.augment import CropFlipDraws
from stepgraph.data.cifar10 import CIFAR10_MEAN, CIFAR10_STD, TRAIN_BATCHES


def fake_batches(rng, sizes):
    """(pixels (n, 3072) uint8, labels (n,)) per size."""
    return [(rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
             rng.integers(0, 10, size=n)) for n in sizes]


def write_python(directory, batches, numpy1=False):
    """Write train batches 1..5 then the test batch as the python release does; `numpy1`
    names NumPy's array reconstructor as NumPy 1.x pickles (like the real files) do."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, (pixels, labels) in zip((*TRAIN_BATCHES, "test_batch"), batches):
        record = {b"batch_label": name.encode(), b"labels": [int(v) for v in labels],
                  b"data": pixels, b"filenames": [b"x.png"] * len(labels)}
        data = pickle.dumps(record, protocol=2)
        if numpy1:
            data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        (directory / name).write_bytes(data)


def write_binary(directory, batches):
    directory.mkdir(parents=True, exist_ok=True)
    for name, (pixels, labels) in zip((*TRAIN_BATCHES, "test_batch"), batches):
        records = np.concatenate([labels.astype(np.uint8)[:, None], pixels], axis=1)
        (directory / f"{name}.bin").write_bytes(records.tobytes())


@pytest.fixture
def batches():
    return fake_batches(np.random.default_rng(0), (3, 2, 4, 1, 2, 5))


def expected_images(pixels):
    images = pixels.reshape(-1, 3, 32, 32) / 255.0
    mean = np.array(CIFAR10_MEAN).reshape(1, 3, 1, 1)
    return (images - mean) / np.array(CIFAR10_STD).reshape(1, 3, 1, 1)


def check(data, batches):
    train_pixels = np.concatenate([p for p, _ in batches[:5]])
    assert data.name == "cifar10" and data.classes == 10
    assert data.x_train.shape == (12, 3, 32, 32) and data.x_test.shape == (5, 3, 32, 32)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    np.testing.assert_allclose(data.x_train, expected_images(train_pixels), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(data.x_test, expected_images(batches[5][0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(data.y_train, np.concatenate([y for _, y in batches[:5]]))
    np.testing.assert_array_equal(data.y_test, batches[5][1])
    assert data.image_shape == (3, 32, 32)


@pytest.mark.parametrize("subdir, numpy1", [("", False), ("cifar-10-batches-py", True)])
def test_reads_python_release(tmp_path, batches, subdir, numpy1):
    write_python(tmp_path / subdir if subdir else tmp_path, batches, numpy1)
    check(load_cifar10(tmp_path), batches)


@pytest.mark.parametrize("subdir", ["", "cifar-10-batches-bin"])
def test_reads_binary_release(tmp_path, batches, subdir):
    write_binary(tmp_path / subdir if subdir else tmp_path, batches)
    check(load_cifar10(tmp_path), batches)
    check(load_dataset("cifar10", tmp_path), batches)


def test_pixel_layout_is_channel_planes(tmp_path):
    pixels = np.zeros((1, 3072), dtype=np.uint8)
    pixels[0, 1024 + 32 * 5 + 7] = 255            # green plane, row 5, column 7
    write_binary(tmp_path, [(pixels, np.array([3]))] * 6)
    image = load_cifar10(tmp_path).x_test[0]
    green = image[1] * CIFAR10_STD[1] + CIFAR10_MEAN[1]
    assert np.argwhere(green > 0.5).tolist() == [[5, 7]]


def test_empty_directory_names_both_releases(tmp_path):
    with pytest.raises(DatasetNotFoundError) as info:
        load_cifar10(tmp_path)
    message = str(info.value)
    assert "data_batch_1," in message and "test_batch.bin" in message
    assert str(tmp_path / "cifar-10-batches-py") in message
    assert isinstance(info.value, FileNotFoundError)


def test_missing_files_are_named(tmp_path, batches):
    directory = tmp_path / "cifar-10-batches-py"
    write_python(directory, batches)
    (directory / "data_batch_3").unlink()
    (directory / "test_batch").unlink()
    with pytest.raises(DatasetNotFoundError) as info:
        load_cifar10(tmp_path)
    message = str(info.value)
    assert message.endswith(f"in {directory}: data_batch_3, test_batch")
    with pytest.raises(DatasetNotFoundError, match="needs a data directory"):
        load_dataset("cifar10", None)


def test_corrupt_python_batches(tmp_path, batches):
    write_python(tmp_path, batches)
    (tmp_path / "data_batch_2").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(DatasetFormatError, match="data_batch_2: not a CIFAR-10 python batch"):
        load_cifar10(tmp_path)
    with open(tmp_path / "data_batch_2", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(DatasetFormatError, match=r"b'data' must be uint8 \(N, 3072\)"):
        load_cifar10(tmp_path)
    with open(tmp_path / "data_batch_2", "wb") as f:
        pickle.dump({b"labels": [0]}, f)
    with pytest.raises(DatasetFormatError, match="expected a dict with b'data'"):
        load_cifar10(tmp_path)


def test_python_batches_cannot_run_code(tmp_path, batches):
    write_python(tmp_path, batches)
    with open(tmp_path / "test_batch", "wb") as f:
        pickle.dump({b"data": print}, f)
    with pytest.raises(DatasetFormatError, match="refusing to load builtins.print"):
        load_cifar10(tmp_path)


def test_corrupt_binary_batches(tmp_path, batches):
    write_binary(tmp_path, batches)
    path = tmp_path / "test_batch.bin"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(DatasetFormatError, match="test_batch.bin: 15364 bytes is not a whole"):
        load_cifar10(tmp_path)
    bad = bytearray((tmp_path / "data_batch_1.bin").read_bytes())
    bad[0] = 12
    write_binary(tmp_path, batches)
    (tmp_path / "data_batch_1.bin").write_bytes(bytes(bad))
    with pytest.raises(DatasetFormatError,
                       match=r"data_batch_1.bin: labels must be in \[0, 10\), got \d+..12"):
        load_cifar10(tmp_path)


# ---- augmentation ----------------------------------------------------------------------------

def reference_crop_flip(x, draws, padding):
    """One image at a time: pad, crop, mirror."""
    out = np.empty_like(x)
    h, w = x.shape[2:]
    for i, image in enumerate(x):
        padded = np.pad(image, ((0, 0), (padding, padding), (padding, padding)))
        crop = padded[:, draws.top[i]:draws.top[i] + h, draws.left[i]:draws.left[i] + w]
        out[i] = crop[:, :, ::-1] if draws.flip[i] else crop
    return out


def test_flip_and_crop_semantics():
    x = np.arange(2 * 1 * 3 * 3, dtype=np.float32).reshape(2, 1, 3, 3) + 1
    draws = CropFlipDraws(np.array([1, 0]), np.array([1, 2]), np.array([True, False]))
    out = apply_crop_flip(x, draws, padding=1)
    np.testing.assert_array_equal(out[0, 0], x[0, 0, :, ::-1])          # centred: a pure flip
    np.testing.assert_array_equal(out[1, 0], [[0, 0, 0], [11, 12, 0], [14, 15, 0]])
    assert out.dtype == np.float32 and out.flags.c_contiguous


def test_matches_per_image_reference():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 3, 8, 6)).astype(np.float32)
    for padding in (0, 2, 4):
        draws = draw_crop_flip(3, 1, 2, len(x), padding)
        assert draws.top.max() <= 2 * padding and draws.left.min() >= 0
        np.testing.assert_array_equal(apply_crop_flip(x, draws, padding),
                                      reference_crop_flip(x, draws, padding))


def test_draws_are_a_pure_function_of_seed_epoch_batch():
    transform = RandomCropFlip(padding=4, seed=5)
    x = np.random.default_rng(2).standard_normal((64, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(transform(x, 2, 3), RandomCropFlip(4, seed=5)(x, 2, 3))
    others = [transform(x, 2, 4), transform(x, 3, 3), RandomCropFlip(4, seed=6)(x, 2, 3)]
    assert all(not np.array_equal(transform(x, 2, 3), other) for other in others)
    flips = draw_crop_flip(5, 0, 0, 4000, 4).flip
    assert 0.45 < flips.mean() < 0.55
    assert not draw_crop_flip(5, 0, 0, 100, 4, flip=False).flip.any()


def test_loader_applies_the_transform_per_batch():
    x = np.random.default_rng(3).standard_normal((10, 1, 4, 4)).astype(np.float32)
    transform = RandomCropFlip(padding=1, seed=0)
    for shuffle in (True, False):
        loader = BatchLoader(x, np.arange(10), 4, shuffle=shuffle, seed=2, transform=transform)
        plain = BatchLoader(x, np.arange(10), 4, shuffle=shuffle, seed=2)
        for i, ((xa, ya), (xp, yp)) in enumerate(zip(loader.epoch(1), plain.epoch(1))):
            np.testing.assert_array_equal(ya, yp)
            np.testing.assert_array_equal(xa, transform(xp, 1, i))
    np.testing.assert_array_equal(loader.x, x)      # the dataset itself is never rewritten


@pytest.mark.cuda
def test_cupy_path_matches_numpy():
    import cupy as cp

    x = np.random.default_rng(4).standard_normal((32, 3, 8, 8)).astype(np.float32)
    transform = RandomCropFlip(padding=4, seed=1)
    got = transform(cp.asarray(x), 0, 7)
    assert isinstance(got, cp.ndarray)
    np.testing.assert_array_equal(cp.asnumpy(got), transform(x, 0, 7))
