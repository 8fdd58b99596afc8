"""The tracer of a training script's tensors from a model call to backward(): a Pass.

A Pass records (mode RECORD: it is an ordinary Tracer whose script-level nodes and top-level
module calls also become a Program's events) or replays (mode REPLAY: each script-level op
and module call is compared with the next event of a recorded Program and answered with that
event's Values, so no model Python runs). At the first difference a replaying pass re-records:
it re-traces the events it had matched, with this iteration's arrays, and goes on recording;
tensors the script already holds keep working through `remap`.

Eager tensors entering a pass at script level (inputs, labels, a mask made this iteration)
become its feeds, filled with this iteration's arrays; inside a module's forward they stay
constants, as in compile_train_step. After backward() (phase PENDING) further ops are kept as
thunks, and once the step ran (DONE) they run eagerly on the values the step kept. A value read
before the step (OPEN or PENDING) is computed ahead of it by the pass's forward (loop/early.py).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any

import numpy as np

from ..errors import CaptureError, StepgraphError
from ..grad_mode import is_grad_enabled
from ..ir.graph import Value, ir_dtype
from ..ir.ops import infer_outputs
from ..ir.trace import EAGER, Tensor, Tracer, tensor_of
from .program import (CallEvent, NodeEvent, Program, align, describe, plain_equal,
                      same_attrs, tree_leaves, tree_map)

RECORD, REPLAY = "record", "replay"
OPEN, PENDING, DONE = "open", "pending", "done"


class RecaptureWarning(UserWarning):
    """The loop did something other than the captured pass: it is recorded again (one line
    saying what differed). A loop that alternates between a few programs keeps them all."""


NOT_READY = ("a value of a training pass was read before optimizer.step(): stepgraph runs "
             "forward, backward and update as one compiled step at optimizer.step(); read it "
             "after that (or evaluate under torch.no_grad() with model.eval())")


class ValueNotReadyError(StepgraphError, RuntimeError):
    """A value of a training pass read before optimizer.step() ran it that cannot be computed
    ahead of the step: a gradient, a clipped norm, or any value of a pass drawing random
    numbers (loop/early.py)."""


class _Feed:
    """An eager tensor met at script level by a replaying pass, before it is matched."""

    def __init__(self, tensor: Tensor):
        self.tensor = tensor


def trace_call(tracer: Tracer, module, args, kwargs):
    """module.forward traced under its path and label (Module.__call__'s traced branch)."""
    with tracer.module_scope(module._trace_path(tracer), module._trace_label()):
        return module.forward(*args, **kwargs)


class Pass(Tracer):
    """One training pass of a script: records a Program, or replays `expected` (module
    docstring). Tensors the script holds have this pass as their tracer."""

    def __init__(self, session, key: tuple, seed: int, expected: Program | None):
        super().__init__(seed=seed, training=True)
        self.session, self.key = session, key
        self.phase = OPEN
        self.mode = REPLAY if expected is not None else RECORD
        self.program = expected if expected is not None else Program(key)
        self.cursor = 0                            # replay: events matched so far
        self.arrays: list = [None] * len(self.program.feeds)
        self._feed_of: dict[int, tuple[Tensor, Value]] = {}   # id(eager tensor) -> its feed
        self.remap: dict[Value, Value] = {}        # replayed Values -> re-recorded ones
        self._tried: set[int] = set()              # programs a replay left
        self.handed: list[weakref.ref] = []        # script-level tensors, to find live ones
        self.deferred: dict[Value, tuple] = {}     # ops after backward(): thunks
        self.kept: dict[Value, Any] = {}           # after the step: Value -> device array
        self.host: dict[Value, np.ndarray] = {}    # values read back (or computed) on the host
        self.backend = None
        self.extra: set[Value] = set()             # step outputs not of the program (p.grad)
        self.loss_at = None             # (LoopStep, call): its loss history entry (alone)

    def extra_tensor(self, v: Value) -> Tensor:
        """A tensor of a value the step computes beside the program (a gradient, a clipped
        norm): readable once the step ran, like the pass's own."""
        self.extra.add(v)
        return self._hand1(Tensor(v, self))

    # ---- what the script's tensors reach ----
    def op_all(self, op: str, inputs: list, **attrs) -> list[Tensor]:
        if self.module_path:
            return super().op_all(op, inputs, **attrs)
        if self.phase != OPEN:
            return self._after_backward(op, inputs, attrs)
        # Tracer.op_all at script level, where a replay spends its time: inline
        values = [self._value(t) for t in inputs]
        values = self._replay(op, values, attrs, None) if self.mode == REPLAY else \
            self.emit(op, values, **attrs)
        if not is_grad_enabled():            # self.training: a pass always trains
            values = [self.emit("stop_gradient", [v])[0] for v in values]
        out = [Tensor(v, self) for v in values]
        handed = self.handed
        for t in out:
            handed.append(weakref.ref(t))
        return out

    def emit(self, op: str, inputs: list, label: str | None = None, **attrs) -> list[Value]:
        if self.mode == RECORD or self.module_path:
            outs = super().emit(op, [self._resolve(v) for v in inputs], label, **attrs)
            if not self.module_path:
                self.program.events.append(NodeEvent(self.graph.nodes[-1]))
            return outs
        return list(self._replay(op, inputs, attrs, label))

    def _replay(self, op: str, inputs: list, attrs: dict, label: str | None) -> list[Value]:
        """The next event's outputs when it is this op on these inputs (the eager ones
        among them filling its feeds); else the pass re-records and emits the op."""
        events = self.program.events
        event = events[self.cursor] if self.cursor < len(events) else None
        if type(event) is NodeEvent and event.node.op == op \
                and same_attrs(event.node.attrs, attrs) \
                and self._fill_inputs(inputs, event.node.inputs):
            self.cursor += 1
            return event.node.outputs
        reason = self._node_mismatch(event, op, inputs, attrs)
        if reason:
            self._rerecord(reason)
            return self.emit(op, inputs, label, **attrs)
        node = event.node
        for got, want in zip(inputs, node.inputs):
            if type(got) is _Feed:
                self._fill(got.tensor, want)
        self.cursor += 1
        return node.outputs

    def _value(self, t):
        if isinstance(t, Tensor):
            if t.array is not None:             # eager (Tensor.is_eager)
                return self.constant(t) if self.module_path else self._feed(t)
            if t.tracer is not self:
                return self._foreign(t)
            return self.remap.get(t.value, t.value)
        return t

    def constant(self, t: Tensor):
        """Inside a forward an eager tensor is a constant, as always; at script level a feed
        (a placeholder matched at the next op while replaying)."""
        return super().constant(t) if self.module_path else self._feed(t)

    def param(self, p) -> Tensor:
        if self.mode == REPLAY and not self.module_path:
            v = next((v for v, q in self.program.params.items() if q is p), None)
            if v is None:
                self._rerecord(f"a parameter ({p.name or 'unnamed'}) the captured pass did "
                               "not use at script level")
                return self.param(p)
            return Tensor(v, self)
        t = super().param(p)
        self.program.params[t.value] = p
        return t

    def buffer(self, b) -> Tensor:
        if self.mode == REPLAY and not self.module_path:
            v = next((v for v, q in self.program.buffers.items() if q is b), None)
            if v is None:
                self._rerecord("a buffer the captured pass did not use at script level")
                return self.buffer(b)
            return Tensor(v, self)
        if not self.module_path:
            self.session.name_state([b])     # a buffer the script uses itself
        t = super().buffer(b)
        self.program.buffers[t.value] = b
        return t

    def rng_step(self) -> Value:
        if self.mode == REPLAY and self.program.rng is not None:
            return self.program.rng
        if self.mode == REPLAY:
            self._rerecord("a random op the captured pass did not have")
        self.program.rng = super().rng_step()
        return self.program.rng

    # ---- module calls ----
    def call_module(self, module, args: tuple, kwargs: dict, mode: tuple | None = None):
        """A module called with this pass's tensors (or, for the pass's first call, the
        script's eager tensors): traced inside a forward, an event at script level. `mode`:
        the session's call_mode(module), where the caller has it."""
        if self.module_path:
            return trace_call(self, module, args, kwargs)
        if self.phase != OPEN:
            raise CaptureError(f"{type(module).__name__} was called on a value of a training "
                               "pass after its backward(): stepgraph compiles a pass from the "
                               "model call to backward(); detach() the value first")
        mode = mode or self.session.call_mode(module)
        if self.mode == REPLAY:
            event = self._next_event()
            reason = self._call_mismatch(event, module, mode, args, kwargs)
            if not reason:
                self.cursor += 1
                self._dropout_sites = event.sites_after
                outputs = event.outputs
                if type(outputs) is Value:          # a forward returning one tensor
                    return self._hand1(Tensor(outputs, self))
                return tree_map(lambda v: self._hand1(Tensor(v, self))
                                if isinstance(v, Value) else v, outputs)
            self._rerecord(reason)
            return self.call_module(module, args, kwargs)
        args, kwargs = tree_map(self._as_input, args), tree_map(self._as_input, kwargs)
        self.session.name_module(module)
        out = trace_call(self, module, args, kwargs)
        self.program.events.append(CallEvent(
            module, tree_map(_value_of, args), tree_map(_value_of, kwargs),
            tree_map(_value_of, out), self._dropout_sites, mode))
        return tree_map(lambda o: self._hand1(o) if isinstance(o, Tensor) else o, out)

    def _as_input(self, a):
        a = as_feed_tensor(a)
        if isinstance(a, Tensor):
            return Tensor(self._resolve(self._value(a)), self)
        return a

    # ---- backward and the step ----
    def backward(self, loss: Tensor) -> None:
        if self.phase != OPEN:
            raise CaptureError("backward() was called twice on one training pass (torch: "
                               "'Trying to backward through the graph a second time'); "
                               "compute the loss again")
        if loss.value.shape != ():
            raise CaptureError(f"backward() needs a scalar loss, got shape {tuple(loss.shape)} "
                               "(torch: grad can be implicitly created only for scalar outputs)")
        v = self._resolve(self._value(loss))
        while self.mode == REPLAY and (v is not self.program.loss
                                       or self.cursor != len(self.program.events)):
            self._rerecord("backward() on another value than the captured pass's loss"
                           if v is not self.program.loss else "fewer ops before backward()")
            v = self._resolve(self._value(loss))
        if self.mode == RECORD:
            self.program.loss = v
            self.session.programs_add(self)
        self.phase = PENDING

    def live_values(self) -> list[Value]:
        """The pass's Values the script still holds (through tensors or thunks' inputs)."""
        found = []
        for ref in self.handed:
            t = ref()
            if t is not None and t.tracer is self:
                v = self.remap.get(t.value, t.value)
                if v not in found and v not in self.deferred:
                    found.append(v)
        for op, inputs, attrs, index in self.deferred.values():
            for t in inputs:
                if isinstance(t, Tensor) and t.tracer is self and t.value not in found \
                        and t.value not in self.deferred:
                    found.append(t.value)
        return found

    def read_value(self, v: Value) -> np.ndarray:
        """The values of one of this pass's tensors (storage dtype): the step's once it ran;
        before, those the pass's forward computes, evaluated ahead of it (loop/early.py)."""
        v = self.remap.get(v, v)
        if v in self.host:
            return self.host[v]
        at = self.program.feed_index.get(v)
        if at is not None and self.arrays[at] is not None:
            return self.arrays[at]
        if self.phase != DONE:
            return self._read_before_step(v)
        if v is self.program.loss and self.loss_at is not None:
            step, call = self.loss_at
            self.host[v] = step.loss_of(call).numpy()
        elif v in self.deferred:
            self.host[v] = self._run_thunk(v)
        elif v in self.kept:
            self.host[v] = self.session.to_host(self.backend, self.kept[v], v.dtype)
        else:
            raise CaptureError("this value of the training pass was not kept: no tensor held "
                               "it when optimizer.step() ran")
        return self.host[v]

    def _read_before_step(self, v: Value) -> np.ndarray:
        """A value read before the step: an op after backward() runs on its inputs' values;
        a gradient or clipped norm waits for the step; a value of the forward is computed by
        one run of the pass's compiled forward, with the other scalars the script holds."""
        if v in self.deferred:
            self.host[v] = self._run_thunk(v)
        elif v in self.extra:
            raise ValueNotReadyError(NOT_READY)
        else:
            for u, values in self.session.values_before_step(self, v).items():
                self.host.setdefault(u, values)          # a value read once stays as read
        return self.host[v]

    # ---- after backward ----
    def _after_backward(self, op: str, inputs: list, attrs: dict) -> list[Tensor]:
        if self.phase == DONE:
            return EAGER.op_all(op, [self._eager(t) for t in inputs], **attrs)
        values = [t.value if isinstance(t, Tensor) else t for t in inputs]
        specs = infer_outputs(op, values, attrs)
        outs = [Value(shape, dtype) for shape, dtype in specs]
        for i, v in enumerate(outs):
            self.deferred[v] = (op, list(inputs), dict(attrs), i)
        return self._hand([Tensor(v, self) for v in outs])

    def _run_thunk(self, v: Value) -> np.ndarray:
        op, inputs, attrs, index = self.deferred[v]
        return EAGER.op_all(op, [self._eager(t) for t in inputs], **attrs)[index].array

    def _eager(self, t):
        """A tensor of this pass as an eager tensor of its values (others as they are)."""
        if isinstance(t, Tensor) and t.tracer is self:
            return Tensor(Value(t.value.shape, t.value.dtype), EAGER, self.read_value(t.value))
        return t

    # ---- feeds ----
    def _feed(self, t: Tensor):
        held = self._feed_of.get(id(t))
        if held is not None:
            return held[1]
        if self.mode == REPLAY:
            return _Feed(t)
        v = self.input(t.shape, t.value.dtype, f"feed{len(self.program.feeds)}").value
        self.program.add_feed(v)
        self.arrays.append(t.array)
        self._feed_of[id(t)] = (t, v)                 # held: its id stays unique
        return v

    def _fill(self, t: Tensor, want: Value) -> None:
        self.arrays[self.program.feed_index[want]] = t.array
        self._feed_of[id(t)] = (t, want)

    def _foreign(self, t: Tensor) -> Value:
        """A tensor of another pass (an earlier iteration's output carried over, a hidden
        state): its values, fed as data."""
        if isinstance(t.tracer, Pass) and t.tracer.phase == DONE:
            return self._feed(t.tracer._eager(t))
        raise CaptureError("a value of another training pass that has not been stepped "
                           "entered this one: call optimizer.step() or detach() it first")

    def _resolve(self, x):
        if isinstance(x, _Feed):
            return self._feed(x.tensor)
        return self.remap.get(x, x) if isinstance(x, Value) else x

    # ---- replay matching ----
    def _next_event(self):
        events = self.program.events
        return events[self.cursor] if self.cursor < len(events) else None

    def _node_mismatch(self, event, op: str, inputs: list, attrs: dict) -> str:
        if type(event) is not NodeEvent:
            got = "a module call" if isinstance(event, CallEvent) else "backward()"
            return f"{self._where('op')} was {got}, the loop now does {op}"
        node = event.node
        if node.op != op or not same_attrs(node.attrs, attrs):
            return f"{self._where('op')} was {node.op}{_short(node.attrs)}, " \
                f"now {op}{_short(attrs)}"
        return self._inputs_mismatch("op", inputs, node.inputs)

    def _where(self, what: str) -> str:
        """The event being compared, for a reason's text: op or step n of the pass."""
        return f"{what} {self.cursor + 1} of the captured pass"

    def _call_mismatch(self, event, module, mode, args, kwargs) -> str:
        if type(event) is not CallEvent or event.module is not module:
            return f"{self._where('step')} was {_event_name(event)}, now a call of " \
                f"{type(module).__name__}"
        if event.mode != mode:
            return f"{type(module).__name__}'s mode changed (train/eval, grad, autocast)"
        if not kwargs and not event.kwargs and self._fill_call(args, event.args):
            return ""
        got = tree_leaves(args) + (tree_leaves(tuple(kwargs.values())) if kwargs else [])
        want = event.leaves
        if len(got) != len(want) or (kwargs.keys() != event.kwargs.keys()):
            return f"{type(module).__name__} is called with other arguments"
        tensors, expected = [], []
        for a, w in zip(got, want):
            a = as_feed_tensor(a)
            if isinstance(a, Tensor):
                tensors.append(self._value(a))
                expected.append(w)
            elif isinstance(w, Value) or not plain_equal(a, w):
                return f"{type(module).__name__}'s argument {describe(a)} was {describe(w)}"
        reason = self._inputs_mismatch("step", tensors, expected)
        if not reason:
            for g, w in zip(tensors, expected):
                if isinstance(g, _Feed):
                    self._fill(g.tensor, w)
        return reason

    def _fill_call(self, args: tuple, want) -> bool:
        """The common module call, decided without building the general comparison: each
        argument an eager tensor of the shape and dtype of its own feed of the event, none
        of them matched yet. Fills those feeds and says True; False (nothing filled) sends
        the call to the general comparison, which finds the same or says what differs."""
        if type(want) is not tuple or len(args) != len(want):
            return False
        feeds, arrays, feed_of = self.program.feed_index, self.arrays, self._feed_of
        slots = []
        for a, w in zip(args, want):
            if type(a) is not Tensor or a.array is None or type(w) is not Value \
                    or id(a) in feed_of:
                return False
            j = feeds.get(w)
            v = a.value
            if j is None or arrays[j] is not None or v.shape != w.shape or v.dtype != w.dtype:
                return False
            slots.append(j)
        if len(slots) > 1 and len(set(slots)) != len(slots):
            return False
        for a, w, j in zip(args, want, slots):
            arrays[j] = a.array
            feed_of[id(a)] = (a, w)
        return True

    def _fill_inputs(self, got: list, want: list) -> bool:
        """_fill_call for an op's inputs: each the event's own Value, or an eager tensor of
        the shape and dtype of the event's feed there, unmatched so far. True: its feeds
        filled; False (nothing filled): _inputs_mismatch decides."""
        if len(got) != len(want):
            return False
        fills = None
        for g, w in zip(got, want):
            if g is w:
                continue
            if type(g) is not _Feed:
                return False
            j = self.program.feed_index.get(w)
            v = g.tensor.value
            if j is None or self.arrays[j] is not None or v.shape != w.shape \
                    or v.dtype != w.dtype:
                return False
            fills = [(j, g.tensor, w)] if fills is None else [*fills, (j, g.tensor, w)]
        if fills is not None:
            if len(fills) > 1 and len({j for j, _, _ in fills}) != len(fills):
                return False
            for j, t, w in fills:
                self.arrays[j] = t.array
                self._feed_of[id(t)] = (t, w)
        return True

    def _inputs_mismatch(self, what: str, got: list, want: list) -> str:
        """Why inputs `got` are not the event's `want` ("" when they are); `what` ("op" or
        "step") names the event in the reason's text."""
        def where():
            return self._where(what)
        if len(got) != len(want):
            return f"{where()} had {len(want)} inputs, now {len(got)}"
        feeds = self.program.feed_index
        claimed: dict[int, int] = {}
        for i, (g, w) in enumerate(zip(got, want)):
            if g is w:
                continue
            if not isinstance(g, _Feed):
                return f"{where()}: input {i} is another value than the captured one"
            j = feeds.get(w)
            if j is None:
                return f"{where()}: input {i} was a computed value, now data"
            t = g.tensor.value
            if t.shape != w.shape or t.dtype != w.dtype:
                return f"{where()}: input {i} was {describe(w)}, now {describe(g.tensor)}"
            if self.arrays[j] is not None or claimed.setdefault(j, id(g.tensor)) != \
                    id(g.tensor):
                return f"{where()}: input {i} is another tensor than the captured one"
        return ""

    def adopt(self, program: Program, m: dict[Value, Value]) -> None:
        """Follow `program` instead of this pass's own, its Values standing for ours by `m`
        (program.align): a recording equal to a known program, or a replay switching to
        another known program that agrees with what was matched so far."""
        self.remap = {k: m.get(v, v) for k, v in self.remap.items()}
        self.remap.update(m)
        self.program = program
        self.arrays = (self.arrays + [None] * len(program.feeds))[:len(program.feeds)]

    def _rerecord(self, reason: str) -> None:
        """Leave the program being replayed: for another known program of this loop that
        agrees with what was matched so far (a loop alternating between bodies), or else
        re-trace the events matched so far with this iteration's arrays and record from
        here on."""
        self._tried.add(id(self.program))
        for other in self.session.programs.get(self.key, ()):
            if id(other) in self._tried:
                continue
            m = align(self.program, other, self.cursor)
            if m is not None:
                self.adopt(other, m)
                return
        warnings.warn(f"stepgraph re-captures the training loop: {reason}",
                      RecaptureWarning, stacklevel=4)
        expected, matched, arrays = self.program, self.cursor, self.arrays
        self.mode, self.program, self.arrays = RECORD, Program(self.key), []
        self._dropout_sites = 0
        fed = {v: a for v, a in zip(expected.feeds, arrays) if a is not None}
        self._feed_of = {}
        remap = self.remap
        for fv, a in fed.items():
            remap[fv] = self._feed(tensor_of(a))
        for v, p in expected.params.items():
            remap[v] = self.param(p).value
        for v, b in expected.buffers.items():
            remap[v] = self.buffer(b).value
        if expected.rng is not None:
            remap[expected.rng] = self.rng_step()
        for event in expected.events[:matched]:
            if isinstance(event, NodeEvent):
                n = event.node
                outs = self.emit(n.op, [remap.get(v, v) for v in n.inputs], n.label,
                                 **n.attrs)
                remap.update(zip(n.outputs, outs))
                continue
            as_tensor = (lambda v: Tensor(remap.get(v, v), self)
                         if isinstance(v, Value) else v)
            out = self.call_module(event.module, tree_map(as_tensor, event.args),
                                   tree_map(as_tensor, event.kwargs))
            for old, new in zip(tree_leaves(event.outputs), tree_leaves(out)):
                if isinstance(old, Value):
                    remap[old] = new.value

    # ---- bookkeeping ----
    def _hand(self, tensors: list[Tensor]) -> list[Tensor]:
        for t in tensors:
            self._hand1(t)
        return tensors

    def _hand1(self, t: Tensor) -> Tensor:
        self.handed.append(weakref.ref(t))
        return t


def as_feed_tensor(a):
    """A module argument as a tensor where it is an array: NumPy arrays as eager tensors, a
    batch already on the GPU (CuPy, __cuda_array_interface__) as an eager tensor holding it,
    fed to the step as it is."""
    if type(a) is Tensor:                 # the common argument: first, and cheap
        return a
    if isinstance(a, np.ndarray):
        return tensor_of(a)
    if hasattr(a, "__cuda_array_interface__") and hasattr(a, "dtype"):
        return Tensor(Value(tuple(a.shape), ir_dtype(a.dtype)), EAGER, a)
    return a


def _value_of(x):
    return x.value if isinstance(x, Tensor) else x


def _short(attrs: dict) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in attrs.items() if k not in ("label",))
    return f"({text[:60]})" if text else ""


def _event_name(event) -> str:
    if isinstance(event, CallEvent):
        return f"a call of {type(event.module).__name__}"
    if isinstance(event, NodeEvent):
        return f"op {event.node.op}"
    return "backward()"

