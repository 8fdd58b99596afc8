"""Launchers of optim.cu: the step bookkeeping (step counter, LR schedule, loss history) and
the multi-tensor optimizer updates (torch.optim.SGD, Adam, AdamW), each over every parameter
in one launch.

sgd_update / adam_update keep a table of tensor pointers, sizes and each parameter's group
hyperparameters, and per-block work items, made at the first eager call on their buffers
(runtime/launch.py `_node_memory`). They read float32 or bf16 gradients and write the bf16
weight copies (attrs copies). An update with attrs update_stream (compile/overlap.py) runs
forked onto the context's update stream (runtime/update_stream.py); update_join makes
ctx.stream wait for the updates forked since the last join.
"""
from __future__ import annotations

from typing import Any, Callable

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ...errors import ShapeError
from ...ir.graph import Node
from ...ops.optim import update_weight_copies
from .runtime.launch import (BLOCK, UPDATE_CHUNK, _aligned, _buffers_key, _check,
                             _check_scalar, _chunk_jobs, _element_ctype, _grid, _launch,
                             _node_memory)
from .runtime.update_stream import launch_update, update_join

# update_join runs no kernel: its (held) operands may be of any dtype.
BF16_OPS = frozenset({"sgd_update", "adam_update", "update_join"})


def step_increment(ctx, step) -> None:
    """step += 1 on the device (int64 scalar)."""
    _check_scalar("step_increment step", step, "int64")
    _launch(ctx, "optim.cu", "step_increment_kernel", (1,), (32,), (step,))


def lr_schedule(ctx, step, schedule, lr) -> None:
    """lr = schedule(step) from the (6,) float32 schedule vector (optim/schedules.py)."""
    _check_scalar("lr_schedule step", step, "int64")
    _check("lr_schedule schedule", schedule, shape=(6,))
    _check_scalar("lr_schedule lr", lr, "float32")
    _launch(ctx, "optim.cu", "lr_schedule_kernel", (1,), (32,), (step, schedule, lr))


def record_loss(ctx, loss, step, history_loss, history_step) -> None:
    """history_loss[step % R] = loss, history_step[step % R] = step (compile/history.py)."""
    _check_scalar("record_loss loss", loss, "float32")
    _check_scalar("record_loss step", step, "int64")
    _check("record_loss history_loss", history_loss)
    _check("record_loss history_step", history_step, "int64", shape=history_loss.shape)
    _launch(ctx, "optim.cu", "record_loss_kernel", (1,), (32,),
            (loss, step, history_loss, history_step, np.int64(history_loss.size)))


def advance_step(ctx, step, schedule, loss, history_loss, history_step, lr) -> None:
    """step += 1, lr = schedule(step), loss recorded under step: one launch."""
    _check_scalar("advance_step step", step, "int64")
    _check("advance_step schedule", schedule, shape=(6,))
    _check_scalar("advance_step loss", loss, "float32")
    _check("advance_step history_loss", history_loss)
    _check("advance_step history_step", history_step, "int64", shape=history_loss.shape)
    _check_scalar("advance_step lr", lr, "float32")
    _launch(ctx, "optim.cu", "advance_step_kernel", (1,), (32,),
            (step, schedule, loss, history_loss, history_step, np.int64(history_loss.size), lr))


def _update_groups(node: Node, ins: list):
    """(lr, step, norm or None, params, grads, slots) of an update op's inputs (ops.py); the
    bf16 weight copies (attrs copies) follow the slots, a guarded one's flags (attrs guard)
    come last."""
    a = node.attrs
    n, k, s = a["n_params"], a["n_scalars"], a["n_slots"]
    copies = len(a.get("copies", ()))
    if k not in (2, 3) or len(ins) != k + (2 + s) * n + copies + bool(a.get("guard")):
        raise ShapeError(f"{node.op}: {len(ins)} inputs do not match n_params={n}, "
                         f"n_scalars={k}, n_slots={s}, {copies} bf16 copies")
    if k == 3 and a.get("max_norm") is None:
        raise ShapeError(f"{node.op}: a norm input needs attrs max_norm")
    slots = [ins[k + (2 + j) * n:k + (3 + j) * n] for j in range(s)]
    return ins[0], ins[1], (ins[2] if k == 3 else None), ins[k:k + n], ins[k + n:k + 2 * n], slots


