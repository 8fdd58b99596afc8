"""SGD with momentum, dampening, weight decay and Nesterov, with torch.optim.SGD's formulas:
g = -g (maximize); g += wd * p; buf = g at step 1, else buf = momentum * buf +
(1 - dampening) * g; g = g + momentum * buf (nesterov) or buf; p -= lr * g.
Every group may set lr, momentum, dampening and weight_decay, and change them between steps
(optimizer.py); nesterov and maximize are fixed once a step is compiled."""
from __future__ import annotations

from .optimizer import Optimizer, check_nesterov


class SGD(Optimizer):
    """torch.optim.SGD(params, lr=1e-3, momentum=0, dampening=0, weight_decay=0,
    nesterov=False, *, maximize=False, foreach=None, differentiable=False, fused=None);
    params None updates every parameter of the steps compiled with it. foreach,
    differentiable and fused are accepted and unused (the update is one fused multi-tensor
    launch). stepgraph's own: schedule (optim/schedules.py) and max_grad_norm (clipping by
    the global norm inside the step).

    Momentum buffers exist when some group has a non-zero momentum at compile time; a group
    may then switch momentum off (0) and on between steps. A buffer starts as the gradient of
    step 1 (PyTorch's starts at the group's first step with momentum: the same unless a group
    turns momentum on later)."""

    update_op = "sgd_update"
    dynamic_keys = ("lr", "weight_decay", "momentum", "dampening")
    static_keys = ("nesterov", "maximize")

    def __init__(self, params=None, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None,
                 differentiable: bool = False, fused: bool | None = None, schedule=None,
                 max_grad_norm: float | None = None):
        check_nesterov(nesterov, float(momentum), float(dampening))
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov,
                                      maximize=maximize, foreach=foreach,
                                      differentiable=differentiable, fused=fused),
                         schedule, max_grad_norm)

    momentum = property(lambda self: self.defaults["momentum"])
    dampening = property(lambda self: self.defaults["dampening"])
    weight_decay = property(lambda self: self.defaults["weight_decay"])
    nesterov = property(lambda self: self.defaults["nesterov"])

    def slots_for(self, groups) -> tuple[str, ...]:
        return ("momentum_buffer",) if any(g["momentum"] for g in groups) else ()

    def state_entry(self, group: dict, count: int, slots: dict) -> dict:
        # PyTorch's SGD keeps a momentum buffer only, and nothing without momentum; the step
        # is stepgraph's counter (PyTorch ignores it when loading).
        if not group["momentum"] or "momentum_buffer" not in slots:
            return {}
        return super().state_entry(group, count, slots)

    def formula_attrs(self, group: dict) -> dict:
        return {"nesterov": group["nesterov"], "maximize": group["maximize"]}

    def hyperparameters(self) -> dict:
        d = self.defaults
        out = dict(momentum=d["momentum"], dampening=d["dampening"],
                   weight_decay=d["weight_decay"], nesterov=d["nesterov"])
        if d["maximize"]:
            out["maximize"] = True
        return out
