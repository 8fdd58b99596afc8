"""torch.amp (also torch.cuda.amp and torch.autocast): mixed precision as a training script
asks for it.

- autocast(device_type, dtype=torch.bfloat16 or torch.float16): the training pass recorded
  inside it compiles with precision="bf16" or "fp16" (PyTorch's autocast semantics, float32
  master weights: compile/autocast.py), and so does a predictor called inside it. On cuda,
  float16 runs where the ops have float16 kernels (compile/autocast.py check_fp16_support).
- GradScaler: dynamic loss scaling as torch's, inside the one compiled step of a captured
  loop (compile/loss_scale.py). Its scale and growth counter are two Buffers, state of
  every step that uses the scaler: scale(loss) multiplies the loss by the device scale (a
  recorded script-level op, so a new scale is no new graph), step() has the compiled step
  unscale the gradients, skip the update on a non-finite one (a device-side select: no
  host sync) and move the scale as torch's update() does (times backoff_factor after a
  skipped step, times growth_factor after growth_interval good ones). update() therefore
  only clears unscale_()'s marks and applies new_scale; get_scale() and state_dict() read
  the device. A difference from torch: the scale moves at every scaler.step() even where a
  script never calls update(). enabled=False: every method is a pass-through.
"""
from __future__ import annotations

import functools

import numpy as np

from .dtypes import as_dtype        # imports only errors and ir.graph: no cycle
from .errors import UnsupportedOpError

_STATE: list[str | None] = [None]       # the innermost autocast's precision, or None


def autocast_state() -> str | None:
    """"bf16" or "fp16" inside an enabled bfloat16 or float16 autocast, else None."""
    return _STATE[-1]


def _precision(dtype) -> str:
    if dtype is None:       # torch's CPU default; its CUDA default, float16, only by name
        dtype = "bfloat16"
    name = str(as_dtype(dtype))
    precision = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(name)
    if precision is None:
        raise UnsupportedOpError(f"autocast(dtype={name}) is not supported by stepgraph: use "
                                 "dtype=torch.bfloat16 or torch.float16")
    return precision


class autocast:  # noqa: N801 - torch's name
    """torch.autocast(device_type, dtype=None, enabled=True, cache_enabled=None): a context
    manager or decorator. dtype None means bfloat16 (torch's CUDA default, float16, is taken
    when named)."""

    def __init__(self, device_type: str = "cuda", dtype=None, enabled: bool = True,
                 cache_enabled=None):
        if device_type not in ("cuda", "cpu", "mps", "xpu"):
            raise ValueError(f"autocast: unknown device_type {device_type!r}")
        self.precision = _precision(dtype) if enabled else None

    def __enter__(self):
        _STATE.append(None if self.precision == "fp32" else self.precision)
        return self

    def __exit__(self, *exc) -> None:
        _STATE.pop()

    def __call__(self, fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return wrapped


def is_autocast_available(device_type: str) -> bool:
    return device_type in ("cuda", "cpu")


class GradScaler:
    """torch.amp.GradScaler(device="cuda", init_scale=2.**16, growth_factor=2.0,
    backoff_factor=0.5, growth_interval=2000, enabled=True): dynamic loss scaling as torch's,
    inside the compiled step (see the module docstring and compile/loss_scale.py)."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        from .nn.module import Buffer

        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError("GradScaler needs growth_factor > 1 and 0 < backoff_factor < 1")
        self._enabled = bool(enabled)
        # The step's state: float32 and int32 0-d, as torch's _scale and _growth_tracker.
        self._scale = Buffer(np.float32(init_scale))
        self._growth_tracker = Buffer(np.int32(0))
        self._scale.name, self._growth_tracker.name = "grad_scaler.scale", \
            "grad_scaler.growth_tracker"
        self._growth_factor, self._backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._unscaled: set[int] = set()         # id(optimizer) unscale_()d since update()

    def is_enabled(self) -> bool:
        return self._enabled

    def scale(self, outputs):
        """outputs (a loss, or a list, tuple or dict of them) times the current scale. In a
        training pass the scale is the step's device value, not a constant of the graph."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, dict):
            return {k: self.scale(v) for k, v in outputs.items()}
        tracer = getattr(outputs, "tracer", None)
        if tracer is not None and tracer is hooks_open_pass():
            return outputs * self._scale.as_tensor()
        return outputs * self.get_scale()

    def unscale_(self, optimizer) -> None:
        """Marks the optimizer's gradients unscaled: the compiled step unscales every
        gradient before clipping and the update, so clip_grad_norm_ after unscale_ sees
        unscaled gradients, as in torch."""
        if not self._enabled:
            return
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since "
                               "the last update().")
        self._unscaled.add(id(optimizer))

    def step(self, optimizer, *args, **kwargs):
        """optimizer.step() inside the compiled step, which unscales the gradients and skips
        the update (parameters and optimizer state unchanged) when one is not finite."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or args:
            raise RuntimeError("Closure use is not currently supported if GradScaler is "
                               "enabled.")
        from .compile.loss_scale import LossScaling
        from .loop import hooks

        if any(p.dtype == "float16" for p in optimizer.trained_parameters()):
            raise ValueError("Attempting to unscale FP16 gradients.")      # as torch's
        s = hooks.SESSION              # made with the optimizer (it was given parameters)
        if s is None:
            return optimizer.step()
        s.loss_scaling = LossScaling(self._scale, self._growth_tracker, self._growth_factor,
                                     self._backoff_factor, self._growth_interval)
        self._unscaled.add(id(optimizer))
        return optimizer.step()

    def update(self, new_scale=None) -> None:
        """The step has moved the scale on the device already (halved after a skipped step,
        doubled after growth_interval good ones); new_scale (a float or a 1-element tensor)
        sets it."""
        if not self._enabled:
            return
        self._unscaled.clear()
        if new_scale is not None:
            self._scale.assign(np.float32(np.asarray(new_scale, np.float32).reshape(())))

    def get_scale(self) -> float:
        """The current scale (reads the device, a sync as torch's)."""
        return float(self._scale.numpy()) if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = int(new_interval)

    def _get_growth_tracker(self) -> int:
        return int(self._growth_tracker.numpy()) if self._enabled else 0

    def state_dict(self) -> dict:
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval,
                "_growth_tracker": self._get_growth_tracker()}

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        self._scale.assign(np.float32(state_dict["scale"]))
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker.assign(np.int32(state_dict["_growth_tracker"]))


def hooks_open_pass():
    """The training pass open at script level, or None (loop/hooks.py)."""
    from .loop import hooks
    return hooks.open_pass()


def __getattr__(name: str):
    from .errors import lookup_torch_name
    return lookup_torch_name(__name__, "torch.amp", name)
