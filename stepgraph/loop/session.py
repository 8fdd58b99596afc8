"""The loop session: which modules train under which optimizer, the recorded programs, the passes
waiting for optimizer.step(), and the compiled LoopSteps.

It exists from the first optimizer made with parameters (torch's style: `SGD(model.
parameters(), lr=...)`). A module holding such parameters, called with concrete tensors:
- with grad enabled and in training mode, opens a training pass (passes.Pass);
- under no_grad in eval mode, runs a compiled predictor (loop/predict.py) when it is called
  with tensors only, else eagerly on the host;
every other module call runs as before.
"""
from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import numpy as np

from ..amp import autocast_state
from ..backends import cuda_available, flags
from ..grad_mode import is_grad_enabled
from ..ir.graph import INPUT, PARAM, STATE, Value
from ..ir.trace import Tensor
from . import hooks
from .carry import StateCarry
from .early import values_before_step
from .passes import DONE, OPEN, Pass, RecaptureWarning, as_feed_tensor
from .program import Program, align, tree_leaves
from .step import GRAD_NORM, LoopStep, ProgramModel, export_name


class LoopSession:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self.optimizers: list[weakref.ref] = []
        self.programs: dict[tuple, list[Program]] = {}     # first-call key -> most recent first
        self.current: Pass | None = None                   # the pass the script is in
        self.pending: list[Pass] = []                      # backward() done, waiting for step
        self.done: list[weakref.ref] = []                  # stepped passes whose values may live
        self.steps: dict[tuple, LoopStep] = {}
        self.carries: dict[tuple, StateCarry] = {}         # (id(optimizer), device) -> state
        self.kept: dict[int, list[Value]] = {}             # id(program) -> Values ever kept
        self.names: dict[int, str] = {}                    # id(Parameter or Buffer) -> name
        self.named: dict[int, Any] = {}                    # id -> the object (kept alive)
        self.roots = 0
        self.clip: tuple | None = None                     # clip_grad_norm_/value_ until step
        self.loss_scaling = None                           # GradScaler.step's, until step
        self.device = "cuda" if cuda_available() else "cpu"
        self.predictors: dict[tuple, Any] = {}
        self.early: dict[tuple, tuple] = {}                # values read before a step (early.py)
        self.spares: dict[tuple, list] = {}                # detached values' buffers
        self.eager_depth = 0                               # inside an eager forward
        self.grads: dict[int, tuple] = {}                  # p.grad asked before a step
        self.grads_kept: dict[int, tuple] = {}             # p.grad the last step kept
        self.last_step: LoopStep | None = None
        self.last_executable = None
        self._cache: dict = {}
        self._cache_version = -1

    def values_before_step(self, pass_: Pass, v: Value) -> dict[Value, np.ndarray]:
        """A value of a pass read before optimizer.step(), with the other scalars of the pass
        the script holds, from one run of the pass's compiled forward (loop/early.py)."""
        return values_before_step(self, pass_, v)

    # ---- optimizers and modules ----
    def register(self, optimizer) -> None:
        self.optimizers.append(weakref.ref(optimizer, lambda _: hooks.changed()))
        hooks.changed()

    def _cached(self, key, compute):
        """compute(), remembered until a mode, trainable set or optimizer changes (hooks)."""
        if self._cache_version != hooks.VERSION[0]:
            self._cache.clear()
            self._cache_version = hooks.VERSION[0]
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def _cached_for(self, obj, name: str, compute):
        """compute(obj) for one object (a module, an optimizer), remembered as _cached's
        values are, and held by weak reference so that another object at the same address
        never sees it. Asked at every model call and step: one dict lookup."""
        if self._cache_version != hooks.VERSION[0]:
            self._cache.clear()
            self._cache_version = hooks.VERSION[0]
        key = (name, id(obj))
        entry = self._cache.get(key)
        if entry is None or entry[0]() is not obj:
            entry = self._cache[key] = (weakref.ref(obj), compute(obj))
        return entry[1]

    def trained_ids(self) -> frozenset[int]:
        def compute():
            ids: set[int] = set()
            for ref in self.optimizers:
                opt = ref()
                if opt is not None:
                    ids.update(id(p) for p in opt.trained_parameters())
            return frozenset(ids)
        return self._cached("trained", compute)

    def trained_used(self) -> frozenset[int]:
        """The ids of the trained parameters (requires_grad) the waiting passes use."""
        # programs are complete once waiting (and live as long as the session)
        key = ("used", *[id(p.program) for p in self.pending])
        found = self._cache.get(key) if self._cache_version == hooks.VERSION[0] else None
        if found is not None:
            return found

        def compute():
            trained = self.trained_ids()
            return frozenset(id(p) for pass_ in self.pending
                             for p in pass_.program.params.values()
                             if id(p) in trained and p.requires_grad)
        return self._cached(key, compute)

    def open_pass(self) -> Pass | None:
        p = self.current
        return p if p is not None and p.phase == OPEN and not p.module_path else None

    def call_handler(self, module):
        if self.eager_depth:
            return None
        current = self.current
        if current is not None:
            if current.phase == OPEN and not current.module_path and current.live_values():
                return current.call_module      # a second model call of the same pass
            self.current = None                 # a forward nothing holds: forgotten
        if not self._cached_for(module, "module", self._module_facts)[0]:
            return None
        if is_grad_enabled() and module.training:
            return self.start_pass
        return self.predict

    def _module_facts(self, module) -> tuple[bool, tuple]:
        """Whether `module` holds a parameter an optimizer trains, and the training flags of
        its modules (kept by _cached_for until a mode, trainable set or optimizer changes)."""
        trained = self.trained_ids()
        return (any(id(p) in trained for p in module.parameters()),
                tuple(m.training for m in module.modules()))

    def call_mode(self, module) -> tuple:
        return (self._cached_for(module, "module", self._module_facts)[1], is_grad_enabled(),
                autocast_state())

    # ---- passes ----
    def start_pass(self, module, args: tuple, kwargs: dict):
        mode = self.call_mode(module)
        key = (id(module), mode, _signature(args, kwargs))
        known = self.programs.get(key)
        self.current = Pass(self, key, self.seed, known[0] if known else None)
        return self.current.call_module(module, args, kwargs, mode)

    def programs_add(self, pass_: Pass) -> None:
        """A recorded pass's program, first among its key's; a recording equal to a known
        program (align) adopts that one instead, keeping its compiled steps."""
        known = self.programs.setdefault(pass_.key, [])
        for q in known:
            m = align(pass_.program, q)
            if m is not None:
                pass_.adopt(q, m)
                known.remove(q)
                known.insert(0, q)
                return
        known.insert(0, pass_.program)
        self._name(pass_.program)

    def backward(self, pass_: Pass, loss: Tensor) -> None:
        pass_.backward(loss)
        self.pending.append(pass_)
        if self.current is pass_:
            self.current = None

    def zero_grad(self) -> None:
        self.grads_kept.clear()
        if self.pending:
            warnings.warn(f"zero_grad() dropped {len(self.pending)} backward() pass(es) that no "
                          "optimizer.step() used (their gradients, as torch's, and also their "
                          "forward's buffer updates)", RecaptureWarning, stacklevel=3)
            self.pending.clear()
            self.clip = None

    def grad_of(self, param):
        """p.grad: a tensor of the waiting passes' gradient of `param` (kept by the step that
        runs them), the last step's where it kept one, else None."""
        if self.pending:
            last = self.pending[-1]
            v = self.grads.get(id(param))
            if v is None or v[0] is not last:
                v = self.grads[id(param)] = (last, Value(param.shape, "float32"), param)
            return last.extra_tensor(v[1])
        kept = self.grads_kept.get(id(param))
        if kept is None:
            return None
        pass_, value = kept
        if pass_() is None:
            return None
        return Tensor(value, pass_())

    # ---- the step ----
    def step(self, optimizer) -> None:
        passes = self.pending
        if not passes:
            return                  # torch: no gradients, nothing to update
        self.pending = []
        clip, self.clip = self.clip, None
        grads = self.grads
        if grads:
            grads = {i: v for i, v in grads.items() if v[0] is passes[-1]}
            self.grads = {}
        if self.grads_kept:
            self.grads_kept.clear()
        scaling, self.loss_scaling = self.loss_scaling, None
        if scaling is not None:
            self.name_state([scaling.scale, scaling.growth_tracker])
        if self.done:
            self._detach_done()
        alone = len(passes) == 1
        kept = [self._kept(p, alone) for p in passes]
        arrays = passes[0].arrays if alone else [a for p in passes for a in p.arrays]
        precision = passes[0].key[1][2] or self._float32_precision()
        hook = _grad_hook(clip, [(self.names[i], v[1]) for i, v in grads.items()]) \
            if grads or (clip is not None and clip[0] == "value") else None
        max_norm = clip[1] if clip is not None and clip[0] == "norm" else None
        step = self._loop_step(optimizer, passes, kept, arrays, precision, scaling, hook,
                               max_norm)
        exe = step.launch([p.program for p in passes], kept, arrays, hook, max_norm, scaling)
        outputs, backend = exe.outputs, step.backend
        for j, (p, values) in enumerate(zip(passes, kept)):
            p.kept = {v: outputs[export_name(j, k)] for k, v in enumerate(values)} \
                if values else {}
            p.phase, p.backend = DONE, backend
            self.done.append(weakref.ref(p))
        if alone:
            passes[0].loss_at = (step, step._host_step)
        if clip is not None and clip[2] is not None:
            passes[-1].kept[clip[2]] = exe.outputs[GRAD_NORM]
        for i, (_, value, _) in grads.items():
            buffer = exe.outputs.get(grad_name(self.names[i]))
            if buffer is not None:          # a frozen parameter has no gradient: stays None
                passes[-1].kept[value] = buffer
                self.grads_kept[i] = (weakref.ref(passes[-1]), value)
        self.last_step, self.last_executable = step, exe

    def _loop_step(self, optimizer, passes, kept, arrays, precision, scaling, hook,
                   max_norm) -> LoopStep:
        """The LoopStep of this optimizer, device, precision, bad-step policy (GradScaler's
        skip) and trainable set, holding the optimizer state the script's last step left
        (carry.py); clipping, loss scaling and the rest are its Executables'."""
        trained, frozen = self._cached_for(optimizer, "optimizer", self._trainable)
        policy = "skip" if scaling is not None else "ignore"
        data_parallel = _data_parallel(passes)
        key = (id(optimizer), self.device, precision, policy, frozen, data_parallel)
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = LoopStep(
                self._model(), optimizer, trained, [p.program for p in passes], kept, arrays,
                self.device, precision, policy, self.seed, hook, max_norm, scaling,
                data_parallel)
        # torch's optimizer state is per parameter: it carries over to this step (carry.py)
        self.carries.setdefault((id(optimizer), self.device), StateCarry()).switch(step)
        return step

    def _float32_precision(self) -> str:
        """"tf32" where a script asks for TF32 matmuls (torch.backends.cuda.matmul.allow_tf32
        or set_float32_matmul_precision("high" / "medium")) and the step runs on CUDA."""
        if self.device != "cuda":
            return "fp32"
        tf32 = flags.matmul.allow_tf32 or flags.get_float32_matmul_precision() != "highest"
        return "tf32" if tf32 else "fp32"

    def _trainable(self, optimizer) -> tuple[frozenset, tuple]:
        """The ids of the optimizer's parameters and the names of those frozen now."""
        trained = frozenset(id(p) for p in optimizer.trained_parameters())
        return trained, tuple(sorted(n for i, n in self.names.items()
                                     if i in trained and not self.named[i].requires_grad))

    def _kept(self, p: Pass, alone: bool) -> list[Value]:
        """The values of a pass the script holds now, and every value kept for its program
        before (so a loop keeps one Executable): computed values only (feeds are on the
        host, parameters in the model). The loss of a pass stepped `alone` is not among
        them: the step records it in its loss history (compile/history.py), which keeps it
        readable for many steps without a copy."""
        ever = self.kept.setdefault(id(p.program), [])
        loss = p.program.loss
        live = p.live_values()
        for v in live:          # `in` on Values (eq=False) compares identities
            if v is not loss and v.role not in (INPUT, PARAM, STATE) and v not in p.extra \
                    and v not in ever:
                ever.append(v)
        return list(ever) if alone or loss not in live else [*ever, loss]

    def _detach_done(self) -> None:
        """Before a step overwrites its outputs: copy out the values of earlier steps the
        script still holds (a loop that keeps the last loss until the next step returns, a
        list of losses). The copies go into buffers recycled once their pass is dropped, so
        a loop in its steady state allocates nothing."""
        for ref in self.done:
            p = ref()
            if p is None or not p.kept:
                continue                # gone, or nothing of it kept: nothing to copy
            for v in p.live_values():
                if v in p.kept and v not in p.host:
                    p.kept[v] = self._spare_copy(p, p.kept[v])
        self.done = []

    def _spare_copy(self, pass_: Pass, buffer):
        """A copy of `buffer` (queued on the step's stream) in a spare buffer of its shape
        and dtype, given back to the spares when `pass_` is garbage."""
        free = self.spares.setdefault((tuple(buffer.shape), str(buffer.dtype)), [])
        if free:
            copy = free.pop()
            pass_.backend.copy_into(copy, buffer)
        else:
            copy = pass_.backend.copy_result(buffer)       # allocates: once per shape
        # back among the spares of its own dtype (the CPU backend widens bf16 when it copies)
        spares = self.spares.setdefault((tuple(copy.shape), str(copy.dtype)), [])
        weakref.finalize(pass_, spares.append, copy)
        return copy

    @staticmethod
    def to_host(backend, buffer, dtype: str) -> np.ndarray:
        from ..backends.numpy import bf16

        host = backend.to_numpy(buffer)
        if host.dtype == np.uint16 and dtype != "bfloat16":
            host = bf16.from_bits(host)
        if dtype == "bfloat16" and host.dtype != np.uint16:
            host = bf16.to_bits(host.astype(np.float32))
        return host

    # ---- names the steps bind parameters by ----
    def _name(self, program: Program) -> None:
        for event in program.events:
            module = getattr(event, "module", None)
            if module is not None:
                self.name_module(module)
        self.name_state([*program.params.values(), *program.buffers.values()])
        hooks.changed()                          # the frozen names may have grown

    def name_module(self, module) -> None:
        """Names for a module's parameters and buffers (its state_dict keys, under a prefix
        for a second root), given before a pass first traces its forward: the trace binds
        a buffer by name, and a model never loaded or compiled has none yet."""
        if id(module) in self.named:
            return
        self.named[id(module)] = module
        prefix = "" if self.roots == 0 else f"loop{self.roots}."
        self.roots += 1
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if id(t) not in self.names:
                self.names[id(t)] = prefix + name
                self.named[id(t)] = t
            t.name = t.name or self.names[id(t)]

    def name_state(self, tensors) -> None:
        """Names for Parameters and Buffers no module call reached: used only at script
        level, or bound by a step that no pass traced (GradScaler's growth counter)."""
        for t in tensors:
            if id(t) not in self.names:
                self.names[id(t)] = f"loop.extra{len(self.names)}"
                self.named[id(t)] = t
                t.name = t.name or self.names[id(t)]
                hooks.changed()

    def _model(self) -> ProgramModel:
        from ..nn.module import Buffer, Parameter

        objs = [(n, self.named[i]) for i, n in self.names.items()]
        return ProgramModel([(n, t) for n, t in objs if isinstance(t, Parameter)],
                            [(n, t) for n, t in objs if isinstance(t, Buffer)])

    # ---- evaluation ----
    def predict(self, module, args: tuple, kwargs: dict):
        """An eval-mode call under no_grad: the compiled predictor (loop/predict.py) for
        tensor arguments; anything else (keyword or non-tensor arguments, a module in training
        mode under no_grad) eagerly, on the host."""
        from .predict import TreePredictor

        arrays = [as_feed_tensor(a) for a in args]
        if kwargs or module.training or not all(isinstance(a, Tensor) and a.is_eager
                                                for a in arrays):
            return self.eagerly(module, args, kwargs)
        arrays = [a.array for a in arrays]
        key = (id(module), len(arrays), self.device, autocast_state() or "fp32")
        predictor = self.predictors.get(key)
        if predictor is None or predictor.model is not module:
            predictor = TreePredictor(module, arrays, device=self.device, precision=key[3])
            self.predictors[key] = predictor
        return predictor(*arrays)

    def eagerly(self, module, args: tuple, kwargs: dict):
        """module's forward op by op on the host, submodules included."""
        self.eager_depth += 1
        try:
            return module.forward(*args, **kwargs)
        finally:
            self.eager_depth -= 1


