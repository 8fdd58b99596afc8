"""Loss history: the graph itself records each step's loss in a device ring buffer.

A step returns a `LossHandle` (its step number and the ring) instead of copying the loss out,
so returning a loss costs the host nothing and `float(loss)` syncs only when it is read. A
handle stays readable for HISTORY_LENGTH steps; past that its slot holds a later step's loss
and reading it raises instead of returning the wrong number.
"""
from __future__ import annotations

from ..ir.graph import Value
from ..ir.trace import Tracer

HISTORY_LENGTH = 1024
HISTORY_PREFIX = "history."


def emit_record_loss(tracer: Tracer, loss: Value) -> None:
    history_loss = tracer.state((HISTORY_LENGTH,), loss.dtype, HISTORY_PREFIX + "loss")
    history_step = tracer.state((HISTORY_LENGTH,), "int64", HISTORY_PREFIX + "step")
    tracer.label = "loss history"
    tracer.emit("record_loss", [loss, tracer.rng_step(), history_loss, history_step])


class LossHandle:
    """The loss of one training step, still on the device."""

    __slots__ = ("step", "_loss", "_steps", "_to_numpy")

    def __init__(self, step: int, history_loss, history_step, to_numpy):
        self.step, self._loss, self._steps, self._to_numpy = step, history_loss, history_step, to_numpy

    def __float__(self) -> float:
        slot = self.step % HISTORY_LENGTH
        value = float(self._to_numpy(self._loss[slot:slot + 1])[0])
        recorded = int(self._to_numpy(self._steps[slot:slot + 1])[0])
        if recorded != self.step:
            raise RuntimeError(f"the loss of step {self.step} was overwritten by step {recorded}: "
                               f"read a loss within {HISTORY_LENGTH} steps of computing it")
        return value

    def item(self) -> float:
        return float(self)

    def __array__(self, dtype=None, copy=None):
        import numpy as np
        return np.asarray(float(self), dtype=dtype)

    def __format__(self, spec: str) -> str:
        return format(float(self), spec)

    def __repr__(self):
        return f"LossHandle(step={self.step}, loss={float(self):.6g})"
