"""The `stepgraph` command line: argument handling, error reporting, exit codes."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from stepgraph.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_exits_zero(capsys):
    code, out, _ = run(capsys, "train", "--help")
    assert code == 0
    for flag in ("--model", "--data", "--data-dir", "--epochs", "--batch-size", "--lr",
                 "--device", "--seed", "--out", "--resume"):
        assert flag in out


def test_no_command_and_bad_usage_exit_two(capsys):
    assert run(capsys, )[0] == 2
    code, _, err = run(capsys, "train", "--model", "vgg")
    assert code == 2 and "invalid choice" in err


def test_invalid_values_are_reported_as_errors(capsys, tmp_path):
    code, _, err = run(capsys, "train", "--epochs", "0", "--out", str(tmp_path))
    assert code == 2 and err.strip() == "error: --epochs must be >= 1, got 0"
    code, _, err = run(capsys, "train", "--lr", "-1", "--out", str(tmp_path))
    assert code == 2 and err.startswith("error: --lr must be a positive number")


def test_missing_mnist_names_files_and_directory(capsys, tmp_path):
    code, _, err = run(capsys, "train", "--data", "mnist", "--data-dir", str(tmp_path / "none"),
                       "--device", "cpu")
    assert code == 2 and err.startswith("error: MNIST files missing: train-images-idx3-ubyte")
    assert str(tmp_path / "none") in err


def test_resume_without_checkpoint(capsys, tmp_path):
    code, _, err = run(capsys, "train", "--device", "cpu", "--out", str(tmp_path), "--resume")
    assert code == 2 and err.startswith("error: no checkpoint at")


def test_cuda_request_without_gpu_is_an_error(capsys, tmp_path):
    import stepgraph as sg

    if sg.cuda_available():
        pytest.skip("this machine has a GPU")
    code, _, err = run(capsys, "train", "--device", "cuda", "--out", str(tmp_path))
    assert code == 2 and err.startswith("error: --device cuda: no usable GPU")


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_train_mnist_files_end_to_end(capsys, tmp_path, fake_mnist, model):
    directory, _ = fake_mnist
    out = tmp_path / "run"
    code, stdout, _ = run(capsys, "train", "--data", "mnist", "--data-dir", str(directory),
                          "--model", model, "--epochs", "2", "--device", "cpu",
                          "--out", str(out), "--no-progress")
    assert code == 0
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"test accuracy: [01]\.\d{4}", last)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["device"] == "cpu" and len(metrics["epochs"]) == 2
    assert metrics["config"]["model"] == model and metrics["config"]["batch_size"] == 64
    assert float(last.split(": ")[1]) == pytest.approx(metrics["test_accuracy"], abs=5e-5)
    assert (out / "checkpoint.safetensors").is_file() and (out / "metrics.png").is_file()


def test_bench_and_profile_are_subcommands(capsys):
    import stepgraph as sg

    code, out, _ = run(capsys, "bench", "--help")
    assert code == 0 and "--workloads" in out
    code, out, _ = run(capsys, "profile", "--help")
    assert code == 0 and "--workload" in out
    if not sg.cuda_available():
        assert run(capsys, "profile")[0] == 2


def test_python_dash_m_runs_the_cli():
    result = subprocess.run([sys.executable, "-m", "stepgraph", "train", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--resume" in result.stdout
