"""compile_train_step and compile_predict: the public entry points.

    trace -> autodiff -> optimizer -> fuse -> plan -> Executable (per feed signature)

A TrainStep keeps one Executable per feed signature (the last partial batch of an epoch gets
its own), all bound to the same parameter and optimizer-state buffers.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from .backends import get_backend, resolve_device
from .backends.numpy import bf16
from .compile.autocast import PRECISION as BF16_PRECISION
from .compile.autocast import (check_bf16_support, check_fp16_support, copy_values,
                               is_bf16_copy, parse_weight_copy)
from .compile.build import (PREDICT_RNG_KEY, ModelLoss, ModuleValues, build_predict_graph,
                            build_train_graph)
from .compile.distribute import average_gradients, broadcast_buffers, shard_optimizer_state
from .compile.executable import COPY_ROLES, INFERENCE, STATIC_ROLES, TRAIN, Executable, GraphKey
from .compile.feed import Signature, check_feed, check_labels, check_steps_feed, signature_of
from .compile.fuse import fuse
from .compile.guard import (COUNTERS_KEY, GUARD_PREFIX, HISTORY_FLAG_KEY, GuardMonitor,
                            check_policy, label_check)
from .compile.history import HISTORY_PREFIX, LossHandle
from .compile import layout_choice
from .compile.layout import resolve_memory_format
from .compile.overlap import check_option as check_overlap_option
from .compile.overlap import resolve as resolve_overlap
from .compile.permute_groups import group_permutes
from .compile.update_permutes import read_gradients_through_permutes
from .compile.plan import Plan, make_plan
from .distributed.buckets import cap_bytes_of
from .errors import BackendUnavailableError, PlanError, StateDictError
from .ir.graph import PARAM, STATE, Graph, Value
from .nn.module import Module
from .optim.optimizer import HYPERPARAMETERS_KEY, SCHEDULE_KEY, SLOT_PREFIX, STEP_KEY

# fp32; tf32 (CUDA: TF32 tensor-core GEMMs); bf16 (PyTorch autocast semantics with float32
# master weights, compile/autocast.py; on CUDA only where the ops have bf16 kernels); fp16
# (the same with float16; on CUDA, as any float16 value, only where the ops have float16
# kernels: compile/autocast.py check_fp16_support).
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def _input_names(n: int, with_target: bool) -> tuple[str, ...]:
    xs = ("x",) if n - with_target == 1 else tuple(f"x{i}" for i in range(n - with_target))
    return xs + (("y",) if with_target else ())


class _CompiledModel:
    """What train and predict steps share: the backend, its context, the model's parameters
    moved onto the device once, and a cache of Executables by GraphKey."""

    mode = ""
    freezes = False     # whether requires_grad=False parameters are traced as constants

    def __init__(self, model: Module, example_inputs, device: str, graph: bool | None,
                 precision: str, with_target: bool, memory_format: str = "auto",
                 deterministic: bool = True):
        if not isinstance(model, Module):
            raise TypeError(f"model must be a stepgraph.nn.Module, got {type(model).__name__}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        device = resolve_device(device)
        if device == "cpu" and precision == "tf32":
            raise ValueError("precision='tf32' needs device='cuda'")
        self.model = model
        self.backend = get_backend(device)
        self.device = device
        self.module_values = ModuleValues(model)     # what the compiled steps folded in
        self.use_graph = (device == "cuda") if graph is None else bool(graph)
        if self.use_graph and device != "cuda":
            raise ValueError("graph=True needs device='cuda' (the CPU backend runs eagerly)")
        self.deterministic = bool(deterministic)
        self.ctx = self.backend.make_context(precision, deterministic=self.deterministic)
        self.precision = precision
        self.memory_format = resolve_memory_format(memory_format, device, precision)
        self.layout_choice: layout_choice.LayoutChoice | None = None   # how "auto" was decided
        example_inputs = tuple(example_inputs)
        self.signature = signature_of(_input_names(len(example_inputs), with_target),
                                      example_inputs)
        model.name_parameters()
        named = list(model.named_parameters())
        self.params = {k: p for k, p in named if self._trains(p)}
        # Bound as `state` values by their keys: buffers, and the frozen parameters this step
        # was built with (graphs traced for later feed signatures freeze the same ones).
        self.buffers = dict(model.named_buffers())
        self.buffers.update((k, p) for k, p in named if k not in self.params)
        self.frozen = frozenset(id(p) for k, p in named if k not in self.params)
        for p in [*self.params.values(), *self.buffers.values()]:
            self._on_device(p)
        self.executables: dict[GraphKey, Executable] = {}

    def _trains(self, p) -> bool:
        """Whether parameter p is a `param` of this step's graphs (else a constant `state`)."""
        return p.requires_grad or not self.freezes

    def _on_device(self, p) -> None:
        """Move a Parameter's or Buffer's data into the backend's memory (once)."""
        if not self.backend.owns(p.storage):
            host = p.numpy()
            p.storage = self.backend.empty(host.shape, str(host.dtype))
            self.backend.copy_into(p.storage, host)

    def build_graph(self, signature: Signature) -> Graph:
        raise NotImplementedError

    def bind(self, v: Value) -> Any:
        if v.role == PARAM:
            return self.params[v.name].storage
        if v.role == STATE and v.name in self.buffers:
            return self.buffers[v.name].storage
        raise KeyError(v.name)

    def executable(self, signature: Signature) -> Executable:
        key = GraphKey(self.mode, hash(signature), STATIC_ROLES[self.mode],
                       COPY_ROLES[self.mode], signature)
        exe = self.executables.get(key)
        if exe is None:
            exe = self.executables[key] = self.new_executable(signature, key)
        return exe

    def new_executable(self, signature: Signature, key: GraphKey) -> Executable:
        return self.executable_of(self.plan(signature), key)

    def executable_of(self, plan: Plan, key: GraphKey) -> Executable:
        """The plan bound to this model's buffers, after the checks that the backend runs
        every op of it at this precision."""
        if self.precision == BF16_PRECISION:
            check_bf16_support(plan.graph, getattr(self.backend, "bf16_ops", None), self.device)
        check_fp16_support(plan.graph, getattr(self.backend, "fp16_ops", None), self.device)
        return Executable(plan, self.backend, self.bind, self.ctx, self.mode, key)

    def plan(self, signature: Signature) -> Plan:
        return make_plan(group_permutes(fuse(self.build_graph(signature))))

    def _prepare(self, arrays) -> Executable:
        signature = check_feed(self.signature, arrays)
        self._check_values(arrays)
        self.module_values.check()
        exe = self.executable(signature)
        exe.feed(arrays)
        return exe

    def _check_values(self, arrays) -> None:
        """Checks of a well-formed feed's values, before anything is copied or run."""


