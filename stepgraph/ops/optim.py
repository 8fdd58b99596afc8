"""Optim family: a step's bookkeeping (step counter, learning-rate factor from the schedule,
loss history; advance_step does the three in one op), the gradients' global norm for clipping,
and the multi-tensor parameter updates (PyTorch's SGD, Adam, AdamW, RMSprop, Adagrad) with the
join of updates that ran on the update stream. optim/ emits them; the formulas of the
schedules are in optim/schedules.py.

The NumPy references compute the scalars PyTorch computes in Python floats (bias
corrections, schedules) in float64 and cast once.
"""
from __future__ import annotations

import math

import numpy as np

from ..ir.graph import HALF_DTYPES, Node
from ..ir.ops import defop, impl
from ..optim.schedules import schedule_factor
from .guard import FLAG_SKIP


# ---- step bookkeeping ----------------------------------------------------------------------

@defop("step_increment", mutates=lambda attrs: (0,))
def _step_increment(ins, attrs):
    """step += 1 (int64 scalar state), in place."""
    return []


@defop("lr_schedule")
def _lr_schedule(ins, attrs):
    """lr = schedule_factor(schedule, step), the factor of every parameter group's lr (exactly
    1.0 for the constant schedule): ins (step int64 scalar, schedule float32 (6,) =
    [base_lr, warmup_steps, total_steps, min_lr, step_size, gamma]); optim/schedules.py has
    the formulas, computed in double."""
    return [((), "float32")]


@defop("record_loss", mutates=lambda attrs: (2, 3))
def _record_loss(ins, attrs):
    """history_loss[step % R] = loss; history_step[step % R] = step. ins (loss, step,
    history_loss float32 (R,), history_step int64 (R,)): each step's loss stays readable on
    the device for R steps without a copy from the host."""
    return []


@defop("advance_step", mutates=lambda attrs: (0, 3, 4))
def _advance_step(ins, attrs):
    """step_increment, lr_schedule and record_loss of one step in one op: ins (step, schedule,
    loss, history_loss, history_step); step += 1, then lr = schedule_factor(schedule, step) and
    the loss recorded under the new step."""
    return [((), "float32")]


@impl("step_increment")
def step_increment(node: Node, ins, outs, ctx):
    ins[0][...] += 1


@impl("lr_schedule")
def lr_schedule(node: Node, ins, outs, ctx):
    step, schedule = ins
    outs[0][...] = schedule_factor(schedule, int(step))


@impl("record_loss")
def record_loss(node: Node, ins, outs, ctx):
    loss, step, history_loss, history_step = ins
    slot = int(step) % history_loss.shape[0]
    history_loss[slot] = loss
    history_step[slot] = step


@impl("advance_step")
def advance_step(node: Node, ins, outs, ctx):
    step, schedule, loss, history_loss, history_step = ins
    step_increment(node, [step], [], ctx)
    lr_schedule(node, [step, schedule], outs, ctx)
    record_loss(node, [loss, step, history_loss, history_step], [], ctx)


# ---- global norm ---------------------------------------------------------------------------

@defop("global_norm")
def _global_norm(ins, attrs):
    """norm = sqrt(sum over every input of sum(g^2)); float32 when the inputs are bf16
    gradients (compile/fuse.py fuse_gradient_casts)."""
    return [((), "float32" if ins[0].dtype in HALF_DTYPES else ins[0].dtype)]


@impl("global_norm")
def global_norm(node: Node, ins, outs, ctx):
    total = sum(float(np.sum(g.astype(np.float64) ** 2)) for g in ins)
    outs[0][...] = math.sqrt(total)


# ---- parameter updates ---------------------------------------------------------------------

