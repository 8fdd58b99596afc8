"""A value of a training pass read before optimizer.step() ran it: the pass's program (or the
events of it matched so far) evaluated forward-only, ahead of the step.

torch has computed the loss by the time `loss.backward()` returns, so scripts read it there
(`running += loss.item()` between the backward() calls of gradient accumulation, a print before
backward()). A captured loop computes it in the one step optimizer.step() runs; a read before
that runs the pass's forward once more, here, and the value is the one the step computes:
- the same arithmetic: the forward is traced as the step traces it (emit_program, training
  mode, grad enabled, the step's frozen set and precision) and goes through the same passes
  before autodiff (compile/build.py rewrite_train_forward);
- no state changes: what the forward writes in place (BatchNorm's running statistics and
  num_batches_tracked) goes to scratch copies of those buffers, filled before each run; the
  optimizer state, the step counter and the loss history are the step's alone;
- a pass that draws random numbers (dropout, torch.rand) is refused: an evaluation ahead of the
  step would draw other masks than the step's.
The compiled forward is kept per program, the events evaluated and the values computed, so a
replayed loop compiles it once; the values come back to the host and stay in Pass.host.
"""
from __future__ import annotations

import numpy as np

from ..api import _CompiledModel
from ..compile.build import _trace_inputs, rewrite_train_forward
from ..compile.executable import INFERENCE
from ..compile.feed import Signature
from ..grad_mode import enable_grad
from ..ir.graph import PARAM, Graph, Value
from ..ir.trace import Tracer
from .passes import NOT_READY, REPLAY, ValueNotReadyError
from .program import CallEvent, Program, tree_leaves
from .step import ProgramModel, emit_program

RANDOM = ("a value of a training pass was read before optimizer.step(), and the pass draws "
          "random numbers (dropout, torch.rand, ...): evaluated ahead of the step it would draw "
          "other masks than the step's; read it after optimizer.step() (or evaluate under "
          "torch.no_grad() with model.eval())")


class PassForward(_CompiledModel):
    """The forward of `program` computing the Values `wanted` of it, on the step's device and
    precision, reading the parameters and buffers in place (state it writes: scratch)."""

    mode = INFERENCE
    freezes = True

    def __init__(self, model: ProgramModel, program: Program, wanted: tuple, arrays,
                 device: str, precision: str, trained: frozenset):
        self.program, self.wanted, self._trained = program, wanted, trained
        self._written: set[Value] = set()        # externals the plan writes in place
        self._scratch: list[tuple] = []          # (scratch buffer, the Parameter or Buffer)
        super().__init__(model, arrays, device, None, precision, with_target=False)
        self.executable(self.signature)

    def _trains(self, p) -> bool:
        return p.requires_grad and id(p) in self._trained     # as LoopStep's

    def build_graph(self, signature: Signature) -> Graph:
        self.model.name_parameters()
        tracer = Tracer(training=True, frozen=self.frozen)
        with enable_grad():                   # as optimizer.step() traces it
            m = emit_program(tracer, self.program, _trace_inputs(tracer, signature))
        loss = () if self.program.loss is None else (m[self.program.loss],)
        recomputed = tuple(tracer.recomputed)
        graph = tracer.graph
        graph.outputs = {f"value{i}": m[v] for i, v in enumerate(self.wanted)}
        return rewrite_train_forward(graph, self.model, self.device, loss, recomputed,
                                     self.module_values, self.memory_format, self.precision)

    def plan(self, signature: Signature):
        plan = super().plan(signature)
        self._written = {n.inputs[i] for n in plan.steps for i in n.mutates}
        return plan

    def bind(self, v: Value):
        if v not in self._written:
            return super().bind(v)
        held = (self.params if v.role == PARAM else self.buffers)[v.name]
        scratch = self.backend.empty(v.shape, v.dtype)
        self._scratch.append((scratch, held))
        return scratch

    def __call__(self, arrays) -> dict[Value, object]:
        """The wanted Values' device buffers after one run on `arrays` (overwritten by the
        next run)."""
        exe = self._prepare(arrays)
        for scratch, held in self._scratch:
            self.backend.copy_into(scratch, held.storage)
        exe.run(self.use_graph)
        return {v: exe.outputs[f"value{i}"] for i, v in enumerate(self.wanted)}


def values_before_step(session, pass_, v: Value) -> dict[Value, np.ndarray]:
    """Value `v` of `pass_` (not stepped), and the other scalars of it the script holds, on the
    host: one run of the pass's compiled forward (made on first use)."""
    program = pass_.program
    events = pass_.cursor if pass_.mode == REPLAY else len(program.events)
    made = _computed(program.events[:events])
    if v not in made:
        raise ValueNotReadyError(NOT_READY)
    if program.rng is not None:
        raise ValueNotReadyError(RANDOM)
    live = {u for u in pass_.live_values() if u.shape == ()}
    wanted = tuple(u for u in made if u is v or u in live)
    precision = pass_.key[1][2] or session._float32_precision()     # the step's
    key = (id(program), events, tuple(u.id for u in wanted), precision)
    held = session.early.get(key)
    if held is None or held[0] is not program:
        part = _prefix(program, events)
        session.name_state([*part.params.values(), *part.buffers.values()])
        held = session.early[key] = (program, PassForward(
            session._model(), part, wanted, _arrays(pass_, part), session.device, precision,
            session.trained_ids()))
    forward = held[1]
    buffers = forward(_arrays(pass_, forward.program))
    return {u: session.to_host(forward.backend, buffers[u], u.dtype) for u in wanted}


def _computed(events) -> dict[Value, None]:
    """The Values the events compute, in order (a dict as an ordered set)."""
    out: dict[Value, None] = {}
    for e in events:
        values = tree_leaves(e.outputs) if isinstance(e, CallEvent) else e.node.outputs
        out.update((x, None) for x in values if isinstance(x, Value) and not x.is_external)
    return out


def _prefix(program: Program, events: int) -> Program:
    """`program` as far as its first `events` events, with the feeds those read."""
    if events == len(program.events) and program.loss is not None:
        return program
    kept = program.events[:events]
    read = {x for e in kept for x in (e.leaves if isinstance(e, CallEvent) else e.node.inputs)
            if isinstance(x, Value)}
    part = Program(program.key, list(kept), params=dict(program.params),
                   buffers=dict(program.buffers))
    for f in program.feeds:
        if f in read:
            part.add_feed(f)
    return part


def _arrays(pass_, part: Program) -> list:
    index = pass_.program.feed_index
    return [pass_.arrays[index[f]] for f in part.feeds]
