"""Launchers of loss.cu: log_softmax, cross-entropy (forward, backward, and both fused with
label smoothing and ignore_index), nll_loss and mse, with their gradients.

Device memory kept per node (runtime/launch.py `_node_memory`): cross_entropy /
cross_entropy_train over more than one block keep an arrival counter, the kept rows' count
(ignore_index) and N floats of per-row losses for the train kernel and the label-smoothed
forward (without it, a capture falls back to one block); cross_entropy_grad the kept rows'
count (without it, each block counts the labels); mse over more than one block its blocks'
partial sums and an arrival counter (without them, one block). cross_entropy_train also
takes bf16 logits and gradients (compile/fuse.py fuse_loss_casts), and float16 ones with a
float16 loss (a float16 model: model.half()); log_softmax and its gradient take float32,
bf16 or float16.
"""
from __future__ import annotations

from typing import Callable

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ...errors import ShapeError
from ...ir.graph import Node
from .runtime.launch import (BLOCK, ELEMENT_CTYPES, LABEL_CTYPES, _check, _check_int32,
                             _check_scalar, _element_ctype, _float_kind, _grid, _launch,
                             _node_memory, _or_null, _row_block, _row_grid, _typed,
                             current_sm_count)

SINGLE_BLOCK_ELEMENTS = 1 << 15   # cross-entropy over at most this many logits: one block
SHORT_ROW = 32                    # cross_entropy_train in one block: a thread per row up to here
# cross_entropy_train's blocks an SM at most (one wave of 256 threads' blocks, rows grid-strided):
# a second, partial wave and 2,048 arrivals left gpt bf16's SMs idle over half its 26 us
TRAIN_BLOCKS_PER_SM = 8
# lanes a sample of the classes-first train kernel: 32 samples x 8 lanes a block of 256, each
# lane over C / 8 classes (65: 9), so gpt's 16,384 rows make 512 blocks
COLUMN_LANES = 8
BF16_OPS = frozenset({"cross_entropy_train", "log_softmax", "log_softmax_grad"})
FP16_OPS = BF16_OPS
# (logits, dlogits) storages of the train kernels: float32 and bf16 in any mix, float16 alone
TRAIN_CTYPES = [(x, d) for x in ("float", "unsigned short") for d in ("float", "unsigned short")] \
    + [("fp16_bits", "fp16_bits")]


def _check_logits(what: str, x, labels=None, dtype: str | None = "float32",
                  classes_first: bool = False) -> tuple[int, int]:
    """(batch, classes) of logits x, (batch, classes) or, classes_first, (classes, batch)."""
    _check(f"{what} logits", x, dtype=dtype)
    if x.ndim != 2:
        layout = "(classes, batch)" if classes_first else "(batch, classes)"
        raise ShapeError(f"{what}: expected {layout}, got {tuple(x.shape)}")
    _check_int32(what, x.size)
    n, c = x.shape[::-1] if classes_first else x.shape
    if labels is not None:
        _check(f"{what} labels", labels, dtype=None, shape=(n,))
        if labels.dtype not in LABEL_CTYPES:
            raise ShapeError(f"{what} labels: expected int32 or int64, got {labels.dtype}")
    return n, c


def _typed_rows(what: str, x) -> tuple[str, int, int]:
    """(C type, rows, cols) of x (rank >= 1, float32, bf16 or float16) viewed as rows of its
    last axis."""
    ctype = _element_ctype(what, x)
    if x.ndim < 1:
        raise ShapeError(f"{what}: expected rank >= 1 (rows of the last axis), got a scalar")
    _check_int32(what, x.size)
    return ctype, x.size // max(x.shape[-1], 1), x.shape[-1]


def log_softmax_forward(ctx, x, y) -> None:
    """y = x - logsumexp(x, last axis), any rank >= 1; y of x's dtype."""
    ctype, n, c = _typed_rows("log_softmax input", x)
    _check("log_softmax output", y, x.dtype, shape=x.shape)
    if x.size:
        block = _row_block(c, BLOCK, narrow=True)
        _launch(ctx, "loss.cu", _typed("log_softmax_forward_kernel", ctype),
                _row_grid(n, block[1]), block, (x, y, np.int32(n), np.int32(c)))


def log_softmax_backward(ctx, dy, y, dx) -> None:
    """dx = dy - exp(y) * dy.sum(last axis), any rank >= 1; one dtype."""
    ctype, n, c = _typed_rows("log_softmax_grad dy", dy)
    _check("log_softmax_grad y", y, dy.dtype, shape=dy.shape)
    _check("log_softmax_grad dx", dx, dy.dtype, shape=dy.shape)
    if dy.size:
        block = _row_block(c, BLOCK, narrow=True)
        _launch(ctx, "loss.cu", _typed("log_softmax_backward_kernel", ctype),
                _row_grid(n, block[1]), block, (dy, y, dx, np.int32(n), np.int32(c)))


