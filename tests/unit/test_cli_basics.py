"""`stepgraph --version`, and `make train` with TRAIN_ARGS run twice in a row."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stepgraph import __version__
from stepgraph.cli import main

ROOT = Path(__file__).parents[2]


def test_version_flag(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"stepgraph {__version__}"


def test_python_dash_m_version():
    result = subprocess.run([sys.executable, "-m", "stepgraph", "--version"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == f"stepgraph {__version__}"


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def make_venv(tmp_path: Path) -> Path:
    """A stand-in for the Makefile's .venv: this interpreter, `stepgraph` running this tree,
    and a fresh install stamp so that make installs nothing."""
    venv = tmp_path / "venv"
    if venv.exists():
        return venv
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    cli = venv / "bin" / "stepgraph"
    cli.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m stepgraph "$@"\n')
    cli.chmod(0o755)
    (venv / ".stamp-train").touch()
    return venv


def make_train_command(tmp_path: Path, *args: str) -> str:
    """The `stepgraph train` line `make train` would run (make -n)."""
    result = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(ROOT),
                             f"VENV={make_venv(tmp_path)}", "train", *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if "stepgraph train" in line][-1]


@needs_make
def test_make_train_keeps_overwrite_whatever_train_args(tmp_path):
    assert make_train_command(tmp_path).split()[-1] == "--overwrite"
    line = make_train_command(tmp_path, "TRAIN_ARGS=--model cnn --epochs 1")
    assert line.split()[-5:] == ["--overwrite", "--model", "cnn", "--epochs", "1"]
    # --resume and --overwrite exclude each other: a resume continues the run instead
    line = make_train_command(tmp_path, "TRAIN_ARGS=--resume --epochs 3")
    assert "--overwrite" not in line and line.split()[-3:] == ["--resume", "--epochs", "3"]


@needs_make
def test_make_train_with_train_args_runs_twice(tmp_path):
    venv = make_venv(tmp_path)
    args = f"--model cnn --epochs 1 --device cpu --no-progress --out {tmp_path / 'run'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for attempt in (1, 2):
        result = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT),
                                 f"VENV={venv}", "train", f"TRAIN_ARGS={args}"],
                                capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, (attempt, result.stderr[-2000:])
        assert result.stdout.strip().splitlines()[-1].startswith("test accuracy: ")
