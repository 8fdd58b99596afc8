"""Optimizer state across the LoopSteps of one optimizer (loop/session.py).

A training script that changes which parameters train (requires_grad_ on a layer between
iterations, or a precision change) gets another LoopStep, with state buffers of its own. In
torch the optimizer's state is per parameter and survives such a change: the parameters trained
before and after keep their momentum or Adam moments, a frozen one keeps its state untouched
until it trains again, and one trained for the first time starts afresh. `StateCarry` keeps
that: whenever the script moves from one LoopStep of an optimizer to another (a new one, or
one met before), the step it moves to takes the latest value of each optimizer state buffer
it has (the step counter, the per-parameter slots) from the step that holds it.

torch counts steps per parameter too (Adam's bias corrections, SGD's first momentum step,
Adagrad's lr decay read it). The steps share one device counter, so each step keeps, per
parameter, the steps it missed (TrainStep.step_offsets, the hyperparameters' step_offset
column): a parameter frozen for three steps resumes at its own count, one trained from step 7
on starts at its own step 1. The counts are read when the script moves (one host sync per
change of the trainable set, none per step).
"""
from __future__ import annotations

from ..optim.optimizer import HYPERPARAMETERS_KEY, SCHEDULE_KEY, SLOT_PREFIX, STEP_KEY


def carried(name: str) -> bool:
    """Whether state `name` is the optimizer's own (the step counter, a parameter's slot),
    which moves between the steps; the hyperparameters and the schedule are written from the
    optimizer by each step, the loss history, the guard and the bf16 weight copies are each
    step's own."""
    return name.startswith(SLOT_PREFIX) and name not in (HYPERPARAMETERS_KEY, SCHEDULE_KEY)


class StateCarry:
    """The state of one optimizer on one device across its LoopSteps."""

    def __init__(self):
        self.active = None                        # the step that ran last
        self.holders: dict[str, object] = {}      # state name -> the step holding its latest
        self.own_steps: dict[int, int] = {}       # id(Parameter) -> its step count when it left

    def switch(self, step) -> None:
        """Make `step` the one that runs next: it takes the latest value of every optimizer
        state buffer it has, and its parameters' step offsets from their own counts."""
        previous = self.active
        if previous is step:
            return
        self.active = step
        if previous is not None:
            counter = int(previous.backend.to_numpy(previous.state[STEP_KEY]))
            for p in previous.trained_rows():
                self.own_steps[id(p)] = counter - previous.step_offsets.get(id(p), 0)
            for name, buf in step.state.items():
                holder = self.holders.get(name)
                if holder is None or holder is step or not carried(name):
                    continue
                source = holder.state[name]
                if tuple(source.shape) == tuple(buf.shape) and source.dtype == buf.dtype:
                    step.backend.copy_into(buf, source)
            offsets = {id(p): counter - self.own_steps.get(id(p), 0)
                       for p in step.trained_rows()}
            step.resume({k: v for k, v in offsets.items() if v})
        for name in step.state:
            if carried(name):
                self.holders[name] = step
