"""End-to-end training on the bundled digits dataset, on the CPU.

Acceptance: the default `stepgraph train` (digits, mlp) reaches test accuracy >= 0.95, and a run
resumed from a checkpoint ends with bit-identical state to an uninterrupted run.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from stepgraph.checkpoint import CHECKPOINT_NAME, CheckpointError, load_checkpoint
from stepgraph.train import TrainConfig, train


def quiet(line: str) -> None:
    """Swallow the loop's log lines."""


def config(tmp_path, name: str, **kw) -> TrainConfig:
    return TrainConfig(device="cpu", out=str(tmp_path / name), progress=False, **kw)


def test_default_mlp_reaches_95_percent(tmp_path):
    result = train(config(tmp_path, "mlp"), log=quiet)
    assert result.test_accuracy >= 0.95
    assert len(result.history) == 20 and result.device == "cpu"
    first, last = result.history[0], result.history[-1]
    assert last.loss < first.loss and last.train_accuracy > first.train_accuracy

    metrics = json.loads((result.out_dir / "metrics.json").read_text())
    assert metrics["test_accuracy"] == result.test_accuracy
    assert metrics["config"]["epochs"] == 20 and metrics["config"]["batch_size"] == 32
    assert [e["epoch"] for e in metrics["epochs"]] == list(range(1, 21))
    assert all(e["steps_per_s"] > 0 for e in metrics["epochs"])
    assert (result.out_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    saved = load_checkpoint(result.out_dir / CHECKPOINT_NAME)
    assert saved.epoch == 20 and saved.config["model"] == "mlp"
    assert {"0.weight", "0.bias", "3.weight", "3.bias", "optimizer.step"} <= saved.state.keys()
    np.testing.assert_array_equal(saved.state["0.weight"], result.model.state_dict()["0.weight"])


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_resume_is_bitwise_identical(tmp_path, model):
    straight = train(config(tmp_path, "straight", model=model, epochs=2), log=quiet)
    train(config(tmp_path, "split", model=model, epochs=1), log=quiet)
    resumed = train(config(tmp_path, "split", model=model, epochs=2, resume=True), log=quiet)

    expected, got = straight.step.state_dict(), resumed.step.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert [m.epoch for m in resumed.history] == [1, 2]
    assert resumed.test_accuracy == straight.test_accuracy
    assert straight.history[1].loss < straight.history[0].loss


def test_resume_refuses_a_different_run(tmp_path):
    train(config(tmp_path, "run", epochs=1), log=quiet)
    with pytest.raises(CheckpointError, match="lr: checkpoint 0.001, now 0.01"):
        train(config(tmp_path, "run", epochs=2, lr=0.01, resume=True), log=quiet)