UPDATE_HYPERPARAMETERS = ("lr_scale", "weight_decay", "beta1", "beta2")   # optim.cu UpdateEntry


def _hyperparameters(node: Node) -> list[tuple[float, ...]]:
    """Per parameter (lr_scale, weight_decay, beta1, beta2): from attrs tuples (optimizer
    parameter groups, one entry a parameter) or the scalar attrs (1.0 for a missing lr_scale,
    0.0 for a missing weight decay or beta: SGD has none)."""
    a, n = node.attrs, node.attrs["n_params"]
    columns = []
    for name in UPDATE_HYPERPARAMETERS:
        value = a.get(name)
        if isinstance(value, (tuple, list)):
            if len(value) != n:
                raise ShapeError(f"{node.op}: attrs {name} has {len(value)} entries for {n} "
                                 "parameters")
            columns.append([float(v or 0.0) for v in value])
        else:
            default = 1.0 if name == "lr_scale" else 0.0
            columns.append([default if value is None else float(value)] * n)
    return list(zip(*columns))


def _weight_copies(node: Node, ins: list) -> list[tuple[int, Any, Any]]:
    """(parameter index, bf16 copy, transpose dims or None) of each weight copy of an update
    (attrs copies, copy_dims: ops.py sgd_update), each copy checked against its parameter."""
    k = node.attrs["n_scalars"]
    found = []
    for j, (at_param, at_copy, dims) in enumerate(update_weight_copies(node.attrs)):
        i, p, copy = at_param - k, ins[at_param], ins[at_copy]
        _check(f"{node.op} bf16 copy {j}", copy, "uint16")
        if copy.size != p.size:
            raise ShapeError(f"{node.op} bf16 copy {j}: {tuple(copy.shape)} does not hold "
                             f"parameter {i} {tuple(p.shape)}")
        if dims is not None and (sorted(dims) != list(range(p.ndim)) or p.ndim > 4):
            raise ShapeError(f"{node.op} bf16 copy {j}: copy_dims {dims} is no permutation of "
                             f"a parameter of at most 4 dims {tuple(p.shape)}")
        if dims is not None and tuple(dims) == tuple(range(p.ndim)):
            dims = None              # the identity: the same element order
        found.append((i, copy, None if dims is None else tuple(dims)))
    return found


def _build_update_tables(op: str, params, grads, slots, hyper, copies) -> dict:
    """The update kernels' UpdateEntry rows and (parameter, chunk) jobs. copies: {parameter
    index: its bf16 copy in the parameter's element order}, written by the update itself."""
    rows = []
    for i, (p, g) in enumerate(zip(params, grads)):
        tensors = [p, g] + [group[i] for group in slots]
        for what, t in zip(("param", "grad", "slot 0", "slot 1"), tensors):
            _check(f"{op} {what} {i}", t, dtype=None if what == "grad" else "float32",
                   shape=p.shape)
        _element_ctype(f"{op} grad {i}", g)    # or bf16 bits (fuse.py fuse_gradient_casts)
        ptrs = [t.data.ptr for t in tensors] + [0] * (4 - len(tensors))
        copy = copies.get(i)
        ptrs.append(0 if copy is None else copy.data.ptr)
        aligned = _aligned(*tensors, *([] if copy is None else [copy]))
        doubles = np.array(hyper[i], dtype=np.float64).view(np.int64).tolist()
        rows.append(ptrs + [p.size, int(aligned), int(g.dtype == np.uint16)] + doubles)
    jobs = _chunk_jobs([p.size for p in params])
    width = 8 + len(UPDATE_HYPERPARAMETERS)
    return dict(entries=cp.asarray(np.array(rows, dtype=np.int64).reshape(-1, width)),
                jobs=cp.asarray(jobs))


def _update_tables(node: Node, ins: list, ctx):
    lr, step, norm, params, grads, slots = _update_groups(node, ins)
    _check_scalar(f"{node.op} lr", lr, "float32")
    _check_scalar(f"{node.op} step", step, "int64")
    if norm is not None:
        _check_scalar(f"{node.op} norm", norm, "float32")
    key = ("update",) + _buffers_key(ins)
    in_order = {i: copy for i, copy, dims in _weight_copies(node, ins) if dims is None}
    tables = _node_memory(node, key, ctx, lambda: _build_update_tables(
        node.op, params, grads, slots, _hyperparameters(node), in_order))
    clip = (norm if norm is not None else lr, np.int32(norm is not None),
            np.float64(node.attrs.get("max_norm") or 0.0))
    guard = np.uint64(0)   # null: no guard; else the step's flags, whose [1] says skip
    if node.attrs.get("guard"):
        guard = ins[-1]
        _check(f"{node.op} guard flags", guard, "int32", (2,))
    return tables, (tables["entries"], tables["jobs"], np.int32(UPDATE_CHUNK), lr, step) + clip \
        + (guard,)