def _data_parallel(passes) -> object:
    """The DataParallel options of the DistributedDataParallel the passes call (nn/parallel.py;
    torch's DDP averages the gradients of the passes run through it), else False."""
    parallel = sys.modules.get("stepgraph.nn.parallel")    # none made: nothing to look for
    if parallel is None:
        return False
    for p in passes:
        for event in p.program.events:
            if isinstance(getattr(event, "module", None), parallel.DistributedDataParallel):
                return event.module.data_parallel
    return False


def grad_name(param_name: str) -> str:
    return f"grad.{param_name}"


def _grad_hook(clip, wanted: list[tuple[str, Value]]):
    """What the step does to the gradients before the update: clip_grad_value_'s clamp, and
    the gradients p.grad asked for kept as outputs (by parameter name)."""
    limit = float(clip[1]) if clip is not None and clip[0] == "value" else None
    if limit is None and not wanted:
        return None
    names = tuple(name for name, _ in wanted)

    def hook(tracer, params, grads):
        if limit is not None:
            grads = [tracer.emit("scalar", [tracer.emit("scalar", [g], kind="maximum",
                                                        value=-limit)[0]],
                                 kind="minimum", value=limit)[0] for g in grads]
        by_name = {p.name: g for p, g in zip(params, grads)}
        for name in names:
            if name in by_name:
                tracer.graph.outputs[grad_name(name)] = by_name[name]
        return grads
    hook.key = (limit, names)
    return hook


def _signature(args: tuple, kwargs: dict) -> tuple:
    """The shapes and dtypes of the tensors of a call's arguments, and the other leaves."""
    if not kwargs:                                                # the common call: fast
        out = []
        for a in args:
            if type(a) is not Tensor:
                break
            v = a.value
            out.append(("tensor", v.shape, v.dtype, a.array is not None))
        else:
            return tuple(out)
    out = []
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, Tensor):
            out.append(("tensor", tuple(leaf.shape), leaf.value.dtype, leaf.is_eager))
        elif isinstance(leaf, np.ndarray) or hasattr(leaf, "__cuda_array_interface__"):
            out.append(("array", tuple(leaf.shape), str(leaf.dtype)))
        else:
            try:
                hash(leaf)
                out.append(leaf)
            except TypeError:
                out.append(repr(leaf)[:80])
    return tuple(out)


_SESSION: LoopSession | None = None


def session() -> LoopSession:
    """The process's loop session (made on first use)."""
    global _SESSION
    if _SESSION is None:
        _SESSION = LoopSession()
        hooks.SESSION = _SESSION
    return _SESSION