def _loss_layout(node: Node, ctx, n: int, c: int, rowloss: bool, partials: bool = False,
                 columns: bool = False):
    """(grid, block, scratch) of a cross-entropy kernel: one block of 1024 threads for small
    inputs (no scratch), else one block per 256 threads' rows with the node's scratch (rowloss:
    n floats; partials: a float64 a block, the blocks then at most one wave). columns: the
    classes-first train kernel's blocks, 32 rows by COLUMN_LANES lanes, alone too."""
    single = (32, COLUMN_LANES) if columns else _row_block(c, 1024)
    rows_of = (lambda b: b[0]) if columns else (lambda b: b[1])
    if n * c <= SINGLE_BLOCK_ELEMENTS or n <= rows_of(single):
        return (1,), single, None
    block = (32, COLUMN_LANES) if columns else _row_block(c, BLOCK)
    grid = _row_grid(n, rows_of(block))
    if partials:
        grid = (min(grid[0], TRAIN_BLOCKS_PER_SM * current_sm_count()),)
    key = ("cross_entropy", n, rowloss, grid[0] if partials else 0)

    def build():
        return dict(counter=cp.zeros(1, np.uint32), count=cp.zeros(1, np.int32),
                    rowloss=cp.empty(n if rowloss else 1, np.float32),
                    partials=cp.empty(grid[0] if partials else 1, np.float64))

    scratch = _node_memory(node, key, ctx, build, required=False)
    if scratch is None:      # capture without a warm-up: one block is slower, still exact
        return (1,), single, None
    return grid, block, scratch


def _scratch_args(scratch, fallback) -> tuple:
    if scratch is None:      # unused by a one-block launch; any valid pointer will do
        return fallback, fallback
    return scratch["rowloss"], scratch["counter"]


def _count_kept(ctx, labels, ignore: np.int64, count) -> None:
    """count (device int32) = how many labels are not ignore_index (one block)."""
    _launch(ctx, "loss.cu", f"cross_entropy_count_kernel<{LABEL_CTYPES[labels.dtype]}>", (1,),
            (1024,), (labels, np.int32(labels.size), ignore, count))


def _ignore(ignore_index) -> np.int64:
    """ignore_index as the kernels take it (PyTorch's default -100 when None)."""
    value = -100 if ignore_index is None else int(ignore_index)
    if not -2**63 <= value < 2**63:
        raise ValueError(f"ignore_index {value} does not fit in 64 bits")
    return np.int64(value)


def _smoothing(eps: float, classes: int) -> tuple[np.float32, np.float32, np.float32]:
    """(eps, hit, off) of label smoothing eps (loss.cu): hit = float32(1 - eps) weighs the
    label, off = float32(eps / C) every class; (0, 1, 0) without smoothing."""
    eps = float(eps or 0.0)
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {eps}")
    return np.float32(eps), np.float32(1.0 - eps), np.float32(eps / max(classes, 1))


def cross_entropy_forward(ctx, node: Node, logits, labels, loss, lse,
                          label_smoothing: float = 0.0, ignore_index: int = -100) -> None:
    """loss = mean((1-eps)(lse - logits[i, label_i]) + eps (lse - mean_j logits[i, j])),
    eps = label_smoothing, over the rows whose label is not ignore_index; lse (N,) =
    logsumexp of each row."""
    n, c = _check_logits("cross_entropy", logits, labels)
    _check_scalar("cross_entropy loss", loss, "float32")
    _check("cross_entropy lse", lse, shape=(n,))
    eps, hit, _ = _smoothing(label_smoothing, c)
    # Smoothed losses over several blocks are parked per row (their means are not in lse).
    grid, block, scratch = _loss_layout(node, ctx, n, c, rowloss=bool(eps))
    rowloss, counter = _scratch_args(scratch, loss)
    _launch(ctx, "loss.cu", f"cross_entropy_forward_kernel<{LABEL_CTYPES[labels.dtype]}>",
            grid, block, (logits, labels, loss, lse, rowloss, counter, np.int32(n), np.int32(c),
                          eps, hit, _ignore(ignore_index)))


