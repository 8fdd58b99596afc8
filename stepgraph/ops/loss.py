"""Loss family: cross_entropy (label smoothing, ignore_index; its gradient and the fused
forward + backward), nll_loss and mse, each with its gradient; mean reduction, PyTorch's
semantics."""
from __future__ import annotations

import numpy as np

from ..ir.graph import BF16, Node
from ..ir.ops import Emit, _need, defop, impl, vjp
from .softmax import logsumexp

# The cross-entropy ops' ignore_index when their attrs give none (PyTorch's default): a label
# the loss skips, not a bad one.
IGNORE_INDEX = -100


def _check_labels(op, logits, labels, classes_first: bool = False):
    layout = "(classes, batch)" if classes_first else "(batch, classes)"
    _need(len(logits.shape) == 2, op, f"logits must be {layout}, got {logits.shape}")
    rows = logits.shape[1 if classes_first else 0]
    _need(labels.shape == (rows,), op,
          f"labels must be ({rows},) for logits {logits.shape}, got {labels.shape}")
    _need(labels.dtype in ("int32", "int64"), op, f"labels must be integers, got {labels.dtype}")


# ---- cross_entropy -------------------------------------------------------------------------

@defop("cross_entropy")
def _cross_entropy(ins, attrs):
    """loss = mean_i((1-eps)(lse_i - logits[i, labels_i]) + eps (lse_i - mean_j logits[i, j]))
    with eps = attrs label_smoothing (default 0.0, PyTorch's), the mean over the rows whose
    label is not attrs ignore_index (default -100; every row ignored: NaN, as PyTorch);
    second output lse (N,) = logsumexp rows."""
    _check_labels("cross_entropy", *ins)
    return [((), ins[0].dtype), ((ins[0].shape[0],), ins[0].dtype)]


@defop("cross_entropy_grad")
def _cross_entropy_grad(ins, attrs):
    """dlogits = dloss * (exp(logits - lse) - (1-eps) onehot(labels) - eps/C) / kept, eps =
    attrs label_smoothing (default 0.0), kept = the rows whose label is not attrs ignore_index
    (default -100); those rows get 0; ins (dloss, logits, lse, labels)."""
    return [(ins[1].shape, ins[1].dtype)]


@defop("cross_entropy_train")
def _cross_entropy_train(ins, attrs):
    """Fused forward and backward with dloss = 1: (loss, dlogits) from (logits, labels);
    attrs label_smoothing and ignore_index as cross_entropy's. bf16 logits (compile/fuse.py
    fuse_loss_casts) are widened exactly and give bf16 dlogits, rounded once; the loss is
    float32. With attrs classes_first the logits and dlogits are stored transposed, (C, N)
    (compile/logits_layout.py)."""
    _check_labels("cross_entropy", *ins, classes_first=bool(attrs.get("classes_first")))
    loss_dtype = "float32" if ins[0].dtype == BF16 else ins[0].dtype
    return [((), loss_dtype), (ins[0].shape, ins[0].dtype)]


@vjp("cross_entropy")
def _cross_entropy_vjp(emit: Emit, node: Node, dy: list, wants) -> list:
    logits, labels = node.inputs
    return [emit("cross_entropy_grad", [dy[0], logits, node.outputs[1], labels],
                 label_smoothing=float(node.attrs.get("label_smoothing", 0.0)),
                 ignore_index=int(node.attrs.get("ignore_index", IGNORE_INDEX)))[0], None]


def _valid_rows(labels: np.ndarray, classes: int) -> np.ndarray:
    """Rows whose label lies in [0, classes): the others pick NaN and get no one-hot term, as
    in the CUDA kernels (a guarded step then skips its update instead of failing)."""
    return np.flatnonzero((labels >= 0) & (labels < classes))


def _picked(x: np.ndarray, labels: np.ndarray) -> np.ndarray:
    rows = _valid_rows(labels, x.shape[1])
    if len(rows) == len(labels):
        return x[np.arange(x.shape[0]), labels]
    out = np.full(x.shape[0], np.nan, dtype=x.dtype)
    out[rows] = x[rows, labels[rows]]
    return out


def _kept_rows(labels: np.ndarray, ignore_index) -> np.ndarray:
    """Rows whose label is not ignore_index (IGNORE_INDEX when None)."""
    return labels != (IGNORE_INDEX if ignore_index is None else int(ignore_index))


def _cross_entropy_loss(logits, labels, lse, eps: float, ignore_index: int):
    """The mean over the rows not ignored of (1-eps) (lse_i - x[i, y_i]) + eps (lse_i -
    mean_j x[i, j]) (PyTorch's); NaN when every row is ignored."""
    kept = _kept_rows(labels, ignore_index)
    if not kept.any():
        return np.nan
    logits, labels, lse = logits[kept], labels[kept], lse[kept]
    nll = lse - _picked(logits, labels)
    if eps:
        t = logits.dtype.type
        nll = t(1 - eps) * nll + t(eps) * (lse - logits.mean(axis=1))
    return nll.mean()


