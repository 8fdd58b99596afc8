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

    def __post_init__(self):
        # args then keyword values, flat: what a replayed call is compared with
        self.leaves = tree_leaves(self.args) + tree_leaves(tuple(self.kwargs.values()))


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
    feed_index: dict = field(default_factory=dict, repr=False)   # feed Value -> position

    def add_feed(self, v: Value) -> None:
        self.feed_index[v] = len(self.feeds)
        self.feeds.append(v)


def tree_map(fn: Callable, obj):
    """fn applied to every leaf of nested tuples, lists and dicts (their types kept)."""
    if type(obj) is tuple and not any(type(o) in _CONTAINERS for o in obj):   # flat: fast
        return tuple(fn(o) if not isinstance(o, _CONTAINERS) else tree_map(fn, o)
                     for o in obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):       # a namedtuple
        return type(obj)(*(tree_map(fn, o) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(tree_map(fn, o) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, tree_map(fn, v)) for k, v in obj.items())
    return fn(obj)


def tree_leaves(obj) -> list:
    if type(obj) is tuple and not any(isinstance(o, _CONTAINERS) for o in obj):
        return list(obj)
    leaves: list = []
    tree_map(leaves.append, obj)
    return leaves


_CONTAINERS = (tuple, list, dict)


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


def align(a: Program, b: Program, events: int | None = None) -> dict[Value, Value] | None:
    """A map from a's Values to b's under which a's first `events` events (all: None) are
    b's: the same modules, modes and arguments, ops and attrs, on corresponding feeds,
    parameters, buffers and earlier results. None when they differ. Two recordings of one
    loop body align; replaying against either gives the same step."""
    n = len(a.events) if events is None else events
    if n > len(b.events) or (events is None and len(a.events) != len(b.events)):
        return None
    m: dict[Value, Value] = {}

    def same(x, y) -> bool:
        if not isinstance(x, Value) or not isinstance(y, Value):
            return not isinstance(x, Value) and not isinstance(y, Value) and plain_equal(x, y)
        if x in m:
            return m[x] is y
        if x in a.feeds:
            ok = y in b.feeds and a.feeds.index(x) == b.feeds.index(y) and \
                (x.shape, x.dtype) == (y.shape, y.dtype)
        elif x in a.params or x in a.buffers:
            ok = (a.params.get(x) or a.buffers.get(x)) is (b.params.get(y) or b.buffers.get(y))
        else:
            ok = x is a.rng and y is b.rng
        if ok:
            m[x] = y
        return ok

    def outputs(xs, ys) -> bool:
        xs, ys = tree_leaves(xs), tree_leaves(ys)
        if len(xs) != len(ys):
            return False
        for x, y in zip(xs, ys):
            if isinstance(x, Value) and isinstance(y, Value) and x.shape == y.shape:
                m[x] = y
            elif isinstance(x, Value) or isinstance(y, Value) or not plain_equal(x, y):
                return False
        return True

    for ea, eb in zip(a.events[:n], b.events[:n]):
        if isinstance(ea, CallEvent) and isinstance(eb, CallEvent):
            la, lb = tree_leaves((ea.args, ea.kwargs)), tree_leaves((eb.args, eb.kwargs))
            if ea.module is not eb.module or ea.mode != eb.mode or len(la) != len(lb) \
                    or ea.sites_after != eb.sites_after \
                    or not all(same(x, y) for x, y in zip(la, lb)) \
                    or not outputs(ea.outputs, eb.outputs):
                return None
        elif isinstance(ea, NodeEvent) and isinstance(eb, NodeEvent):
            na, nb = ea.node, eb.node
            if na.op != nb.op or not same_attrs(na.attrs, nb.attrs) \
                    or len(na.inputs) != len(nb.inputs) \
                    or not all(same(x, y) for x, y in zip(na.inputs, nb.inputs)) \
                    or not outputs(na.outputs, nb.outputs):
                return None
        else:
            return None
    if events is None and not (a.loss in m and m[a.loss] is b.loss):
        return None
    return m


def plain_equal(x, y) -> bool:
    """Equal non-tensor arguments: the same type and ==, or the same object where == fails."""
    try:
        return type(x) is type(y) and bool(x == y)
    except Exception:                    # noqa: BLE001 - objects without a plain ==
        return x is y
