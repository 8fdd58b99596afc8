"""Optim family: a step's bookkeeping (step counter, learning rate from the schedule, loss
history; advance_step does the three in one op), the gradients' global norm for clipping, and
the multi-tensor parameter updates (PyTorch's SGD, Adam, AdamW) with the join of updates that
ran on the update stream. optim/ emits them; the formulas of the schedules are in
optim/schedules.py.

The NumPy references compute the scalars PyTorch computes in Python floats (bias
corrections, schedules) in float64 and cast once.
"""
from __future__ import annotations

import math

import numpy as np

from ..ir.graph import BF16, Node
from ..ir.ops import defop, impl
from ..optim.schedules import schedule_lr
from .guard import FLAG_SKIP


# ---- step bookkeeping ----------------------------------------------------------------------

@defop("step_increment", mutates=lambda attrs: (0,))
def _step_increment(ins, attrs):
    """step += 1 (int64 scalar state), in place."""
    return []


@defop("lr_schedule")
def _lr_schedule(ins, attrs):
    """lr = schedule_lr(schedule, step): ins (step int64 scalar, schedule float32 (6,) =
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
    loss, history_loss, history_step); step += 1, then lr = schedule_lr(schedule, step) and
    the loss recorded under the new step."""
    return [((), "float32")]


@impl("step_increment")
def step_increment(node: Node, ins, outs, ctx):
    ins[0][...] += 1


@impl("lr_schedule")
def lr_schedule(node: Node, ins, outs, ctx):
    step, schedule = ins
    outs[0][...] = schedule_lr(schedule, int(step))


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
    return [((), "float32" if ins[0].dtype == BF16 else ins[0].dtype)]


@impl("global_norm")
def global_norm(node: Node, ins, outs, ctx):
    total = sum(float(np.sum(g.astype(np.float64) ** 2)) for g in ins)
    outs[0][...] = math.sqrt(total)


# ---- parameter updates ---------------------------------------------------------------------

def _update_mutates(attrs) -> tuple[int, ...]:
    # inputs: n_scalars scalars (lr, step[, norm]), then params, grads and n_slots groups of
    # per-parameter state (momentum buffers; Adam's exp_avg, exp_avg_sq), n_params each, then
    # one bf16 weight copy per entry of attrs copies (precision="bf16").
    n, k = attrs["n_params"], attrs["n_scalars"]
    written = list(range(k, k + n))
    for s in range(attrs["n_slots"]):
        written += range(k + (2 + s) * n, k + (3 + s) * n)
    written += [at for _, at, _ in update_weight_copies(attrs)]
    return tuple(written)


def update_weight_copies(attrs) -> list[tuple[int, int, tuple[int, ...] | None]]:
    """(parameter input index, copy input index, transpose dims or None) of each bf16 weight
    copy an update writes (attrs copies, copy_dims; sgd_update's docstring)."""
    n, k = attrs["n_params"], attrs["n_scalars"]
    first = k + (2 + attrs["n_slots"]) * n
    indices = attrs.get("copies", ())
    dims = attrs.get("copy_dims") or (None,) * len(indices)
    return [(k + i, first + j, d) for j, (i, d) in enumerate(zip(indices, dims))]


@defop("sgd_update", mutates=_update_mutates)
def _sgd_update(ins, attrs):
    """PyTorch SGD over every parameter in one op. ins = lr, step[, norm], params, grads,
    momentum buffers[, bf16 weight copies][, guard flags]. Grads are scaled by min(1, max_norm
    / (norm + 1e-6)) when clipping. attrs copies (precision="bf16", compile/autocast.py): the
    indices of the parameters with a bf16 copy, one copy input each in that order; after the
    update, copy j = bf16(params[copies[j]]) rounded to nearest even, transposed by copy_dims[j]
    when attrs copy_dims gives dims (not None) and viewed with the copy's shape (a conv
    weight's channels-last copy (O, kh, kw, C/groups)). With attrs guard, the
    last input is a guard's flags (ops/guard.py): nothing is written when flags[1]
    (FLAG_SKIP) is set. attrs update_stream (compile/overlap.py: one bucket of a step's
    parameters, placed inside the backward pass): on a backend with streams it runs beside the
    nodes after it, until the next update_join; the results are the same."""
    return []


