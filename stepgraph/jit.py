"""torch.jit as model files use it, with what each name means for a traced program.

stepgraph never runs TorchScript: it traces forward once in Python (ir/trace.py) and compiles
the whole step. So
- `is_scripting()` and `is_tracing()` are False: the code traced is the Python code, and the
  branches torch takes outside TorchScript are the ones to trace (torchvision raises inside
  `if torch.jit.is_scripting():` for paths TorchScript lacks);
- the decorators `unused`, `ignore` (with or without `drop=`), `export`, `_overload_method`
  and `_overload` return what they decorate: they only steer TorchScript's compiler (a later
  `def` of the same name replaces an overload stub, as in torch outside TorchScript);
- `script(obj)` and `trace(func, example_inputs)` return `obj` / `func` itself: a scripted or
  traced module behaves as its Python forward, and the compile that runs it here is
  compile_train_step / compile_predict (example inputs are not run);
- `annotate(type, value)` is `value`; `Final` is typing.Final.
Saving and loading TorchScript archives (`save`, `load`) and other names are refused
(UnsupportedOpError, an AttributeError)."""
from __future__ import annotations

from typing import Final  # noqa: F401  (torch.jit.Final in class annotations)


def is_scripting() -> bool:
    """False: stepgraph traces the Python code, never TorchScript."""
    return False


def is_tracing() -> bool:
    """False: torch.jit.trace is not running (stepgraph's own tracing is not torch.jit's)."""
    return False


def unused(fn):
    """Identity (TorchScript would compile the function as a raise)."""
    return fn


def export(fn):
    """Identity (TorchScript would compile the method as an entry point)."""
    return fn


def ignore(drop=False, **kwargs):
    """Identity, as `@ignore` and as `@ignore(drop=True)` (TorchScript leaves the function
    to Python, which is what runs here anyway)."""
    if callable(drop):
        return drop
    return lambda fn: fn


def _overload_method(fn):
    """Identity: an overload stub, replaced by the method defined after it."""
    return fn


def _overload(fn):
    """Identity: an overload stub, replaced by the function defined after it."""
    return fn


def script(obj, optimize=None, _frames_up: int = 0, _rcb=None, example_inputs=None):
    """`obj` itself: a module or function runs as its Python code (see the module doc)."""
    return obj


def trace(func, example_inputs=None, *args, **kwargs):
    """`func` itself, example inputs not run: its Python code is what a compile traces."""
    return func


def annotate(the_type, the_value):
    """`the_value` (a type hint for TorchScript)."""
    return the_value


def __getattr__(name: str):
    """A torch.jit name stepgraph lacks: UnsupportedOpError, which is an AttributeError."""
    from .errors import missing_torch_name
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise missing_torch_name(f"torch.jit.{name}")