# The multi-tensor updates (PyTorch's SGD, Adam / AdamW, RMSprop, Adagrad).
UPDATE_OPS = ("sgd_update", "adam_update", "rmsprop_update", "adagrad_update")
# An update's scalar inputs: lr (the schedule's factor), step, the hyperparameters[, norm].
UPDATE_SCALARS = 3
HYPER_AT, NORM_AT = 2, 3
# The hyperparameters every script may change: graph state (optim/optimizer.py
# HYPERPARAMETERS_KEY), one float64 row per parameter, written from the host between steps
# (never baked into a captured graph). float64 because PyTorch computes the scalars of its
# updates (lr * weight_decay, 1 - beta1 ** t, lr / (1 + (t - 1) * lr_decay)) in Python floats
# from the group's float64 values; the updates do the same and cast each scalar once.
# Column "lr" is the group's lr: parameter i's lr is the lr input (the schedule's factor,
# exactly 1.0 without a schedule) times it. Flags that change the formula (nesterov,
# maximize, amsgrad, centered, decoupled) stay attrs.
# step_offset: the steps a parameter did not take part in (frozen for a while in a training
# script, or trained from a later step on: loop/session.py); its own step count, which torch
# keeps per parameter and the update's step-dependent terms read (SGD's first momentum step,
# Adam's bias corrections, Adagrad's lr decay), is the step counter minus its offset.
STEP_OFFSET = "step_offset"
HYPER_COLUMNS = {
    "sgd_update": ("lr", "weight_decay", "momentum", "dampening", STEP_OFFSET),
    "adam_update": ("lr", "weight_decay", "beta1", "beta2", "eps", STEP_OFFSET),
    "rmsprop_update": ("lr", "weight_decay", "alpha", "eps", "momentum"),
    "adagrad_update": ("lr", "weight_decay", "lr_decay", "eps", STEP_OFFSET),
}
HYPER_DTYPE = "float64"


# The float32 elements of the shared-memory tile an update moves one parameter's axis-0 slices
# through when it reads a transposed gradient or writes a transposed copy (include/update.cuh):
# 48 KB, what a launch may take without opting in.
UPDATE_TILE = 12_288


def is_slice_transpose(dims) -> bool:
    """Whether dims move axis 1 last and keep the others in order, (0, 2, ..., d - 1, 1): a
    conv weight (O, C, kh, kw) to its channels-last (O, kh, kw, C), each axis-0 slice a
    (C, rest) -> (rest, C) transpose."""
    return dims is not None and len(dims) >= 3 and \
        tuple(dims) == (0, *range(2, len(dims)), 1)


def slice_tile_fits(shape) -> bool:
    """Whether one axis-0 slice of a parameter of `shape`, its rows padded by one element
    against bank conflicts ((rest, C + 1) floats), fits UPDATE_TILE."""
    rest = math.prod(shape[2:])
    return len(shape) >= 3 and shape[1] > 0 and rest * (shape[1] + 1) <= UPDATE_TILE


def update_transposes(dims, shape) -> bool:
    """Whether an update reads a gradient, or writes a copy, of a parameter of `shape` given
    transposed by dims itself, moving its slices through its tile: a slice transpose whose
    slices fit."""
    return is_slice_transpose(dims) and slice_tile_fits(shape)


def update_grad_dims(attrs) -> tuple:
    """Per parameter, the dims that give its gradient input from a gradient in the parameter's
    own order (attrs grad_dims, compile/update_permutes.py), or None: read as it is."""
    return tuple(attrs.get("grad_dims") or (None,) * attrs["n_params"])


def hyper_rows(attrs) -> tuple[int, ...]:
    """The hyperparameter row of each parameter of an update: attrs hyper_rows (an update of
    some of the step's parameters: compile/overlap.py buckets, distribute.py's ZeRO shards),
    else parameter i reads row i."""
    rows = attrs.get("hyper_rows")
    return tuple(range(attrs["n_params"])) if rows is None else tuple(rows)