def cross_entropy_backward(ctx, dloss, logits, lse, labels, dx,
                           label_smoothing: float = 0.0, node: Node | None = None,
                           ignore_index: int = -100) -> None:
    """dlogits = dloss * (softmax(logits) - (1-eps) onehot(labels) - eps / C) / kept, zero in
    the rows whose label is ignore_index (kept: the other rows). With the node's count
    scratch, one block counts the kept rows first; else every block counts them."""
    n, c = _check_logits("cross_entropy_grad", logits, labels)
    _check_scalar("cross_entropy_grad dloss", dloss, "float32")
    _check("cross_entropy_grad lse", lse, shape=(n,))
    _check("cross_entropy_grad dx", dx, shape=logits.shape)
    _, hit, off = _smoothing(label_smoothing, c)
    if not logits.size:
        return
    ignore = _ignore(ignore_index)
    count = None
    if node is not None:
        count = _node_memory(node, ("cross_entropy_count",), ctx,
                             lambda: cp.zeros(1, np.int32), required=False)
    if count is not None:
        _count_kept(ctx, labels, ignore, count)
    _launch(ctx, "loss.cu", f"cross_entropy_backward_kernel<{LABEL_CTYPES[labels.dtype]}>",
            _grid(logits.size), (BLOCK,),
            (dloss, logits, lse, labels, dx, _or_null(count), np.int32(n), np.int32(c), off,
             hit, ignore))


def _train_loss_name(kernel: str, x: str, d: str, label: str) -> str:
    return f"{kernel}<{x}, {d}, {label}>"


