"""no_grad, enable_grad, inference_mode and set_grad_enabled, as torch's: context managers
and decorators (`@torch.no_grad()` and bare `@torch.no_grad` alike).

stepgraph derives the backward from the loss at compile time, so grad mode matters only
inside a traced train forward: there every output of an op recorded while grad mode is off
passes through a `stop_gradient` node (a view, no copy), so no gradient flows back through
it, as in torch (compile_predict's trace has no backward and records none). Eager tensors (outside a traced forward) never track gradients: model code that
wraps initialisation or generation in no_grad runs unchanged. A parameter whose every use
is cut this way gets no gradient, and the compile says the loss does not depend on it.
"""
from __future__ import annotations

import functools

_enabled = [True]      # the current mode, innermost last


def is_grad_enabled() -> bool:
    """Whether ops traced now can carry gradients."""
    return _enabled[-1]


class _GradMode:
    """Sets grad mode `mode` for a with-block or a decorated function, with or without
    parentheses (`@no_grad` hands the function to __init__)."""

    mode = False

    def __init__(self, orig_func=None):
        self._wrapped = orig_func
        if orig_func is not None:
            functools.update_wrapper(self, orig_func)

    def __enter__(self):
        _enabled.append(self.mode)

    def __exit__(self, *exc):
        _enabled.pop()
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
    """torch.no_grad: ops traced inside carry no gradient (see the module docstring)."""


class enable_grad(_GradMode):
    """torch.enable_grad: ops traced inside carry gradients again."""

    mode = True


class inference_mode(_GradMode):
    """torch.inference_mode(mode=True): as no_grad when mode is true, else no change."""

    def __init__(self, mode=True):
        super().__init__(mode if callable(mode) else None)
        self._off = callable(mode) or bool(mode)

    def __enter__(self):
        _enabled.append(False if self._off else _enabled[-1])


class set_grad_enabled(_GradMode):
    """torch.set_grad_enabled(mode): sets the mode at once when called; as a context manager
    or decorator, the mode holds for the block or call and the previous one comes back."""

    def __init__(self, mode: bool):
        super().__init__(None)
        self.mode = bool(mode)
        self._previous = _enabled[-1]
        _enabled[-1] = self.mode               # the call form takes effect at once

    def __exit__(self, *exc):
        super().__exit__(*exc)
        _enabled[-1] = self._previous          # leaving the block: the mode before the call
        return False

    def __call__(self, fn):
        _enabled[-1] = self._previous          # as a decorator it holds only inside calls
        scoped = _GradMode()
        scoped.mode = self.mode
        return scoped(fn)


__all__ = ["no_grad", "enable_grad", "inference_mode", "set_grad_enabled", "is_grad_enabled"]
