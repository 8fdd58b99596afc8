"""Loss history: the graph itself records each step's loss in a device ring buffer.

A step returns a `LossHandle` (its step number and the ring) instead of copying the loss out,
so returning a loss costs the host nothing and `float(loss)` syncs only when it is read. A
handle stays readable for HISTORY_LENGTH steps; past that its slot holds a later step's loss
and reading it raises instead of returning the wrong number.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..ir.graph import Value
from ..ir.trace import Tracer
from ..ops.guard import describe_bits

HISTORY_LENGTH = 1024
HISTORY_PREFIX = "history."


def emit_record_loss(tracer: Tracer, loss: Value) -> None:
    history_loss = tracer.state((HISTORY_LENGTH,), loss.dtype, HISTORY_PREFIX + "loss")
    history_step = tracer.state((HISTORY_LENGTH,), "int64", HISTORY_PREFIX + "step")
    tracer.label = "loss history"
    tracer.emit("record_loss", [loss, tracer.rng_step(), history_loss, history_step])


class LossHandle:
    """The loss of one training step, still on the device. float(loss), loss.item(),
    np.asarray(loss) and sg.to_numpy(loss) read it (and sync); in a guarded step the read
    raises the error of an unreported bad step (compile/guard.py). `step` numbers the calls
    of the step object (the optimizer step when none was skipped; after load_state_dict the
    numbering goes on from the loaded step counter)."""

    __slots__ = ("step", "_loss", "_steps", "_to_numpy", "_flags", "_check")

    def __init__(self, step: int, history_loss, history_step, to_numpy, history_flag=None,
                 check: Callable[[], None] | None = None):
        self.step, self._loss, self._steps, self._to_numpy = step, history_loss, history_step, to_numpy
        self._flags, self._check = history_flag, check

    def _slot(self, ring) -> np.ndarray:
        """This step's entry of `ring` (a host copy), after checking it is still this step's."""
        slot = self.step % HISTORY_LENGTH
        value = self._to_numpy(ring[slot:slot + 1])
        recorded = int(self._to_numpy(self._steps[slot:slot + 1])[0])
        if recorded != self.step:
            raise RuntimeError(f"the loss of step {self.step} was overwritten by step {recorded}: "
                               f"read a loss within {HISTORY_LENGTH} steps of computing it")
        return value

    def numpy(self) -> np.ndarray:
        """The loss as a 0-d NumPy array of the loss's dtype."""
        value = self._slot(self._loss).reshape(())
        if self._check is not None:
            self._check()
        return value

    def __float__(self) -> float:
        return float(self.numpy())

    def item(self) -> float:
        return float(self)

    def __array__(self, dtype=None, copy=None):
        value = self.numpy()
        return value if dtype is None else value.astype(dtype)

    @property
    def skipped(self) -> bool:
        """Whether the guard skipped this step's update (always False without a guard)."""
        return self._flags is not None and bool(self._slot(self._flags)[0])

    @property
    def problem(self) -> str | None:
        """What the guard found wrong with this step's batch, in words; None when nothing."""
        if self._flags is None:
            return None
        bits = int(self._slot(self._flags)[0])
        return describe_bits(bits) if bits else None

    def __format__(self, spec: str) -> str:
        return format(float(self), spec)

    def __repr__(self):   # never raises, and leaves a pending guard error for the next read
        try:
            return f"LossHandle(step={self.step}, loss={float(self._slot(self._loss)[0]):.6g})"
        except Exception as err:  # overwritten, or the device is gone
            return f"LossHandle(step={self.step}, unreadable: {err})"