@defop("adam_update", mutates=_update_mutates)
def _adam_update(ins, attrs):
    """PyTorch Adam (decoupled=False) or AdamW (decoupled=True) over every parameter.
    ins = lr, step[, norm], params, grads, exp_avg, exp_avg_sq[, bf16 weight copies][, guard
    flags] (as sgd_update)."""
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
    """Split an update op's inputs: (lr, step, clip coefficient, params, grads, state slots)."""
    a = node.attrs
    n, k = a["n_params"], a["n_scalars"]
    lr, step = float(ins[0]), int(ins[1])
    coef = 1.0
    if k == 3:
        coef = min(1.0, a["max_norm"] / (float(ins[2]) + 1e-6))
    params, grads = ins[k:k + n], ins[k + n:k + 2 * n]
    slots = [ins[k + (2 + s) * n:k + (3 + s) * n] for s in range(a["n_slots"])]
    return lr, step, coef, params, grads, slots


def _write_weight_copies(node: Node, ins) -> None:
    """The bf16 weight copies of an update (attrs copies, copy_dims): copy j =
    params[copies[j]] transposed by copy_dims[j] (None: as is) in the copy's shape, rounded
    to bf16 by the backend, which holds the copies as bf16 (NumpyBackend.run_node)."""
    for at_param, at_copy, dims in update_weight_copies(node.attrs):
        p, copy = ins[at_param], ins[at_copy]
        copy[...] = (p if dims is None else p.transpose(dims)).reshape(copy.shape)


def _per_param(attrs: dict, key: str, i: int, default=None):
    """attrs[key], or its entry for parameter i when parameter groups made it a tuple."""
    v = attrs.get(key, default)
    return v[i] if isinstance(v, (tuple, list)) else v


@impl("sgd_update")
def sgd_update(node: Node, ins, outs, ctx):
    if _skipped(node, ins):
        return
    a = node.attrs
    lr, step, coef, params, grads, slots = _update_groups(node, ins)
    for i, (p, g) in enumerate(zip(params, grads)):
        t = p.dtype.type
        lr_i, wd = lr * _per_param(a, "lr_scale", i, 1.0), _per_param(a, "weight_decay", i)
        d = g * t(coef) if coef != 1.0 else g.copy()
        if wd:
            d = d + t(wd) * p
        if a["momentum"]:
            buf = slots[0][i]
            if step == 1:
                buf[...] = d
            else:
                buf *= t(a["momentum"])
                buf += t(1 - a["dampening"]) * d
            d = d + t(a["momentum"]) * buf if a["nesterov"] else buf
        p -= t(lr_i) * d
    _write_weight_copies(node, ins)


@impl("adam_update")
def adam_update(node: Node, ins, outs, ctx):
    if _skipped(node, ins):
        return
    a = node.attrs
    lr, step, coef, params, grads, (exp_avg, exp_avg_sq) = _update_groups(node, ins)
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avg, exp_avg_sq)):
        t = p.dtype.type
        lr_i, wd = lr * _per_param(a, "lr_scale", i, 1.0), _per_param(a, "weight_decay", i)
        b1, b2 = _per_param(a, "beta1", i), _per_param(a, "beta2", i)
        step_size = lr_i / (1 - b1**step)
        bc2_sqrt = math.sqrt(1 - b2**step)
        d = g * t(coef) if coef != 1.0 else g
        if wd and a["decoupled"]:
            p *= t(1 - lr_i * wd)
        elif wd:
            d = d + t(wd) * p
        m += (d - m) * t(1 - b1)           # PyTorch: exp_avg.lerp_(grad, 1 - beta1)
        v *= t(b2)
        v += t(1 - b2) * d * d
        denom = np.sqrt(v) / t(bc2_sqrt) + t(a["eps"])
        p -= t(step_size) * (m / denom)
    _write_weight_copies(node, ins)


@impl("update_join")
def update_join(node: Node, ins, outs, ctx):
    """The updates before it ran in program order: nothing to wait for."""
