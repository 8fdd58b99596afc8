"""Adam and AdamW with torch.optim's formulas (bias corrections from the device step counter):
m = lerp(m, g, 1 - b1); v = b2 v + (1 - b2) g^2;
p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
Adam adds wd * p to g; AdamW first scales p by (1 - lr * wd).
Parameter groups may set lr, weight_decay and betas (see optimizer.py)."""
from __future__ import annotations

from .optimizer import Optimizer


def _check_betas(betas) -> tuple[float, float]:
    if len(betas) != 2 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
        raise ValueError(f"invalid betas {betas}")
    return float(betas[0]), float(betas[1])


class Adam(Optimizer):
    """torch.optim.Adam: Adam(params_or_groups=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.0); params_or_groups None updates every parameter of the step alike."""

    update_op = "adam_update"
    slot_names = ("exp_avg", "exp_avg_sq")
    group_keys = ("weight_decay", "betas")
    decoupled = False

    def __init__(self, params_or_groups=None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, schedule=None, max_grad_norm: float | None = None):
        super().__init__(lr, schedule, max_grad_norm, params_or_groups)
        self.betas, self.eps, self.weight_decay = _check_betas(betas), float(eps), \
            float(weight_decay)
        for g in self._groups or ():
            if "betas" in g:
                g["betas"] = _check_betas(g["betas"])

    def split_group_value(self, key: str, values: list) -> dict[str, list]:
        if key == "betas":
            return {"beta1": [b[0] for b in values], "beta2": [b[1] for b in values]}
        return super().split_group_value(key, values)

    def hyperparameters(self) -> dict:
        return dict(beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                    weight_decay=self.weight_decay, decoupled=self.decoupled)


class AdamW(Adam):
    """torch.optim.AdamW: AdamW(params_or_groups=None, lr=1e-3, betas=(0.9, 0.999),
    eps=1e-8, weight_decay=0.01), decoupled weight decay."""

    decoupled = True

    def __init__(self, params_or_groups=None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, schedule=None, max_grad_norm: float | None = None):
        super().__init__(params_or_groups, lr, betas, eps, weight_decay, schedule, max_grad_norm)
