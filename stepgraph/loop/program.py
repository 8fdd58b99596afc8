"""What a recorded pass is: its events (module calls and script-level nodes), feeds and loss.

A Program is compared against later passes (passes.ReplayPass) and re-emitted into the
compiled step's trace (step.ProgramModel), so it holds the recording's own Values: inputs of
events are feeds, parameters, buffers, the step counter, or outputs of earlier events.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..ir.graph import Node, Value
from ..ir.trace import Tensor


@dataclass
class CallEvent:
    """A top-level module call: `module(*args, **kwargs)` with Values where tensors were."""
    module: Any
    args: tuple
    kwargs: dict
    outputs: Any              # the returned structure, Values where tensors were
    sites_after: int          # the dropout-site counter after the call (replays skip forward)
    mode: tuple               # the modules' training flags, grad mode and autocast then


@dataclass
class NodeEvent:
    """A node the script's own code recorded outside any module (a loss, a division)."""
    node: Node


@dataclass
class Program:
    """One recorded pass. `feeds` are the recording's input Values, in the order each
    iteration's arrays fill them; `loss` the Value backward() was called on."""
    key: tuple
    events: list = field(default_factory=list)
    feeds: list[Value] = field(default_factory=list)
    params: dict = field(default_factory=dict)      # Value -> Parameter
    buffers: dict = field(default_factory=dict)     # Value -> Buffer
    rng: Value | None = None
    loss: Value | None = None

    @property
    def signature(self) -> tuple:
        return tuple((v.shape, v.dtype) for v in self.feeds)


def tree_map(fn: Callable, obj):
    """fn applied to every leaf of nested tuples, lists and dicts (their types kept)."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):       # a namedtuple
        return type(obj)(*(tree_map(fn, o) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(tree_map(fn, o) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, tree_map(fn, v)) for k, v in obj.items())
    return fn(obj)


def tree_leaves(obj) -> list:
    leaves: list = []
    tree_map(leaves.append, obj)
    return leaves


def describe(obj) -> str:
    """A short text of an argument for a one-line reason."""
    if isinstance(obj, Tensor):
        return f"tensor{tuple(obj.shape)} {obj.value.dtype}"
    if isinstance(obj, Value):
        return f"tensor{obj.shape} {obj.dtype}"
    if isinstance(obj, np.ndarray):
        return f"array{obj.shape} {obj.dtype}"
    return repr(obj)[:40]


def same_attrs(a: dict, b: dict) -> bool:
    """Attrs equal as the compiler sees them (arrays by content, the rest by ==)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
                    and x.shape == y.shape and np.array_equal(x, y)):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True