def hyperparameter_table(op: str, values: dict, n: int) -> np.ndarray:
    """The (n, columns) float64 hyperparameters of `op` from `values`: per column a number
    (every parameter alike) or a sequence of n (one a parameter); a missing column is 0."""
    columns = HYPER_COLUMNS[op]
    table = np.zeros((n, len(columns)), np.float64)
    for j, name in enumerate(columns):
        value = values.get(name, 0.0)
        table[:, j] = [float(v) for v in value] if isinstance(value, (tuple, list)) \
            else float(value)
    return table


def _update_mutates(attrs) -> tuple[int, ...]:
    # inputs: n_scalars scalars (lr, step, hyperparameters[, norm]), then params, grads and
    # n_slots groups of per-parameter state (momentum buffers; Adam's exp_avg, exp_avg_sq),
    # n_params each, then one weight copy per entry of attrs copies (bf16, or float32).
    n, k = attrs["n_params"], attrs["n_scalars"]
    written = list(range(k, k + n))
    for s in range(attrs["n_slots"]):
        written += range(k + (2 + s) * n, k + (3 + s) * n)
    written += [at for _, at, _ in update_weight_copies(attrs)]
    return tuple(written)


def update_weight_copies(attrs) -> list[tuple[int, int, tuple[int, ...] | None]]:
    """(parameter input index, copy input index, transpose dims or None) of each weight copy
    an update writes (attrs copies, copy_dims; sgd_update's docstring)."""
    n, k = attrs["n_params"], attrs["n_scalars"]
    first = k + (2 + attrs["n_slots"]) * n
    indices = attrs.get("copies", ())
    dims = attrs.get("copy_dims") or (None,) * len(indices)
    return [(k + i, first + j, d) for j, (i, d) in enumerate(zip(indices, dims))]


@defop("sgd_update", mutates=_update_mutates)
def _sgd_update(ins, attrs):
    """PyTorch SGD over every parameter in one op. ins = lr, step, hyperparameters[, norm],
    params, grads, momentum buffers[, weight copies][, guard flags]. lr is the schedule's
    factor; hyperparameters the (rows, 4) float64 state of HYPER_COLUMNS (lr, weight_decay,
    momentum, dampening), parameter i reading row hyper_rows(attrs)[i]; n_slots 1 (a momentum
    buffer each) or 0 (the step was built without momentum: a row's momentum is then unused).
    A row with momentum 0 updates as plain SGD and leaves its buffer as it is (PyTorch's). attrs
    nesterov, maximize. Grads are scaled by min(1, max_norm / (norm + 1e-6)) when clipping.
    attrs copies (compile/autocast.py, compile/weight_permutes.py): the indices of the
    parameters with a weight copy, one copy input each in that order; after the update, copy j
    = params[copies[j]] (a bf16 copy: rounded to nearest even; a float32 one: as is),
    transposed by copy_dims[j] when attrs copy_dims gives dims (not None) and viewed with the
    copy's shape (a conv weight's channels-last copy (O, kh, kw, C/groups)). attrs grad_dims (optional, one entry
    a parameter): gradient i is given as the parameter-ordered gradient transposed by
    grad_dims[i] (None: in the parameter's order), as a channels-last convolution made it
    (compile/update_permutes.py). With attrs guard, the
    last input is a guard's flags (ops/guard.py): nothing is written when flags[1]
    (FLAG_SKIP) is set. attrs update_stream (compile/overlap.py: one bucket of a step's
    parameters, placed inside the backward pass): on a backend with streams it runs beside the
    nodes after it, until the next update_join; the results are the same."""
    return []


@defop("adam_update", mutates=_update_mutates)
def _adam_update(ins, attrs):
    """PyTorch Adam (decoupled=False) or AdamW (decoupled=True) over every parameter.
    ins = lr, step, hyperparameters (lr, weight_decay, beta1, beta2, eps)[, norm], params,
    grads, exp_avg, exp_avg_sq[, max_exp_avg_sq with attrs amsgrad][, weight copies][,
    guard flags] (as sgd_update); attrs maximize."""
    return []


