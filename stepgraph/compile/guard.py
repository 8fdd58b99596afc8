"""Guards: a bad batch (labels out of range, a NaN or Inf loss or gradient, a gradient whose
square overflows, which would leave Inf in Adam's exp_avg_sq) never changes the model or the
optimizer state, without a host sync per step.

In the graph (`emit_guard`, then the optimizer's `GraphGuard.emit_advance`):

    [guard_save(buffers)]                        first: state the forward updates in place
    forward, loss, backward -> guard_check(flags, loss, labels, grads)      one pass, no sync
    -> guard_advance(flags, counters, step, ...) -> lr                      step += 1 unless bad
    -> [guard_restore(flags, saved, buffers)]                               put back when bad
    -> update(..., flags)                                                   skipped when bad

On the host (`GuardMonitor`): policy "raise" keeps every later step from applying its update
once one was bad, until the host has reported it, so the parameters, optimizer state and step
counter stay exactly as they were before the bad step however late the host notices. It
notices at the next call when the device has finished the bad step by then (the CUDA kernel
posts the bad step's number to mapped host memory; the CPU backend is always finished), and
at the latest when a loss is read (which syncs anyway): that call or read raises LabelError
or NonFiniteError naming the step. Policy "skip" skips bad steps and counts them
(`step.skipped_steps`, read from the device when asked). Policy "ignore" emits nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import LabelError, NonFiniteError
from ..ir.graph import STATE, Graph, Node, Value
from ..ir.trace import Tracer
from ..ops.guard import (CALLS, FIRST_BAD, FIRST_BITS, GUARD_LABELS, N_COUNTERS, N_FLAGS,
                         SKIPPED, describe_bits, save_layout)
from ..ops.loss import IGNORE_INDEX
from .history import HISTORY_LENGTH, HISTORY_PREFIX

POLICIES = ("raise", "skip", "ignore")
GUARD_PREFIX = "guard."
FLAGS_KEY = GUARD_PREFIX + "flags"
COUNTERS_KEY = GUARD_PREFIX + "counters"
HISTORY_FLAG_KEY = HISTORY_PREFIX + "flag"
LABEL_OPS = ("cross_entropy", "cross_entropy_train", "nll_loss")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"on_bad_batch must be one of {POLICIES}, got {policy!r}")
    return policy


def label_check(graph: Graph, target: Value) -> tuple[int | None, int | None]:
    """(classes, ignore_index) of the first loss node reading `target` as class labels: a
    label must lie in [0, classes) or be ignore_index. (None, None) when no loss reads it so."""
    loss = next((n for n in graph.nodes if n.op in LABEL_OPS and n.inputs[1] is target), None)
    if loss is None:
        return None, None
    return loss.inputs[0].shape[-1], loss.attrs.get("ignore_index", IGNORE_INDEX)


@dataclass
class GraphGuard:
    """The guard's values in one step's graph, handed to the optimizer."""

    flags: Value
    counters: Value
    loss: Value
    sticky: bool
    buffers: list[Value]            # state the forward pass updates in place
    saved: Value | None             # guard_save's copy of them (None: there are none)
    offsets: tuple[int, ...] = ()

    def emit_advance(self, tracer: Tracer, step: Value, schedule: Value) -> Value:
        """guard_advance in place of step_increment + lr_schedule + record_loss (and
        guard_restore after it when the forward updates state): returns lr."""
        history_loss = tracer.state((HISTORY_LENGTH,), self.loss.dtype, HISTORY_PREFIX + "loss")
        history_step = tracer.state((HISTORY_LENGTH,), "int64", HISTORY_PREFIX + "step")
        history_flag = tracer.state((HISTORY_LENGTH,), "int32", HISTORY_FLAG_KEY)
        lr = tracer.emit("guard_advance", [self.flags, self.counters, step, schedule,
                                           self.loss, history_loss, history_step,
                                           history_flag], sticky=self.sticky)[0]
        if self.saved is not None:
            tracer.emit("guard_restore", [self.flags, self.saved] + self.buffers,
                        offsets=self.offsets)
        return lr


def _mutated_state(nodes: list[Node]) -> list[Value]:
    """State values the nodes so far (forward and backward) write in place, in order."""
    found = [n.inputs[i] for n in nodes for i in n.mutates if n.inputs[i].role == STATE]
    return list(dict.fromkeys(found))


def _emit_save_first(tracer: Tracer, buffers: list[Value]) -> tuple[Value, tuple[int, ...]]:
    """guard_save of `buffers`, placed before every node (the schedule is program order)."""
    offsets, nbytes = save_layout(buffers)
    saved = tracer.emit("guard_save", list(buffers), offsets=offsets, nbytes=nbytes)[0]
    tracer.graph.nodes.insert(0, tracer.graph.nodes.pop())
    return saved, offsets


def emit_guard(tracer: Tracer, policy: str, loss: Value, target: Value,
               grads: list[Value], loss_scaled: bool = False) -> GraphGuard | None:
    """guard_check over the labels (when a loss reads `target` as labels), the loss and every
    gradient, after the backward; None for policy "ignore". loss_scaled (GradScaler's skip,
    compile/loss_scale.py): as torch's found_inf, only the gradients decide, and the forward's
    in-place state (BatchNorm's running statistics) keeps this step's update, as in torch,
    where the forward ran before the skip was known."""
    if check_policy(policy) == "ignore":
        return None
    flags = tracer.state((N_FLAGS,), "int32", FLAGS_KEY)
    counters = tracer.state((N_COUNTERS,), "int64", COUNTERS_KEY)
    classes, ignore = label_check(tracer.graph, target)
    labels = [target] if classes is not None else []
    tracer.label = "guard"
    buffers = [] if loss_scaled else _mutated_state(tracer.graph.nodes)
    saved, offsets = _emit_save_first(tracer, buffers) if buffers else (None, ())
    checks = dict(check_loss=False) if loss_scaled else {}
    tracer.emit("guard_check", [flags, loss] + labels + list(grads), classes=classes,
                ignore_index=ignore, **checks)
    return GraphGuard(flags, counters, loss, policy == "raise", buffers, saved, offsets)


class GuardMonitor:
    """The host side of one train step's guard (see the module docstring)."""

    def __init__(self, backend, counters, policy: str, classes: int | None,
                 nonfinite_params=lambda: []):
        self.backend, self.counters, self.policy, self.classes = backend, counters, policy, classes
        # Names of the parameters holding NaN or Inf (asked only when an error is raised): a
        # model loaded with such values fails every step, and the error should say so.
        self.nonfinite_params = nonfinite_params
        # A host array the device updates without a sync (None: only syncs see the device).
        self.mirror = backend.host_mirror(counters)

    def check_call(self) -> None:
        """Raise the pending error if the host can already see one (no sync)."""
        if self.policy == "raise" and self.mirror is not None and self.mirror[FIRST_BAD]:
            self.raise_pending()

    def check_read(self) -> None:
        """After a sync (a loss was read): raise the pending error, if any. The mirror is
        exact once the device is idle, so a good step costs no second copy."""
        if self.policy != "raise":
            return
        if self.mirror is None or self.mirror[FIRST_BAD]:
            self.raise_pending()

    def raise_pending(self) -> None:
        """Raise LabelError / NonFiniteError for the first unreported bad step, if any (syncs),
        and clear it, so that training may go on from the state before that step."""
        if self.policy != "raise":
            return
        counters = self.backend.to_numpy(self.counters)
        first = int(counters[FIRST_BAD])
        if not first:
            return
        bits, held = int(counters[FIRST_BITS]), int(counters[CALLS]) - first
        counters[FIRST_BAD] = counters[FIRST_BITS] = 0
        self.backend.copy_into(self.counters, counters)
        if self.mirror is not None:
            self.mirror[FIRST_BAD] = 0
        raise bad_step_error(first, bits, held, self.classes, self.nonfinite_params())

    def skipped(self) -> int:
        return int(self.backend.to_numpy(self.counters)[SKIPPED])

    def calls(self) -> int:
        return int(self.backend.to_numpy(self.counters)[CALLS])

    def reset(self, calls: int) -> None:
        """A state was loaded: forget an unreported bad step, and number the calls from
        `calls` on (the loaded step counter), as an unguarded step numbers its losses."""
        counters = self.backend.to_numpy(self.counters)
        counters[FIRST_BAD] = counters[FIRST_BITS] = 0
        counters[CALLS] = calls
        self.backend.copy_into(self.counters, counters)
        if self.mirror is not None:
            self.mirror[FIRST_BAD] = 0


def bad_step_error(step: int, bits: int, held: int = 0, classes: int | None = None,
                   nonfinite_params: tuple | list = ()) -> LabelError | NonFiniteError:
    """The typed error of a bad step: LabelError when its labels were out of range (the cause
    of a NaN loss too), else NonFiniteError, which blames the parameters rather than the
    batch when some of them (`nonfinite_params`, by name) hold NaN or Inf."""
    cause = f"the batch gave {describe_bits(bits, classes)}"
    if nonfinite_params and not bits & GUARD_LABELS:
        names = ", ".join(nonfinite_params[:5]) + (", ..." if len(nonfinite_params) > 5 else "")
        cause = (f"the parameters hold NaN or Inf ({names}; loaded that way, e.g. by "
                 f"load_state_dict?), so every batch gives {describe_bits(bits, classes)}")
    message = (f"step {step}: {cause}; its update was not applied (parameters, optimizer "
               "state and step counter are as before it)")
    if held > 0:
        message += f", nor those of the {held} step(s) after it, run before this was reported"
    err = (LabelError if bits & GUARD_LABELS else NonFiniteError)(message)
    err.step = step
    return err

