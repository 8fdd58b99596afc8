"""The optimizer base: torch.optim's constructors, parameter groups and state_dict, and the
update of every parameter appended to the step's graph as ops.

Per step: step_increment, lr_schedule, (global_norm when clipping), then ONE multi-tensor
update op over every parameter (compile/overlap.py may later split it into buckets that
overlap the backward pass). The step counter, the LR schedule, the per-parameter slots
(momentum, Adam moments, ...) and the hyperparameters are graph state living in device memory.

Hyperparameters. Every value a script may change between steps (each group's lr,
weight_decay, momentum, dampening, betas, eps, alpha, lr_decay: `dynamic_keys`) is a float64
row per parameter of the state HYPERPARAMETERS_KEY (ops/optim.py HYPER_COLUMNS), written from
the host before the next step of every compiled step whenever one changed, never baked into a
captured graph. Parameter i's lr is the schedule's factor (exactly 1.0 without a stepgraph
schedule, so that it is the group's lr bit for bit, as PyTorch's) times its group's lr.
Switches of the formula (nesterov, maximize, amsgrad, centered, decoupled_weight_decay:
`static_keys`) are attrs of the update op: the same in every group, and fixed once a step is
compiled (a change is refused with ValueError). So is the existence of a state slot: an SGD or
RMSprop compiled with momentum 0 in every group has no momentum buffers, and a later write of a
non-zero momentum is refused.

`param_groups` is PyTorch's: a list of live dicts (ParamGroup), kept between reads; a write of
a hyperparameter reaches the compiled steps, other keys (a scheduler's initial_lr, max_lr,
...) are stored and ignored. An optimizer built without parameters (params=None,
compile_train_step's style) has one group, with the optimizer's hyperparameters, whose params
are every parameter of the steps compiled with it (empty until then).
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..ir.graph import Value
from ..ir.trace import Tracer, tensor_of
from ..loop.optimizer_methods import LoopMethods
from .schedules import SCHEDULE_SLOTS, Constant

SCHEDULE_KEY = "optimizer.lr_schedule"
STEP_KEY = "optimizer.step"
HYPERPARAMETERS_KEY = "optimizer.hyperparameters"
SLOT_PREFIX = "optimizer."


class ParamGroup(dict):
    """One entry of `optimizer.param_groups`: a dict whose writes are checked and published
    by its optimizer (module docstring). Copies and pickles are plain dicts."""

    def __init__(self, owner: "Optimizer", values: dict):
        super().__init__(values)
        self._owner = owner

    def __setitem__(self, key, value):
        value = self._owner._checked(self, key, value)
        super().__setitem__(key, value)
        self._owner._changed(key)

    def update(self, *args, **kwargs):
        items = dict(*args, **kwargs)
        checked = {k: self._owner._checked(self, k, v) for k, v in items.items()}
        for k, v in checked.items():
            super().__setitem__(k, v)
            self._owner._changed(k)

    def __ior__(self, other):
        self.update(other)
        return self

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def __delitem__(self, key):
        self._owner._check_removal(key)
        super().__delitem__(key)

    def pop(self, key, *default):
        if key in self:
            self._owner._check_removal(key)
        return super().pop(key, *default)

    def popitem(self):
        raise TypeError("a parameter group's keys cannot be removed in bulk")

    def clear(self):
        raise TypeError("a parameter group's keys cannot be removed in bulk")

    def __reduce__(self):
        return (dict, (dict(self),))


def _non_negative(name: str):
    def check(value):
        value = float(value)
        if not value >= 0.0:
            raise ValueError(f"Invalid {name} value: {value}")
        return value
    return check


def _betas(value) -> tuple[float, float]:
    betas = tuple(float(b) for b in value)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Invalid betas {value}: two values in [0, 1) are needed")
    return betas


# How a written value is checked and normalised, by group key (PyTorch's checks).
VALUE_CHECKS = {
    "lr": _non_negative("learning rate"), "weight_decay": _non_negative("weight_decay"),
    "momentum": _non_negative("momentum value"), "dampening": float,
    "eps": _non_negative("epsilon value"), "alpha": _non_negative("alpha value"),
    "lr_decay": _non_negative("lr_decay value"), "betas": _betas,
    "initial_accumulator_value": _non_negative("initial_accumulator_value"),
    "nesterov": bool, "maximize": bool, "amsgrad": bool, "centered": bool,
    "decoupled_weight_decay": bool,
}


class Optimizer(LoopMethods):
    update_op = ""
    # The group keys written to the device hyperparameters (HYPER_COLUMNS, betas as beta1
    # and beta2) and the switches of the formula (attrs of the update op).
    dynamic_keys: tuple[str, ...] = ("lr", "weight_decay")
    static_keys: tuple[str, ...] = ("maximize",)

    def __init__(self, params, defaults: dict, schedule=None,
                 max_grad_norm: float | None = None):
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        self.defaults = {k: self._normalised(k, v) for k, v in defaults.items()}
        self._schedule = schedule or Constant()
        self.max_grad_norm = max_grad_norm
        self._version = 0                 # moves at every change the device must see
        self._steps: list[weakref.ref] = []
        self._emitted = False             # a step was built: static keys and slots are fixed
        self._slots: tuple[str, ...] | None = None
        self._rows: list[Any] = []        # the Parameters of the last update emitted, in order
        self._pending: dict | None = None  # state loaded before any step was compiled
        # None: one group of every parameter of the compiled steps (compile_train_step's).
        self._implicit = params is None
        self.param_groups: list[ParamGroup] = []
        if self._implicit:
            self.param_groups.append(ParamGroup(self, {"params": [], **self.defaults}))
        else:
            for group in self._check_groups(params):
                self.add_param_group(group)
        if not self._implicit:
            self._join_loop()           # torch's style: it may drive a training script's loop

    # ---- Python-side knobs: they write device memory before the next step ----
    @property
    def lr(self) -> float:
        """The optimizer's lr (defaults["lr"]): the base of a stepgraph schedule. Setting it
        moves every group's lr alike (a group at the old value gets the new one exactly)."""
        return self.defaults["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        value, old = _non_negative("learning rate")(value), self.defaults["lr"]
        self.defaults["lr"] = value
        for g in self.param_groups:
            if g["lr"] == old:
                dict.__setitem__(g, "lr", value)
            elif old:
                dict.__setitem__(g, "lr", g["lr"] * value / old)
        self._version += 1

    @property
    def schedule(self):
        return self._schedule

    @schedule.setter
    def schedule(self, value) -> None:
        self._schedule = value or Constant()
        self._version += 1

    @property
    def version(self) -> int:
        """Moves whenever the schedule or a hyperparameter changes (TrainStep republishes)."""
        return self._version

    def schedule_vector(self) -> np.ndarray:
        vec = self._schedule.vector(self.lr)
        assert vec.shape == (SCHEDULE_SLOTS,)
        return vec

    def attach(self, step) -> None:
        """Register a compiled TrainStep: it publishes this optimizer's changes before each of
        its steps, and state_dict() reads its device state."""
        self._steps = [r for r in self._steps if r() is not None and r() is not step]
        self._steps.append(weakref.ref(step))
        self._pending = None       # consumed by the step's initial state

    def compiled_steps(self) -> list:
        """The live TrainSteps compiled with this optimizer, oldest first."""
        return [s for s in (r() for r in self._steps) if s is not None]

    # ---- parameter groups ----
    def _check_groups(self, params) -> list[dict]:
        """PyTorch's `params` argument as a list of group dicts: an iterable of Parameters,
        of (name, Parameter) pairs (named_parameters()), or of dicts with "params"."""
        from ..nn.module import Parameter

        if isinstance(params, (Parameter, dict)) or not hasattr(params, "__iter__"):
            raise TypeError("params argument given to the optimizer should be an iterable of "
                            f"Parameters or dicts, but got {type(params).__name__}")
        items = list(params)
        if not items:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(items[0], dict):
            items = [{"params": items}]
        return items

    def add_param_group(self, param_group: dict) -> None:
        """torch.optim.Optimizer.add_param_group: a group of new parameters, the optimizer's
        defaults filling the keys it does not set. Only before a step is compiled (a compiled
        step's parameters are fixed)."""
        from ..nn.module import Parameter

        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(f"a parameter group must be a dict with 'params', got "
                            f"{param_group!r}")
        if self._emitted:
            raise ValueError(f"{type(self).__name__}.add_param_group: a step is already "
                             "compiled with this optimizer; build the optimizer with every "
                             "group before compiling")
        params = param_group["params"]
        params = [params] if isinstance(params, Parameter) else list(params)
        names = None
        if params and all(isinstance(p, tuple) and len(p) == 2 for p in params):
            names, params = [n for n, _ in params], [p for _, p in params]
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for p in params:
            if not isinstance(p, Parameter):
                raise TypeError(f"optimizer can only optimize Parameters, got {p!r}")
            if id(p) in seen:
                raise ValueError(f"{p!r} is in more than one parameter group")
            seen.add(id(p))
        values = {k: self._normalised(k, v) for k, v in param_group.items() if k != "params"}
        group = {"params": params, **self.defaults, **values}
        if names is not None:
            group["param_names"] = names
        for key in self.static_keys:
            if self.param_groups and group[key] != self.param_groups[0][key]:
                raise ValueError(f"{type(self).__name__}: {key} must be the same in every "
                                 "parameter group (it selects the update's formula)")
        self.param_groups.append(ParamGroup(self, group))

    def _normalised(self, key: str, value):
        check = VALUE_CHECKS.get(key)
        return value if check is None or value is None else check(value)

    def _checked(self, group: dict, key: str, value):
        """A value about to be written to `group` (ParamGroup.__setitem__), checked."""
        if key == "params":
            raise ValueError("a parameter group's params cannot be replaced; use "
                             "add_param_group before compiling a step")
        value = self._normalised(key, value)
        if key in self.static_keys and self._emitted and value != group.get(key):
            raise ValueError(
                f"{type(self).__name__}: {key} selects the compiled update's formula and "
                f"cannot change once a step is compiled ({group.get(key)!r} -> {value!r}); "
                "build the optimizer with it")
        self._check_slot_use(key, value)
        return value

    def _check_slot_use(self, key: str, value) -> None:
        """Refuse a value the compiled steps have no state for (SGD / RMSprop momentum)."""
        if key == "momentum" and value and self._emitted and \
                "momentum_buffer" not in (self._slots or ()):
            raise ValueError(
                f"{type(self).__name__}: the step was compiled with momentum 0 in every group, "
                "so it keeps no momentum buffers; build the optimizer with a non-zero momentum "
                "(a group may set 0 until it needs it)")

    def _check_removal(self, key: str) -> None:
        if key == "params" or key in self.defaults:
            raise KeyError(f"{key!r} cannot be removed from a parameter group")

    def _changed(self, key: str) -> None:
        if key in self.dynamic_keys:
            self._version += 1

    def _group_of(self, p, by_id: dict | None = None) -> dict:
        """The group of Parameter p (None: a parameter without a Parameter object, in the
        implicit group); by_id: `_groups_by_id()`, for many lookups."""
        by_id = self._groups_by_id() if by_id is None else by_id
        if id(p) in by_id:
            return by_id[id(p)]
        if self._implicit:
            if p is not None:
                self.param_groups[0]["params"].append(p)
                by_id[id(p)] = self.param_groups[0]
            return self.param_groups[0]
        raise ValueError(f"{type(self).__name__}: parameter {p!r} is in no parameter group "
                         "(every trained parameter must be in one)")

    def _groups_by_id(self) -> dict[int, dict]:
        return {id(p): g for g in self.param_groups for p in g["params"]}

    def _param_index(self) -> list:
        """Every Parameter in PyTorch's state_dict order (group by group)."""
        return [p for g in self.param_groups for p in g["params"]]

    # ---- hyperparameters ----
    def column(self, group: dict, name: str) -> float:
        """The value of HYPER_COLUMNS column `name` for a parameter of `group`."""
        return float(group[name])

    def hyperparameter_table(self, rows: list | None = None,
                             step_offsets: dict | None = None) -> np.ndarray:
        """The (parameters, columns) float64 hyperparameters of the Parameters `rows` (None:
        those of the last update emitted), one row each from its group; step_offsets {id of a
        Parameter: the steps it missed} fills the step_offset column (0 where absent)."""
        from ..ops.optim import HYPER_COLUMNS, STEP_OFFSET, hyperparameter_table

        rows = self._rows if rows is None else rows
        by_id = self._groups_by_id()
        groups = [self._group_of(p, by_id) for p in rows]
        values = {c: [self.column(g, c) for g in groups] for c in HYPER_COLUMNS[self.update_op]
                  if c != STEP_OFFSET}
        values[STEP_OFFSET] = [(step_offsets or {}).get(id(p), 0) for p in rows]
        return hyperparameter_table(self.update_op, values, len(rows))

    # ---- graph emission ----
    def hyperparameters(self) -> dict:
        """The optimizer's construction-time settings (a checkpoint's signature)."""
        raise NotImplementedError

    def slots_for(self, groups: list[dict]) -> tuple[str, ...]:
        """The state each parameter keeps (PyTorch's names), for parameters of `groups`."""
        raise NotImplementedError

    def formula_attrs(self, group: dict) -> dict:
        """The update op's attrs from the static keys (every group has the same)."""
        return {"maximize": group["maximize"]}

    def emit(self, tracer: Tracer, params: list[Value], grads: list[Value], guard=None,
             weight_copies=None) -> None:
        """Append the update. With a guard (compile/guard.py), its guard_advance moves the
        step counter only on steps that pass, and the update op reads its flags (last input,
        attrs guard) and leaves everything as it was on a step that does not.
        weight_copies (compile/autocast.py WeightCopy list: the bf16 copies of precision="bf16",
        the float32 transposed conv weights of compile/weight_permutes.py): the update also
        writes each copy from its freshly updated float32 parameter (attrs copies,
        copy_dims)."""
        from ..ops.optim import HYPER_COLUMNS, HYPER_DTYPE   # ops imports optim

        by_value = {tracer.param_values[id(p)]: p for p in tracer.parameters
                    if id(p) in tracer.param_values}
        rows = [by_value.get(v) for v in params]
        by_id = self._groups_by_id()
        groups = [self._group_of(p, by_id) for p in rows]
        for key in self.static_keys:
            if len({g[key] for g in groups}) > 1:
                raise ValueError(f"{type(self).__name__}: {key} must be the same in every "
                                 "parameter group (it selects the update's formula)")
        slots = self.slots_for(groups)
        if self._emitted and slots != self._slots:
            raise ValueError(f"{type(self).__name__}: this step would keep state {slots}, the "
                             f"steps compiled before keep {self._slots}")
        tracer.label = f"{type(self).__name__} update"
        step = tracer.rng_step()
        schedule = tracer.state((SCHEDULE_SLOTS,), "float32", SCHEDULE_KEY)
        hyper = tracer.state((len(params), len(HYPER_COLUMNS[self.update_op])), HYPER_DTYPE,
                             HYPERPARAMETERS_KEY)
        if guard is None:
            tracer.emit("step_increment", [step])
            lr = tracer.emit("lr_schedule", [step, schedule])[0]
        else:
            lr = guard.emit_advance(tracer, step, schedule)
        scalars = [lr, step, hyper]
        if self.max_grad_norm is not None:
            scalars.append(tracer.emit("global_norm", grads)[0])
        slot_values = [tracer.state(p.shape, p.dtype, f"{SLOT_PREFIX}{slot}.{p.name}")
                       for slot in slots for p in params]
        guarded = {"guard": True} if guard is not None else {}
        flags = [guard.flags] if guard is not None else []
        index = {p: i for i, p in enumerate(params)}
        copies = [c for c in weight_copies or () if c.param in index]
        copied = {"copies": tuple(index[c.param] for c in copies)} if copies else {}
        if any(c.dims is not None for c in copies):
            copied["copy_dims"] = tuple(c.dims for c in copies)
        # Several groups: each parameter's group (per-parameter attrs: a ZeRO-sharded update,
        # which mixes parameters in one chunk, refuses them).
        numbered = {id(g): i for i, g in enumerate(self.param_groups)}
        grouped = {"param_group": tuple(numbered[id(g)] for g in groups)} \
            if len({id(g) for g in groups}) > 1 else {}
        first = groups[0] if groups else self.param_groups[0]
        tracer.emit(self.update_op,
                    scalars + params + grads + slot_values + [c.value for c in copies] + flags,
                    n_params=len(params), n_scalars=len(scalars), n_slots=len(slots),
                    max_norm=self.max_grad_norm, **guarded, **copied, **grouped,
                    **self.formula_attrs(first))
        self._emitted, self._slots, self._rows = True, slots, rows

    def emitted_rows(self) -> list:
        """The Parameters of the last update emitted, in its row order."""
        return list(self._rows)

    def initial_state(self, value: Value, rows: list | None = None) -> np.ndarray:
        """The value a state buffer starts from. rows: the step's Parameters in the order of
        its hyperparameter rows (None: those of the last update emitted)."""
        rows = self._rows if rows is None else rows
        if value.name == SCHEDULE_KEY:
            return self.schedule_vector()
        if value.name == HYPERPARAMETERS_KEY:
            return self.hyperparameter_table(rows)
        pending = self._pending or {}
        if value.name == STEP_KEY and pending.get("step") is not None:
            return np.array(pending["step"], dtype=value.dtype)
        slot, p = self._slot_of(value.name, rows)
        loaded = pending.get("state", {}).get(id(p), {}).get(slot)
        if loaded is not None:
            return np.asarray(loaded, dtype=value.dtype).reshape(value.shape)
        if slot is not None:
            group = self.param_groups[0] if p is None else self._group_of(p)
            return np.full(value.shape, self.slot_start(slot, group), value.dtype)
        return np.zeros(value.shape, dtype=value.dtype)

    def slot_start(self, slot: str, group: dict) -> float:
        """The value a state slot starts from (Adagrad's sum: initial_accumulator_value)."""
        return 0.0

    def _slot_of(self, name: str, rows: list) -> tuple[str | None, Any]:
        """(slot, Parameter) of a state buffer `optimizer.<slot>.<parameter name>`; a
        ZeRO-sharded slot (`optimizer.<slot>.zero.bucket<b>`) belongs to the one group."""
        for slot in self._slots or ():
            prefix = f"{SLOT_PREFIX}{slot}."
            if name.startswith(prefix):
                rest = name[len(prefix):]
                found = next((p for p in rows if p is not None and p.name == rest), None)
                return slot, found
        return None, None

    # ---- PyTorch's state_dict ----
    def state_dict(self) -> dict:
        """PyTorch's layout: {"state": {index: {"step": 0-d float32, slot: tensor, ...}},
        "param_groups": [{hyperparameters..., "params": [indices]}]}, indices counting the
        parameters group by group. State is read from the compiled step's device memory
        (the latest compiled step holding the parameter; syncs) into eager tensors holding
        copies (PyTorch's are the optimizer's own tensors); a parameter has none before its
        first step (PyTorch's). SGD's entries carry "step" too (stepgraph's counter;
        PyTorch's SGD keeps none and ignores it)."""
        params = self._param_index()
        groups, at = [], 0
        for g in self.param_groups:
            out = {k: (list(v) if isinstance(v, list) else v) for k, v in g.items()
                   if k != "params"}
            out["params"] = list(range(at, at + len(g["params"])))
            at += len(g["params"])
            groups.append(out)
        state = {}
        for i, p in enumerate(params):
            entry = self._device_state(p)
            if entry:
                state[i] = entry
        return {"state": state, "param_groups": groups}

    def _holder(self, p):
        """The latest compiled step that updates Parameter p, or None."""
        for step in reversed(self.compiled_steps()):
            if step.optimizer_holds(p):
                return step
        return None

    def _device_state(self, p) -> dict:
        step = self._holder(p)
        count, slots = (0, {}) if step is None else \
            step.optimizer_state_of(p, self._slots or ())
        if count == 0:
            entry = self.unstarted_entry(self._group_of(p), p)
        else:
            entry = self.state_entry(self._group_of(p), count, slots)
        # eager tensors, as torch's state (a 0-d float32 step): torch code calls tensor
        # methods on them (exp_avg.clone(), step.item())
        return {k: tensor_of(v) if isinstance(v, np.ndarray) else v for k, v in entry.items()}

    def unstarted_entry(self, group: dict, p) -> dict:
        """A parameter's state_dict entry before its first step (never trained, or frozen
        from the start): none, as PyTorch's optimizers make their state lazily."""
        return {}

    def state_entry(self, group: dict, count: int, slots: dict) -> dict:
        """A parameter's state_dict entry from the step counter and its slots (PyTorch's
        keys: a group with momentum 0 has no momentum_buffer)."""
        if "momentum_buffer" in slots and not group["momentum"]:
            slots = {k: v for k, v in slots.items() if k != "momentum_buffer"}
        return {"step": np.array(float(count), np.float32), **slots}

    @property
    def state(self) -> dict:
        """{Parameter: its state (state_dict's entries)}, read from the device (a snapshot)."""
        out = {}
        for p in self._param_index():
            entry = self._device_state(p)
            if entry:
                out[p] = entry
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load PyTorch's layout (state_dict()'s, or one a torch.optim optimizer of the same
        class made for the same parameters): the groups' hyperparameters (checked; keys of
        PyTorch's own kernels are kept and ignored) and each parameter's state, written to the
        compiled steps' device memory, or kept until the first step is compiled. stepgraph
        keeps one step counter: the entries' steps must agree. A state without steps (PyTorch's
        SGD) keeps the counter, at least 1 where momentum buffers are loaded (so that the next
        step continues them instead of starting them from its gradient)."""
        saved_groups = state_dict["param_groups"]
        if self._implicit and not self.param_groups[0]["params"]:
            raise ValueError(f"{type(self).__name__} was built without parameters and no step "
                             "is compiled yet: compile a step first, or build it with "
                             "model.parameters()")
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for g, saved in zip(self.param_groups, saved_groups):
            if len(saved["params"]) != len(g["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't "
                                 "match the size of optimizer's group")
        by_index = {i: p for saved, g in zip(saved_groups, self.param_groups)
                    for i, p in zip(saved["params"], g["params"])}
        updates = [{k: v for k, v in saved.items() if k not in ("params", "param_names")}
                   for saved in saved_groups]
        for g, values in zip(self.param_groups, updates):          # check everything first
            for k, v in values.items():
                self._checked(g, k, v)
        state, steps = {}, set()
        for index, entry in state_dict.get("state", {}).items():
            p = by_index.get(int(index))
            if p is None:
                raise ValueError(f"loaded state dict has state for parameter {index}, which "
                                 "is in no group")
            arrays = {}
            for key, value in entry.items():
                if key == "step":
                    steps.add(int(round(float(np.asarray(value)))))
                elif key in (self._slots or self.slots_for(self.param_groups)) and \
                        value is not None:
                    arrays[key] = np.asarray(value, dtype=np.float32)
                    if arrays[key].shape != tuple(p.shape):
                        raise ValueError(f"loaded {key} of parameter {index} has shape "
                                         f"{arrays[key].shape}, the parameter {tuple(p.shape)}")
            state[id(p)] = arrays
        if len(steps) > 1:
            raise ValueError(f"loaded state dict has parameters at different steps {steps}: "
                             "stepgraph keeps one step counter for every parameter")
        for g, values in zip(self.param_groups, updates):
            g.update(values)
        step = steps.pop() if steps else None
        continues = step is None and any("momentum_buffer" in a for a in state.values())
        fresh = not state_dict.get("state") and bool(self._slots or self.slots_for(
            self.param_groups))
        steps_ = self.compiled_steps()
        if not steps_:
            self._pending = {"state": state,
                             "step": 0 if fresh else 1 if continues else step}
        for compiled in steps_:
            compiled.load_optimizer_state(self, state, 0 if fresh else step, continues)

    def __repr__(self):
        hp = ", ".join(f"{k}={v}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}(lr={self.lr}, {hp})"


def check_nesterov(nesterov: bool, momentum: float, dampening: float) -> None:
    """PyTorch's check of SGD's defaults."""
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