@defop("rmsprop_update", mutates=_update_mutates)
def _rmsprop_update(ins, attrs):
    """PyTorch RMSprop over every parameter. ins = lr, step, hyperparameters (lr,
    weight_decay, alpha, eps, momentum)[, norm], params, grads, square_avg[, grad_avg with
    attrs centered][, momentum_buffer: n_slots = 1 + centered + 1 when the step was built with
    momentum][, weight copies][, guard flags] (as sgd_update); attrs maximize."""
    return []


@defop("adagrad_update", mutates=_update_mutates)
def _adagrad_update(ins, attrs):
    """PyTorch Adagrad over every parameter. ins = lr, step, hyperparameters (lr,
    weight_decay, lr_decay, eps)[, norm], params, grads, sum (starting at the group's
    initial_accumulator_value)[, weight copies][, guard flags] (as sgd_update); attrs
    maximize."""
    return []


@defop("update_join")
def _update_join(ins, attrs):
    """Wait until every update with attrs update_stream before it has finished. ins: the
    temporaries those updates read (gradients, lr), read by nothing; listed so that their
    memory stays untouched until here."""
    return []


def _skipped(node: Node, ins) -> bool:
    """A guarded update (attrs guard) whose guard flags (its last input) say skip."""
    return bool(node.attrs.get("guard")) and bool(ins[-1][FLAG_SKIP])


def _update_groups(node: Node, ins):
    """Split an update op's inputs: (lr, step, clip coefficient, params, grads, state slots,
    each parameter's hyperparameters as a dict of HYPER_COLUMNS)."""
    a = node.attrs
    n, k = a["n_params"], a["n_scalars"]
    lr, step, hyper = float(ins[0]), int(ins[1]), ins[HYPER_AT]
    coef = 1.0
    if k == NORM_AT + 1:
        coef = min(1.0, a["max_norm"] / (float(ins[NORM_AT]) + 1e-6))
    params = ins[k:k + n]
    grads = [g if dims is None else g.transpose(np.argsort(dims))
             for g, dims in zip(ins[k + n:k + 2 * n], update_grad_dims(a))]
    slots = [ins[k + (2 + s) * n:k + (3 + s) * n] for s in range(a["n_slots"])]
    columns = HYPER_COLUMNS[node.op]
    rows = [dict(zip(columns, (float(x) for x in hyper[r]))) for r in hyper_rows(a)]
    return lr, step, coef, params, grads, slots, rows


def _write_weight_copies(node: Node, ins) -> None:
    """The weight copies of an update (attrs copies, copy_dims): copy j = params[copies[j]]
    transposed by copy_dims[j] (None: as is) in the copy's shape; a bf16 copy rounded to bf16
    by the backend, which holds it as bf16 (NumpyBackend.run_node), a float32 one as is."""
    for at_param, at_copy, dims in update_weight_copies(node.attrs):
        p, copy = ins[at_param], ins[at_copy]
        copy[...] = (p if dims is None else p.transpose(dims)).reshape(copy.shape)


def _direction(g, p, coef: float, maximize: bool, weight_decay: float):
    """The gradient an update steps along: clipped, negated for maximize, plus wd * p
    (PyTorch's order); a new array."""
    t = p.dtype.type
    d = g * t(coef) if coef != 1.0 else g.copy()
    if maximize:
        d = -d
    if weight_decay:
        d = d + t(weight_decay) * p
    return d


@impl("sgd_update")
def sgd_update(node: Node, ins, outs, ctx):
    if _skipped(node, ins):
        return
    a = node.attrs
    lr, step, coef, params, grads, slots, rows = _update_groups(node, ins)
    for i, (p, g, h) in enumerate(zip(params, grads, rows)):
        t = p.dtype.type
        d = _direction(g, p, coef, a.get("maximize", False), h["weight_decay"])
        momentum = h["momentum"] if slots else 0.0
        if momentum:
            buf = slots[0][i]
            if step - h[STEP_OFFSET] == 1:
                buf[...] = d
            else:
                buf *= t(momentum)
                buf += t(1 - h["dampening"]) * d
            d = d + t(momentum) * buf if a.get("nesterov") else buf
        p -= t(lr * h["lr"]) * d
    _write_weight_copies(node, ins)


