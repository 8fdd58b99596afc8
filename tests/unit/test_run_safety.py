"""Runs that are never lost: an --out holding a run is refused, an edited checkpoint header is
refused, a resume that changes the run is refused, and every data or file error is one
`error:` line naming the file and what was kept (CPU, digits at a large batch)."""
from __future__ import annotations

import errno
import gzip
import json
import os
import struct

import numpy as np
import pytest

from stepgraph import checkpoint as ckpt
from stepgraph.checkpoint import CHECKPOINT_NAME, Checkpoint, CheckpointError
from stepgraph.cli import main

QUICK = ("--device", "cpu", "--no-progress", "--batch-size", "256")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def train(capsys, out, *argv):
    return run(capsys, "train", *QUICK, "--out", str(out), *argv)


@pytest.fixture
def one_epoch(capsys, tmp_path):
    """A finished one-epoch mlp run on digits."""
    out = tmp_path / "run"
    code, _, err = train(capsys, out, "--epochs", "1")
    assert code == 0, err
    return out


def test_an_out_holding_a_run_is_refused(capsys, one_epoch):
    before = (one_epoch / CHECKPOINT_NAME).read_bytes()
    code, out, err = train(capsys, one_epoch, "--epochs", "1")
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith(f"error: --out {one_epoch} already holds a run (checkpoint"
                          ".safetensors, metrics.json)")
    assert "--resume" in err and "--overwrite" in err
    assert (one_epoch / CHECKPOINT_NAME).read_bytes() == before
    code, _, err = train(capsys, one_epoch, "--epochs", "1", "--overwrite", "--seed", "1")
    assert code == 0, err
    assert ckpt.load_checkpoint(one_epoch / CHECKPOINT_NAME).config["seed"] == 1


def test_metrics_alone_are_a_run_too(capsys, tmp_path):
    (tmp_path / "metrics.json").write_text("{}")
    code, _, err = train(capsys, tmp_path, "--epochs", "1")
    assert code == 2 and "already holds a run (metrics.json)" in err


def test_resume_and_overwrite_exclude_each_other(capsys, tmp_path):
    code, _, err = train(capsys, tmp_path, "--resume", "--overwrite")
    assert code == 2 and "pass one of them" in err
    code, _, err = train(capsys, tmp_path, "--force")
    assert code == 2 and "--force applies to --resume only" in err


def test_resume_with_other_settings_lists_each_difference(capsys, one_epoch):
    code, _, err = train(capsys, one_epoch, "--epochs", "2", "--resume", "--precision", "bf16",
                         "--seed", "3")
    assert code == 2 and "Traceback" not in err
    assert "precision: checkpoint 'fp32', now 'bf16'" in err
    assert "seed: checkpoint 0, now 3" in err and "--force" in err
    code, _, err = run(capsys, "train", "--device", "cpu", "--no-progress", "--out",
                       str(one_epoch), "--epochs", "2", "--resume", "--lr", "0.01")
    assert code == 2 and "batch_size: checkpoint 256, now 32" in err
    assert "lr: checkpoint 0.001, now 0.01" in err
    # --force resumes anyway: the model's state still fits the step
    code, _, err = train(capsys, one_epoch, "--epochs", "2", "--resume", "--force", "--seed",
                         "3")
    assert code == 0, err
    assert err.startswith("warning: --force: resuming with settings that differ from the "
                          "checkpoint's: seed: checkpoint 0, now 3")
    saved = ckpt.load_checkpoint(one_epoch / CHECKPOINT_NAME)
    assert saved.epoch == 2 and saved.config["seed"] == 3


