"""Adagrad with torch.optim.Adagrad's formulas (ops/optim.py adagrad_update):
g = -g (maximize); g += wd * p; clr = lr / (1 + (t - 1) lr_decay); sum += g^2;
p -= clr g / (sqrt(sum) + eps), sum starting at initial_accumulator_value (the constructor's,
as PyTorch's, also for a group that sets its own).
Every group may set lr, lr_decay, weight_decay and eps and change them between steps
(optimizer.py); maximize is fixed once a step is compiled."""
from __future__ import annotations

import numpy as np

from .optimizer import Optimizer


class Adagrad(Optimizer):
    """torch.optim.Adagrad(params, lr=1e-2, lr_decay=0, weight_decay=0,
    initial_accumulator_value=0, eps=1e-10, foreach=None, *, maximize=False,
    differentiable=False, fused=None); params None updates every parameter of the steps
    compiled with it. foreach, differentiable and fused are accepted and unused;
    initial_accumulator_value is read when the state starts (PyTorch's likewise). t is the
    step counter of the compiled step. stepgraph's own: schedule and max_grad_norm."""

    update_op = "adagrad_update"
    dynamic_keys = ("lr", "weight_decay", "lr_decay", "eps")
    static_keys = ("maximize",)

    def __init__(self, params=None, lr: float = 1e-2, lr_decay: float = 0.0,
                 weight_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10, foreach: bool | None = None, *, maximize: bool = False,
                 differentiable: bool = False, fused: bool | None = None, schedule=None,
                 max_grad_norm: float | None = None):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, eps=eps,
                                      weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value,
                                      foreach=foreach, maximize=maximize,
                                      differentiable=differentiable, fused=fused),
                         schedule, max_grad_norm)

    def slots_for(self, groups) -> tuple[str, ...]:
        return ("sum",)

    def slot_start(self, slot: str, group: dict) -> float:
        # PyTorch starts every sum at the constructor's value, whatever the group says.
        return self.defaults["initial_accumulator_value"]

    def unstarted_entry(self, group: dict, p) -> dict:
        # PyTorch's Adagrad makes every parameter's state in its constructor: step 0 and the
        # sum's start, listed by state_dict() before (or without) any step.
        return {"step": np.array(0.0, np.float32),
                "sum": np.full(p.shape, self.slot_start("sum", group), np.float32)}

    def hyperparameters(self) -> dict:
        d = self.defaults
        return {k: d[k] for k in ("lr_decay", "weight_decay", "initial_accumulator_value",
                                  "eps", "maximize")}
