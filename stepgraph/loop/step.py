"""The compiled step of a captured loop: the waiting passes' programs as one model, trained by a
TrainStep (the same trace -> autodiff -> update -> fuse -> plan -> Executable pipeline).

One LoopStep per optimizer (and device, precision, trainable set, bad-batch policy) holds the
optimizer state; each distinct set of waiting passes (one pass, k accumulated passes, the last
partial batch's), of values kept for the script and of gradient treatment (clip_grad_norm_,
clip_grad_value_, p.grad asked for, a GradScaler's loss scaling) is one Executable of it,
sharing that state.
"""
from __future__ import annotations

from ..api import TrainStep, _input_names
from ..compile.autocast import check_fp16_support
from ..compile.build import ModelLoss, build_train_graph
from ..compile.executable import COPY_ROLES, STATIC_ROLES, Executable, GraphKey
from ..compile.feed import Signature, signature_of
from ..ir.graph import Value
from ..ir.trace import Tensor, Tracer, current_tracer
from ..nn.module import Module
from .passes import trace_call
from .program import CallEvent, NodeEvent, Program, tree_leaves, tree_map

GRAD_NORM = "grad_norm"


def emit_program(tracer: Tracer, program: Program, feeds: list[Tensor]) -> dict[Value, Value]:
    """Re-emit a recorded pass into `tracer` with `feeds` for its feed Values; returns the map
    from the program's Values to the new ones. Module calls are traced again (their forward
    runs on this trace); script-level nodes are emitted as recorded, random ones at fresh
    dropout sites so that every accumulated pass draws its own masks."""
    m: dict[Value, Value] = {fv: t.value for fv, t in zip(program.feeds, feeds)}
    m.update((v, tracer.param(p).value) for v, p in program.params.items())
    m.update((v, tracer.buffer(b).value) for v, b in program.buffers.items())
    if program.rng is not None:
        m[program.rng] = tracer.rng_step()
    as_tensor = (lambda v: Tensor(m[v], tracer) if isinstance(v, Value) else v)
    for event in program.events:
        if isinstance(event, CallEvent):
            out = trace_call(tracer, event.module, tree_map(as_tensor, event.args),
                             tree_map(as_tensor, event.kwargs))
            for old, new in zip(tree_leaves(event.outputs), tree_leaves(out)):
                if isinstance(old, Value):
                    m[old] = new.value
            continue
        assert isinstance(event, NodeEvent)
        n = event.node
        attrs = dict(n.attrs)
        if "site" in attrs:
            attrs["site"] = tracer.next_dropout_site()
        m.update(zip(n.outputs, tracer.emit(n.op, [m[v] for v in n.inputs], n.label, **attrs)))
    return m


class ProgramModel(Module):
    """The passes of one step as one model: forward(*feeds) re-emits each pass's program and
    returns the sum of their losses (backward of the sum = gradients accumulated over the
    passes). Its parameters are the trained modules' own, under names the loop session keeps
    stable (so optimizer state found by name survives every re-capture)."""

    def __init__(self, named_params: list, named_buffers: list):
        super().__init__()
        object.__setattr__(self, "_named_p", named_params)
        object.__setattr__(self, "_named_b", named_buffers)
        object.__setattr__(self, "programs", ())
        object.__setattr__(self, "kept", ())        # per program: the Values to export
        object.__setattr__(self, "exports", {})      # output name -> Value, set by forward

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True):
        return iter(self._named_p)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True):
        return iter(self._named_b)

    def name_parameters(self) -> None:
        for name, p in [*self._named_p, *self._named_b]:
            p.name = name

    def forward(self, *feeds):
        tracer = current_tracer()
        total, at = None, 0
        self.exports.clear()
        for j, (program, kept) in enumerate(zip(self.programs, self.kept)):
            n = len(program.feeds)
            m = emit_program(tracer, program, list(feeds[at:at + n]))
            at += n
            loss = Tensor(m[program.loss], tracer)
            total = loss if total is None else total + loss
            for k, v in enumerate(kept):
                self.exports[export_name(j, k)] = m[v]
        return total


def export_name(j: int, k: int) -> str:
    return f"pass{j}.{k}"


