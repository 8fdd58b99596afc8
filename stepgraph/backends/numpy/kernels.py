"""Reference implementations, one function per op (the contracts are in ir/ops.py).

Each writes its results into the preallocated `outs` (and into the inputs its node mutates),
exactly as a device kernel would. Scalars that PyTorch computes in Python floats (bias
corrections, schedules) are computed here in float64 and cast once.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ... import rng
from ...ir.graph import Node
from ...ir.ops import IGNORE_INDEX, conv_geometry, nchw_attrs, update_weight_copies

IMPLS: dict = {}


def impl(op: str):
    def register(fn):
        IMPLS[op] = fn
        return fn
    return register


# ---- activations ---------------------------------------------------------------------------

def _erf(x: np.ndarray) -> np.ndarray:
    # numpy has no erf; math.erf per element in float64 is exact enough and fast at our sizes.
    return np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64))


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def act_forward(z: np.ndarray, kind: str, slope: float = 0.01) -> np.ndarray:
    if kind == "relu":
        return np.maximum(z, 0)
    if kind == "leaky_relu":
        return np.where(z > 0, z, z * z.dtype.type(slope))
    if kind == "sigmoid":
        return 1 / (1 + np.exp(-z))
    if kind == "tanh":
        return np.tanh(z)
    if kind == "gelu":
        return (0.5 * z * (1 + _erf(z / math.sqrt(2.0)))).astype(z.dtype)
    if kind == "gelu_tanh":
        return 0.5 * z * (1 + np.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z**3)))
    if kind == "silu":
        return z / (1 + np.exp(-z))
    raise ValueError(f"unknown activation {kind!r}")


def act_derivative(saved: np.ndarray, kind: str, slope: float = 0.01) -> np.ndarray:
    """d act / d z, from y for relu/sigmoid/tanh and from z otherwise (ops.GRAD_FROM_OUTPUT)."""
    one = saved.dtype.type(1)
    if kind == "relu":
        return (saved > 0).astype(saved.dtype)
    if kind == "leaky_relu":
        return np.where(saved > 0, one, saved.dtype.type(slope))
    if kind == "sigmoid":
        return saved * (1 - saved)
    if kind == "tanh":
        return 1 - saved * saved
    if kind == "gelu":
        z = saved.astype(np.float64)
        cdf = 0.5 * (1 + _erf(z / math.sqrt(2.0)))
        pdf = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
        return (cdf + z * pdf).astype(saved.dtype)
    if kind == "gelu_tanh":
        z = saved
        inner = _SQRT_2_OVER_PI * (z + 0.044715 * z**3)
        t = np.tanh(inner)
        return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * z * z)
    if kind == "silu":                      # d/dz z s(z) = s(z) (1 + z (1 - s(z)))
        s = 1 / (1 + np.exp(-saved))
        return s * (1 + saved * (1 - s))
    raise ValueError(f"unknown activation {kind!r}")


@impl("act")
def act(node: Node, ins, outs, ctx):
    outs[0][...] = act_forward(ins[0], node.attrs["kind"], node.attrs.get("slope", 0.01))


@impl("act_grad")
def act_grad(node: Node, ins, outs, ctx):
    dy, saved = ins
    outs[0][...] = dy * act_derivative(saved, node.attrs["kind"], node.attrs.get("slope", 0.01))


@impl("act_bias_grad")
def act_bias_grad(node: Node, ins, outs, ctx):
    dy, saved = ins
    kind = node.attrs["kind"]
    dz = dy if kind == "none" else dy * act_derivative(saved, kind, node.attrs.get("slope", 0.01))
    outs[0][...] = dz
    outs[1][...] = dz.sum(axis=0)


# ---- dense ---------------------------------------------------------------------------------

@impl("matmul")
def matmul(node: Node, ins, outs, ctx):
    a, b = ins
    a = a.T if node.attrs.get("trans_a") else a
    b = b.T if node.attrs.get("trans_b") else b
    np.matmul(a, b, out=outs[0])


@impl("linear")
def linear(node: Node, ins, outs, ctx):
    x, w = ins[0], ins[1]
    z = x @ w.T
    if len(ins) == 3:
        z += ins[2]
    kind = node.attrs.get("act")
    outs[0][...] = z if kind is None else act_forward(z, kind, node.attrs.get("slope", 0.01))
    if node.attrs.get("save_preact"):
        outs[1][...] = z


@impl("reduce_sum")
def reduce_sum(node: Node, ins, outs, ctx):
    outs[0][...] = ins[0].sum(axis=tuple(node.attrs["axes"]))


@impl("add")
def add(node: Node, ins, outs, ctx):
    np.add(ins[0], ins[1], out=outs[0])


@impl("fill")
def fill(node: Node, ins, outs, ctx):
    outs[0][...] = node.attrs["value"]


# ---- convolution and pooling ---------------------------------------------------------------

def channels_last_capable(reference):
    """`reference`, an NCHW image op's reference, also running nodes with attrs layout "NHWC"
    (ir/ops.py LAYOUTS): every array of rank >= 3 is viewed with its last axis (channels)
    moved to axis 1, as are the shape attrs; the NCHW reference then reads and writes
    through those views."""
    @functools.wraps(reference)
    def run(node: Node, ins, outs, ctx):
        if node.attrs.get("layout", "NCHW") == "NCHW":
            return reference(node, ins, outs, ctx)
        view = lambda a: np.moveaxis(a, -1, 1) if a.ndim >= 3 else a     # noqa: E731
        return reference(replace(node, attrs=nchw_attrs(node.attrs)), [view(a) for a in ins],
                         [view(a) for a in outs], ctx)
    return run


def _pad(x: np.ndarray, ph: int, pw: int) -> np.ndarray:
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))) if ph or pw else x


def _windows(xp: np.ndarray, kh: int, kw: int, sh: int, sw: int) -> np.ndarray:
    """(N, C, Ho, Wo, kh, kw) strided view of the windows of a padded NCHW array."""
    return sliding_window_view(xp, (kh, kw), axis=(2, 3))[:, :, ::sh, ::sw]


def _conv_windows(x: np.ndarray, kh: int, kw: int, attrs) -> np.ndarray:
    """(N, groups, C/groups, Ho, Wo, kh, kw) strided view of a conv's (dilated) windows."""
    (sh, sw), (ph, pw), (dh, dw), groups = conv_geometry(attrs)
    span = (dh * (kh - 1) + 1, dw * (kw - 1) + 1)
    win = sliding_window_view(_pad(x, ph, pw), span, axis=(2, 3))[:, :, ::sh, ::sw, ::dh, ::dw]
    return win.reshape(x.shape[0], groups, x.shape[1] // groups, *win.shape[2:])


def _split_groups(a: np.ndarray, groups: int, axis: int) -> np.ndarray:
    """A view with `axis` (channels) split into (groups, channels per group)."""
    return a.reshape(*a.shape[:axis], groups, a.shape[axis] // groups, *a.shape[axis + 1:])


@impl("conv2d")
@channels_last_capable
def conv2d(node: Node, ins, outs, ctx):
    x, w = ins[0], ins[1]
    groups = conv_geometry(node.attrs)[3]
    win = _conv_windows(x, w.shape[2], w.shape[3], node.attrs)
    y = np.einsum("ngchwij,gocij->ngohw", win, _split_groups(w, groups, 0),
                  optimize=True).reshape(outs[0].shape)
    if len(ins) == 3:
        y += ins[2][None, :, None, None]
    outs[0][...] = y


@impl("conv2d_grad_weight")
@channels_last_capable
def conv2d_grad_weight(node: Node, ins, outs, ctx):
    dy, x = ins
    groups = conv_geometry(node.attrs)[3]
    _, _, kh, kw = node.attrs["weight_shape"]
    win = _conv_windows(x, kh, kw, node.attrs)
    dw = np.einsum("ngchwij,ngohw->gocij", win, _split_groups(dy, groups, 1), optimize=True)
    outs[0][...] = dw.reshape(outs[0].shape)
    if node.attrs.get("bias"):
        outs[1][...] = dy.sum(axis=(0, 2, 3))


@impl("conv2d_grad_input")
@channels_last_capable
def conv2d_grad_input(node: Node, ins, outs, ctx):
    dy, w = ins
    (sh, sw), (ph, pw), (dh, dw), groups = conv_geometry(node.attrs)
    n, c, h, wd = node.attrs["input_shape"]
    _, _, kh, kw = w.shape
    _, _, ho, wo = dy.shape
    dxp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw), dtype=dy.dtype)
    # Scatter each kernel tap's contribution: kh*kw strided adds, no Python loop over pixels.
    contrib = np.einsum("ngohw,gocij->ngcijhw", _split_groups(dy, groups, 1),
                        _split_groups(w, groups, 0), optimize=True).reshape(n, c, kh, kw, ho, wo)
    for i in range(kh):
        for j in range(kw):
            dxp[:, :, i * dh:i * dh + sh * ho:sh, j * dw:j * dw + sw * wo:sw] += contrib[:, :, i, j]
    outs[0][...] = dxp[:, :, ph:ph + h, pw:pw + wd]


