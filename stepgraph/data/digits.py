"""The scikit-learn digits dataset: 1,797 8x8 grey images of 0-9, bundled (no download)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DIGITS_SPLIT_SEED = 0
DIGITS_TEST_FRACTION = 0.2


@dataclass(frozen=True)
class Dataset:
    """A labelled image dataset split into train and test.

    Images are float32 with shape (N, C, H, W), in [0, 1] (digits, MNIST) or standardised per
    channel (CIFAR-10); labels are int64 in [0, classes).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: int = 10

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of one image."""
        return tuple(self.x_train.shape[1:])

    @property
    def features(self) -> int:
        """Number of values in one flattened image."""
        return int(np.prod(self.image_shape))


def load_digits(seed: int = DIGITS_SPLIT_SEED,
                test_fraction: float = DIGITS_TEST_FRACTION) -> Dataset:
    """The digits dataset, split stratified by class with a fixed seed (80/20 by default)."""
    from sklearn.datasets import load_digits as sklearn_load_digits
    from sklearn.model_selection import train_test_split

    bunch = sklearn_load_digits()
    # Pixel values are integers 0..16.
    images = (bunch.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = bunch.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels)
    return Dataset("digits", np.ascontiguousarray(x_train), y_train,
                   np.ascontiguousarray(x_test), y_test)
