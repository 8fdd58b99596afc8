"""An Executable is a Plan bound to memory on one backend: the fixed buffers of one feed
signature. It runs the plan op by op (eager) or, on a backend that can capture, records it
once as a CUDA graph and then replays it.

Policies per mode (DESIGN.md, "Roles and the graph cache"): every external has a fixed buffer
before capture; inputs are copied from the feed into theirs each call; params and state are
bound to buffers shared by every executable of a model and are never overwritten by a feed.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Any, Callable

from ..errors import CaptureError, PlanError
from ..ir.graph import INPUT, PARAM, STATE, Value
from .plan import Plan

TRAIN, INFERENCE = "train", "inference"
LOSS_OPS = ("cross_entropy", "cross_entropy_train", "nll_loss", "mse")
UPDATE_OPS = ("step_increment", "lr_schedule", "advance_step", "global_norm", "sgd_update",
              "adam_update", "rmsprop_update", "adagrad_update", "record_loss", "guard_check",
              "guard_advance", "guard_save", "guard_restore", "all_reduce_max", "update_join")
# Inference state: buffers (BatchNorm's running statistics), frozen parameters and the
# predictor's random counter (compile/build.py PREDICT_RNG_KEY), which its graph advances.
STATIC_ROLES = {TRAIN: (INPUT, PARAM, STATE), INFERENCE: (INPUT, PARAM, STATE)}
COPY_ROLES = {TRAIN: (INPUT,), INFERENCE: (INPUT,)}


@dataclass(frozen=True)
class GraphKey:
    """What a captured graph depends on: replaying it under any other key would be wrong."""
    mode: str
    plan_key: int
    static_roles: tuple[str, ...]
    copy_roles: tuple[str, ...]
    signature: tuple


def phase_of(node) -> str:
    """forward, loss, backward or optimizer: the NVTX range and profile group of a node."""
    if node.op in UPDATE_OPS:
        return "optimizer"
    if node.op in LOSS_OPS:
        return "loss"
    return "backward" if node.label.endswith(" bwd") else "forward"


class Executable:
    def __init__(self, plan: Plan, backend, bind: Callable[[Value], Any], ctx, mode: str,
                 key: GraphKey):
        self.plan, self.backend, self.ctx, self.mode, self.key = plan, backend, ctx, mode, key
        self.arena = backend.empty((max(plan.arena_bytes, 1),), "uint8")
        buffers: dict[Value, Any] = {}
        for v in plan.graph.inputs:
            buffers[v] = backend.empty(v.shape, v.dtype)
        for v in plan.graph.params + plan.graph.state:
            buffers[v] = bind(v)
        for v, slot in plan.slots.items():
            buffers[v] = backend.view(self.arena, slot.offset, v.shape, v.dtype)
        for v, root in plan.views.items():
            buffers[v] = self._alias(buffers, v, root)
        self.buffers = buffers
        self.input_buffers = [buffers[v] for v in plan.graph.inputs]
        self.outputs = {k: buffers[v] for k, v in plan.graph.outputs.items()}
        self.calls = [(n, [buffers[v] for v in n.inputs], [buffers[v] for v in n.outputs])
                      for i, n in enumerate(plan.steps) if plan.runs(i)]
        self.phases = [(phase, list(calls))
                       for phase, calls in groupby(self.calls, key=lambda c: phase_of(c[0]))]
        self.captured = None
        self.runs = 0
        self.replays: dict[int, StepsReplay] = {}   # by steps per launch
        backend.prepare([n for n, _, _ in self.calls], getattr(ctx, "precision", "fp32"),
                        self.calls, ctx)

    def _alias(self, buffers: dict, v: Value, root: Value):
        """The buffer of alias v: its root's whole buffer reshaped, or the range of the arena
        at the root's slot plus v's offset (compile/aliases.py)."""
        offset = self.plan.offsets.get(v, 0)
        if offset == 0 and v.nbytes == root.nbytes:
            return buffers[root].reshape(v.shape)
        slot = self.plan.slots.get(root)
        if slot is None:
            raise PlanError(f"alias {v!r} at offset {offset} of {root!r}, which has no slot "
                            "in the arena")
        return self.backend.view(self.arena, slot.offset + offset, v.shape, v.dtype)

    def _check_static(self) -> None:
        for v in self.plan.graph.externals:
            if v.role in STATIC_ROLES[self.mode] and self.buffers.get(v) is None:
                raise CaptureError(f"{v.role} {v.name!r} has no fixed buffer to capture")

    def feed(self, arrays) -> None:
        _copy_in(self.backend, self.input_buffers, arrays)

    def run_eager(self) -> None:
        run, annotate = self.backend.run_node, self.backend.annotate
        for phase, calls in self.phases:
            with annotate(phase):
                for node, ins, outs in calls:
                    with annotate(node.label or node.op):
                        run(node, ins, outs, self.ctx)

    def run(self, use_graph: bool) -> None:
        """One step. With use_graph, the first run is eager (warm-up: it plans GEMMs and
        builds device tables on the same buffers), the second captures, later ones replay."""
        self.launch(use_graph, self, self.run_eager)

    def launch(self, use_graph: bool, owner, body) -> None:
        """body() eagerly without a graph or on this plan's first run (its warm-up), else
        the graph of body captured once into owner.captured and replayed."""
        self.runs += 1
        if not use_graph or self.runs == 1:
            body()
            return
        if owner.captured is None:
            self._check_static()
            owner.captured = self.backend.capture(body, self.ctx)
        owner.captured.launch()

    def uncapture(self) -> None:
        """Drop the captured graph, keeping the warm-up done: the next run captures again.
        For runs made before the owner finished its setup (compile/layout_choice.py times
        steps inside TrainStep's constructor, before the guard's mailbox, whose address a
        capture records, exists)."""
        self.captured = None
        self.runs = min(self.runs, 1)

    def replay(self, steps: int) -> StepsReplay:
        """The cached StepsReplay of `steps` steps of this plan per launch."""
        replay = self.replays.get(steps)
        if replay is None:
            replay = self.replays[steps] = StepsReplay(self, steps)
        return replay


class StepsReplay:
    """`steps` steps of one Executable as one launch: the batches of all of them are staged
    in device buffers of shape (steps, *input shape) by one copy per input, and each step
    copies its slice into the Executable's input buffers (device-to-device) before running.
    Captured, that is one CUDA graph holding `steps` copies of the step, each preceded by one
    memcpy node per input. Every step runs exactly the launches of Executable.run_eager on the
    same buffers, so the trajectory is that of `steps` single steps, bit for bit."""

    def __init__(self, exe: Executable, steps: int):
        self.exe, self.steps = exe, steps
        self.stages = [exe.backend.empty((steps, *v.shape), v.dtype)
                       for v in exe.plan.graph.inputs]
        self.captured = None

    def feed(self, chunks) -> None:
        """Stage one launch's batches: `chunks[i]` of shape (steps, *input i's shape)."""
        _copy_in(self.exe.backend, self.stages, chunks)

    def run_steps(self) -> None:
        exe = self.exe
        for k in range(self.steps):
            for buf, stage in zip(exe.input_buffers, self.stages):
                exe.backend.copy_into(buf, stage[k])
            exe.run_eager()

    def run(self, use_graph: bool) -> None:
        """The staged steps. With use_graph: eagerly while the Executable has never run (its
        warm-up, as in Executable.run), else captured once and replayed."""
        self.exe.launch(use_graph, self, self.run_steps)


def _copy_in(backend, buffers, arrays) -> None:
    """Each array into its device buffer, the host arrays kept until the copies have read
    them."""
    for buf, a in zip(buffers, arrays):
        backend.copy_into(buf, a)
    backend.keep_until_read(arrays)
