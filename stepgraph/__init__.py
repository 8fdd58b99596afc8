"""stepgraph: compile a whole training step once, run it as one call."""
from . import distributed, losses, nn, ops, optim
from .api import Predictor, TrainStep, compile_predict, compile_train_step
from .backends import cuda_available
from .functions import *  # noqa: F401,F403  torch-level functions (torch.exp, torch.where)
from .errors import (BackendUnavailableError, CaptureError, DistributedError, LabelError,
                     NonFiniteError, PlanError, ShapeError, StateDictError, StepgraphError,
                     UnsupportedOpError)
from .errors import LossSelectionError
from .ir.trace import arange
from .nn.module import to_numpy
from .version import __version__

__all__ = ["nn", "optim", "losses", "distributed", "compile_train_step", "compile_predict",
           "TrainStep", "Predictor", "cuda_available", "to_numpy", "arange", "StepgraphError",
           "ShapeError", "LabelError", "NonFiniteError", "PlanError", "CaptureError",
           "StateDictError", "BackendUnavailableError", "UnsupportedOpError", "DistributedError",
           "LossSelectionError"]
