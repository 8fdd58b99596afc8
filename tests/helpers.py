"""Helpers shared by the unit and the cuda test folders."""
from __future__ import annotations

from typing import Callable

import pytest


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