@impl("maxpool2d")
@channels_last_capable
def maxpool2d(node: Node, ins, outs, ctx):
    x = ins[0]
    (kh, kw), (sh, sw) = node.attrs["kernel"], node.attrs["stride"]
    ph, pw = node.attrs.get("padding", (0, 0))
    # -inf padding is never a window's maximum: at most half a window is padding
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=-np.inf) \
        if ph or pw else x
    win = _windows(xp, kh, kw, sh, sw)
    n, c, ho, wo = win.shape[:4]
    flat = win.reshape(n, c, ho, wo, kh * kw)
    arg = flat.argmax(axis=-1)  # first maximum in row-major window order, as PyTorch
    y = np.take_along_axis(flat, arg[..., None], axis=-1)[..., 0]
    outs[0][...] = act_forward(y, "relu") if node.attrs.get("relu") else y
    rows = np.arange(ho)[:, None] * sh + arg // kw - ph
    cols = np.arange(wo)[None, :] * sw + arg % kw - pw
    outs[1][...] = rows * x.shape[3] + cols


@impl("maxpool2d_grad")
@channels_last_capable
def maxpool2d_grad(node: Node, ins, outs, ctx):
    dy, idx = ins[:2]
    if node.attrs.get("relu"):                  # ReLU's gradient, from the pooled output
        dy = dy * act_derivative(ins[2], "relu")
    n, c, h, w = node.attrs["input_shape"]
    dx = np.zeros((n * c, h * w), dtype=dy.dtype)
    planes = np.repeat(np.arange(n * c), idx[0, 0].size)
    np.add.at(dx, (planes, idx.reshape(-1)), dy.reshape(-1))
    outs[0][...] = dx.reshape(n, c, h, w)


