"""`stepgraph train --precision bf16`: image models and the GPT train with the bf16 emulation on
the CPU; tf32 still needs a GPU."""
from __future__ import annotations

import json
import re

from stepgraph.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_train_mlp_in_bf16_on_the_cpu(capsys, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = run(capsys, "train", "--precision", "bf16", "--epochs", "1",
                            "--device", "cpu", "--out", str(out), "--no-progress")
    assert code == 0, err
    assert re.fullmatch(r"test accuracy: [01]\.\d{4}", stdout.strip().splitlines()[-1])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["precision"] == "bf16"


def test_train_gpt_in_bf16_on_the_cpu(capsys, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60, encoding="utf-8")
    code, stdout, err = run(capsys, "train", "--model", "gpt", "--text-file", str(text),
                            "--precision", "bf16", "--steps", "2", "--eval-interval", "2",
                            "--batch-size", "4", "--block-size", "16", "--n-layer", "1",
                            "--n-head", "2", "--n-embd", "16", "--device", "cpu",
                            "--out", str(tmp_path / "gpt"), "--no-progress")
    assert code == 0, err
    assert re.fullmatch(r"validation loss: \d+\.\d{4}", stdout.strip().splitlines()[-1])


def test_tf32_on_the_cpu_is_refused_for_image_models(capsys, tmp_path):
    code, _, err = run(capsys, "train", "--precision", "tf32", "--device", "cpu",
                       "--out", str(tmp_path))
    assert code == 2 and "--precision tf32 needs a GPU" in err
