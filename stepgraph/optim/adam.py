"""Adam and AdamW with torch.optim's formulas (bias corrections from the device step counter):
m = lerp(m, g, 1 - b1); v = b2 v + (1 - b2) g^2;
p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
Adam adds wd * p to g; AdamW first scales p by (1 - lr * wd)."""
from __future__ import annotations

from .optimizer import Optimizer


class Adam(Optimizer):
    update_op = "adam_update"
    slot_names = ("exp_avg", "exp_avg_sq")
    decoupled = False

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, schedule=None,
                 max_grad_norm: float | None = None):
        super().__init__(lr, schedule, max_grad_norm)
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid betas {betas}")
        self.betas, self.eps, self.weight_decay = tuple(betas), float(eps), float(weight_decay)

    def hyperparameters(self) -> dict:
        return dict(beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                    weight_decay=self.weight_decay, decoupled=self.decoupled)


class AdamW(Adam):
    decoupled = True

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, schedule=None,
                 max_grad_norm: float | None = None):
        super().__init__(lr, betas, eps, weight_decay, schedule, max_grad_norm)
