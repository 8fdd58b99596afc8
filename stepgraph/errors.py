"""Typed errors. Each says what mismatched: which input, expected vs got."""


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


class BackendUnavailableError(StepgraphError, RuntimeError):
    """The requested device has no working backend on this machine."""


class UnsupportedOpError(StepgraphError, NotImplementedError, AttributeError):
    """A tensor operation or argument stepgraph cannot trace; names the op and the module path
    (e.g. "model.layer1.0") where the model called it. Also raised for a torch name stepgraph
    lacks (`torch.foo`), hence an AttributeError: hasattr and getattr with a default work."""


class UnsupportedPrecisionError(UnsupportedOpError):
    """A step's precision needs kernels its backend lacks: `precision="bf16"` on a backend
    whose kernels for some of the step's ops do not take bfloat16 yet (names those ops)."""


class DistributedError(StepgraphError, RuntimeError):
    """A data-parallel run cannot go on: a rank never arrived or stopped answering, the
    launch environment (RANK, WORLD_SIZE, ...) is inconsistent, or NCCL is unusable."""
