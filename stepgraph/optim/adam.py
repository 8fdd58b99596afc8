"""Adam and AdamW with torch.optim's formulas (bias corrections from the device step counter):
g = -g (maximize); m = lerp(m, g, 1 - b1); v = b2 v + (1 - b2) g^2; amsgrad: vmax =
max(vmax, v), read in place of v; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
Adam adds wd * p to g; AdamW (decoupled_weight_decay) first scales p by (1 - lr * wd).
Every group may set lr, weight_decay, betas and eps, and change them between steps
(optimizer.py); amsgrad, maximize and decoupled_weight_decay are fixed once a step is
compiled."""
from __future__ import annotations

from .optimizer import Optimizer


class Adam(Optimizer):
    """torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
    amsgrad=False, *, foreach=None, maximize=False, capturable=False, differentiable=False,
    fused=None, decoupled_weight_decay=False); params None updates every parameter of the
    steps compiled with it. foreach, capturable, differentiable and fused are accepted and
    unused (the update is one fused multi-tensor launch inside the captured step). stepgraph's
    own: schedule and max_grad_norm (as SGD's)."""

    update_op = "adam_update"
    dynamic_keys = ("lr", "weight_decay", "betas", "eps")
    static_keys = ("amsgrad", "maximize", "decoupled_weight_decay")
    default_weight_decay = 0.0
    decoupled_default = False

    def __init__(self, params=None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float | None = None, amsgrad: bool = False, *,
                 foreach: bool | None = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 decoupled_weight_decay: bool | None = None, schedule=None,
                 max_grad_norm: float | None = None):
        if weight_decay is None:
            weight_decay = self.default_weight_decay
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self.decoupled_default
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      amsgrad=amsgrad, maximize=maximize, foreach=foreach,
                                      capturable=capturable, differentiable=differentiable,
                                      fused=fused,
                                      decoupled_weight_decay=decoupled_weight_decay),
                         schedule, max_grad_norm)

    betas = property(lambda self: self.defaults["betas"])
    eps = property(lambda self: self.defaults["eps"])
    weight_decay = property(lambda self: self.defaults["weight_decay"])
    decoupled = property(lambda self: self.defaults["decoupled_weight_decay"])

    def column(self, group: dict, name: str) -> float:
        if name in ("beta1", "beta2"):
            return group["betas"][name == "beta2"]
        return super().column(group, name)

    def slots_for(self, groups) -> tuple[str, ...]:
        amsgrad = bool(groups) and groups[0]["amsgrad"]
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())

    def formula_attrs(self, group: dict) -> dict:
        return {"decoupled": group["decoupled_weight_decay"], "amsgrad": group["amsgrad"],
                "maximize": group["maximize"]}

    def hyperparameters(self) -> dict:
        d = self.defaults
        out = dict(beta1=d["betas"][0], beta2=d["betas"][1], eps=d["eps"],
                   weight_decay=d["weight_decay"], decoupled=d["decoupled_weight_decay"])
        out.update((k, True) for k in ("amsgrad", "maximize") if d[k])
        return out


class AdamW(Adam):
    """torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
    amsgrad=False, *, maximize=False, foreach=None, capturable=False, differentiable=False,
    fused=None): Adam with decoupled weight decay."""

    default_weight_decay = 0.01
    decoupled_default = True

    def __init__(self, params=None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None, schedule=None,
                 max_grad_norm: float | None = None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable,
                         differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, schedule=schedule,
                         max_grad_norm=max_grad_norm)
