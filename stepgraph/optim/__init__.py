"""Optimizers: update rules appended to the step's graph as ops."""
from . import schedules
from . import lr_scheduler
from .adam import Adam, AdamW
from .optimizer import Optimizer
from .schedules import Constant, Cosine, StepDecay, WarmupCosine
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "schedules", "Constant", "StepDecay", "Cosine",
           "WarmupCosine"]