class TrainStep(_CompiledModel):
    """One training step as one call: `loss = step(x, y)`.

    on_bad_batch (compile/guard.py) decides what a batch with labels outside [0, classes) or
    a NaN/Inf loss or gradient does, checked on the device without a per-step sync:
    "raise" (default): its update is not applied (parameters, optimizer state and the step
    counter stay as before it, and so do they for any later call until it is reported), and
    the next call, once the device has finished that step, or else the next read of a loss
    raises LabelError or NonFiniteError naming the step; labels in host memory are checked
    before the call runs and raise LabelError at once. "skip": its update is skipped and
    counted in `skipped_steps`; training goes on. "ignore": no checks on the device.

    distributed (True or a distributed.DataParallel): data parallelism over the process group
    (distributed.init()): rank 0's parameters and buffers are copied to every rank now, and
    each step averages the gradients across ranks before the update (compile/distribute.py),
    so every rank holds the same parameters after every step. The loss a step returns is
    this rank's; the buffers the step updates (BatchNorm's running statistics) are rank 0's
    on every rank after every step (DataParallel.broadcast_buffers); dropout masks differ
    between ranks.

    memory_format ("auto", "channels_last" or "contiguous", PyTorch's names): how the image
    tensors between convolutions are stored on the device (compile/layout.py). "auto" is
    contiguous (NCHW) on the CPU, at fp32 and without cuDNN. On CUDA at precision "tf32" or
    "bf16" with cuDNN present it is channels_last (NHWC, cuDNN's fast tensor-core layout)
    where the convolutions with channel counts in multiples of 8 carry nearly all the
    convolution FLOPs (layout.rule_is_sure); where the split is closer, the first step is
    built both ways, each timed for a few steps from the same state (restored afterwards),
    and the faster kept, the decision stored on disk for later processes
    (compile/layout_choice.py; `layout_choice` says how it was decided;
    STEPGRAPH_LAYOUT_MEASURE=always times every model with convolutions, =0 none; data
    parallelism takes the rule, layout.channels_last_pays). Parameters, gradients and the
    state_dict keep PyTorch's layouts either way.

    deterministic (default True): every kernel gives the same bits on every run. False lets
    the autotuner also pick cuDNN plans that accumulate with atomics (what PyTorch does with
    cudnn.deterministic off): often faster weight gradients, results that vary in the last
    bits between runs (a captured graph then no longer equals eager bit for bit).

    overlap_update ("auto", True or False; compile/overlap.py): the optimizer's update split
    into buckets of parameters, each updated as soon as its gradients are final and nothing
    later in the step reads the old values, on CUDA on a second stream beside the rest of the
    backward pass (inside the same graph), joined before the step ends; the results are the
    same bits as the one update after the backward pass. It needs on_bad_batch="ignore", no
    gradient clipping (max_grad_norm None) and no data parallelism. "auto" (default): on for
    CUDA where it applies and the parameters make more than one bucket; True: on, or a
    PlanError saying why it cannot apply (on the CPU the buckets run in program order);
    False: off.
    """

    mode = TRAIN
    freezes = True

    def __init__(self, model, loss, optimizer, example_inputs, device="cpu", graph=None,
                 seed=0, precision="fp32", on_bad_batch="raise", distributed=False,
                 memory_format="auto", deterministic=True, overlap_update="auto"):
        self.on_bad_batch = check_policy(on_bad_batch)
        self.overlap_update = check_overlap_option(overlap_update)
        self.data_parallel, self.group = _data_parallel(distributed)
        super().__init__(model, example_inputs, device, graph, precision,
                         with_target=not isinstance(loss, ModelLoss),
                         memory_format=memory_format, deterministic=deterministic)
        self.loss_fn, self.optimizer, self.seed = loss, optimizer, int(seed)
        self.state: dict[str, Any] = {}
        self._has_copies = False   # whether state holds weight copies (bind)
        if isinstance(loss, Module):
            # A loss module's buffers (class weights, pos_weight) are state bound by key.
            for name, b in loss.named_buffers("loss."):
                b.name = name
                self._on_device(b)
                self.buffers[name] = b
        if self.group is not None:
            self._broadcast_parameters()
        self._host_step: int | None = None
        self._rows: list | None = None       # the Parameter of each hyperparameter row
        # id(Parameter) -> the steps it missed (its own step count is the counter less this;
        # a training script's frozen layers, loop/session.py)
        self.step_offsets: dict[int, int] = {}
        first = self.executable(self.signature)
        self.classes, self.ignore_index = label_check(first.plan.graph,
                                                     first.plan.graph.inputs[-1])
        self._guard = None
        if COUNTERS_KEY in self.state:
            self._guard = GuardMonitor(self.backend, self.state[COUNTERS_KEY], on_bad_batch,
                                       self.classes, self._nonfinite_params)
        optimizer.attach(self)
        self._optimizer_version = optimizer.version    # what the device holds
        self._versions = self._param_versions()   # the weight copies' source versions

    def _nonfinite_params(self) -> list[str]:
        """Names of the parameters holding a NaN or Inf (syncs; asked when a step failed)."""
        return [name for name, p in self.params.items()
                if not np.isfinite(self.backend.to_numpy(p.storage)).all()]

    def new_executable(self, signature: Signature, key: GraphKey) -> Executable:
        """The step of `signature`; the first one built with memory_format "auto" (one
        process) decides the layout, timing both where the rule is unsure
        (compile/layout_choice.py), and sets memory_format for every later one."""
        if self.memory_format != "auto" or self.group is not None or not layout_choice.enabled():
            return super().new_executable(signature, key)
        self.layout_choice, exe = layout_choice.choose(self, signature, key)
        return exe

    def build_graph(self, signature: Signature) -> Graph:
        # Each rank draws its own dropout masks (the same key would repeat one rank's masks
        # on every rank's different samples).
        seed = self.seed if self.group is None else self.seed + (self.group.rank << 32)
        return build_train_graph(self.model, self.loss_fn, self.optimizer, signature, seed,
                                 self.on_bad_batch, self.memory_format, self.precision,
                                 frozen=self.frozen, device=self.device,
                                 values=self.module_values,
                                 permuted_weights=not self._shards_optimizer())

    def _shards_optimizer(self) -> bool:
        """Whether each rank's update writes its shard of the parameters only (ZeRO-1)."""
        return self.group is not None and self.data_parallel.shard_optimizer

    def plan(self, signature: Signature) -> Plan:
        graph = fuse(self.build_graph(signature))
        rows = self.optimizer.emitted_rows()
        if self._rows is None:
            self._rows = rows
        elif [id(p) for p in rows] != [id(p) for p in self._rows]:
            raise PlanError("the step traced for this batch shape uses the parameters in "
                            "another order than the first: they share one table of "
                            "hyperparameters")
        dp = self.data_parallel
        if self._shards_optimizer():
            graph = shard_optimizer_state(graph, self.group.id, self.group.world_size,
                                          cap_bytes_of(dp.bucket_cap_mb))
        elif self.group is not None:
            graph = average_gradients(graph, self.group.id, self.group.world_size,
                                      cap_bytes_of(dp.bucket_cap_mb), dp.strategy,
                                      dp.reduce_dtype == "bf16")
        if self.group is not None and dp.broadcast_buffers:
            graph = broadcast_buffers(graph, self.group.id, self.group.world_size,
                                      self.buffers)
        graph = resolve_overlap(self.overlap_update, graph, self.device)
        return make_plan(group_permutes(read_gradients_through_permutes(graph)))

    def _broadcast_parameters(self) -> None:
        """Rank 0's parameters and buffers on every rank: NCCL on CUDA, the store on the CPU."""
        arrays = [p.storage for p in [*self.params.values(), *self.buffers.values()]]
        if self.group.world_size == 1 or not arrays:
            return
        if self.device == "cuda":
            from .backends.cuda.collective import broadcast_parameters

            broadcast_parameters(self.backend, self.group, arrays)
            return
        host = self.group.broadcast([self.backend.to_numpy(a) for a in arrays],
                                    what="parameter broadcast")
        for a, value in zip(arrays, host):
            self.backend.copy_into(a, value)

    def bind(self, v: Value) -> Any:
        if v.role == PARAM or v.name in self.buffers:   # the model's own storage
            return super().bind(v)
        if v.name not in self.state:
            self.state[v.name] = self.backend.empty(v.shape, v.dtype)
            if parse_weight_copy(v.name) is None:
                self.backend.copy_into(self.state[v.name],
                                       self.optimizer.initial_state(v, self._rows))
            else:                                  # a weight copy starts as its param
                self._write_weight_copy(v.name, self.state[v.name])
                self._has_copies = True
        return self.state[v.name]

    def _write_weight_copy(self, name: str, buf) -> None:
        param, dims = parse_weight_copy(name)
        values = copy_values(self.params[param].numpy(), dims, tuple(buf.shape))
        self.backend.copy_into(buf, bf16.to_bits(values) if is_bf16_copy(name) else
                               values.astype(np.float32))

    def _param_versions(self) -> tuple[int, ...]:
        return tuple(p.version for p in self.params.values())

    def _copies_stale(self) -> bool:
        """Whether a parameter was written from outside the step since the weight copies
        were made from it."""
        return self._has_copies and self._versions != self._param_versions()

    def _refresh_weight_copies(self) -> None:
        """Each weight copy made again from its parameter (bf16, or float32 transposed): after
        parameters were written from outside the step (model.load_state_dict,
        Parameter.assign), which the copies cannot see."""
        for name, buf in self.state.items():
            if parse_weight_copy(name) is not None:
                self._write_weight_copy(name, buf)
        self._versions = self._param_versions()

    def _check_values(self, arrays) -> None:
        # After check_feed: arrays[-1] is the target. Under "skip" the guard skips the batch.
        if self.classes is not None and self.on_bad_batch != "skip":
            check_labels(self.signature[-1].name, arrays[-1], self.classes, self.ignore_index)

    def _sync_optimizer(self) -> None:
        """Write the optimizer's schedule and hyperparameters to the device when they changed
        since the last write (optimizer.param_groups, optimizer.lr, a scheduler). The copies
        are queued on the backend's stream, the one the steps run (and replay) on: they land
        after the previous step has read the old values and before the next one reads."""
        opt = self.optimizer
        if self._optimizer_version == opt.version:
            return
        self.backend.copy_into(self.state[SCHEDULE_KEY], opt.schedule_vector())
        self.backend.copy_into(self.state[HYPERPARAMETERS_KEY],
                               opt.hyperparameter_table(self._rows, self.step_offsets))
        self._optimizer_version = opt.version

    # ---- what Optimizer.state_dict / load_state_dict read and write (optim/optimizer.py) ----
    def optimizer_holds(self, p) -> bool:
        """Whether this step updates Parameter p."""
        return any(q is p for q in self._rows or ())

    def optimizer_state_of(self, p, slots) -> tuple[int, dict[str, np.ndarray]]:
        """(step counter, {slot: Parameter p's state as a NumPy array}) from the device."""
        keys = {slot: f"{SLOT_PREFIX}{slot}.{p.name}" for slot in slots}
        sharded = [k for k in keys.values() if k not in self.state]
        if sharded:
            raise StateDictError(f"{sharded} are not kept per parameter (a ZeRO-sharded step): "
                                 "use the step's state_dict()")
        own = int(self.backend.to_numpy(self.state[STEP_KEY])) - self.step_offsets.get(id(p), 0)
        return (own, {slot: self.backend.to_numpy(self.state[k]) for slot, k in keys.items()})

    def load_optimizer_state(self, optimizer, state: dict, step: int | None,
                             at_least_one: bool) -> None:
        """Write loaded optimizer state (Optimizer.load_state_dict): state {id(Parameter):
        {slot: array}}; a parameter of this step without a slot there starts it afresh;
        step: the counter (None: kept, raised to 1 when at_least_one)."""
        writes = []
        for p in self._rows or ():
            for slot in optimizer._slots or ():
                key = f"{SLOT_PREFIX}{slot}.{p.name}"
                if key not in self.state:
                    raise StateDictError(f"{key} is not kept per parameter (a ZeRO-sharded "
                                         "step): use the step's load_state_dict()")
                value = state.get(id(p), {}).get(slot)
                if value is None:
                    value = np.full(p.shape, optimizer.slot_start(slot, optimizer._group_of(p)))
                writes.append((self.state[key], np.asarray(value, np.float32).reshape(p.shape)))
        for buf, value in writes:
            self.backend.copy_into(buf, value)
        if step is None and at_least_one:
            step = max(1, int(self.backend.to_numpy(self.state[STEP_KEY])))
        if step is not None:
            self.backend.copy_into(self.state[STEP_KEY], np.array(step, np.int64))
            self._host_step = None
            if self._guard is not None:
                self._guard.reset(step)

    def __call__(self, *arrays):
        """Run one step on (inputs..., target); returns the loss (float() reads it)."""
        if self._guard is not None:
            self._guard.check_call()
        exe = self._prepare(arrays)
        self._sync_optimizer()
        if self._copies_stale():
            self._refresh_weight_copies()
        if self._host_step is None:   # mirror the device counter once; then count on the host
            self._host_step = self._device_calls()
        exe.run(self.use_graph)
        self._host_step += 1
        return self._loss_handle(self._host_step)

    def run(self, batches, *, steps: int) -> list[LossHandle]:
        """Train on `steps` batches per launch: `losses = step.run((x, y), steps=K)`.

        `batches` holds one array per argument of the step (inputs..., target), each the
        batches of K steps stacked along a new leading axis: shape (K, *shape of one step's
        argument), or (n * K, ...) to run n launches of K steps in order. Arrays may be NumPy,
        CuPy or DLPack. Returns one LossHandle per step, in order, read as a single step's
        (a loss stays readable for history.HISTORY_LENGTH = 1024 steps).

        The trajectory is that of calling the step on each slice in turn, bit for bit: the
        LR schedule is computed on the device from the step counter (a change of lr or of the
        schedule between calls is written to the device before the next launch), dropout
        draws from the device RNG counter, and a guard checks each step on the device. Each
        launch's batches are copied into staging buffers once, and each step copies its slice
        into the step's inputs and runs the step's plan (compile/executable.py StepsReplay).
        With a CUDA graph (graph=True) one launch replays one graph of K steps, copies
        included, so the host pays once per K steps; it is captured at the first launch for
        this batch shape and K once the step has run (a step's first run, single or K-step,
        is its eager warm-up) and kept with its staging buffers. Without a graph (the CPU
        backend, graph=False) the steps run op by op. Under on_bad_batch="raise" a bad step
        stops the updates of every later step, and the next call or loss read raises its
        error naming the step, as for single steps.
        """
        if self._guard is not None:
            self._guard.check_call()
        signature, launches = check_steps_feed(self.signature, batches, steps)
        self._check_values(batches)       # every step's labels, before any step runs
        self.module_values.check()
        replay = self.executable(signature).replay(steps)
        self._sync_optimizer()
        if self._copies_stale():
            self._refresh_weight_copies()
        if self._host_step is None:
            self._host_step = self._device_calls()
        losses = []
        for n in range(launches):
            replay.feed([a[n * steps:(n + 1) * steps] for a in batches])
            replay.run(self.use_graph)
            losses += [self._loss_handle(self._host_step + k + 1) for k in range(steps)]
            self._host_step += steps
        return losses

    def _loss_handle(self, step: int) -> LossHandle:
        guard = self._guard
        return LossHandle(step, self.state[HISTORY_PREFIX + "loss"],
                          self.state[HISTORY_PREFIX + "step"], self.backend.to_numpy,
                          self.state.get(HISTORY_FLAG_KEY),
                          guard.check_read if guard is not None else None)

    def _device_calls(self) -> int:
        """The device counter the loss history is keyed by: calls (guarded) or steps."""
        if self._guard is not None:
            return self._guard.calls()
        return int(self.backend.to_numpy(self.state[STEP_KEY]))

    @property
    def skipped_steps(self) -> int:
        """Steps whose update a guard did not apply (read from the device: syncs)."""
        return 0 if self._guard is None else self._guard.skipped()

    def profile(self, *arrays, iters: int = 50):
        """The per-op device-time table of this step on the batch `arrays` (step_profile.py's
        StepProfile; print its .table()). CUDA only. It runs the step many times; the step's
        parameters and state are restored afterwards."""
        if self.device != "cuda":
            raise BackendUnavailableError(
                "step.profile() times each op on the GPU: compile the step with device='cuda' "
                f"(this one runs on {self.device})")
        from .step_profile import profile_step

        return profile_step(self, arrays, iters=iters)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters and buffers (PyTorch keys), optimizer state and the step counter, as
        NumPy arrays."""
        self._sync_optimizer()
        # NumPy, as the optimizer state beside them (the model's own state_dict holds eager
        # tensors, as torch's): a host copy of each Parameter and Buffer under each of its keys
        out = {k: p.numpy() for k, p in self.model.state_dict(keep_vars=True).items()}
        out.update((k, self.backend.to_numpy(v)) for k, v in sorted(self._training_state()))
        return out

    def _training_state(self):
        # bf16 weight copies and the hyperparameters (the optimizer's param_groups, written
        # before each step): derived, not kept
        return [(k, v) for k, v in self.state.items()
                if not k.startswith((HISTORY_PREFIX, GUARD_PREFIX))
                and parse_weight_copy(k) is None and k != HYPERPARAMETERS_KEY]

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what state_dict() returned, in place (compiled graphs keep their buffers)."""
        state = dict(self._training_state())
        missing = [k for k in state if k not in state_dict]
        if missing:
            raise StateDictError(f"state_dict lacks optimizer state {missing}")
        for k, buf in state.items():
            if tuple(np.shape(state_dict[k])) != tuple(buf.shape):
                raise StateDictError(f"{k}: expected shape {tuple(buf.shape)}, "
                                     f"got {np.shape(state_dict[k])}")
        self.model.load_state_dict({k: v for k, v in state_dict.items() if k not in state})
        for k, buf in state.items():
            # np.array keeps 0-d state (the step counter) 0-d; ascontiguousarray makes it 1-d
            self.backend.copy_into(buf, np.array(state_dict[k], dtype=buf.dtype, order="C"))
        self._host_step = None
        if self._guard is not None:
            self._guard.reset(int(np.asarray(state_dict[STEP_KEY])))
        # The schedule's base lr, held in float32 there: every group moves with it
        # (Optimizer.lr), unless it is this optimizer's own (kept in float64).
        saved_lr = np.float32(np.asarray(state_dict[SCHEDULE_KEY])[0])
        if saved_lr != np.float32(self.optimizer.lr):
            self.optimizer.lr = float(saved_lr)
        if self._has_copies:
            self._refresh_weight_copies()


