"""Launchers of the guard ops (ops/guard.py, compile/guard.py): guard_check, guard_save,
guard_restore, loss_scale_update and guard_advance, a guarded step's bookkeeping (guard.cu),
and the mailbox through which guard_advance tells the host about a bad step without a sync.

guard_check and the copies keep a device table per node and buffers (pointers, sizes, kinds,
flag bits, and the per-block work items), made at the first eager call like the update tables
of optim.py. No launcher syncs or allocates in the hot path.
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Callable

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ...errors import ShapeError
from ...ir.graph import Node
from ...ops.guard import GUARD_GRADS, GUARD_LABELS, GUARD_LOSS, N_COUNTERS, N_FLAGS
from .runtime.launch import (BLOCK, LABEL_CTYPES, MULTI_TENSOR_CHUNK, _aligned, _buffers_key,
                             _check, _check_scalar, _chunk_jobs, _float_kind, _launch,
                             _node_memory, _or_null)

SOURCE = "guard.cu"
# guard.cu KIND_*; uint16 is bf16's storage (a gradient whose cast fuse_gradient_casts dropped),
# float16 a model.half() gradient or loss
KINDS = {np.dtype("float32"): 0, np.dtype("int32"): 1, np.dtype("int64"): 2, np.dtype("uint16"): 3,
         np.dtype("float16"): 4}
ENTRY = np.dtype([("p", "<u8"), ("n", "<i8"), ("kind", "<i4"), ("bit", "<i4"),
                  ("aligned", "<i4"), ("square", "<i4")])  # guard.cu's GuardEntry, 32 bytes
COPY_ENTRY = np.dtype([("src", "<u8"), ("dst", "<u8"), ("n", "<i8"), ("vec", "<i8")])
BF16_OPS = frozenset({"guard_check"})   # bf16 gradients (KIND 3)
# float16 gradients and losses (KIND 4); a float16 loss in a float16 history
FP16_OPS = frozenset({"guard_check", "guard_advance"})
COPY_CHUNK = MULTI_TENSOR_CHUNK     # bytes a block copies (the saved state is small: BatchNorm's)
# Elements guard_check_kernel's block reads (a multiple of 8): four 16-byte loads a thread at
# float32, two at 16 bits. At one load a thread (MULTI_TENSOR_CHUNK) the check read unet_pad's
# gradients at 1.1-2.3 TB/s, its blocks as long starting as reading.
GUARD_CHUNK = 4 * MULTI_TENSOR_CHUNK


def kernel_names() -> dict[str, set[str]]:
    """Every kernel this module launches, by source file (for the NVRTC compile test)."""
    return {SOURCE: {"guard_advance_kernel", "guard_check_kernel", "guard_copy_kernel",
                     "loss_scale_update_kernel"}}


# ---- guard_check -----------------------------------------------------------------------------

def _check_tables(node: Node, loss, labels, grads) -> dict:
    checked = [(loss, GUARD_LOSS)] if node.attrs.get("check_loss", True) else []
    rows = checked + ([(labels, GUARD_LABELS)] if labels is not None else []) \
        + [(g, GUARD_GRADS) for g in grads]
    entries = np.zeros(len(rows), ENTRY)
    for i, (t, bit) in enumerate(rows):
        kind = KINDS.get(t.dtype)
        if kind is None:
            raise ShapeError(f"guard_check input {i}: the kernel takes float32, bf16, float16, "
                             f"int32 or int64, got {t.dtype}")
        _check(f"guard_check input {i}", t, dtype=None)
        # gradients: their squares (ops/guard.py guard_check says why)
        entries[i] = (t.data.ptr, t.size, kind, bit, int(_aligned(t)), int(bit == GUARD_GRADS))
    jobs = _chunk_jobs([t.size for t, _ in rows], GUARD_CHUNK)
    return dict(entries=cp.asarray(entries.view(np.int64)), jobs=cp.asarray(jobs))


def guard_check(ctx, node: Node, ins: list) -> None:
    """flags[0] |= the bits of what is wrong with the labels, the loss and the gradients
    (ops/guard.py, "guard_check"): one launch over all of them."""
    flags, loss = ins[0], ins[1]
    classes = node.attrs.get("classes")
    labels = ins[2] if classes is not None else None
    grads = ins[3:] if classes is not None else ins[2:]
    _check("guard_check flags", flags, "int32", (N_FLAGS,))
    _float_kind("guard_check loss", loss)
    if loss.size != 1:
        raise ShapeError(f"guard_check loss: expected a scalar, got shape {tuple(loss.shape)}")
    if labels is not None and labels.dtype not in LABEL_CTYPES:
        raise ShapeError(f"guard_check labels: expected int32 or int64, got {labels.dtype}")
    key = ("guard_check",) + _buffers_key(ins)
    tables = _node_memory(node, key, ctx, lambda: _check_tables(node, loss, labels, grads))
    ignore = node.attrs.get("ignore_index")
    _launch(ctx, SOURCE, "guard_check_kernel", (len(tables["jobs"]),), (BLOCK,),
            (tables["entries"], tables["jobs"], np.int32(GUARD_CHUNK),
             np.int64(classes or 0), np.int64(ignore if ignore is not None else -1),
             np.int32(ignore is not None), flags))


# ---- guard_save and guard_restore -----------------------------------------------------------

def _copy_tables(pairs) -> dict:
    """The device table of (src, dst, bytes) copies and their (entry, chunk) work items."""
    entries = np.zeros(len(pairs), COPY_ENTRY)
    for i, (src, dst, n) in enumerate(pairs):
        entries[i] = (src, dst, n, int((src | dst | n) % 16 == 0))
    jobs = _chunk_jobs([n for _, _, n in pairs])         # chunks of COPY_CHUNK bytes
    return dict(entries=cp.asarray(entries.view(np.int64)), jobs=cp.asarray(jobs))


def _saved_pairs(node: Node, saved, buffers, to_saved: bool) -> list[tuple[int, int, int]]:
    offsets = node.attrs["offsets"]
    if len(offsets) != len(buffers):
        raise ShapeError(f"{node.op}: {len(buffers)} buffers but {len(offsets)} offsets")
    pairs = []
    for i, (b, offset) in enumerate(zip(buffers, offsets)):
        _check(f"{node.op} buffer {i}", b, dtype=None)
        if offset + b.nbytes > saved.nbytes:
            raise ShapeError(f"{node.op}: buffer {i} ({b.nbytes} bytes at {offset}) overruns "
                             f"the {saved.nbytes}-byte copy")
        ends = (b.data.ptr, saved.data.ptr + offset)
        pairs.append((*(ends if to_saved else ends[::-1]), b.nbytes))
    return pairs


def guard_copy(ctx, node: Node, saved, buffers, flags=None) -> None:
    """guard_save (flags None: buffers -> saved) or guard_restore (saved -> buffers, only on
    a step whose flags say skip): one launch for every buffer."""
    _check(f"{node.op} saved", saved, "uint8")
    if flags is not None:
        _check(f"{node.op} flags", flags, "int32", (N_FLAGS,))
    key = (node.op,) + _buffers_key([saved, *buffers])
    tables = _node_memory(node, key, ctx, lambda: _copy_tables(
        _saved_pairs(node, saved, buffers, to_saved=flags is None)))
    _launch(ctx, SOURCE, "guard_copy_kernel", (len(tables["jobs"]),), (BLOCK,),
            (tables["entries"], tables["jobs"], np.int32(COPY_CHUNK), _or_null(flags)))


# ---- guard_advance and the mailbox ---------------------------------------------------------

class Mailbox:
    """One int64 in page-locked host memory that the device writes directly (mapped memory:
    with unified addressing its host pointer is valid in kernels): guard_advance posts the
    number of a bad step there. The host reads it without a sync (GuardMonitor.check_call)."""

    def __init__(self):
        runtime = cp.cuda.runtime
        self.ptr = runtime.hostAlloc(8, runtime.hostAllocMapped | runtime.hostAllocPortable)
        self._free = weakref.finalize(self, runtime.freeHost, self.ptr)
        self.array = np.ctypeslib.as_array((ctypes.c_int64 * 1).from_address(self.ptr))
        self.array[0] = 0


# counters buffer (pointer, size) -> its Mailbox; weak: a mailbox lives as long as the step
# (GuardMonitor) holding it, and so does any graph that captured its pointer.
_MAILBOXES: "weakref.WeakValueDictionary[tuple, Mailbox]" = weakref.WeakValueDictionary()


def mailbox(counters):
    """A host view standing for `counters` (int64 (4,)) in GuardMonitor: its [FIRST_BAD]
    reads the mailbox that guard_advance posts to. Made outside any capture (TrainStep does
    at construction); None when mapped memory cannot be had."""
    from ...ops.guard import FIRST_BAD

    _check("guard counters", counters, "int64", (N_COUNTERS,))
    key = _buffers_key([counters])
    box = _MAILBOXES.get(key)
    if box is None:
        try:
            box = Mailbox()
        except cp.cuda.runtime.CUDARuntimeError:
            return None
        _MAILBOXES[key] = box
    return _MailboxCounters(box, FIRST_BAD)


class _MailboxCounters:
    """Indexable like the counters for the one slot the mailbox mirrors; other slots read 0."""

    def __init__(self, box: Mailbox, slot: int):
        self.box, self.slot = box, slot

    def __getitem__(self, i):
        return int(self.box.array[0]) if i == self.slot else 0

    def __setitem__(self, i, value):
        if i == self.slot:
            self.box.array[0] = value


def guard_advance(ctx, node: Node, ins: list, lr) -> None:
    """The guarded step's bookkeeping (ops/guard.py, "guard_advance") in one thread."""
    flags, counters, step, schedule, loss, history_loss, history_step, history_flag = ins
    _check("guard_advance flags", flags, "int32", (N_FLAGS,))
    _check("guard_advance counters", counters, "int64", (N_COUNTERS,))
    _check_scalar("guard_advance step", step, "int64")
    _check("guard_advance schedule", schedule, shape=(6,))
    kind = _float_kind("guard_advance loss", loss)
    _check_scalar("guard_advance loss", loss, loss.dtype.name)
    _check("guard_advance history_loss", history_loss, loss.dtype.name)
    _check("guard_advance history_step", history_step, "int64", shape=history_loss.shape)
    _check("guard_advance history_flag", history_flag, "int32", shape=history_loss.shape)
    _check_scalar("guard_advance lr", lr, "float32")
    box = _MAILBOXES.get(_buffers_key([counters]))
    _launch(ctx, SOURCE, "guard_advance_kernel", (1,), (32,),
            (flags, counters, step, schedule, loss, history_loss, history_step, history_flag,
             np.int64(history_loss.size), np.int32(bool(node.attrs.get("sticky"))), lr,
             np.uint64(box.ptr if box is not None else 0), kind))


