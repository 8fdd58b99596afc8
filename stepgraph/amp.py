"""torch.amp (also torch.cuda.amp and torch.autocast): mixed precision as a training script
asks for it.

- autocast(device_type, dtype=torch.bfloat16): the training pass recorded inside it compiles
  with precision="bf16" (PyTorch's autocast semantics, float32 master weights:
  compile/autocast.py), and so does a predictor called inside it. float16 is refused: the
  IR has no float16 tensors; bfloat16 needs no loss scaling.
- GradScaler: with float32 master weights and bf16 compute, scaling the loss by a power of two
  and unscaling the gradients gives the same bits (no float16 gradient to overflow), so
  scale() returns the loss itself and unscale_() has nothing to do. What stays is torch's
  skip: step() runs the optimizer's step with non-finite gradients skipped inside the
  compiled step (its guard), and update() moves the scale as torch's does (halved after a
  skipped step, doubled after growth_interval good ones), reading the skip counter (one sync,
  as torch's GradScaler.step makes). enabled=False: every method is a pass-through.
"""
from __future__ import annotations

import functools

from .dtypes import as_dtype        # imports only errors and ir.graph: no cycle
from .errors import UnsupportedOpError

_STATE: list[str | None] = [None]       # the innermost autocast's precision, or None


def autocast_state() -> str | None:
    """"bf16" inside an enabled bfloat16 autocast, else None."""
    return _STATE[-1]


def _precision(dtype) -> str:
    name = str(as_dtype(dtype)) if dtype is not None else "bfloat16"
    if name in ("bfloat16", "torch.bfloat16"):
        return "bf16"
    if name in ("float32", "torch.float32"):
        return "fp32"
    raise UnsupportedOpError(f"autocast(dtype={name}) is not supported by stepgraph: use "
                             "dtype=torch.bfloat16 (bf16 compute with float32 master weights, "
                             "no loss scaling needed)")


class autocast:  # noqa: N801 - torch's name
    """torch.autocast(device_type, dtype=None, enabled=True, cache_enabled=None): a context
    manager or decorator. dtype None means bfloat16 here (torch's CUDA default, float16, is
    refused when asked for by name)."""

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
    backoff_factor=0.5, growth_interval=2000, enabled=True); see the module docstring."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError("GradScaler needs growth_factor > 1 and 0 < backoff_factor < 1")
        self._enabled = bool(enabled)
        self._scale = float(init_scale)
        self._growth_factor, self._backoff_factor = float(growth_factor), float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._growth_tracker = 0
        self._skipped_seen: dict[int, int] = {}      # id(step) -> its skip count last read
        self._stepped: list = []                     # compiled steps since update()

    def is_enabled(self) -> bool:
        return self._enabled

    def scale(self, outputs):
        """The loss (or losses) as given: see the module docstring."""
        return outputs

    def unscale_(self, optimizer) -> None:
        """Nothing to undo (the gradients were never scaled)."""

    def step(self, optimizer, *args, **kwargs):
        """optimizer.step(), skipping the update inside the compiled step when a gradient
        or the loss is not finite (enabled only)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        from .loop import hooks

        s = hooks.SESSION              # made with the optimizer (it was given parameters)
        if s is None:
            return optimizer.step(*args, **kwargs)
        s.skip_nonfinite = True
        out = optimizer.step(*args, **kwargs)
        step = s.last_step
        if step is not None and step not in self._stepped:
            self._stepped.append(step)
        return out

    def update(self, new_scale=None) -> None:
        """Move the scale as torch's: halve it if the last step was skipped, double it
        after growth_interval steps in a row that were not."""
        if not self._enabled:
            return
        if new_scale is not None:
            self._scale = float(new_scale)
            return
        skipped = 0
        for step in self._stepped:
            count = step.skipped_steps                    # reads the device (a sync)
            skipped += count - self._skipped_seen.get(id(step), 0)
            self._skipped_seen[id(step)] = count
        self._stepped = []
        if skipped:
            self._scale *= self._backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self._growth_interval:
                self._scale *= self._growth_factor
                self._growth_tracker = 0

    def get_scale(self) -> float:
        return self._scale if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def state_dict(self) -> dict:
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor,
                "growth_interval": self._growth_interval,
                "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("The source state dict is empty, possibly because it was saved "
                               "from a disabled instance of GradScaler.")
        self._scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])


def __getattr__(name: str):
    from .errors import lookup_torch_name
    return lookup_torch_name(__name__, "torch.amp", name)