def _data_parallel(distributed):
    """(DataParallel options, process group), or (None, None) for a one-process step."""
    from . import distributed as dist

    if distributed is False or distributed is None:
        return None, None
    if distributed is True:
        distributed = dist.DataParallel()
    if not isinstance(distributed, dist.DataParallel):
        raise TypeError("distributed must be a bool or a stepgraph.distributed.DataParallel, "
                        f"got {type(distributed).__name__}")
    return distributed, distributed.group or dist.init()


class Predictor(_CompiledModel):
    """The model's forward pass in eval mode, reading the same parameter buffers.

    Random draws of the forward (F.dropout(x, p, training=True) as Monte-Carlo dropout does,
    torch.rand, ...) come from the Philox stream keyed by `seed`, at a counter this predictor
    owns on the device (every feed signature's graph shares it) and each call advances
    inside its graph: fresh values every call, no host sync, no re-capture, and the same
    sequence from a new predictor with the same seed."""

    mode = INFERENCE

    def __init__(self, model, example_inputs, device="cpu", graph=None, precision="fp32",
                 memory_format="auto", seed: int = 0):
        super().__init__(model, example_inputs, device, graph, precision, with_target=False,
                         memory_format=memory_format)
        self.seed = int(seed)
        self._rng_counter = None        # made when a graph first draws (bind)
        self.executable(self.signature)

    def build_graph(self, signature: Signature) -> Graph:
        return build_predict_graph(self.model, signature, self.memory_format, self.precision,
                                   self.seed, self.device, self.module_values)

    def bind(self, v: Value) -> Any:
        if v.role == STATE and v.name == PREDICT_RNG_KEY:
            if self._rng_counter is None:
                self._rng_counter = self.backend.empty((), "int64")
                self.backend.copy_into(self._rng_counter, np.zeros((), np.int64))
            return self._rng_counter
        return super().bind(v)

    def __call__(self, *arrays):
        """The model's output for this batch, as a new array on the step's device."""
        exe = self._prepare(arrays)
        exe.run(self.use_graph)
        return self.backend.copy_result(exe.outputs["output"])