def _ce_attrs(node: Node) -> tuple[float, int]:
    return node.attrs.get("label_smoothing", 0.0), node.attrs.get("ignore_index", IGNORE_INDEX)


@impl("cross_entropy")
def cross_entropy(node: Node, ins, outs, ctx):
    logits, labels = ins
    lse = logsumexp(logits)[:, 0]
    outs[0][...] = _cross_entropy_loss(logits, labels, lse, *_ce_attrs(node))
    outs[1][...] = lse


def _softmax_minus_onehot(logits, lse, labels, dloss, eps: float, ignore_index: int):
    """(softmax - (1-eps) onehot - eps/C) * dloss / kept in the rows not ignored (kept of
    them), 0 in the ignored rows: the smoothed target's gradient."""
    t = logits.dtype.type
    g = np.exp(logits - lse[:, None])
    rows = _valid_rows(labels, logits.shape[1])
    g[rows, labels[rows]] -= t(1 - eps)
    if eps:
        g -= t(eps / logits.shape[1])
    kept = _kept_rows(labels, ignore_index)
    g[~kept] = 0
    return g * (dloss / t(max(int(kept.sum()), 1)))


@impl("cross_entropy_grad")
def cross_entropy_grad(node: Node, ins, outs, ctx):
    dloss, logits, lse, labels = ins
    outs[0][...] = _softmax_minus_onehot(logits, lse, labels, dloss, *_ce_attrs(node))


@impl("cross_entropy_train")
def cross_entropy_train(node: Node, ins, outs, ctx):
    logits, labels = ins
    dlogits = outs[1]
    if node.attrs.get("classes_first"):   # rows contiguous: the same sums as (N, C) logits
        logits, dlogits = np.ascontiguousarray(logits.T), dlogits.T
    lse = logsumexp(logits)[:, 0]
    outs[0][...] = _cross_entropy_loss(logits, labels, lse, *_ce_attrs(node))
    dlogits[...] = _softmax_minus_onehot(logits, lse, labels, logits.dtype.type(1),
                                         *_ce_attrs(node))


# ---- nll_loss ------------------------------------------------------------------------------

@defop("nll_loss")
def _nll_loss(ins, attrs):
    """loss = -mean_i(logp[i, labels_i])."""
    _check_labels("nll_loss", *ins)
    return [((), ins[0].dtype)]


@defop("nll_loss_grad")
def _nll_loss_grad(ins, attrs):
    """dlogp (N, attrs classes) = -dloss / N at (i, labels_i), zero elsewhere;
    ins (dloss, labels)."""
    dloss, labels = ins
    return [((labels.shape[0], attrs["classes"]), dloss.dtype)]


@vjp("nll_loss")
def _nll_loss_vjp(emit: Emit, node: Node, dy: list, wants) -> list:
    logp, labels = node.inputs
    return [emit("nll_loss_grad", [dy[0], labels], classes=logp.shape[1])[0], None]


@impl("nll_loss")
def nll_loss(node: Node, ins, outs, ctx):
    logp, labels = ins
    outs[0][...] = -_picked(logp, labels).mean()


@impl("nll_loss_grad")
def nll_loss_grad(node: Node, ins, outs, ctx):
    dloss, labels = ins
    g = outs[0]
    g[...] = 0
    rows = _valid_rows(labels, g.shape[1])
    g[rows, labels[rows]] = -dloss / len(labels)


# ---- mse -----------------------------------------------------------------------------------

@defop("mse")
def _mse(ins, attrs):
    """loss = mean((pred - target)^2) over all elements."""
    pred, target = ins
    _need(pred.shape == target.shape, "mse", f"pred {pred.shape} vs target {target.shape}")
    return [((), pred.dtype)]


@defop("mse_grad")
def _mse_grad(ins, attrs):
    """dpred = dloss * 2 (pred - target) / numel; ins (dloss, pred, target)."""
    return [(ins[1].shape, ins[1].dtype)]


@vjp("mse")
def _mse_vjp(emit: Emit, node: Node, dy: list, wants) -> list:
    pred, target = node.inputs
    dpred = emit("mse_grad", [dy[0], pred, target])[0] if wants(0) else None
    dtarget = None
    if wants(1):  # d/dtarget = -d/dpred
        dtarget = emit("mse_grad", [dy[0], target, pred])[0]
    return [dpred, dtarget]


@impl("mse")
def mse(node: Node, ins, outs, ctx):
    pred, target = ins
    outs[0][...] = np.mean((pred - target) ** 2)


@impl("mse_grad")
def mse_grad(node: Node, ins, outs, ctx):
    dloss, pred, target = ins
    outs[0][...] = dloss * 2 * (pred - target) / pred.size