# ---- dropout -------------------------------------------------------------------------------

def keep_mask(shape: tuple, p: float, attrs, step) -> np.ndarray:
    """The dropout op's uint8 keep mask of a `shape` tensor: Philox at each element's flat
    index, keyed by attrs seed and site and the step counter (rng.py). Every op that drops
    (dropout, the pointwise programs, attention) draws it here."""
    return rng.dropout_keep_mask(math.prod(shape), p, attrs["seed"], attrs["site"],
                                 int(step)).reshape(shape)


@impl("dropout")
def dropout(node: Node, ins, outs, ctx):
    x, step = ins
    a = node.attrs
    y, mask = outs
    mask[...] = keep_mask(mask.shape, a["p"], a, step)
    y[...] = x * _broadcast_mask(mask, x) * x.dtype.type(1.0 / (1.0 - a["p"]))


def _broadcast_mask(mask: np.ndarray, like: np.ndarray) -> np.ndarray:
    return mask.reshape(mask.shape + (1,) * (like.ndim - mask.ndim))


@impl("dropout_grad")
def dropout_grad(node: Node, ins, outs, ctx):
    dy, mask = ins
    outs[0][...] = dy * _broadcast_mask(mask, dy) * dy.dtype.type(1.0 / (1.0 - node.attrs["p"]))


# ---- softmax and losses --------------------------------------------------------------------

def _logsumexp(x: np.ndarray) -> np.ndarray:
    """logsumexp over the last axis, kept as an axis of 1."""
    m = x.max(axis=-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@impl("log_softmax")
def log_softmax(node: Node, ins, outs, ctx):
    x = ins[0]
    outs[0][...] = x - _logsumexp(x)


@impl("log_softmax_grad")
def log_softmax_grad(node: Node, ins, outs, ctx):
    dy, y = ins
    outs[0][...] = dy - np.exp(y) * dy.sum(axis=-1, keepdims=True)


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
    lse = _logsumexp(logits)[:, 0]
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
    lse = _logsumexp(logits)[:, 0]
    outs[0][...] = _cross_entropy_loss(logits, labels, lse, *_ce_attrs(node))
    outs[1][...] = _softmax_minus_onehot(logits, lse, labels, logits.dtype.type(1),
                                         *_ce_attrs(node))


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


@impl("mse")
def mse(node: Node, ins, outs, ctx):
    pred, target = ins
    outs[0][...] = np.mean((pred - target) ** 2)


@impl("mse_grad")
def mse_grad(node: Node, ins, outs, ctx):
    dloss, pred, target = ins
    outs[0][...] = dloss * 2 * (pred - target) / pred.size


# ---- optimizer -----------------------------------------------------------------------------

@impl("step_increment")
def step_increment(node: Node, ins, outs, ctx):
    ins[0][...] += 1


@impl("lr_schedule")
def lr_schedule(node: Node, ins, outs, ctx):
    from ...optim.schedules import schedule_lr

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


@impl("global_norm")
def global_norm(node: Node, ins, outs, ctx):
    total = sum(float(np.sum(g.astype(np.float64) ** 2)) for g in ins)
    outs[0][...] = math.sqrt(total)


def _skipped(node: Node, ins) -> bool:
    """A guarded update (attrs guard) whose guard flags (its last input) say skip."""
    from ...ops.guard import FLAG_SKIP

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
