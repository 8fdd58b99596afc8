"""Optimizers: update rules appended to the step's graph as ops."""
from . import schedules
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .optimizer import Optimizer
from .rmsprop import RMSprop
from .schedules import Constant, Cosine, StepDecay, WarmupCosine
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "schedules", "Constant",
           "StepDecay", "Cosine", "WarmupCosine"]
