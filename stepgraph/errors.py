"""Typed errors. Each says what mismatched: which input, expected vs got."""
import sys


class StepgraphError(Exception):
    """Base class of every error stepgraph raises on purpose."""


class ShapeError(StepgraphError, ValueError):
    """A value's shape, rank or dtype does not match what the graph expects."""


class LabelError(StepgraphError, ValueError):
    """Class labels outside [0, classes). Raised by a step's guard (`on_bad_batch="raise"`),
    `step` is the number of the call whose batch held them (None for a check made before
    the call ran)."""

    step: int | None = None


class NonFiniteError(StepgraphError, ArithmeticError):
    """A training step's loss or gradients were NaN or infinite, so its update was not
    applied (`on_bad_batch="raise"`); `step` is the number of the call that produced them."""

    step: int | None = None


class PlanError(StepgraphError):
    """The graph cannot be scheduled or placed in memory."""


class CaptureError(StepgraphError):
    """A CUDA graph cannot be captured (an external without a fixed buffer, a sync inside)."""


class StateDictError(StepgraphError, KeyError):
    """A state_dict has missing or unexpected keys, or tensors of the wrong shape."""

    def __str__(self):  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class LossSelectionError(StepgraphError, ValueError):
    """compile_train_step(loss=None) found no scalar loss where the model's output should
    hold it (says what the model returned and which argument picks the entry)."""


class NothingToTrainError(StepgraphError, ValueError):
    """compile_train_step on a model whose loss depends on no trainable parameter (none, all
    frozen, or unused by forward); says which and what to change."""


class BackendUnavailableError(StepgraphError, RuntimeError):
    """The requested device has no working backend on this machine."""


class UnsupportedOpError(StepgraphError, NotImplementedError, AttributeError):
    """A tensor operation or argument stepgraph cannot trace; names the op and the module path
    (e.g. "model.layer1.0") where the model called it. Also raised for a torch name stepgraph
    lacks (`torch.foo`), hence an AttributeError: hasattr and getattr with a default work."""


# What a model uses instead of a torch name stepgraph lacks, where there is something.
ALTERNATIVES = {
    "torch.nn.DataParallel": "torch.nn.parallel.DistributedDataParallel, one process per GPU "
                             "under torchrun or `stepgraph launch --gpus N`",
    "torch.nn.parallel.DataParallel": "torch.nn.parallel.DistributedDataParallel, one process "
                                      "per GPU under torchrun or `stepgraph launch --gpus N`",
    "torch.Tensor.backward": "compile_train_step(model, loss=...), which derives the "
                             "gradients and applies the update",
    "torch.Tensor.masked_select": "x.masked_fill(~mask, 0) or torch.where(mask, x, 0)",
    "torch.Tensor.nonzero": "a mask: torch.where(mask, x, 0)",
    "torch.Tensor.kthvalue": "x.topk(k, dim, largest=False) and its last entry",
    "torch.Tensor.index_put": "torch.where(mask, v, x) or x.scatter(dim, index, v)",
    "torch.Tensor.index_put_": "torch.where(mask, v, x) or x.scatter(dim, index, v)",
    "torch.Tensor.index_add": "x.scatter_add(dim, index, src)",
    "torch.autograd.grad": "compile_train_step(model, loss=...), which derives the gradients "
                           "from the loss",
    "torch.autograd.backward": "compile_train_step(model, loss=...), which derives the "
                               "gradients from the loss",
    "torch.autograd.Function": "the ops stepgraph has (each has its gradient rule); "
                               "compile_train_step derives the gradients",
    "torch.jit.save": "torch.save(model.state_dict(), f) (torch's zip format, tensors under "
                      "torch's keys)",
    "torch.jit.load": "model.load_state_dict(state_dict) on the model's Python class",
    "torch.fx.Tracer": "stepgraph.compile_train_step / compile_predict (they trace forward)",
    "torch.fx.GraphModule": "stepgraph.compile_train_step / compile_predict (they trace "
                            "forward)",
}


def called_in() -> str:
    """" (called in model.layer1.0)" while a module's forward is being traced, else ""."""
    # Read from sys.modules, not imported: the IR imports this module, and a forward can only
    # be traced once it is loaded.
    trace = sys.modules.get("stepgraph.ir.trace")
    tracer = trace.current_tracer() if trace is not None else None
    return f" (called in {tracer.where()})" if tracer is not None else ""


def missing_torch_name(torch_name: str) -> UnsupportedOpError:
    """The error for a torch name stepgraph lacks: the name, the module whose forward asked
    for it (while one is traced) and the alternative where there is one."""
    alternative = ALTERNATIVES.get(torch_name)
    hint = f"; use {alternative}" if alternative else \
        " (see docs/TORCH_COMPAT.md for the torch names it has)"
    return UnsupportedOpError(f"{torch_name} is not supported by stepgraph{called_in()}{hint}")


def lookup_torch_name(module: str, torch_module: str, name: str):
    """The module `__getattr__` of a torch-namespace package (`module`, standing for
    `torch_module`): a submodule not imported yet, AttributeError for a private name, else
    UnsupportedOpError naming the torch name stepgraph lacks (`missing_torch_name`)."""
    import importlib
    import importlib.util

    if name.startswith("_"):
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    # a submodule not loaded yet (only a package has them: find_spec on a plain module's
    # child raises, and pickle's whichmodule asks every loaded module for names it lacks)
    if hasattr(sys.modules.get(module), "__path__") and \
            importlib.util.find_spec(f"{module}.{name}") is not None:
        return importlib.import_module(f"{module}.{name}")
    raise missing_torch_name(f"{torch_module}.{name}")


class UnsupportedPrecisionError(UnsupportedOpError):
    """A step's precision needs kernels its backend lacks: `precision="bf16"` on a backend
    whose kernels for some of the step's ops do not take bfloat16 yet (names those ops)."""


class DistributedError(StepgraphError, RuntimeError):
    """A data-parallel run cannot go on: a rank never arrived or stopped answering, the
    launch environment (RANK, WORLD_SIZE, ...) is inconsistent, or NCCL is unusable."""


class TypePromotionError(StepgraphError, RuntimeError):
    """An in-place op whose result type cannot be written into its tensor: torch's "result
    type Float can't be cast to the desired output type Long" (ir/promotion.py); or operands
    of dtypes an op needs to be one (lerp, heaviside), with torch's message."""
