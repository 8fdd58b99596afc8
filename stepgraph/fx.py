"""torch.fx as model files use it: `torch.fx.wrap("name")` at module level (torchvision marks
its helpers so that fx's symbolic tracing keeps them as leaf calls).

stepgraph traces every forward itself (ir/trace.py) and calls a wrapped function like any
other Python code, so `wrap` registers nothing and returns its argument. fx's own symbolic
tracing (`symbolic_trace`, `Tracer`, `GraphModule`) builds torch.fx graphs of torch ops, which
stepgraph has no use for: refused with a line naming what compiles a model here."""
from __future__ import annotations

from .errors import UnsupportedOpError

_COMPILE = "stepgraph.compile_train_step / compile_predict (they trace forward themselves)"


def wrap(fn_or_name):
    """Identity: torch.fx.wrap("f") or @torch.fx.wrap marks `f` as a leaf for fx's tracer;
    stepgraph's tracer runs `f` (its ops are recorded), so there is nothing to mark."""
    return fn_or_name


def symbolic_trace(root, concrete_args=None):
    """Refused: stepgraph does not build torch.fx graphs."""
    raise UnsupportedOpError(f"torch.fx.symbolic_trace is not supported by stepgraph; use "
                             f"{_COMPILE}")


def __getattr__(name: str):
    """A torch.fx name stepgraph lacks (Tracer, GraphModule, Proxy, ...): UnsupportedOpError,
    which is an AttributeError."""
    from .errors import missing_torch_name
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise missing_torch_name(f"torch.fx.{name}")
