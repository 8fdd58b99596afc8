"""Optimizers: update rules appended to the step's graph as ops."""
from . import schedules
from . import lr_scheduler
from .adam import Adam, AdamW
from .optimizer import Optimizer
from .schedules import Constant, Cosine, StepDecay, WarmupCosine
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "schedules", "Constant", "StepDecay", "Cosine",
           "WarmupCosine"]


def __getattr__(name: str):
    """A torch.optim name stepgraph lacks (RMSprop, ...): UnsupportedOpError, an AttributeError."""
    from ..errors import lookup_torch_name
    return lookup_torch_name(__name__, "torch.optim", name)
