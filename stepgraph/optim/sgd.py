"""SGD with momentum, dampening, weight decay and Nesterov, with torch.optim.SGD's formulas:
g += wd * p; buf = g at step 1, else buf = momentum * buf + (1 - dampening) * g;
g = g + momentum * buf (nesterov) or buf; p -= lr * g.
Parameter groups may set lr and weight_decay (see optimizer.py)."""
from __future__ import annotations

from .optimizer import Optimizer


class SGD(Optimizer):
    """torch.optim.SGD: SGD(params_or_groups=None, lr=1e-3, momentum=0.0, dampening=0.0,
    weight_decay=0.0, nesterov=False); params_or_groups None updates every parameter of the
    step alike."""

    update_op = "sgd_update"

    def __init__(self, params_or_groups=None, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 schedule=None, max_grad_norm: float | None = None):
        super().__init__(lr, schedule, max_grad_norm, params_or_groups)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        self.momentum, self.dampening = float(momentum), float(dampening)
        self.weight_decay, self.nesterov = float(weight_decay), bool(nesterov)

    def slots_for(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum else ()

    def hyperparameters(self) -> dict:
        return dict(momentum=self.momentum, dampening=self.dampening,
                    weight_decay=self.weight_decay, nesterov=self.nesterov)
