"""Where the core reaches the loop capture without importing it: nn.Module calls, Parameters used
at script level, and Tensor.backward. Nothing here runs until a torch-style optimizer exists
(LoopSession.register sets `SESSION`), so compile_train_step users never pay for it."""
from __future__ import annotations

SESSION = None          # the LoopSession, once an optimizer was made with parameters
# loop/session.py's session(), set by the package's __init__: the core (nn, optim) reaches
# the loop through this module only, so that it never imports the compile pipeline.
MAKE_SESSION = None
# Bumped whenever a module's training flag or a parameter's requires_grad changes: the
# session's per-call checks (modes, trainable sets) are cached under it.
VERSION = [0]


def changed() -> None:
    VERSION[0] += 1


def call_handler(module):
    """What runs `module(...)` called with no traced tensor: None (eagerly, as before), or
    a function (module, args, kwargs) -> output that records or replays a training pass or
    runs the compiled predictor."""
    return None if SESSION is None else SESSION.call_handler(module)


def open_pass():
    """The training pass being recorded or replayed at script level, else None."""
    return None if SESSION is None else SESSION.open_pass()


def grad_of(param):
    """p.grad: the gradient a training script's waiting step will compute, or None."""
    return None if SESSION is None else SESSION.grad_of(param)


def session():
    """The process's loop session, made on first use."""
    return SESSION if SESSION is not None else MAKE_SESSION()
