"""The optimizer base: appends the update of every parameter to the step's graph as ops.

Per step: step_increment, lr_schedule, (global_norm when clipping), then ONE multi-tensor
update op over every parameter. The step counter, the LR schedule and the per-parameter
slots (momentum, Adam moments) are graph state living in device memory.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..ir.graph import Value
from ..ir.trace import Tracer
from .schedules import SCHEDULE_SLOTS, Constant

SCHEDULE_KEY = "optimizer.lr_schedule"
STEP_KEY = "optimizer.step"


class Optimizer:
    update_op = ""
    slot_names: tuple[str, ...] = ()

    def __init__(self, lr: float, schedule=None, max_grad_norm: float | None = None):
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        self._lr = float(lr)
        self._schedule = schedule or Constant()
        self.max_grad_norm = max_grad_norm
        # Compiled steps register a writer for the schedule vector in their device memory.
        self._schedule_sinks: list[Callable[[np.ndarray], None]] = []

    # ---- Python-side knobs: they write device memory, never re-capture ----
    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = float(value)
        self._publish()

    @property
    def schedule(self):
        return self._schedule

    @schedule.setter
    def schedule(self, value) -> None:
        self._schedule = value or Constant()
        self._publish()

    def schedule_vector(self) -> np.ndarray:
        vec = self._schedule.vector(self._lr)
        assert vec.shape == (SCHEDULE_SLOTS,)
        return vec

    def _publish(self) -> None:
        for sink in self._schedule_sinks:
            sink(self.schedule_vector())

    def attach(self, sink: Callable[[np.ndarray], None]) -> None:
        self._schedule_sinks.append(sink)

    # ---- graph emission ----
    def hyperparameters(self) -> dict:
        raise NotImplementedError

    def slots_for(self) -> tuple[str, ...]:
        return self.slot_names

    def emit(self, tracer: Tracer, params: list[Value], grads: list[Value]) -> None:
        tracer.label = f"{type(self).__name__} update"
        step = tracer.rng_step()
        schedule = tracer.state((SCHEDULE_SLOTS,), "float32", SCHEDULE_KEY)
        tracer.emit("step_increment", [step])
        lr = tracer.emit("lr_schedule", [step, schedule])[0]
        scalars = [lr, step]
        if self.max_grad_norm is not None:
            scalars.append(tracer.emit("global_norm", grads)[0])
        slots = [tracer.state(p.shape, p.dtype, f"optimizer.{slot}.{p.name}")
                 for slot in self.slots_for() for p in params]
        tracer.emit(self.update_op, scalars + params + grads + slots, n_params=len(params),
                    n_scalars=len(scalars), n_slots=len(self.slots_for()),
                    max_norm=self.max_grad_norm, **self.hyperparameters())

    def initial_state(self, value: Value) -> np.ndarray:
        """The value a state buffer starts from."""
        if value.name == SCHEDULE_KEY:
            return self.schedule_vector()
        return np.zeros(value.shape, dtype=value.dtype)

    def __repr__(self):
        hp = ", ".join(f"{k}={v}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}(lr={self.lr}, {hp})"
