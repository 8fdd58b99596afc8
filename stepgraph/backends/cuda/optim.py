"""Launchers of optim.cu, the step bookkeeping (step counter, LR schedule, loss history) and
the permuted bf16 weight copies, and of the multi-tensor optimizer updates (torch.optim.SGD,
Adam, AdamW, RMSprop, Adagrad; a file each, UPDATE_SOURCES), each over every parameter in
one launch.

The updates keep a table of tensor pointers, sizes and each parameter's row of the
hyperparameters, and per-block work items, made at the first eager call on their buffers
(runtime/launch.py `_node_memory`); the hyperparameters themselves are read from their device
buffer (state `optimizer.hyperparameters`) at every launch, so a write between steps is seen by
a replayed graph. They read float32 or bf16 gradients and write the weight copies (attrs
copies: bf16, or a channels-last step's transposed float32 conv weights); a float16 parameter
(model.half()) has float16 state and a float16 gradient, each widened, updated in float32 and
rounded once on store. An update with attrs update_stream (compile/overlap.py) runs forked onto
the context's update stream (runtime/update_stream.py); update_join makes ctx.stream wait for
the updates forked since the last join.
"""
from __future__ import annotations

from typing import Any, Callable

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ...errors import ShapeError
from ...ir.graph import Node
from ...ops.optim import (HYPER_AT, HYPER_COLUMNS, HYPER_DTYPE, NORM_AT, UPDATE_OPS,
                          UPDATE_SCALARS, UPDATE_TILE, hyper_rows, update_grad_dims,
                          update_transposes, update_weight_copies)
from .broadcast import permute_tables
from .runtime.launch import (BLOCK, FLOAT_KINDS, _aligned, _buffers_key, _check,
                             _check_scalar, _chunk_jobs, _element_ctype, _float_kind,
                             _launch, _node_memory, update_chunk)
from .runtime.update_stream import launch_update, update_join

# update_join runs no kernel: its (held) operands may be of any dtype.
BF16_OPS = frozenset(UPDATE_OPS + ("update_join",))
# The kernel file of each update op's `<op>_kernel`: one per optimizer, so that a plan's first
# step waits for the compile of its own optimizer's kernel alone.
UPDATE_SOURCES = {"sgd_update": "optim_sgd.cu", "adam_update": "optim_adam.cu",
                  "rmsprop_update": "optim_rmsprop.cu", "adagrad_update": "optim_adagrad.cu"}
# float16 parameters, gradients and state; a float16 loss recorded in a float16 history
FP16_OPS = frozenset(UPDATE_OPS + ("update_join", "record_loss", "advance_step"))


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
    """history_loss[step % R] = loss, history_step[step % R] = step (compile/history.py); the
    loss and its history float32, or both float16."""
    kind = _loss_kind("record_loss", loss, history_loss)
    _check_scalar("record_loss step", step, "int64")
    _check("record_loss history_step", history_step, "int64", shape=history_loss.shape)
    _launch(ctx, "optim.cu", "record_loss_kernel", (1,), (32,),
            (loss, step, history_loss, history_step, np.int64(history_loss.size), kind))


def _loss_kind(what: str, loss, history_loss) -> np.int32:
    """The storage code of a scalar loss and its history (float32, or float16 for a float16
    model's loss), which must agree."""
    kind = _float_kind(f"{what} loss", loss)
    if loss.size != 1:
        raise ShapeError(f"{what} loss: expected a scalar, got shape {tuple(loss.shape)}")
    _check(f"{what} history_loss", history_loss, loss.dtype.name)
    return kind


def advance_step(ctx, step, schedule, loss, history_loss, history_step, lr) -> None:
    """step += 1, lr = schedule(step), loss recorded under step: one launch."""
    _check_scalar("advance_step step", step, "int64")
    _check("advance_step schedule", schedule, shape=(6,))
    kind = _loss_kind("advance_step", loss, history_loss)
    _check("advance_step history_step", history_step, "int64", shape=history_loss.shape)
    _check_scalar("advance_step lr", lr, "float32")
    _launch(ctx, "optim.cu", "advance_step_kernel", (1,), (32,),
            (step, schedule, loss, history_loss, history_step, np.int64(history_loss.size), lr,
             kind))


