"""torch.compile as a training script calls it."""
from __future__ import annotations


def compile(model=None, *, fullgraph: bool = False, dynamic=None, backend="inductor",  # noqa: A001
            mode=None, options=None, disable: bool = False):
    """torch.compile(model, ...): returns `model` itself. stepgraph always compiles: a
    training loop over the model becomes one compiled step (loop capture) and evaluation a
    compiled predictor, whatever fullgraph, dynamic, backend, mode and options say (accepted
    and ignored). Used as a decorator (`@torch.compile` or `@torch.compile(mode=...)`) it
    returns the function unchanged."""
    if model is None:
        return lambda fn: fn
    return model