class LoopStep(TrainStep):
    """A TrainStep whose model is the waiting passes (ProgramModel). `launch` runs one set of
    passes; the Executable of each (program set, kept values, gradient treatment) is built
    once, and all of them share the optimizer state (a step that clips and one that does not
    are two Executables of one LoopStep)."""

    def __init__(self, model: ProgramModel, optimizer, trained: frozenset, programs, kept,
                 arrays, device: str, precision: str, on_bad_batch: str, seed: int,
                 grad_hook=None, max_norm: float | None = None, loss_scaling=None,
                 distributed=False):
        self._trained = trained
        self._launched: dict[tuple, tuple] = {}   # launch key -> (Executable, check labels)
        self._use(programs, kept, grad_hook, max_norm, loss_scaling)
        # distributed: a DistributedDataParallel's options (nn/parallel.py), else False
        super().__init__(model, ModelLoss(), optimizer, arrays, device=device, seed=seed,
                         precision=precision, on_bad_batch=on_bad_batch,
                         distributed=distributed)

    def trained_rows(self) -> tuple:
        """The Parameters this step updates (its hyperparameter rows)."""
        return tuple(self._rows or ())

    def resume(self, step_offsets: dict[int, int]) -> None:
        """Run next after another step of the optimizer ran (carry.py copied the optimizer
        state in): `step_offsets` {id(Parameter): steps it missed} go to the device with the
        hyperparameters before the next step, the host mirror of the counter is read again,
        weight copies are made from the parameters again, and the optimizer's state_dict
        reads this step."""
        self.step_offsets = step_offsets
        self._optimizer_version = None
        self._host_step = None
        if self._has_copies:
            self._refresh_weight_copies()
        self.optimizer.attach(self)

    def _trains(self, p) -> bool:
        # torch computes a gradient for every requires_grad parameter but updates only the
        # optimizer's: the others are constants of this step.
        return p.requires_grad and id(p) in self._trained

    def _use(self, programs, kept, grad_hook, max_norm, loss_scaling) -> None:
        """What the next Executable built is made of: the passes' programs, the values kept
        for the script, the gradients' hook (clip_grad_value_, p.grad), clip_grad_norm_'s
        max_norm (None: no clip) and a GradScaler's LossScaling (None: none)."""
        self._programs, self._kept, self._grad_hook = tuple(programs), tuple(kept), grad_hook
        self._max_norm, self._loss_scaling = max_norm, loss_scaling
        self._program_key = (tuple(id(p) for p in programs),
                             tuple(tuple(v.id for v in k) for k in kept),
                             None if grad_hook is None else grad_hook.key, max_norm,
                             None if loss_scaling is None else loss_scaling.key)

    def build_graph(self, signature: Signature):
        model = self.model
        object.__setattr__(model, "programs", self._programs)
        object.__setattr__(model, "kept", self._kept)
        # clip_grad_norm_'s max_norm, carried as compile_train_step's optimizer carries it
        opt, saved = self.optimizer, self.optimizer.max_grad_norm
        opt.max_grad_norm = saved if self._max_norm is None else self._max_norm
        try:
            graph = build_train_graph(model, self.loss_fn, opt, signature, self.seed,
                                      self.on_bad_batch, self.memory_format, self.precision,
                                      frozen=self.frozen, extra_outputs=model.exports,
                                      grad_hook=self._grad_hook, device=self.device,
                                      values=self.module_values,
                                      loss_scaling=self._loss_scaling,
                                      permuted_weights=not self._shards_optimizer())
        finally:
            opt.max_grad_norm = saved
        norm = next((n.outputs[0] for n in graph.nodes if n.op == "global_norm"), None)
        if norm is not None:
            graph.outputs[GRAD_NORM] = norm
        return graph

    def executable(self, signature: Signature) -> Executable:
        key = GraphKey(self.mode, hash((self._program_key, signature)), STATIC_ROLES[self.mode],
                       COPY_ROLES[self.mode], (self._program_key, signature))
        exe = self.executables.get(key)
        if exe is None:
            plan = self.plan(signature)
            check_fp16_support(plan.graph, getattr(self.backend, "fp16_ops", None), self.device)
            exe = Executable(plan, self.backend, self.bind, self.ctx, self.mode, key)
            self.executables[key] = exe
        return exe

    def launch(self, programs, kept, arrays, grad_hook=None,
               max_norm: float | None = None, loss_scaling=None) -> Executable:
        """Run one step over these passes' feeds; returns the Executable whose outputs hold
        the kept values until its next run. The Executable of a (program set, kept values,
        gradient treatment, feed shapes) is found by one dict lookup after its first step."""
        # kept Values stand for themselves (eq=False: hashed and compared by identity; the
        # key holds them, so no other Value takes their place)
        key = (tuple(map(id, programs)), tuple(map(tuple, kept)),
               None if grad_hook is None else grad_hook.key, max_norm,
               None if loss_scaling is None else loss_scaling.key,
               tuple([(a.shape, a.dtype) for a in arrays]))
        found = self._launched.get(key)
        if found is None:
            self._use(programs, kept, grad_hook, max_norm, loss_scaling)
            signature = signature_of(_input_names(len(arrays), False), arrays)
            # the first program set's label check (TrainStep's) where the feeds are its
            labels = tuple(s.shape for s in signature) == \
                tuple(s.shape for s in self.signature)
            found = self._launched[key] = (self.executable(signature), labels)
        exe, labels = found
        if labels:
            self._check_values(arrays)
        exe.feed(arrays)
        self._sync_optimizer()          # param_groups writes (a scheduler's) reach the device
        if self._copies_stale():
            self._refresh_weight_copies()
        if self._host_step is None:      # mirror the device counter once; then count here
            self._host_step = self._device_calls()
        exe.run(self.use_graph)
        self._host_step += 1
        return exe

    # Optimizer.state_dict / load_state_dict find a parameter's state by its name, which a
    # state_dict() of another root (a DistributedDataParallel's .module) renamed since: the
    # session's names are put back first.
    def optimizer_state_of(self, p, slots):
        self.model.name_parameters()
        return super().optimizer_state_of(p, slots)

    def load_optimizer_state(self, optimizer, state: dict, step, at_least_one: bool) -> None:
        self.model.name_parameters()
        super().load_optimizer_state(optimizer, state, step, at_least_one)

    def loss_of(self, call: int):
        """The LossHandle of this step's call number `call` (its loss history entry): made
        when the script reads a loss, not at every step."""
        return self._loss_handle(call)