def _permuted_copies(ctx, node: Node, ins: list) -> None:
    """After the update launch: the bf16 copies whose element order is a transpose of their
    parameter's (attrs copy_dims), one small gather launch each (the others were written by
    the update itself)."""
    guard = ins[-1] if node.attrs.get("guard") else np.uint64(0)
    k = node.attrs["n_scalars"]
    for i, copy, dims in _weight_copies(node, ins):
        if dims is None or not copy.size:
            continue
        p = ins[k + i]
        elem = [st // p.itemsize for st in p.strides]
        shape = [1] * (4 - p.ndim) + [p.shape[d] for d in dims]
        strides = [0] * (4 - p.ndim) + [elem[d] for d in dims]
        _launch(ctx, "optim.cu", "weight_copy_permute_kernel", _grid(copy.size), (BLOCK,),
                (p, copy, np.int64(copy.size), *(np.int32(v) for v in shape[1:]),
                 *(np.int64(v) for v in strides), guard))


def sgd_update(ctx, node: Node, ins: list) -> None:
    """torch.optim.SGD over every parameter in one launch (ins layout: ops.py sgd_update);
    lr_scale and weight_decay per parameter group from the table (_hyperparameters)."""
    a = node.attrs
    momentum = float(a.get("momentum") or 0.0)
    if momentum and a["n_slots"] < 1:
        raise ShapeError("sgd_update: momentum needs a momentum buffer slot (n_slots=1)")
    if not a["n_params"]:
        return
    tables, args = _update_tables(node, ins, ctx)
    args += (np.float32(momentum), np.float32(1.0 - float(a.get("dampening") or 0.0)),
             np.int32(bool(momentum)), np.int32(bool(a.get("nesterov"))))
    _launch(ctx, "optim.cu", "sgd_update_kernel", (len(tables["jobs"]),), (BLOCK,), args)
    _permuted_copies(ctx, node, ins)


def adam_update(ctx, node: Node, ins: list) -> None:
    """torch.optim.Adam (decoupled=False) / AdamW (True) over every parameter in one launch;
    lr_scale, weight_decay, beta1 and beta2 per parameter group from the table."""
    a = node.attrs
    if a["n_slots"] != 2:
        raise ShapeError(
            f"adam_update: needs n_slots=2 (exp_avg, exp_avg_sq), got {a['n_slots']}")
    if not a["n_params"]:
        return
    tables, args = _update_tables(node, ins, ctx)
    args += (np.float32(a["eps"]), np.int32(bool(a.get("decoupled"))))
    _launch(ctx, "optim.cu", "adam_update_kernel", (len(tables["jobs"]),), (BLOCK,), args)
    _permuted_copies(ctx, node, ins)


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name these launchers may launch} (as elementwise.py's)."""
    return {"optim.cu": {"adam_update_kernel", "advance_step_kernel", "lr_schedule_kernel",
                         "record_loss_kernel", "sgd_update_kernel", "step_increment_kernel",
                         "weight_copy_permute_kernel"}}


IMPLS: dict[str, Callable] = {
    "step_increment": lambda node, ins, outs, ctx: step_increment(ctx, ins[0]),
    "lr_schedule": lambda node, ins, outs, ctx: lr_schedule(ctx, ins[0], ins[1], outs[0]),
    "record_loss": lambda node, ins, outs, ctx: record_loss(ctx, *ins),
    "advance_step": lambda node, ins, outs, ctx: advance_step(ctx, *ins, outs[0]),
    "sgd_update": lambda node, ins, outs, ctx: launch_update(ctx, node, ins, sgd_update),
    "adam_update": lambda node, ins, outs, ctx: launch_update(ctx, node, ins, adam_update),
    "update_join": lambda node, ins, outs, ctx: update_join(ctx),
}