def _update_groups(node: Node, ins: list):
    """(lr, step, hyperparameters, norm or None, params, grads, slots) of an update op's inputs
    (ops.py); the weight copies (attrs copies) follow the slots, a guarded one's flags
    (attrs guard) come last."""
    a = node.attrs
    n, k, s = a["n_params"], a["n_scalars"], a["n_slots"]
    copies = len(a.get("copies", ()))
    if k not in (UPDATE_SCALARS, UPDATE_SCALARS + 1) or \
            len(ins) != k + (2 + s) * n + copies + bool(a.get("guard")):
        raise ShapeError(f"{node.op}: {len(ins)} inputs do not match n_params={n}, "
                         f"n_scalars={k}, n_slots={s}, {copies} weight copies")
    if k == NORM_AT + 1 and a.get("max_norm") is None:
        raise ShapeError(f"{node.op}: a norm input needs attrs max_norm")
    slots = [ins[k + (2 + j) * n:k + (3 + j) * n] for j in range(s)]
    norm = ins[NORM_AT] if k == NORM_AT + 1 else None
    return (ins[0], ins[1], ins[HYPER_AT], norm, ins[k:k + n], ins[k + n:k + 2 * n], slots)


def _weight_copies(node: Node, ins: list) -> list[tuple[int, Any, Any]]:
    """(parameter index, copy, transpose dims or None) of each weight copy of an update (attrs
    copies, copy_dims: ops.py sgd_update), each copy checked against its parameter: bf16
    bits, or float32 transposed as the update writes it itself (compile/weight_permutes.py)."""
    k = node.attrs["n_scalars"]
    found = []
    for j, (at_param, at_copy, dims) in enumerate(update_weight_copies(node.attrs)):
        i, p, copy = at_param - k, ins[at_param], ins[at_copy]
        _float_kind(f"{node.op} weight copy {j}", copy, ("uint16", "float32"))   # bf16 bits
        if copy.size != p.size:
            raise ShapeError(f"{node.op} weight copy {j}: {tuple(copy.shape)} does not hold "
                             f"parameter {i} {tuple(p.shape)}")
        if dims is not None and (sorted(dims) != list(range(p.ndim)) or p.ndim > 4):
            raise ShapeError(f"{node.op} weight copy {j}: copy_dims {dims} is no permutation "
                             f"of a parameter of at most 4 dims {tuple(p.shape)}")
        if copy.dtype.name == "float32" and not update_transposes(dims, p.shape):
            raise ShapeError(f"{node.op} weight copy {j}: a float32 copy must be a transpose "
                             f"the update writes itself, not copy_dims {dims} of "
                             f"{tuple(p.shape)}")
        if dims is not None and tuple(dims) == tuple(range(p.ndim)):
            dims = None              # the identity: the same element order
        found.append((i, copy, None if dims is None else tuple(dims)))
    return found


