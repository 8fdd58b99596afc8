"""RMSprop with torch.optim.RMSprop's formulas (ops/optim.py rmsprop_update):
g = -g (maximize); g += wd * p; sq = alpha sq + (1 - alpha) g^2; centered: ga =
lerp(ga, g, 1 - alpha), avg = sqrt(sq - ga^2) + eps, else avg = sqrt(sq) + eps; momentum > 0:
buf = momentum buf + g / avg, p -= lr buf; else p -= lr g / avg.
Every group may set lr, alpha, eps, weight_decay and momentum and change them between steps
(optimizer.py); centered and maximize are fixed once a step is compiled."""
from __future__ import annotations

from .optimizer import Optimizer


class RMSprop(Optimizer):
    """torch.optim.RMSprop(params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0,
    centered=False, capturable=False, foreach=None, maximize=False, differentiable=False);
    params None updates every parameter of the steps compiled with it. capturable, foreach and
    differentiable are accepted and unused. Momentum buffers exist when some group has a
    momentum > 0 at compile time (PyTorch's likewise: they are made at the first step).
    stepgraph's own: schedule and max_grad_norm (as SGD's)."""

    update_op = "rmsprop_update"
    dynamic_keys = ("lr", "weight_decay", "alpha", "eps", "momentum")
    static_keys = ("centered", "maximize")

    def __init__(self, params=None, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.0, centered: bool = False,
                 capturable: bool = False, foreach: bool | None = None, maximize: bool = False,
                 differentiable: bool = False, *, schedule=None,
                 max_grad_norm: float | None = None):
        super().__init__(params, dict(lr=lr, momentum=momentum, alpha=alpha, eps=eps,
                                      centered=centered, weight_decay=weight_decay,
                                      capturable=capturable, foreach=foreach,
                                      maximize=maximize, differentiable=differentiable),
                         schedule, max_grad_norm)

    def slots_for(self, groups) -> tuple[str, ...]:
        centered = bool(groups) and groups[0]["centered"]
        return ("square_avg",) + (("grad_avg",) if centered else ()) + \
            (("momentum_buffer",) if any(g["momentum"] > 0 for g in groups) else ())

    def formula_attrs(self, group: dict) -> dict:
        return {"centered": group["centered"], "maximize": group["maximize"]}

    def hyperparameters(self) -> dict:
        d = self.defaults
        return {k: d[k] for k in ("alpha", "eps", "weight_decay", "momentum", "centered",
                                  "maximize")}
