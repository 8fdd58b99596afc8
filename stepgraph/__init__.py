"""stepgraph: compile a whole training step once, run it as one call.

It is also the `torch` namespace of model files (`import stepgraph as torch`): factories,
dtypes, device, no_grad, backends flags (docs/TORCH_COMPAT.md); a torch name it lacks raises
UnsupportedOpError (an AttributeError) naming it."""
from . import amp, backends, cuda, distributed, losses, nn, ops, optim, return_types
from .amp import autocast
from .loop import hooks as _loop_hooks
from .loop import session as _loop_session
from . import checkpoint  # noqa: F401  (checkpoint.model_state: a run's weights)
from .api import Predictor, TrainStep, compile_predict, compile_train_step
from .backends import cuda_available
from .errors import (BackendUnavailableError, CaptureError, DistributedError, LabelError,
                     NonFiniteError, PlanError, ShapeError, StateDictError, StepgraphError,
                     LossSelectionError, UnsupportedOpError)
from .errors import lookup_torch_name as _lookup_torch_name
from .backends.flags import (are_deterministic_algorithms_enabled,
                             get_float32_matmul_precision,
                             is_deterministic_algorithms_warn_only_enabled,
                             set_float32_matmul_precision, use_deterministic_algorithms)
from .devices import (channels_last, channels_last_3d, contiguous_format, device,
                      memory_format, preserve_format)
from .dtypes import *  # noqa: F401,F403
from .dtypes import __all__ as _dtype_names
from .functions import *  # noqa: F401,F403
from .functions import factories as _factories
from .functions.asserts import _assert
from .grad_mode import (enable_grad, inference_mode, is_grad_enabled, no_grad,
                        set_grad_enabled)
from .ir.trace import Size, Tensor
from .ir import tensor_cast as _tensor_cast  # noqa: F401  (Tensor's to, float, long, ...)
from .ir import tensor_compare as _tensor_compare  # noqa: F401  (Tensor's <, ==, &, where)
from .ir import tensor_inplace as _tensor_inplace  # noqa: F401  (Tensor's add_, +=, copy_)
from .ir import tensor_math as _tensor_math  # noqa: F401  (Tensor's + - * / @, mm)
from .ir import tensor_new as _tensor_new  # noqa: F401  (Tensor's new_zeros, clone)
from .ir import tensor_reduce as _tensor_reduce  # noqa: F401  (Tensor's sum, max, topk)
from .ir import tensor_select as _tensor_select  # noqa: F401  (Tensor's x[i], gather)
from .ir import tensor_shape as _tensor_shape  # noqa: F401  (Tensor's reshape, permute)
from .ir import tensor_unary as _tensor_unary  # noqa: F401  (Tensor's exp, relu, clamp)
from .ir import tensor_indexing as _tensor_indexing  # noqa: F401  (Tensor's x[i] = v)
from .ir import tensor_random as _tensor_random  # noqa: F401  (Tensor's random draws)
from .nn.module import to_numpy
from .serialization import load, save
from .version import __version__

__all__ = ["nn", "optim", "losses", "distributed", "compile_train_step", "compile_predict",
           "TrainStep", "Predictor", "cuda_available", "to_numpy", "StepgraphError",
           "ShapeError", "LabelError", "NonFiniteError", "PlanError", "CaptureError",
           "StateDictError", "BackendUnavailableError", "UnsupportedOpError", "DistributedError",
           "backends", "cuda", "device", "Size", "Tensor", "no_grad", "enable_grad",
           "inference_mode", "set_grad_enabled", "is_grad_enabled",
           "set_float32_matmul_precision", "get_float32_matmul_precision",
           "use_deterministic_algorithms", "are_deterministic_algorithms_enabled",
           "is_deterministic_algorithms_warn_only_enabled",
           *(n for n in _dtype_names if n not in ("float", "int", "bool")),  # keep builtins
           "LossSelectionError", "amp", "autocast", "compile", "memory_format", "channels_last",
           "channels_last_3d", "contiguous_format", "preserve_format", *_factories.__all__, "save",
           "load"]


_loop_hooks.MAKE_SESSION = _loop_session.session


def __getattr__(name: str):
    """A torch name stepgraph lacks: UnsupportedOpError, which is an AttributeError."""
    return _lookup_torch_name(__name__, "torch", name)

