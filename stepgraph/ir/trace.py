"""Tracing: modules are called once on symbolic tensors and every op records a node.

`Tracer` builds a Graph; `Tensor` is the symbolic value modules see. Nothing here runs per step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .graph import INPUT, PARAM, STATE, Graph, Node, Value
from .ops import OPS, infer_outputs

if TYPE_CHECKING:
    from ..nn.module import Parameter


class Tensor:
    """A symbolic tensor: a Value plus the tracer recording ops on it."""

    def __init__(self, value: Value, tracer: Tracer):
        self.value = value
        self.tracer = tracer

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def dtype(self) -> str:
        return self.value.dtype

    @property
    def ndim(self) -> int:
        return len(self.value.shape)

    def reshape(self, *shape) -> Tensor:
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if -1 in shape:
            known = 1
            for d in shape:
                known *= d if d != -1 else 1
            shape = tuple(self.value.size // known if d == -1 else d for d in shape)
        return self.tracer.op("reshape", [self], shape=tuple(shape))

    def __repr__(self):
        return f"Tensor({self.value!r})"


class Tracer:
    """Records nodes into `graph`. Parameters and state become external values once each."""

    def __init__(self, seed: int = 0, training: bool = True):
        self.graph = Graph()
        self.seed = seed
        self.training = training
        self.param_values: dict[int, Value] = {}   # id(Parameter) -> Value
        self.parameters: list[Parameter] = []
        self._rng_step: Value | None = None
        self._dropout_sites = 0
        self.label = ""                            # module label for recorded nodes

    # ---- externals ----
    def input(self, shape, dtype: str, name: str) -> Tensor:
        v = Value(tuple(shape), dtype, INPUT, name)
        self.graph.inputs.append(v)
        return Tensor(v, self)

    def param(self, p: Parameter) -> Tensor:
        v = self.param_values.get(id(p))
        if v is None:
            v = Value(p.shape, p.dtype, PARAM, p.name)
            self.param_values[id(p)] = v
            self.parameters.append(p)
            self.graph.params.append(v)
        return Tensor(v, self)

    def state(self, shape, dtype: str, name: str) -> Value:
        v = Value(tuple(shape), dtype, STATE, name)
        self.graph.state.append(v)
        return v

    def rng_step(self) -> Value:
        """The device step counter dropout reads; shared with the optimizer (`optimizer.step`)."""
        if self._rng_step is None:
            self._rng_step = self.state((), "int64", "optimizer.step")
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
        values = [t.value if isinstance(t, Tensor) else t for t in inputs]
        return Tensor(self.emit(op, values, **attrs)[0], self)

    def op_all(self, op: str, inputs: list, **attrs) -> list[Tensor]:
        values = [t.value if isinstance(t, Tensor) else t for t in inputs]
        return [Tensor(v, self) for v in self.emit(op, values, **attrs)]
