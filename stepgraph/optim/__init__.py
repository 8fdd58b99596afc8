"""Optimizers: update rules appended to the step's graph as ops."""
from . import schedules
from . import lr_scheduler
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .optimizer import Optimizer
from .rmsprop import RMSprop
from .schedules import Constant, Cosine, StepDecay, WarmupCosine
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "schedules", "Constant",
           "StepDecay", "Cosine", "WarmupCosine"]


def __getattr__(name: str):
    """A torch.optim name stepgraph lacks (LBFGS, ...): UnsupportedOpError, an AttributeError."""
    from ..errors import lookup_torch_name
    return lookup_torch_name(__name__, "torch.optim", name)
