"""clip_grad_norm_ and clip_grad_value_ as a training script calls them, between
loss.backward() and optimizer.step(): they set how the next compiled step clips (the global
norm inside the multi-tensor update, as compile_train_step(max_grad_norm=) does; a clamp of
every gradient before it), since gradients exist only inside that step."""
from __future__ import annotations

import math

from ...errors import CaptureError, UnsupportedOpError
from ...ir.graph import Value
from ...ir.trace import Tensor  # noqa: F401 - the returned type
from ...loop import hooks          # imports nothing: no cycle

# The value of the clipped norm: an output of the step beside the passes' programs, kept per
# pass (Pass.kept), so one Value serves every iteration.
NORM = Value((), "float32")


def _pending_pass(name: str):
    session = hooks.SESSION
    if session is None or not session.pending:
        raise CaptureError(f"torch.nn.utils.{name} between loss.backward() and "
                           "optimizer.step() clips that step's gradients: call backward() first")
    return session


def _check_all_trained(session, parameters, name: str) -> None:
    given = {id(p) for p in ([parameters] if not hasattr(parameters, "__iter__")
                             else parameters)}
    if not given >= session.trained_used():
        raise UnsupportedOpError(
            f"torch.nn.utils.{name} over a part of the optimizer's parameters is not supported "
            "by stepgraph (the clip is one step-wide operation): pass every trained "
            "parameter, e.g. model.parameters()")


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach=None) -> Tensor:
    """Scale the gradients by min(1, max_norm / (norm + 1e-6)) as torch's; returns the total
    norm (readable after optimizer.step()). norm_type 2 only."""
    session = _pending_pass("clip_grad_norm_")
    if float(norm_type) != 2.0:
        raise UnsupportedOpError(f"clip_grad_norm_(norm_type={norm_type}) is not supported by "
                                 "stepgraph: the step clips by the global 2-norm")
    if error_if_nonfinite:
        raise UnsupportedOpError("clip_grad_norm_(error_if_nonfinite=True) is not supported "
                                 "by stepgraph: a step checks without a host sync; use "
                                 "torch.amp.GradScaler to skip non-finite steps")
    if not (max_norm > 0 and math.isfinite(max_norm)):
        raise ValueError(f"max_norm must be a positive finite number, got {max_norm}")
    _check_all_trained(session, parameters, "clip_grad_norm_")
    last = session.pending[-1]
    session.clip = ("norm", float(max_norm), NORM)
    return last.extra_tensor(NORM)


def clip_grad_value_(parameters, clip_value: float, foreach=None) -> None:
    """Clamp every gradient element to [-clip_value, clip_value] before the update."""
    session = _pending_pass("clip_grad_value_")
    _check_all_trained(session, parameters, "clip_grad_value_")
    session.clip = ("value", float(clip_value), None)
