"""`stepgraph train --model resnet --data cifar10` on a tiny CIFAR-format directory (CPU)."""
from __future__ import annotations

import functools
import json
import pickle
import re

import numpy as np
import pytest

from stepgraph import models, optim
from stepgraph import train as train_module
from stepgraph.checkpoint import CHECKPOINT_NAME, CheckpointError, load_checkpoint
from stepgraph.cli import main
from stepgraph.data import RandomCropFlip, load_dataset
from stepgraph.train import TrainConfig, build_model, make_optimizer, train
from tests.helpers import run_interrupted

BATCHES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5",
           "test_batch")


@pytest.fixture
def fake_cifar(tmp_path):
    """64 train images (five batches) and 32 test images, python version, 32x32."""
    rng = np.random.default_rng(0)
    directory = tmp_path / "cifar" / "cifar-10-batches-py"
    directory.mkdir(parents=True)
    for name, n in zip(BATCHES, (13, 13, 13, 13, 12, 32)):
        record = {b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
                  b"labels": rng.integers(0, 10, size=n).tolist()}
        (directory / name).write_bytes(pickle.dumps(record))
    return tmp_path / "cifar"


def test_train_resnet_one_epoch(capsys, tmp_path, fake_cifar):
    out = tmp_path / "run"
    code = main(["train", "--model", "resnet", "--data", "cifar10", "--data-dir",
                 str(fake_cifar), "--epochs", "1", "--batch-size", "16", "--device", "cpu",
                 "--out", str(out), "--no-progress"])
    stdout, _ = capsys.readouterr()
    assert code == 0
    assert "resnet on cifar10 (64 train, 32 test samples)" in stdout
    assert re.fullmatch(r"test accuracy: [01]\.\d{4}", stdout.strip().splitlines()[-1])
    metrics = json.loads((out / "metrics.json").read_text())
    config = metrics["config"]
    assert (config["model"], config["batch_size"], config["lr"]) == ("resnet", 16, 0.4)
    assert len(metrics["epochs"]) == 1 and (out / "metrics.png").is_file()
    state = load_checkpoint(out / CHECKPOINT_NAME).state
    for key in ("conv1.weight", "layer3.0.downsample.1.running_var", "fc.bias",
                "layer2.0.bn2.num_batches_tracked", "optimizer.momentum_buffer.fc.weight"):
        assert key in state, key
    assert int(state["layer2.0.bn2.num_batches_tracked"]) == 4         # 64 images / 16
    # 4 steps: 1 of warmup, then cosine down to 0 at step 4
    np.testing.assert_allclose(state["optimizer.lr_schedule"], [0.4, 1, 4, 0, 0, 1])


def test_resnet_recipe():
    config = TrainConfig(model="resnet", data="cifar10", epochs=3)
    sgd = make_optimizer(config, steps_per_epoch=10)
    assert isinstance(sgd, optim.SGD) and sgd.nesterov and sgd.momentum == 0.9
    assert sgd.weight_decay == 5e-4 and sgd.lr == 0.4
    assert sgd.schedule == optim.WarmupCosine(6, 30)
    assert make_optimizer(TrainConfig(model="resnet", epochs=1), 1).schedule == optim.Constant()
    assert isinstance(make_optimizer(TrainConfig(model="mlp"), 10), optim.AdamW)
    assert TrainConfig(model="mlp").learning_rate == 1e-3
    defaults = TrainConfig(model="resnet", data="cifar10")
    assert (defaults.batch, defaults.total_epochs, defaults.learning_rate) == (512, 20, 0.4)


def test_resnet_takes_the_datasets_channels():
    spec = build_model("resnet", load_dataset("digits"))
    assert spec.layout == "image" and spec.loss.keywords == {"label_smoothing": 0.2}
    assert spec.module.state_dict()["conv1.weight"].shape == (64, 1, 3, 3)


def small_resnet(monkeypatch):
    """Build the resnet at small widths: the loop is the same, the steps cheaper."""
    monkeypatch.setattr(train_module.models, "resnet",
                        functools.partial(models.resnet, widths=(8, 16, 32)))


def test_resnet_resume_is_bitwise_identical(tmp_path, fake_cifar, monkeypatch):
    small_resnet(monkeypatch)
    config = functools.partial(TrainConfig, model="resnet", data="cifar10",
                               data_dir=str(fake_cifar), epochs=2, batch_size=16,
                               device="cpu", progress=False)
    straight = train(config(out=str(tmp_path / "straight")), log=lambda _: None)

    run_interrupted(monkeypatch, train_module, "train_epoch", lambda session, epoch: epoch == 1,
                    lambda: train(config(out=str(tmp_path / "split")), log=lambda _: None))
    with pytest.raises(CheckpointError, match="epochs: checkpoint 2, now 3"):
        train(config(out=str(tmp_path / "split"), epochs=3, resume=True), log=lambda _: None)
    resumed = train(config(out=str(tmp_path / "split"), resume=True), log=lambda _: None)

    expected, got = straight.step.state_dict(), resumed.step.state_dict()
    assert expected.keys() == got.keys() and "layer1.0.bn2.running_mean" in got
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert resumed.test_accuracy == straight.test_accuracy


def test_augmentation_is_on_for_cifar10_only(fake_cifar):
    config = TrainConfig(model="resnet", data="cifar10")
    dataset = load_dataset("cifar10", fake_cifar)
    transform = train_module.make_transform(config, build_model("resnet", dataset))
    assert transform == RandomCropFlip(padding=4, seed=0)
    digits = TrainConfig(model="resnet")
    assert train_module.make_transform(digits, build_model("resnet", dataset)) is None
