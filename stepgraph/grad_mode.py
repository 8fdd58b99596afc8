"""no_grad, enable_grad, inference_mode and set_grad_enabled, as torch's: context managers
and decorators (`@torch.no_grad()` and bare `@torch.no_grad` alike).

They are accepted without effect. stepgraph derives the backward from the loss at compile
time: gradients flow only to the parameters the optimizer updates, along the ops the loss
depends on, and eager tensors (outside a traced forward) never track gradients, so model code
that wraps initialisation or generation in no_grad runs unchanged. Inside a traced forward,
values computed under no_grad are NOT cut from the backward; a model that relies on that to
stop a gradient is refused nowhere and trains differently from torch.
"""
from __future__ import annotations

import functools


class _GradMode:
    """A context manager that is also a decorator, with or without parentheses."""

    def __init__(self, orig_func=None):
        self._wrapped = orig_func
        if orig_func is not None:
            functools.update_wrapper(self, orig_func)

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False

    def __call__(self, *args, **kwargs):
        if self._wrapped is not None:          # bare @no_grad: this object is the function
            with self:
                return self._wrapped(*args, **kwargs)
        fn = args[0]

        @functools.wraps(fn)
        def run(*a, **k):
            with self:
                return fn(*a, **k)
        return run

    def __get__(self, obj, objtype=None):     # bare @no_grad on a method binds like one
        return self if obj is None else functools.partial(self.__call__, obj)


class no_grad(_GradMode):
    """torch.no_grad (accepted without effect: see the module docstring)."""


class enable_grad(_GradMode):
    """torch.enable_grad (accepted without effect: see the module docstring)."""


class inference_mode(_GradMode):
    """torch.inference_mode(mode=True) (accepted without effect: see the module docstring)."""

    def __init__(self, mode=True):
        super().__init__(mode if callable(mode) else None)


class set_grad_enabled(_GradMode):
    """torch.set_grad_enabled(mode): usable as a call, a context manager or a decorator
    (accepted without effect: see the module docstring)."""

    def __init__(self, mode: bool):
        super().__init__(None)
        self.mode = bool(mode)


def is_grad_enabled() -> bool:
    """True: stepgraph keeps no grad mode (see the module docstring)."""
    return True


__all__ = ["no_grad", "enable_grad", "inference_mode", "set_grad_enabled", "is_grad_enabled"]