def _edit_header(path, edit) -> None:
    """Rewrite the safetensors JSON header of `path` through edit(header), data unchanged."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size:])


def _state():
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "optimizer.step": np.array(4)}


def test_an_edited_header_is_refused(tmp_path):
    path = ckpt.save_checkpoint(tmp_path / CHECKPOINT_NAME,
                                Checkpoint(_state(), 2, 0, {"lr": 0.001, "precision": "fp32"}))
    assert ckpt.load_checkpoint(path).config["lr"] == 0.001

    def lower_lr(header):
        config = json.loads(header["__metadata__"][ckpt.CONFIG_METADATA_KEY])
        config["lr"] = 0.0001
        header["__metadata__"][ckpt.CONFIG_METADATA_KEY] = json.dumps(config, sort_keys=True)

    _edit_header(path, lower_lr)
    with pytest.raises(CheckpointError, match="header .*SHA-256") as info:
        ckpt.load_checkpoint(path)
    assert str(path) in str(info.value)


def test_checkpoints_with_a_tensor_only_digest_still_load(tmp_path):
    """Checkpoints written before the header was covered: their SHA-256 is of the tensors."""
    path = ckpt.save_checkpoint(tmp_path / CHECKPOINT_NAME, Checkpoint(_state(), 2, 0))

    from safetensors.numpy import load_file

    digest = ckpt.tensors_digest(load_file(str(path)))

    def old_format(header):
        meta = header["__metadata__"]
        del meta[ckpt.CHECKSUM_METADATA_KEY]
        meta[ckpt.DIGEST_METADATA_KEY] = digest

    _edit_header(path, old_format)
    assert ckpt.load_checkpoint(path).epoch == 2
    _edit_header(path, lambda header: header["__metadata__"].pop(ckpt.DIGEST_METADATA_KEY))
    with pytest.raises(CheckpointError, match="carries no SHA-256"):
        ckpt.load_checkpoint(path)


def test_a_truncated_mnist_gz_is_an_error_line(capsys, tmp_path, fake_mnist):
    directory, _ = fake_mnist
    images = directory / "train-images-idx3-ubyte.gz"
    images.write_bytes(images.read_bytes()[:200])
    code, out, err = run(capsys, "train", "--data", "mnist", "--data-dir", str(directory),
                         "--device", "cpu", "--out", str(tmp_path / "run"))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: {images}: truncated or corrupt gzip file")
    assert not (tmp_path / "run").exists()


def test_a_corrupt_gz_is_an_error_too(tmp_path):
    from stepgraph.data import DatasetFormatError, read_idx

    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(b"\0" * 64)[:10] + b"garbage" * 8)
    with pytest.raises(DatasetFormatError, match="truncated or corrupt gzip"):
        read_idx(path)


def test_a_corrupt_metrics_file_is_kept_aside_and_the_run_resumes(capsys, one_epoch):
    (one_epoch / "metrics.json").write_text('{"epochs": [{"epoch": 1, "lo')
    code, out, err = train(capsys, one_epoch, "--epochs", "2", "--resume")
    assert code == 0, err
    assert err.startswith(f"warning: {one_epoch / 'metrics.json'} cannot be read")
    assert "kept it as metrics.json.unreadable" in err
    assert (one_epoch / "metrics.json.unreadable").read_text().endswith('"lo')
    metrics = json.loads((one_epoch / "metrics.json").read_text())
    assert [e["epoch"] for e in metrics["epochs"]] == [2]
    assert ckpt.load_checkpoint(one_epoch / CHECKPOINT_NAME).epoch == 2
    # a second unreadable file does not replace the first one kept
    (one_epoch / "metrics.json").write_text("[1, 2]")
    code, _, err = train(capsys, one_epoch, "--epochs", "3", "--resume")
    assert code == 0 and "kept it as metrics.json.unreadable-1" in err


def _fail_fsync(monkeypatch, code, message):
    def fsync(fd):
        raise OSError(code, message)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_failed_checkpoint_write_names_the_file_and_keeps_the_last(capsys, monkeypatch,
                                                                     one_epoch):
    good = (one_epoch / CHECKPOINT_NAME).read_bytes()
    _fail_fsync(monkeypatch, errno.EFBIG, "File too large")
    code, _, err = train(capsys, one_epoch, "--epochs", "2", "--resume")
    assert code == 2 and "Traceback" not in err
    assert err.strip() == (f"error: cannot write the checkpoint after epoch 2 to "
                           f"{one_epoch / CHECKPOINT_NAME}: File too large; the previous "
                           "checkpoint there is kept")
    assert (one_epoch / CHECKPOINT_NAME).read_bytes() == good
    assert not [p.name for p in one_epoch.iterdir() if p.name.endswith(".tmp")]


def test_a_first_write_failing_leaves_no_file(capsys, monkeypatch, tmp_path):
    _fail_fsync(monkeypatch, errno.ENOSPC, "No space left on device")
    code, _, err = train(capsys, tmp_path, "--epochs", "1")
    assert code == 2 and "No space left on device; none was written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_an_out_that_is_a_file_is_refused(capsys, tmp_path):
    path = tmp_path / "taken"
    path.write_text("keep me")
    code, _, err = train(capsys, path, "--epochs", "1")
    assert code == 2 and err.strip() == (f"error: --out {path} is a file, not a directory; "
                                         "nothing was written")
    assert path.read_text() == "keep me"


def test_an_out_that_cannot_be_made_is_an_error_line(capsys, tmp_path):
    (tmp_path / "file").write_text("keep me")
    out = tmp_path / "file" / "run"
    code, _, err = train(capsys, out, "--epochs", "1")
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"error: cannot create --out {out}: ") and "nothing was written" in err
    assert (tmp_path / "file").read_text() == "keep me"


def test_a_corrupt_checkpoint_is_not_resumed_and_kept(capsys, one_epoch):
    path = one_epoch / CHECKPOINT_NAME
    path.write_bytes(path.read_bytes()[:100])
    code, _, err = train(capsys, one_epoch, "--epochs", "2", "--resume")
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"error: cannot read checkpoint {path} (truncated")
    assert f"nothing in {one_epoch} was changed" in err and len(path.read_bytes()) == 100