_train_cache: "weakref.WeakKeyDictionary[Module, dict]" = weakref.WeakKeyDictionary()


def compile_train_step(model: Module, loss=None, optimizer=None, example_inputs=None,
                       device: str = "cpu", graph: bool | None = None, seed: int = 0,
                       precision: str = "fp32", on_bad_batch: str = "raise", distributed=False,
                       memory_format: str = "auto", deterministic: bool = True,
                       overlap_update: bool | str = "auto", loss_index: int | None = None,
                       loss_key: str = "loss") -> TrainStep:
    """Compile forward + loss + backward + optimizer update into one callable step.

    loss: a function (output, target) -> scalar loss; the step is called as step(*inputs,
    target). loss=None: the model computes its own loss from all the step's arguments,
    step(*inputs) calls model(*inputs), and the loss is what forward returns: a scalar, the
    entry `loss_index` of a tuple or list (default: its only scalar entry, as nanoGPT's
    (logits, loss)), or the entry `loss_key` (default "loss") of a dict; LossSelectionError
    says what was returned when no scalar loss is found there.

    Compiling the same model, loss and optimizer with the same options again returns the same
    step (a new one would start from fresh optimizer state). Parameters with
    requires_grad=False are frozen: traced as constant inputs, no gradient, no update, no
    optimizer state. A step keeps the frozen set it was compiled with; after changing
    requires_grad, compile again (that compile builds a new step, with fresh optimizer state).
    device: "cpu" (the NumPy backend), "cuda", or "auto" (cuda when a GPU backend is usable
    here, else cpu, as `stepgraph train --device auto`). `graph` defaults to True on CUDA.
    on_bad_batch ("raise", "skip" or "ignore"): what a batch with bad labels or a non-finite
    loss or gradient does (TrainStep's docstring). distributed (True, or a
    stepgraph.distributed.DataParallel with options): average the gradients across the
    processes of a data-parallel run inside the step (TrainStep's docstring).
    memory_format ("auto", "channels_last", "contiguous") and deterministic (default True):
    the device layout of the image tensors and whether nondeterministic cuDNN plans may run
    (TrainStep's docstring). overlap_update ("auto", True, False): whether the optimizer's
    update overlaps the backward pass (TrainStep's docstring).
    """
    if optimizer is None or example_inputs is None:
        raise TypeError("compile_train_step needs optimizer= and example_inputs=")
    if loss is None:
        loss = ModelLoss(loss_index, loss_key)
    device = resolve_device(device)     # "auto" and the device it picks share one cached step
    frozen = tuple(k for k, p in model.named_parameters() if not p.requires_grad)
    key = (loss if isinstance(loss, ModelLoss) else id(loss), id(optimizer),
           signature_of(_input_names(len(example_inputs), not isinstance(loss, ModelLoss)),
                        example_inputs), device, graph, seed, precision,
           on_bad_batch, distributed, memory_format, deterministic, overlap_update, frozen)
    per_model = _train_cache.setdefault(model, {})
    step = per_model.get(key)
    if step is None or step.optimizer is not optimizer:
        step = TrainStep(model, loss, optimizer, example_inputs, device, graph, seed, precision,
                         on_bad_batch, distributed, memory_format, deterministic, overlap_update)
        per_model[key] = step
    return step


def compile_predict(model: Module, example_inputs, device: str = "cpu", graph: bool | None = None,
                    precision: str = "fp32", memory_format: str = "auto",
                    seed: int = 0) -> Predictor:
    """Compile the model's eval-mode forward pass; it reads the same parameter buffers as any
    train step of the model, so it always sees the latest trained values. device ("cpu",
    "cuda" or "auto") and memory_format as compile_train_step's.

    The modules are in eval mode (nn.Dropout does not drop), but a dropout the forward asks
    for explicitly (F.dropout(x, p, training=True): Monte-Carlo dropout) drops, and random
    draws (torch.rand, randn, bernoulli, ...) draw, as in torch: from the Philox stream keyed
    by `seed`, fresh at every call and the same sequence for every predictor compiled with
    that seed (Predictor's docstring)."""
    return Predictor(model, example_inputs, device, graph, precision, memory_format, seed)