def _build_update_tables(op: str, params, grads, slots, positions, rows, copies,
                         grad_dims=None) -> dict:
    """The update kernels' UpdateEntry rows and their (parameter, block) jobs: `plain`, chunks of
    `chunk` elements (runtime/launch.py update_chunk), and `sliced`, the transposed entries'
    spans of whole slices (include/update.cuh update_slices), with the shared memory those take.
    slots: per slot, its tensor of each parameter, placed at table slot positions[j] (s0, s1,
    s2); rows: each parameter's hyperparameter row; copies: {parameter index: (its weight copy,
    whether it holds the parameter's slices transposed)}, written by the update itself;
    grad_dims: per parameter, None or the slice transpose its gradient is given in. A parameter
    and its state are float32 or all float16; its gradient float32, bf16 bits or float16."""
    entries, tile = [], 0
    grad_dims = grad_dims or (None,) * len(params)
    for i, (p, g) in enumerate(zip(params, grads)):
        placed = [None, None, None]
        _float_kind(f"{op} param {i}", p)
        for position, group in zip(positions, slots):
            placed[position] = group[i]
        transposed_grad = grad_dims[i] is not None
        if transposed_grad and not update_transposes(grad_dims[i], p.shape):
            raise ShapeError(f"{op} grad {i}: grad_dims {grad_dims[i]} is no slice transpose of "
                             f"{tuple(p.shape)} whose slices fit the update's tile")
        grad_shape = tuple(p.shape[d] for d in grad_dims[i]) if transposed_grad else p.shape
        for what, t in [("param", p)] + [(f"slot {j}", t) for j, t in enumerate(placed)
                                         if t is not None]:
            _check(f"{op} {what} {i}", t, dtype=p.dtype.name, shape=p.shape)
        _check(f"{op} grad {i}", g, dtype=None, shape=grad_shape)
        _element_ctype(f"{op} grad {i}", g)    # or bf16 bits (fuse.py fuse_gradient_casts)
        copy, transposed_copy = copies.get(i, (None, False))
        if copy is not None and p.dtype != np.float32:
            raise ShapeError(f"{op} param {i}: a weight copy needs a float32 parameter")
        ptrs = [p.data.ptr, g.data.ptr] + [0 if t is None else t.data.ptr for t in placed]
        ptrs.append(0 if copy is None else copy.data.ptr)
        used = [p, g] + [t for t in placed if t is not None]
        aligned = _aligned(*used, *([] if copy is None else [copy]))
        kinds = FLOAT_KINDS[g.dtype] | FLOAT_KINDS[p.dtype] << 8 | \
            GRAD_TRANSPOSED * transposed_grad | COPY_TRANSPOSED * transposed_copy | \
            (0 if copy is None else FLOAT_KINDS[copy.dtype] << 24)
        cols = rest = span = 0
        if transposed_grad or transposed_copy:
            cols, rest = p.shape[1], int(np.prod(p.shape[2:]))
            per = max(1, min(UPDATE_TILE // (rest * (cols + 1)), SLICED_SPAN // (cols * rest)))
            if per >= 4 and per * cols * rest % 4:
                per -= per % 4                     # whole float4 groups a block
            span = per * cols * rest
            aligned = aligned and span % 4 == 0
            tile = max(tile, per * rest * (cols + 1) * 4)
        entries.append(ptrs + [p.size, int(aligned), kinds, rows[i], cols, rest, span])
    sizes, spans = [p.size for p in params], [e[-1] for e in entries]
    chunk = update_chunk(sum(n for n, s in zip(sizes, spans) if not s))
    return dict(entries=cp.asarray(np.array(entries, dtype=np.int64).reshape(-1, ENTRY_WIDTH)),
                plain=cp.asarray(_chunk_jobs(sizes, [0 if s else chunk for s in spans])),
                sliced=cp.asarray(_chunk_jobs(sizes, spans)), tile=tile, chunk=chunk)


ENTRY_WIDTH = 13     # include/update.cuh UpdateEntry: 6 pointers, n, aligned, kinds, row, cols,
                     # rest, span
GRAD_TRANSPOSED, COPY_TRANSPOSED = 1 << 16, 1 << 17     # include/update.cuh, bits of kinds
# Elements a block of a transposed entry updates, at most (whole slices, at least one): small
# slices (a 64-channel 3x3 weight's 576) are taken several a block, so that its two
# synchronisations are paid over about 16 elements a thread.
SLICED_SPAN = 4096


def _slot_positions(node: Node) -> list[int]:
    """The table slot (s0, s1, s2 of update.cuh's UpdateEntry) of each of the node's state slots:
    in order, except RMSprop's momentum buffer, always s2 (its grad_avg, s1, only centered)."""
    if node.op == "rmsprop_update" and node.attrs["n_slots"] == 2 + bool(
            node.attrs.get("centered")):
        return list(range(node.attrs["n_slots"] - 1)) + [2]
    return list(range(node.attrs["n_slots"]))


def _update_tables(node: Node, ins: list, ctx):
    lr, step, hyper, norm, params, grads, slots = _update_groups(node, ins)
    _check_scalar(f"{node.op} lr", lr, "float32")
    _check_scalar(f"{node.op} step", step, "int64")
    width = len(HYPER_COLUMNS[node.op])
    rows = hyper_rows(node.attrs)
    _check(f"{node.op} hyperparameters", hyper, HYPER_DTYPE)
    if hyper.ndim != 2 or hyper.shape[1] != width or (rows and max(rows) >= hyper.shape[0]):
        raise ShapeError(f"{node.op}: hyperparameters {tuple(hyper.shape)} are not rows of "
                         f"{width} ({', '.join(HYPER_COLUMNS[node.op])}) for rows {rows}")
    if norm is not None:
        _check_scalar(f"{node.op} norm", norm, "float32")
    key = ("update",) + _buffers_key(ins)
    copies = {i: (copy, dims is not None) for i, copy, dims in _weight_copies(node, ins)
              if dims is None or update_transposes(dims, ins[node.attrs["n_scalars"] + i].shape)}
    tables = _node_memory(node, key, ctx, lambda: _build_update_tables(
        node.op, params, grads, slots, _slot_positions(node), rows, copies,
        update_grad_dims(node.attrs)))
    clip = (norm if norm is not None else lr, np.int32(norm is not None),
            np.float64(node.attrs.get("max_norm") or 0.0))
    guard = np.uint64(0)   # null: no guard; else the step's flags, whose [1] says skip
    if node.attrs.get("guard"):
        guard = ins[-1]
        _check(f"{node.op} guard flags", guard, "int32", (2,))
    return tables, (tables["entries"], np.int32(tables["chunk"]), lr, step, hyper,
                    np.int32(width)) + clip + (guard,)


def _permuted_copies(ctx, node: Node, ins: list) -> None:
    """After the update launch: the bf16 copies whose element order is a transpose of their
    parameter's (attrs copy_dims) other than those the update writes itself
    (update_transposes; every float32 copy is one of those: _weight_copies), all in one
    gather launch."""
    k = node.attrs["n_scalars"]
    permuted = [(ins[k + i], copy, dims) for i, copy, dims in _weight_copies(node, ins)
                if dims is not None and copy.size and not update_transposes(dims, ins[k + i].shape)]
    if not permuted:
        return
    key = ("permuted copies",) + _buffers_key(ins)
    tables = _node_memory(node, key, ctx, lambda: permute_tables(permuted))
    guard = ins[-1] if node.attrs.get("guard") else np.uint64(0)
    _launch(ctx, "optim.cu", "weight_copies_permute_kernel", (len(tables["jobs"]),), (BLOCK,),
            (tables["entries"], tables["jobs"], tables["chunk"], guard))


def _flag(node: Node, name: str) -> np.int32:
    return np.int32(bool(node.attrs.get(name)))


def _update_kernel(op: str, sliced: bool) -> str:
    """The update kernel of `op` for plain chunks or for transposed entries' slices: one path
    compiled each (include/update.cuh update_chunk's SLICED, which keeps the plain one's
    registers down)."""
    return f"{op}_kernel<{str(sliced).lower()}>"


def _launch_update(ctx, node: Node, ins: list, flags: tuple) -> None:
    """The node's update kernel over every parameter: one launch for the parameters in plain
    chunks, one for those whose transposed gradient or copy it moves through its shared-memory
    tile (as many bytes a block as the largest takes, which the plain blocks need not hold);
    then the bf16 copies it does not write. flags: the kernel's trailing int arguments (formula
    switches from attrs)."""
    if not node.attrs["n_params"]:
        return
    tables, args = _update_tables(node, ins, ctx)
    for jobs, sliced, tile in ((tables["plain"], False, 0),
                               (tables["sliced"], True, tables["tile"])):
        if len(jobs):
            _launch(ctx, UPDATE_SOURCES[node.op], _update_kernel(node.op, sliced), (len(jobs),),
                    (BLOCK,), (args[0], jobs) + args[1:] + flags, shared_mem=tile)
    _permuted_copies(ctx, node, ins)


def _need_slots(node: Node, allowed: tuple[int, ...], what: str) -> None:
    if node.attrs["n_slots"] not in allowed:
        raise ShapeError(f"{node.op}: needs n_slots in {allowed} ({what}), got "
                         f"{node.attrs['n_slots']}")


def sgd_update(ctx, node: Node, ins: list) -> None:
    """torch.optim.SGD over every parameter in one launch (ins layout: ops.py sgd_update);
    lr, weight_decay, momentum and dampening per parameter from the hyperparameters."""
    _need_slots(node, (0, 1), "a momentum buffer or none")
    _launch_update(ctx, node, ins, (np.int32(node.attrs["n_slots"] == 1),
                                    _flag(node, "nesterov"), _flag(node, "maximize")))


def adam_update(ctx, node: Node, ins: list) -> None:
    """torch.optim.Adam (decoupled=False) / AdamW (True) over every parameter in one launch;
    lr, weight_decay, beta1, beta2 and eps per parameter from the hyperparameters."""
    amsgrad = bool(node.attrs.get("amsgrad"))
    _need_slots(node, (3,) if amsgrad else (2,), "exp_avg, exp_avg_sq[, max_exp_avg_sq]")
    _launch_update(ctx, node, ins, (_flag(node, "decoupled"), np.int32(amsgrad),
                                    _flag(node, "maximize")))


def rmsprop_update(ctx, node: Node, ins: list) -> None:
    """torch.optim.RMSprop over every parameter in one launch; lr, weight_decay, alpha, eps
    and momentum per parameter from the hyperparameters."""
    centered = bool(node.attrs.get("centered"))
    _need_slots(node, (1 + centered, 2 + centered),
                "square_avg[, grad_avg][, momentum_buffer]")
    has_buffer = node.attrs["n_slots"] == 2 + centered
    _launch_update(ctx, node, ins, (np.int32(centered), np.int32(has_buffer),
                                    _flag(node, "maximize")))


def adagrad_update(ctx, node: Node, ins: list) -> None:
    """torch.optim.Adagrad over every parameter in one launch; lr, weight_decay, lr_decay and
    eps per parameter from the hyperparameters."""
    _need_slots(node, (1,), "sum")
    _launch_update(ctx, node, ins, (_flag(node, "maximize"),))


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name these launchers may launch} (as elementwise.py's)."""
    return {"optim.cu": {"advance_step_kernel", "lr_schedule_kernel", "record_loss_kernel",
                         "step_increment_kernel", "weight_copies_permute_kernel"},
            **{source: {_update_kernel(op, sliced) for sliced in (False, True)}
               for op, source in UPDATE_SOURCES.items()}}


IMPLS: dict[str, Callable] = {
    "step_increment": lambda node, ins, outs, ctx: step_increment(ctx, ins[0]),
    "lr_schedule": lambda node, ins, outs, ctx: lr_schedule(ctx, ins[0], ins[1], outs[0]),
    "record_loss": lambda node, ins, outs, ctx: record_loss(ctx, *ins),
    "advance_step": lambda node, ins, outs, ctx: advance_step(ctx, *ins, outs[0]),
    "sgd_update": lambda node, ins, outs, ctx: launch_update(ctx, node, ins, sgd_update),
    "adam_update": lambda node, ins, outs, ctx: launch_update(ctx, node, ins, adam_update),
    "rmsprop_update": lambda node, ins, outs, ctx: launch_update(ctx, node, ins, rmsprop_update),
    "adagrad_update": lambda node, ins, outs, ctx: launch_update(ctx, node, ins, adagrad_update),
    "update_join": lambda node, ins, outs, ctx: update_join(ctx),
}
