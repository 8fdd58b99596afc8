"""The optimizer base: appends the update of every parameter to the step's graph as ops.

Per step: step_increment, lr_schedule, (global_norm when clipping), then ONE multi-tensor
update op over every parameter (compile/overlap.py may later split it into buckets that
overlap the backward pass). The step counter, the LR schedule and the per-parameter slots
(momentum, Adam moments) are graph state living in device memory.

Parameter groups (PyTorch's: [{"params": [...], "weight_decay": 0.1}, {"params": [...],
"lr": ...}]) stay one update op: its attrs then hold the per-group hyperparameters as
tuples with one entry per parameter (`group_keys` of each optimizer; the learning rate as
lr_scale = group lr / base lr, fixed when the step is built, so that the schedule and later
changes of `lr`, which move the base lr, move every group's lr alike).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..ir.graph import Value
from ..ir.trace import Tracer
from ..loop.optimizer_methods import LoopMethods
from .schedules import SCHEDULE_SLOTS, Constant

SCHEDULE_KEY = "optimizer.lr_schedule"
STEP_KEY = "optimizer.step"


class Optimizer(LoopMethods):
    update_op = ""
    slot_names: tuple[str, ...] = ()
    # Hyperparameters a parameter group may set (besides "params" and "lr").
    group_keys: tuple[str, ...] = ("weight_decay",)

    def __init__(self, lr: float, schedule=None, max_grad_norm: float | None = None,
                 params_or_groups=None):
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        self._lr = float(lr)
        # None: every parameter of the step, with the optimizer's hyperparameters.
        self._groups = None if params_or_groups is None else self._check_groups(params_or_groups)
        self._schedule = schedule or Constant()
        self.max_grad_norm = max_grad_norm
        # Compiled steps register a writer for the schedule vector in their device memory.
        self._schedule_sinks: list[Callable[[np.ndarray], None]] = []
        if self._groups is not None:
            self._join_loop()

    # ---- Python-side knobs: they write device memory, never re-capture ----
    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = float(value)
        self._publish()

    @property
    def schedule(self):
        return self._schedule

    @schedule.setter
    def schedule(self, value) -> None:
        self._schedule = value or Constant()
        self._publish()

    def schedule_vector(self) -> np.ndarray:
        vec = self._schedule.vector(self._lr)
        assert vec.shape == (SCHEDULE_SLOTS,)
        return vec

    def _publish(self) -> None:
        for sink in self._schedule_sinks:
            sink(self.schedule_vector())

    def attach(self, sink: Callable[[np.ndarray], None]) -> None:
        self._schedule_sinks.append(sink)

    # ---- parameter groups ----
    def _check_groups(self, params_or_groups) -> list[dict]:
        """PyTorch's `params` argument as a list of group dicts: an iterable of Parameters
        (one group) or of dicts with "params" and optionally "lr" and `group_keys`."""
        from ..nn.module import Parameter

        if isinstance(params_or_groups, (Parameter, dict)) or \
                not hasattr(params_or_groups, "__iter__"):
            raise TypeError("params_or_groups must be an iterable of Parameters or of dicts, "
                            f"got {type(params_or_groups).__name__}")
        items = list(params_or_groups)
        groups = [dict(g) for g in items] if items and isinstance(items[0], dict) else \
            [{"params": items}]
        seen: set[int] = set()
        for g in groups:
            if not isinstance(g, dict) or "params" not in g:
                raise TypeError(f"a parameter group must be a dict with 'params', got {g!r}")
            unknown = set(g) - {"params", "lr", *self.group_keys}
            if unknown:
                raise ValueError(f"{type(self).__name__} parameter groups may set lr and "
                                 f"{', '.join(self.group_keys)} only, got {sorted(unknown)}")
            g["params"] = [g["params"]] if isinstance(g["params"], Parameter) \
                else list(g["params"])
            for p in g["params"]:
                if not isinstance(p, Parameter):
                    raise TypeError(f"a group's params must be Parameters, got {p!r}")
                if id(p) in seen:
                    raise ValueError(f"{p!r} is in more than one parameter group")
                seen.add(id(p))
            if g.get("lr", 0.0) < 0:
                raise ValueError(f"invalid learning rate {g['lr']} in a parameter group")
        return groups

    @property
    def param_groups(self) -> list[dict] | None:
        """The parameter groups with every hyperparameter filled in (PyTorch's), or None when
        the optimizer updates every parameter of the step alike."""
        if self._groups is None:
            return None
        defaults = dict(lr=self.lr, **self.group_defaults())
        return [{**defaults, **g} for g in self._groups]

    def group_defaults(self) -> dict:
        """The values of `group_keys` for a group that does not set them."""
        return {k: getattr(self, k) for k in self.group_keys}

    def _group_of_each(self, tracer: Tracer, params: list[Value]) -> list[dict]:
        """The (filled-in) group of each parameter Value, matched by Parameter identity."""
        groups = self.param_groups
        by_id = {id(p): g for g in groups for p in g["params"]}
        by_value = {tracer.param_values[id(p)]: by_id.get(id(p)) for p in tracer.parameters}
        found = [by_value.get(v) for v in params]
        missing = [v.name for v, g in zip(params, found) if g is None]
        if missing:
            raise ValueError(f"{type(self).__name__}: parameters {missing} are in no parameter "
                             "group (every trained parameter must be in one)")
        return found

    def group_attrs(self, tracer: Tracer, params: list[Value]) -> dict:
        """Per-parameter hyperparameters of the groups as attrs tuples, one entry per
        parameter: lr_scale, and each of `group_keys` (split by `split_group_value`).
        Empty without groups."""
        if self._groups is None:
            return {}
        groups = self._group_of_each(tracer, params)
        for g in groups:
            if g["lr"] and not self.lr:
                raise ValueError("a parameter group's lr needs a non-zero base lr (lr_scale = "
                                 "group lr / base lr)")
        attrs = {"lr_scale": tuple(g["lr"] / self.lr if self.lr else 1.0 for g in groups)}
        for key in self.group_keys:
            for name, values in self.split_group_value(key, [g[key] for g in groups]).items():
                attrs[name] = tuple(values)
        return attrs

    def split_group_value(self, key: str, values: list) -> dict[str, list]:
        """attrs name -> per-parameter values of one group key (Adam splits betas)."""
        return {key: [float(v) for v in values]}

    # ---- graph emission ----
    def hyperparameters(self) -> dict:
        raise NotImplementedError

    def slots_for(self) -> tuple[str, ...]:
        return self.slot_names

    def emit(self, tracer: Tracer, params: list[Value], grads: list[Value], guard=None,
             weight_copies=None) -> None:
        """Append the update. With a guard (compile/guard.py), its guard_advance moves the
        step counter only on steps that pass, and the update op reads its flags (last input,
        attrs guard) and leaves everything as it was on a step that does not.
        weight_copies (compile/autocast.py WeightCopy list, precision="bf16"): the update also
        writes each bf16 copy from its freshly updated float32 parameter (attrs copies,
        copy_dims)."""
        tracer.label = f"{type(self).__name__} update"
        step = tracer.rng_step()
        schedule = tracer.state((SCHEDULE_SLOTS,), "float32", SCHEDULE_KEY)
        if guard is None:
            tracer.emit("step_increment", [step])
            lr = tracer.emit("lr_schedule", [step, schedule])[0]
        else:
            lr = guard.emit_advance(tracer, step, schedule)
        scalars = [lr, step]
        if self.max_grad_norm is not None:
            scalars.append(tracer.emit("global_norm", grads)[0])
        slots = [tracer.state(p.shape, p.dtype, f"optimizer.{slot}.{p.name}")
                 for slot in self.slots_for() for p in params]
        guarded = {"guard": True} if guard is not None else {}
        flags = [guard.flags] if guard is not None else []
        index = {p: i for i, p in enumerate(params)}
        copies = [c for c in weight_copies or () if c.param in index]
        copied = {"copies": tuple(index[c.param] for c in copies)} if copies else {}
        if any(c.dims is not None for c in copies):
            copied["copy_dims"] = tuple(c.dims for c in copies)
        tracer.emit(self.update_op,
                    scalars + params + grads + slots + [c.value for c in copies] + flags,
                    n_params=len(params), n_scalars=len(scalars), n_slots=len(self.slots_for()),
                    max_norm=self.max_grad_norm, **guarded, **copied,
                    **{**self.hyperparameters(), **self.group_attrs(tracer, params)})

    def initial_state(self, value: Value) -> np.ndarray:
        """The value a state buffer starts from."""
        if value.name == SCHEDULE_KEY:
            return self.schedule_vector()
        return np.zeros(value.shape, dtype=value.dtype)

    def __repr__(self):
        hp = ", ".join(f"{k}={v}" for k, v in self.hyperparameters().items())
        return f"{type(self).__name__}(lr={self.lr}, {hp})"
