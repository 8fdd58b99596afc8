"""Tracing: modules are called once on symbolic tensors and every op records a node.

`Tracer` builds a Graph; `Tensor` (ir/tensor.py, its methods in the tensor_*.py families) is
the symbolic value modules see. Nothing here runs per step. Outside a traced forward, tensors
are eager: `EAGER` runs each op at once (its shape rule and its NumPy reference), so every
Tensor method works on concrete values as well. An eager tensor that meets a traced one
becomes a `constant` of the trace.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ..grad_mode import is_grad_enabled
from .graph import INPUT, PARAM, STATE, Graph, Node, Value, ir_dtype, storage_dtype
from .ops import OPS, infer_outputs
from .tensor import Size, Tensor  # noqa: F401  (Size: re-exported, as torch.Size is)


# Tracers whose module forward is running, innermost last (Tracer.module_scope pushes).
_ACTIVE: list[Tracer] = []


def current_tracer() -> Tracer | None:
    """The tracer of the module forward being traced right now, else None. Tensor factories
    with no tensor argument (stepgraph.functions.factories) record into it."""
    return _ACTIVE[-1] if _ACTIVE else None


class Tracer:
    """Records nodes into `graph`. Parameters and state become external values once each.
    Parameters and Buffers (`param`, `buffer`) are nn/module.py's, not named in annotations
    here: nn imports the IR."""

    def __init__(self, seed: int = 0, training: bool = True, frozen: frozenset = frozenset(),
                 rng_key: str = "optimizer.step"):
        self.graph = Graph()
        self.frozen = frozen                       # ids of Parameters traced as constants
        self.seed = seed
        self.training = training
        self.rng_key = rng_key                     # the state value random draws read
        self.param_values: dict[int, Value] = {}   # id(Parameter) -> Value
        self.parameters: list = []                 # the Parameters traced, in order
        self.buffer_values: dict[int, Value] = {}  # id(Buffer) -> its state Value
        self._rng_step: Value | None = None
        self._dropout_sites = 0
        self.label = ""                            # module label for recorded nodes
        self.module_path: list[str] = []           # paths of the modules being called
        self.module_paths: dict[int, str] = {}     # id(module) -> path, set by the root call
        self._constants: dict[int, tuple] = {}     # id(eager Tensor) -> (it, constant Value)
        # Values computed inside torch.utils.checkpoint regions: the backward recomputes them
        # instead of keeping them (compile/recompute.py).
        self.recomputed: set[Value] = set()

    # ---- where ops come from ----
    def where(self) -> str:
        """The path of the module whose forward is running, e.g. "model.layer1.0.conv1"."""
        return self.module_path[-1] if self.module_path else "no module (top level)"

    @contextmanager
    def module_scope(self, path: str, label: str):
        """Nodes recorded inside carry `label`; errors name `path`. Both restored on exit.
        While inside, this is the current tracer (`current_tracer`)."""
        saved = self.label
        self.module_path.append(path)
        self.label = label
        _ACTIVE.append(self)
        try:
            yield
        finally:
            _ACTIVE.pop()
            self.module_path.pop()
            self.label = saved

    # ---- externals ----
    def input(self, shape, dtype: str, name: str) -> Tensor:
        v = Value(tuple(shape), dtype, INPUT, name)
        self.graph.inputs.append(v)
        return Tensor(v, self)

    def param(self, p) -> Tensor:
        """A Parameter as a `param` value, once per Parameter; a frozen one (in `frozen`) as
        a `state` value instead, like a buffer: the backward and the update never see it."""
        if id(p) in self.frozen:
            return self.buffer(p)
        v = self.param_values.get(id(p))
        if v is None:
            v = Value(p.shape, p.dtype, PARAM, p.name)
            self.param_values[id(p)] = v
            self.parameters.append(p)
            self.graph.params.append(v)
        return Tensor(v, self)

    def buffer(self, b) -> Tensor:
        """A module buffer as a `state` value named by its state_dict key, once per buffer:
        compiled steps bind it to the buffer's storage, and ops may update it in place."""
        v = self.buffer_values.get(id(b))
        if v is None:
            if not b.name:
                raise ValueError(f"{b!r} has no state_dict key: register it on a module of "
                                 "the model being traced")
            v = self.state(b.shape, b.dtype, b.name)
            self.buffer_values[id(b)] = v
        return Tensor(v, self)

    def state(self, shape, dtype: str, name: str) -> Value:
        v = Value(tuple(shape), dtype, STATE, name)
        self.graph.state.append(v)
        return v

    def rng_step(self) -> Value:
        """The device step counter dropout and random draws read: a train trace's is shared
        with the optimizer (`optimizer.step`), a predict trace's is the predictor's own
        (`rng_key`, compile/build.py)."""
        if self._rng_step is None:
            self._rng_step = self.state((), "int64", self.rng_key)
        return self._rng_step

    @property
    def rng_counter(self) -> Value | None:
        """The counter `rng_step` made, or None when nothing traced so far draws."""
        return self._rng_step

    def next_dropout_site(self) -> int:
        self._dropout_sites += 1
        return self._dropout_sites - 1

    # ---- ops ----
    def emit(self, op: str, inputs: list[Value], label: str | None = None, **attrs) -> list[Value]:
        specs = infer_outputs(op, inputs, attrs)
        outs = [Value(shape, dtype) for shape, dtype in specs]
        mutates = OPS[op].mutates(attrs)
        self.graph.nodes.append(Node(op, list(inputs), outs, attrs, mutates,
                                     self.label if label is None else label))
        return outs

    def op(self, op: str, inputs: list, **attrs) -> Tensor:
        """Record `op` on tensors (or values); return its first output as a Tensor."""
        return self.op_all(op, inputs, **attrs)[0]

    def op_all(self, op: str, inputs: list, **attrs) -> list[Tensor]:
        """As `op`, every output. Under no_grad (grad_mode) each output of a training trace
        passes through a stop_gradient view, so the backward stops there (an eval trace, as
        compile_predict's, has no backward: no views that would split fusable patterns)."""
        values = self.emit(op, [self._value(t) for t in inputs], **attrs)
        if self.training and not is_grad_enabled():
            values = [self.emit("stop_gradient", [v])[0] for v in values]
        return [Tensor(v, self) for v in values]

    def _value(self, t) -> Value:
        """The Value of an op input: a tensor's, an eager tensor's constant, or `t` itself."""
        if not isinstance(t, Tensor):
            return t
        return self.constant(t) if t.is_eager else t.value

    def constant(self, t: Tensor) -> Value:
        """Eager tensor `t` as a `constant` node's output, once per tensor: its values at
        trace time become part of the graph."""
        held = self._constants.get(id(t))
        if held is None:
            data = Constant(np.array(t.array, order="C"))   # its values now, 0-d kept
            held = self._constants[id(t)] = (t, self.emit("constant", [], data=data,
                                                          dtype=t.value.dtype)[0])
        return held[1]


