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


# ---- atomic writes, corrupt files, versions and signatures ---------------------------------

def test_a_failed_write_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    import os

    path = save_checkpoint(tmp_path / CHECKPOINT_NAME, Checkpoint(_state(), 1, 0))
    good = path.read_bytes()
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))

    def crash(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(path, Checkpoint(_state(), 2, 0))
    assert synced                                   # the data was flushed before the rename
    assert path.read_bytes() == good and load_checkpoint(path).epoch == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_NAME]   # no temp file


def _corrupt(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[:len(data) // 2]))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "bit-flip":                         # in the last tensor's bytes
        data[-3] ^= 0x40
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, words", [("truncated", "truncated"), ("empty", "empty"),
                                        ("bit-flip", "SHA-256")])
def test_corrupt_checkpoints_are_refused_naming_file_and_fault(tmp_path, how, words):
    path = save_checkpoint(tmp_path / CHECKPOINT_NAME, Checkpoint(_state(), 3, 1))
    _corrupt(path, how)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value) and words in str(info.value)


def test_non_finite_state_is_never_written(tmp_path):
    path = save_checkpoint(tmp_path / CHECKPOINT_NAME, Checkpoint(_state(), 1, 0))
    good = path.read_bytes()
    state = _state()
    state["0.bias"][2] = np.nan
    state["optimizer.exp_avg.0.weight"] = np.full((4, 3), np.inf, np.float32)
    with pytest.raises(CheckpointError, match="NaN or Inf in 0.bias, optimizer.exp_avg"):
        save_checkpoint(path, Checkpoint(state, 2, 0))
    assert path.read_bytes() == good
    save_checkpoint(tmp_path / "debug.safetensors", Checkpoint(state, 2, 0),
                    allow_non_finite=True)


def test_version_and_signature_are_recorded(tmp_path):
    import stepgraph as sg

    signature = {"modules": ["(root): Sequential"], "state": {"w": [[2], "float32"]},
                 "optimizer": {"type": "SGD"}, "loss": "stepgraph.losses.mse"}
    path = save_checkpoint(tmp_path / CHECKPOINT_NAME,
                           Checkpoint(_state(), 1, 0, signature=signature))
    loaded = load_checkpoint(path)
    assert loaded.version == sg.__version__ and loaded.signature == signature


def _step_for(hidden: int, opt):
    import stepgraph as sg
    from stepgraph import losses, nn

    nn.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    x, y = np.ones((4, 3), np.float32), np.array([0, 1, 0, 1])
    return sg.compile_train_step(model, losses.cross_entropy, opt, (x, y))


def test_signature_mismatch_explains_what_differs(tmp_path):
    from stepgraph import optim
    from stepgraph.checkpoint import (check_signature, signature_differences,
                                      signature_digest, step_signature)

    a, b = _step_for(8, optim.AdamW(lr=0.01)), _step_for(16, optim.SGD(lr=0.01))
    sig_a, sig_b = step_signature(a), step_signature(b)
    assert sig_a == step_signature(_step_for(8, optim.AdamW(lr=0.5)))   # the LR may change
    assert signature_digest(sig_a) != signature_digest(sig_b)
    diffs = signature_differences(sig_a, sig_b)
    text = "; ".join(diffs)
    assert "0.weight checkpoint (8, 3) float32, now (16, 3) float32" in text
    assert "optimizer.exp_avg" in text and "optimizer:" in text
    path = save_checkpoint(tmp_path / CHECKPOINT_NAME,
                           Checkpoint(a.state_dict(), 1, 0, signature=sig_a))
    saved = load_checkpoint(path)
    with pytest.raises(CheckpointError, match="different step.*0.weight"):
        check_signature(saved, sig_b, path)
    check_signature(saved, sig_a, path)
    saved.signature = None                      # checkpoints written before signatures
    check_signature(saved, sig_b, path)