def loss_scale_update(ctx, node: Node, ins: list) -> None:
    """GradScaler's scale and growth counter moved by the step's skip flag (ops/guard.py,
    "loss_scale_update") in one thread."""
    flags, scale, tracker = ins
    _check("loss_scale_update flags", flags, "int32", (N_FLAGS,))
    _check_scalar("loss_scale_update scale", scale, "float32")
    _check_scalar("loss_scale_update growth_tracker", tracker, "int32")
    a = node.attrs
    _launch(ctx, SOURCE, "loss_scale_update_kernel", (1,), (1,),
            (flags, scale, tracker, np.float32(a["growth_factor"]),
             np.float32(a["backoff_factor"]), np.int32(a["growth_interval"])))


IMPLS: dict[str, Callable] = {
    "loss_scale_update": lambda node, ins, outs, ctx: loss_scale_update(ctx, node, ins),
    "guard_check": lambda node, ins, outs, ctx: guard_check(ctx, node, ins),
    "guard_advance": lambda node, ins, outs, ctx: guard_advance(ctx, node, ins, outs[0]),
    "guard_save": lambda node, ins, outs, ctx: guard_copy(ctx, node, outs[0], ins),
    "guard_restore": lambda node, ins, outs, ctx: guard_copy(ctx, node, ins[1], ins[2:], ins[0]),
}