def cross_entropy_train(ctx, node: Node, logits, labels, loss, dx,
                        label_smoothing: float = 0.0, ignore_index: int = -100,
                        classes_first: bool = False) -> None:
    """Fused forward and backward with dloss = 1: loss and dlogits in one launch (several
    blocks: after a one-block launch counting the rows not ignored, which every block needs
    for the gradients' scale float32(1 / kept)). logits and dlogits float32, or bf16 where
    compile/fuse.py fuse_loss_casts dropped the casts around the loss; or float16 logits,
    dlogits and loss (a float16 model). classes_first: logits and dlogits (C, N)
    (compile/logits_layout.py)."""
    n, c = _check_logits("cross_entropy_train", logits, labels, dtype=None,
                         classes_first=classes_first)
    loss_kind = _float_kind("cross_entropy_train loss", loss)
    _check_scalar("cross_entropy_train loss", loss, loss.dtype.name)
    _check("cross_entropy_train dlogits", dx, dtype=None, shape=logits.shape)
    types = (_element_ctype("cross_entropy_train logits", logits),
             _element_ctype("cross_entropy_train dlogits", dx), LABEL_CTYPES[labels.dtype])
    smoothing = _smoothing(label_smoothing, c)
    ignore = _ignore(ignore_index)
    if c <= SHORT_ROW and n * c <= SINGLE_BLOCK_ELEMENTS and not classes_first:
        _launch(ctx, "loss.cu", _train_loss_name("cross_entropy_train_short_kernel", *types),
                (1,), (min(1024, max(32, -(-n // 32) * 32)),),
                (logits, labels, loss, dx, np.int32(n), np.int32(c)) + smoothing +
                (ignore, loss_kind))
        return
    grid, block, scratch = _loss_layout(node, ctx, n, c, rowloss=False, partials=True,
                                        columns=classes_first)
    partials, counter = (loss, loss) if scratch is None else \
        (scratch["partials"], scratch["counter"])
    count = np.uint64(0)        # one block counts the kept rows itself
    if scratch is not None:
        count = scratch["count"]
        _count_kept(ctx, labels, ignore, count)
    kernel = "cross_entropy_train_columns_kernel" if classes_first else \
        "cross_entropy_train_kernel"
    _launch(ctx, "loss.cu", _train_loss_name(kernel, *types),
            grid, block, (logits, labels, loss, dx, partials, counter, count, np.int32(n),
                          np.int32(c)) + smoothing + (ignore, loss_kind))


def nll_loss_forward(ctx, logp, labels, loss) -> None:
    """loss = -mean(logp[i, label_i]) (one block)."""
    n, c = _check_logits("nll_loss", logp, labels)
    _check_scalar("nll_loss loss", loss, "float32")
    _launch(ctx, "loss.cu", f"nll_loss_forward_kernel<{LABEL_CTYPES[labels.dtype]}>", (1,),
            (1024,), (logp, labels, loss, np.int32(n), np.int32(c)))


def nll_loss_backward(ctx, dloss, labels, dx) -> None:
    """dlogp (N, C) = -dloss / N at (i, label_i), zero elsewhere."""
    n, c = _check_logits("nll_loss_grad", dx, labels)
    _check_scalar("nll_loss_grad dloss", dloss, "float32")
    if dx.size:
        _launch(ctx, "loss.cu", f"nll_loss_backward_kernel<{LABEL_CTYPES[labels.dtype]}>",
                _grid(dx.size), (BLOCK,), (dloss, labels, dx, np.int32(n), np.int32(c)))


# mse over several blocks: one per MSE_ELEMENTS_PER_BLOCK elements (four a thread), at most
# MSE_BLOCKS, so a (8, 2, 128, 128) U-Net output is summed by 64 blocks, not one.
MSE_ELEMENTS_PER_BLOCK, MSE_BLOCKS = 4096, 264


def mse_forward(ctx, pred, target, loss, node: Node | None = None) -> None:
    """loss = mean((pred - target)^2) over every element: one block, or with the node's
    scratch (partial sums and an arrival counter) one block per 4096 elements."""
    _check("mse pred", pred)
    _check("mse target", target, shape=pred.shape)
    _check_scalar("mse loss", loss, "float32")
    blocks = min(-(-pred.size // MSE_ELEMENTS_PER_BLOCK), MSE_BLOCKS)
    scratch = None
    if blocks > 1 and node is not None:
        scratch = _node_memory(node, ("mse", blocks), ctx, lambda: dict(
            partials=cp.empty(blocks, np.float64), counter=cp.zeros(1, np.uint32)),
            required=False)
    if scratch is None:      # small, or a capture without a warm-up: one block, still exact
        blocks, partials, counter = 1, loss, loss     # unread by one block
    else:
        partials, counter = scratch["partials"], scratch["counter"]
    _launch(ctx, "loss.cu", "mse_forward_kernel", (blocks,), (1024,),
            (pred, target, loss, np.int64(pred.size), partials, counter))


def mse_backward(ctx, dloss, pred, target, dx) -> None:
    """dpred = dloss * 2 * (pred - target) / numel."""
    _check_scalar("mse_grad dloss", dloss, "float32")
    _check("mse_grad pred", pred)
    _check("mse_grad target", target, shape=pred.shape)
    _check("mse_grad dx", dx, shape=pred.shape)
    if pred.size:
        _launch(ctx, "loss.cu", "mse_backward_kernel", _grid(pred.size), (BLOCK,),
                (dloss, pred, target, dx, np.int64(pred.size)))


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name these launchers may launch} (as elementwise.py's)."""
    label = ("cross_entropy_count", "cross_entropy_forward", "cross_entropy_backward",
             "nll_loss_forward", "nll_loss_backward")
    train = ("cross_entropy_train_short_kernel", "cross_entropy_train_kernel",
             "cross_entropy_train_columns_kernel")
    return {"loss.cu": {"mse_forward_kernel", "mse_backward_kernel"}
            | {_typed(f"log_softmax_{d}_kernel", ctype) for d in ("forward", "backward")
               for ctype in ELEMENT_CTYPES.values()}
            | {f"{k}_kernel<{ctype}>" for k in label for ctype in LABEL_CTYPES.values()}
            | {_train_loss_name(k, x, d, lab) for k in train for x, d in TRAIN_CTYPES
               for lab in LABEL_CTYPES.values()}}


IMPLS: dict[str, Callable] = {
    "log_softmax": lambda node, ins, outs, ctx: log_softmax_forward(ctx, ins[0], outs[0]),
    "log_softmax_grad": lambda node, ins, outs, ctx: log_softmax_backward(
        ctx, ins[0], ins[1], outs[0]),
    "cross_entropy": lambda node, ins, outs, ctx: cross_entropy_forward(
        ctx, node, ins[0], ins[1], outs[0], outs[1], node.attrs.get("label_smoothing", 0.0),
        node.attrs.get("ignore_index", -100)),
    "cross_entropy_grad": lambda node, ins, outs, ctx: cross_entropy_backward(
        ctx, ins[0], ins[1], ins[2], ins[3], outs[0], node.attrs.get("label_smoothing", 0.0),
        node, node.attrs.get("ignore_index", -100)),
    "cross_entropy_train": lambda node, ins, outs, ctx: cross_entropy_train(
        ctx, node, ins[0], ins[1], outs[0], outs[1], node.attrs.get("label_smoothing", 0.0),
        node.attrs.get("ignore_index", -100), bool(node.attrs.get("classes_first"))),
    "nll_loss": lambda node, ins, outs, ctx: nll_loss_forward(ctx, ins[0], ins[1], outs[0]),
    "nll_loss_grad": lambda node, ins, outs, ctx: nll_loss_backward(
        ctx, ins[0], ins[1], outs[0]),
    "mse": lambda node, ins, outs, ctx: mse_forward(ctx, ins[0], ins[1], outs[0], node),
    "mse_grad": lambda node, ins, outs, ctx: mse_backward(ctx, ins[0], ins[1], ins[2], outs[0]),
}