@impl("adam_update")
def adam_update(node: Node, ins, outs, ctx):
    if _skipped(node, ins):
        return
    a = node.attrs
    lr, step, coef, params, grads, slots, rows = _update_groups(node, ins)
    for i, (p, g, h) in enumerate(zip(params, grads, rows)):
        t = p.dtype.type
        m, v = slots[0][i], slots[1][i]
        lr_i, wd, b1, b2 = lr * h["lr"], h["weight_decay"], h["beta1"], h["beta2"]
        own = step - h[STEP_OFFSET]                     # the parameter's own step count
        step_size = lr_i / (1 - b1**own)
        bc2_sqrt = math.sqrt(1 - b2**own)
        decoupled = a.get("decoupled", False)
        d = _direction(g, p, coef, a.get("maximize", False), 0.0 if decoupled else wd)
        if wd and decoupled:
            p *= t(1 - lr_i * wd)
        m += (d - m) * t(1 - b1)           # PyTorch: exp_avg.lerp_(grad, 1 - beta1)
        v *= t(b2)
        v += t(1 - b2) * d * d
        if a.get("amsgrad"):
            np.maximum(slots[2][i], v, out=slots[2][i])
            v = slots[2][i]
        denom = np.sqrt(v) / t(bc2_sqrt) + t(h["eps"])
        p -= t(step_size) * (m / denom)
    _write_weight_copies(node, ins)


@impl("rmsprop_update")
def rmsprop_update(node: Node, ins, outs, ctx):
    if _skipped(node, ins):
        return
    a = node.attrs
    lr, step, coef, params, grads, slots, rows = _update_groups(node, ins)
    centered = bool(a.get("centered"))
    has_buffer = a["n_slots"] == 2 + centered
    for i, (p, g, h) in enumerate(zip(params, grads, rows)):
        t = p.dtype.type
        alpha = h["alpha"]
        d = _direction(g, p, coef, a.get("maximize", False), h["weight_decay"])
        square_avg = slots[0][i]
        square_avg *= t(alpha)
        square_avg += t(1 - alpha) * d * d
        if centered:
            grad_avg = slots[1][i]
            grad_avg += (d - grad_avg) * t(1 - alpha)     # lerp_(grad, 1 - alpha)
            avg = np.sqrt(square_avg - grad_avg * grad_avg)
        else:
            avg = np.sqrt(square_avg)
        avg = avg + t(h["eps"])
        if has_buffer and h["momentum"] > 0:
            buf = slots[-1][i]
            buf *= t(h["momentum"])
            buf += d / avg
            p -= t(lr * h["lr"]) * buf
        else:
            p -= t(lr * h["lr"]) * (d / avg)
    _write_weight_copies(node, ins)


@impl("adagrad_update")
def adagrad_update(node: Node, ins, outs, ctx):
    if _skipped(node, ins):
        return
    a = node.attrs
    lr, step, coef, params, grads, slots, rows = _update_groups(node, ins)
    for i, (p, g, h) in enumerate(zip(params, grads, rows)):
        t = p.dtype.type
        d = _direction(g, p, coef, a.get("maximize", False), h["weight_decay"])
        clr = lr * h["lr"] / (1 + (step - h[STEP_OFFSET] - 1) * h["lr_decay"])
        total = slots[0][i]
        total += d * d
        std = np.sqrt(total) + t(h["eps"])
        p -= t(clr) * (d / std)
    _write_weight_copies(node, ins)


@impl("update_join")
def update_join(node: Node, ins, outs, ctx):
    """The updates before it ran in program order: nothing to wait for."""