class Constant:
    """The array of a `constant` node (attrs data). Equal only to itself, so passes that
    compare attrs never compare arrays; its repr is short, for dumps and profiles."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __repr__(self):
        return f"Constant({self.array.dtype}{list(self.array.shape)})"


class EagerTracer:
    """Runs ops at once instead of recording them: what tensors made outside a traced
    forward use. `op` checks the op's shape rule, then runs its NumPy reference on the
    inputs' arrays. An op that also reads a traced tensor is recorded into that tensor's
    trace instead (the eager inputs becoming constants)."""

    training = False
    seed = 0

    def __init__(self):
        self._dropout_sites = 0

    def where(self) -> str:
        return "eager code (outside a traced forward)"

    def rng_step(self) -> Tensor:
        """Eager dropout's step counter: always 0; each call draws at a new site instead,
        so every eager dropout gets a fresh mask."""
        return tensor_of(np.zeros((), np.int64))

    def next_dropout_site(self) -> int:
        self._dropout_sites += 1
        return self._dropout_sites - 1

    def op(self, op: str, inputs: list, **attrs) -> Tensor:
        return self.op_all(op, inputs, **attrs)[0]

    def op_all(self, op: str, inputs: list, **attrs) -> list[Tensor]:
        traced = next((t.tracer for t in inputs if isinstance(t, Tensor) and not t.is_eager),
                      None)
        if traced is not None:
            return traced.op_all(op, inputs, **attrs)
        from ..backends import get_backend
        from ..compile.plan import VIEW_OPS

        values = [t.value for t in inputs]
        outs = [Value(shape, dtype) for shape, dtype in infer_outputs(op, values, attrs)]
        if op in VIEW_OPS:          # as a plan runs them: the input's array, reshaped
            return [Tensor(outs[0], self, inputs[0].array.reshape(outs[0].shape))]
        node = Node(op, values, outs, attrs, OPS[op].mutates(attrs), "eager")
        arrays = [np.empty(v.shape, storage_dtype(v.dtype)) for v in outs]
        get_backend("cpu").run_node(node, [t.array for t in inputs], arrays)
        return [Tensor(v, self, a) for v, a in zip(outs, arrays)]

    def param(self, p) -> Tensor:
        """A Parameter's current values as an eager tensor (a copy)."""
        return tensor_of(p.numpy())

    buffer = param


EAGER = EagerTracer()


def tensor_of(array: np.ndarray) -> Tensor:
    """An eager tensor holding `array` (storage dtype; uint16 is bfloat16 bits), not copied."""
    array = np.asarray(array)
    return Tensor(Value(array.shape, ir_dtype(array.dtype)), EAGER, array)
