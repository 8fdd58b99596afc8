"""Helpers shared by the unit and the cuda test folders."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]


def child_pythonpath() -> str:
    """PYTHONPATH for a process a test starts: this checkout first, then the caller's path,
    kept because it may name where the GPU packages live (the GPU machines install
    nvmath-python and cuDNN's frontend into a folder on PYTHONPATH)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


class Interrupt(Exception):
    """Stands for a run killed midway (resume tests)."""


def run_interrupted(monkeypatch, module, name: str, stops: Callable[..., bool],
                    run: Callable[[], object]) -> None:
    """Runs run() with module.<name> (a training loop's unit of work) raising Interrupt at the
    first call whose arguments `stops` accepts, as a run killed there would stop, its last
    checkpoint left behind; the real function is back in place afterwards."""
    real = getattr(module, name)

    def interrupted(*args):
        if stops(*args):
            raise Interrupt
        return real(*args)

    monkeypatch.setattr(module, name, interrupted)
    with pytest.raises(Interrupt):
        run()
    monkeypatch.setattr(module, name, real)
