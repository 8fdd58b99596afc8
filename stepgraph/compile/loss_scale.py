"""Dynamic loss scaling (torch.amp.GradScaler) inside a compiled step.

The scale and its growth counter are state of the step (the GradScaler's two Buffers, bound
by every step that uses the scaler), so nothing is a host constant and no step syncs:

    loss * scale  (the script's scaler.scale(loss), recorded like any script-level op)
    -> backward -> grads * (1 / scale)     unscale, before clipping and the update
    -> guard_check(grads only) -> guard_advance -> update (skipped on a non-finite gradient)
    -> loss_scale_update(flags, scale, tracker)   back off after a skip, grow after
                                                  growth_interval good steps

The skip is the guard's device-side select (compile/guard.py, policy "skip"); the update of
the scale is GradScaler.update's, run by the step itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ir.graph import Value
from ..ir.trace import Tracer
from .guard import GraphGuard


@dataclass(frozen=True)
class LossScaling:
    """A GradScaler as the step sees it: its scale (float32 ()) and growth counter (int32 ())
    Buffers, and how the scale moves."""

    scale: Any
    growth_tracker: Any
    growth_factor: float
    backoff_factor: float
    growth_interval: int

    @property
    def key(self) -> tuple:
        """What an Executable built with this scaling depends on."""
        return (id(self.scale), id(self.growth_tracker), self.growth_factor,
                self.backoff_factor, self.growth_interval)


def unscale_gradients(tracer: Tracer, scaling: LossScaling, grads: list[Value]) -> list[Value]:
    """Each gradient times 1 / scale (float32, as torch's unscale_: exact for the powers of
    two a scale normally is)."""
    scale = scaling.scale.traced(tracer).value
    inverse = tracer.emit("scalar", [scale], "loss scale", kind="rdiv", value=1.0)[0]
    return [tracer.emit("binary", [g, inverse], "loss scale", kind="mul")[0] for g in grads]


def emit_scale_update(tracer: Tracer, scaling: LossScaling, guard: GraphGuard) -> None:
    """loss_scale_update after the update (guard_advance has written the skip flag)."""
    tracer.emit("loss_scale_update", [guard.flags, scaling.scale.traced(tracer).value,
                                      scaling.growth_tracker.traced(tracer).value],
                "loss scale", growth_factor=float(scaling.growth_factor),
                backoff_factor=float(scaling.backoff_factor),
                growth_interval=int(scaling.growth_interval))
