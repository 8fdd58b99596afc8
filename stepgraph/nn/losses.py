"""Losses with PyTorch semantics and mean reduction. Each maps (prediction, target) tensors to
a scalar tensor while being traced."""
from __future__ import annotations

from ..errors import ShapeError
from ..ir.trace import Tensor


def _label(t: Tensor, name: str) -> None:
    t.tracer.label = name


def cross_entropy(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0,
                  ignore_index: int = -100) -> Tensor:
    """Softmax cross-entropy of (N, C) logits against integer labels (N,); with
    label_smoothing eps the target is (1 - eps) onehot + eps / C, as PyTorch's. Rows whose
    label is ignore_index count for nothing: the mean is over the others (NaN when none)."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    _label(logits, "cross_entropy")
    return logits.tracer.op_all("cross_entropy", [logits, labels],
                                label_smoothing=float(label_smoothing),
                                ignore_index=int(ignore_index))[0]


def nll_loss(log_probs: Tensor, labels: Tensor) -> Tensor:
    """Negative log-likelihood of (N, C) log-probabilities against integer labels (N,)."""
    _label(log_probs, "nll_loss")
    return log_probs.tracer.op("nll_loss", [log_probs, labels])


def mse(pred: Tensor, target: Tensor) -> Tensor:
    """Mean squared error over all elements."""
    if pred.shape != target.shape:
        raise ShapeError(f"mse: prediction {pred.shape} and target {target.shape} differ")
    _label(pred, "mse")
    return pred.tracer.op("mse", [pred, target])


# Losses whose target is a class index: the train step checks labels are in [0, classes).
CLASS_TARGET_LOSSES = (cross_entropy, nll_loss)
