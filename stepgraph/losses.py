"""Losses (mean reduction, PyTorch semantics): cross_entropy, nll_loss, mse."""
from .nn.losses import cross_entropy, mse, nll_loss

__all__ = ["cross_entropy", "nll_loss", "mse"]
