"""Checkpoint files: round trip, integrity checks, resume compatibility (no training here)."""
from __future__ import annotations

import numpy as np
import pytest

from stepgraph.checkpoint import (CHECKPOINT_NAME, Checkpoint, CheckpointError, check_compatible,
                                  load_checkpoint, save_checkpoint)


def _state():
    rng = np.random.default_rng(0)
    return {
        "0.weight": rng.standard_normal((4, 3)).astype(np.float32),
        "0.bias": rng.standard_normal(4).astype(np.float32),
        "optimizer.exp_avg.0.weight": rng.standard_normal((3, 4)).astype(np.float32).T,
        "optimizer.step": np.array(17, dtype=np.int64),          # 0-d stays 0-d
        "optimizer.lr_schedule": np.array([1e-3, 0.0], dtype=np.float32),
    }


def test_round_trip_is_exact(tmp_path):
    state = _state()
    config = {"model": "mlp", "lr": 0.001, "seed": 3}
    path = save_checkpoint(tmp_path / "run" / CHECKPOINT_NAME, Checkpoint(state, 5, 3, config))
    loaded = load_checkpoint(path)
    assert loaded.epoch == 5 and loaded.data_seed == 3 and loaded.config == config
    assert loaded.state.keys() == state.keys()
    for key, value in state.items():
        assert loaded.state[key].shape == value.shape and loaded.state[key].dtype == value.dtype
        np.testing.assert_array_equal(loaded.state[key], value)
    assert not list(path.parent.glob("*.tmp"))


def test_overwrite_replaces_the_file(tmp_path):
    path = tmp_path / CHECKPOINT_NAME
    save_checkpoint(path, Checkpoint(_state(), 1, 0))
    save_checkpoint(path, Checkpoint(_state(), 2, 0))
    assert load_checkpoint(path).epoch == 2


def test_loop_keys_may_not_clash(tmp_path):
    with pytest.raises(CheckpointError, match="train.epoch"):
        save_checkpoint(tmp_path / "c", Checkpoint({"train.epoch": np.zeros(1)}, 1, 0))


def test_missing_and_foreign_files(tmp_path):
    from safetensors.numpy import save_file

    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nothing.safetensors")
    foreign = tmp_path / "weights.safetensors"
    save_file({"w": np.zeros(2, np.float32)}, str(foreign))
    with pytest.raises(CheckpointError, match="not a training checkpoint"):
        load_checkpoint(foreign)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(garbage)


def test_check_compatible_names_every_difference():
    saved = {"model": "mlp", "data": "digits", "lr": 0.001, "epochs": 3}
    check_compatible(saved, {**saved, "epochs": 9}, ("model", "data", "lr"))
    with pytest.raises(CheckpointError, match="model: checkpoint 'mlp', now 'cnn'.*lr"):
        check_compatible(saved, {**saved, "model": "cnn", "lr": 0.1}, ("model", "data", "lr"))
