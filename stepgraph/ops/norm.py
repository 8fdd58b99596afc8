"""Norm family: training-mode batch normalisation and its gradient (PyTorch's BatchNorm).

Eval-mode BatchNorm needs no op: nn.functional.batch_norm composes it of binary/scalar ops
from the running statistics. The NumPy reference accumulates statistics in float64. Both ops
take attrs layout "NHWC" (channels-last, compile/layout.py): the channel axis is then the last
one, x (N, *spatial, C).
"""
from __future__ import annotations

import math

import numpy as np

from ..backends.numpy import bf16
from ..ir.graph import HALF_DTYPES
from ..ir.ops import _need, defop, impl, vjp
from .layout import channels_last_capable, layout_attrs, layout_of

BN_ACTS = ("none", "relu")


def _running_positions(attrs) -> tuple[int, ...]:
    """Input positions of running_mean, running_var, num_batches_tracked (empty without track)."""
    first = 3 if attrs["affine"] else 1
    return (first, first + 1, first + 2) if attrs["track"] else ()


def _reduced_count(shape) -> int:
    """M = N * prod(spatial): the elements each channel's statistics are taken over (of an
    NCHW-ordered shape)."""
    return shape[0] * math.prod(shape[2:])


def _channels(op: str, x, attrs) -> int:
    """C: x's axis 1, or its last axis with layout "NHWC"."""
    return x.shape[-1] if layout_of(op, attrs) == "NHWC" else x.shape[1]


def residual_norm_inputs(attrs) -> int:
    """Inputs after r of a residual_norm batch_norm_train: r_mean, r_invstd[, r_w, r_b]."""
    if not attrs.get("residual_norm"):
        return 0
    return 4 if attrs.get("residual_affine") else 2


def residual_position(attrs) -> int:
    """Input position of a residual batch_norm_train's r."""
    return 1 + 2 * bool(attrs["affine"]) + 3 * bool(attrs["track"])


@defop("batch_norm_train", mutates=_running_positions)
def _batch_norm_train(ins, attrs):
    """Training-mode BatchNorm over the channel axis 1 of x (N, C, *spatial), rank >= 2.
    ins = x, then weight (C,), bias (C,) when attrs affine, then running_mean (C,), running_var
    (C,) (float32, or x's dtype) and num_batches_tracked (int64 scalar) when attrs track.
    attrs eps, momentum (float, or None: cumulative average), affine, track, act ("none" or
    "relu": the ReLU that followed, fused), residual (made only by compile/fuse.py: an input r
    of x's shape and dtype after the others, the residual added before the activation; with
    residual_norm, r is a shortcut's raw value and its BatchNorm is applied on the way in:
    inputs r_mean, r_invstd (its batch_norm_stats) and, with residual_affine, r_weight,
    r_bias follow r, and r counts as that BatchNorm's stored output, residual_eps its eps).
    Per channel
    over M = N*prod(spatial) elements: mean, biased var; save_invstd = 1/sqrt(var + eps); y =
    act((x - mean) * save_invstd * weight + bias), or with residual act(b + r), b that
    normalised value rounded to x's dtype and the sum rounded again, as the unfused
    batch_norm_train and add store them. Outputs y (x.shape), save_mean (C,), save_invstd
    (C,), all of x's dtype (the statistics float32 for a bfloat16 x, whose weight and running
    statistics are float32).
    With track, updates in place: num_batches_tracked += 1; m = momentum, or
    1/num_batches_tracked (after the increment) when momentum is None; running_mean =
    (1-m) running_mean + m mean; running_var = (1-m) running_var + m var M/(M-1).
    Statistics accumulate in float64. attrs layout "NHWC": channels on the last axis of x."""
    x = ins[0]
    _need(len(x.shape) >= 2, "batch_norm_train", f"input must be (N, C, ...), got {x.shape}")
    _need(attrs.get("act", "none") in BN_ACTS, "batch_norm_train",
          f"act must be one of {BN_ACTS}, got {attrs.get('act')!r}")
    residual = bool(attrs.get("residual"))
    channels = 2 * bool(attrs["affine"]) + 2 * bool(attrs["track"])
    want = 1 + channels + bool(attrs["track"]) + residual + residual_norm_inputs(attrs)
    _need(len(ins) == want, "batch_norm_train",
          f"{want} inputs for affine={attrs['affine']}, track={attrs['track']}, "
          f"residual={residual}, residual_norm={bool(attrs.get('residual_norm'))}, "
          f"got {len(ins)}")
    c = _channels("batch_norm_train", x, attrs)
    _need(x.size // max(c, 1) > 1, "batch_norm_train",
          f"more than 1 value per channel needed in training, got input {x.shape}")
    if residual:
        r = ins[residual_position(attrs)]
        _need(r.shape == x.shape and r.dtype == x.dtype, "batch_norm_train",
              f"residual {r!r} must match input {x.shape} {x.dtype}")
    channel_ins = ins[1:1 + channels] + ins[len(ins) - residual_norm_inputs(attrs):]
    for v in channel_ins:
        _need(v.shape == (c,), "batch_norm_train", f"{v!r} must be ({c},) for input {x.shape}")
        _need(v.dtype in (x.dtype, "float32"), "batch_norm_train", f"{v!r} dtype vs {x.dtype}")
    if attrs["track"]:
        count = ins[1 + channels]
        _need(count.shape == () and count.dtype == "int64", "batch_norm_train",
              f"num_batches_tracked must be an int64 scalar, got {count!r}")
    stats = "float32" if x.dtype in HALF_DTYPES else x.dtype    # 16-bit x: float32 statistics
    return [(x.shape, x.dtype), ((c,), stats), ((c,), stats)]


def _stats_running_positions(attrs) -> tuple[int, ...]:
    return (1, 2, 3) if attrs["track"] else ()


@defop("batch_norm_stats", mutates=_stats_running_positions)
def _batch_norm_stats(ins, attrs):
    """The statistics half of batch_norm_train (made only by compile/fuse.py, for a shortcut
    BatchNorm whose output only a residual batch_norm_train reads, which applies it: attrs
    residual_norm there). ins = x, then running_mean, running_var, num_batches_tracked when
    attrs track; attrs eps, momentum, track, layout as batch_norm_train's. Outputs save_mean,
    save_invstd (C,) and the running-statistics update, exactly as batch_norm_train's."""
    x = ins[0]
    _need(len(x.shape) >= 2, "batch_norm_stats", f"input must be (N, C, ...), got {x.shape}")
    want = 1 + 3 * bool(attrs["track"])
    _need(len(ins) == want, "batch_norm_stats",
          f"{want} inputs for track={attrs['track']}, got {len(ins)}")
    c = _channels("batch_norm_stats", x, attrs)
    for v in ins[1:3]:
        _need(v.shape == (c,), "batch_norm_stats", f"{v!r} must be ({c},) for input {x.shape}")
    stats = "float32" if x.dtype in HALF_DTYPES else x.dtype
    return [((c,), stats), ((c,), stats)]


@defop("batch_norm_grad")
def _batch_norm_grad(ins, attrs):
    """Gradient of batch_norm_train. ins = dy, x, [weight when attrs affine], save_mean,
    save_invstd, [bias when attrs affine and act is "relu"]. With act relu, dy is first masked
    where the forward's output was not positive: by z > 0, z = xhat * weight + bias
    recomputed in float32 with the forward kernel's roundings (relu_mask), which is y > 0 of
    the kernels' y bit for bit, so y need not be read.
    xhat = (x - save_mean) * save_invstd; per channel sum_dy, sum_dy_xhat over M elements;
    dx = weight * save_invstd / M * (M dy - sum_dy - xhat sum_dy_xhat) (weight = 1 without
    affine); outputs dx (x's dtype), and dweight = sum_dy_xhat, dbias = sum_dy (the weight's
    dtype) when affine. attrs layout as batch_norm_train's. attrs dy_sum (made only by
    compile/fuse.py): a last input dy2 of dy's shape and dtype, and the gradient is dy + dy2
    rounded to dy's dtype, as the unfused add stores it."""
    dy, x = ins[0], ins[1]
    affine, relu = bool(attrs["affine"]), attrs.get("act", "none") == "relu"
    dy_sum = bool(attrs.get("dy_sum"))
    want = 4 + affine + (affine and relu) + dy_sum
    _need(len(ins) == want, "batch_norm_grad",
          f"{want} inputs for affine={affine}, act={attrs.get('act')}, dy_sum={dy_sum}, "
          f"got {len(ins)}")
    _need(dy.shape == x.shape, "batch_norm_grad", f"dy {dy.shape} vs x {x.shape}")
    if dy_sum:
        _need(ins[-1].shape == dy.shape and ins[-1].dtype == dy.dtype, "batch_norm_grad",
              f"dy2 {ins[-1]!r} must match dy {dy.shape} {dy.dtype}")
    c = (_channels("batch_norm_grad", x, attrs),)
    w = ins[2].dtype if affine else x.dtype      # dweight, dbias: the weight's dtype
    return [(x.shape, x.dtype)] + ([(c, w), (c, w)] if affine else [])


@vjp("batch_norm_train")
def _batch_norm_train_vjp(emit, node, dy, wants):
    a = node.attrs
    if a.get("residual"):
        raise NotImplementedError("batch_norm_train with a residual is made after autodiff "
                                  "(compile/fuse.py); it has no VJP")
    affine, act = bool(a["affine"]), a.get("act", "none")
    x, _, save_mean, save_invstd = node.inputs[0], *node.outputs
    ins = [dy[0], x] + ([node.inputs[1]] if affine else []) + [save_mean, save_invstd] + (
        [node.inputs[2]] if affine and act == "relu" else [])
    grads = emit("batch_norm_grad", ins, affine=affine, act=act, **layout_attrs(node))
    return grads + [None] * (len(node.inputs) - len(grads))   # running statistics: none


def _channel_view(v: np.ndarray, ndim: int) -> np.ndarray:
    """(C,) -> (1, C, 1, ...) broadcasting against an (N, C, *spatial) array."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _statistics(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean, biased var) per channel of an (N, C, *spatial) array, in float64."""
    axes = (0,) + tuple(range(2, x.ndim))
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=axes)
    return mean, np.square(x64 - _channel_view(mean, x.ndim)).mean(axis=axes)


def _normalised(x: np.ndarray, mean, var, eps: float, weight=None, bias=None) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) [* weight + bias] in float64."""
    y = (x.astype(np.float64) - _channel_view(mean, x.ndim)) * _channel_view(
        1.0 / np.sqrt(var + eps), x.ndim)
    if weight is not None:
        y = y * _channel_view(weight, x.ndim) + _channel_view(bias, x.ndim)
    return y


def _stored(y: np.ndarray, dtype: str) -> np.ndarray:
    """y as a node of IR dtype `dtype` stores it: float32, rounded for bfloat16 and float16."""
    return bf16.round_to(y, dtype)


def _update_running(running_mean, running_var, count, attrs, mean, var, shape) -> None:
    """num_batches_tracked += 1 and the running statistics' momentum update, in place."""
    count[...] += 1
    m = attrs["momentum"] if attrs["momentum"] is not None else 1.0 / int(count)
    n = _reduced_count(shape)
    running_mean[...] = (1 - m) * running_mean.astype(np.float64) + m * mean
    running_var[...] = (1 - m) * running_var.astype(np.float64) + m * var * n / (n - 1)


@impl("batch_norm_train")
@channels_last_capable
def _batch_norm_train_impl(node, ins, outs, ctx):
    a, x = node.attrs, ins[0]
    mean, var = _statistics(x)
    y = _normalised(x, mean, var, a["eps"], *((ins[1], ins[2]) if a["affine"] else ()))
    if a.get("residual"):        # the unfused graph's two stores: the normalised value, the sum
        dtype = node.inputs[0].dtype
        r = ins[residual_position(a)]
        if a.get("residual_norm"):     # the shortcut's BatchNorm output, as its node stores it
            # (its statistics recomputed in float64 from r, as that node's reference has them)
            r = _stored(_normalised(r, *_statistics(r), a["residual_eps"],
                                    *(ins[-2:] if a.get("residual_affine") else ())), dtype)
        y = _stored(y, dtype) + r.astype(np.float32)
    if a.get("act", "none") == "relu":
        y = np.maximum(y, 0.0)
    outs[0][...] = y
    outs[1][...] = mean
    outs[2][...] = 1.0 / np.sqrt(var + a["eps"])
    if a["track"]:
        _update_running(*(ins[i] for i in _running_positions(a)), a, mean, var, x.shape)


@impl("batch_norm_stats")
@channels_last_capable
def _batch_norm_stats_impl(node, ins, outs, ctx):
    a, x = node.attrs, ins[0]
    mean, var = _statistics(x)
    outs[0][...] = mean
    outs[1][...] = 1.0 / np.sqrt(var + a["eps"])
    if a["track"]:
        _update_running(ins[1], ins[2], ins[3], a, mean, var, x.shape)


def relu_mask(x, save_mean, save_invstd, weight=None, bias=None) -> np.ndarray:
    """Where the fused ReLU passed the gradient: z > 0 for the pre-activation z = (x - mean) *
    invstd [* weight + bias] in float32, each operation rounded once in the kernels' order
    (norm.cu bn_output; NumPy's float32 operations round to nearest and never contract into
    FMAs), so the mask is y > 0 of the forward kernels' y. A NaN z masks."""
    nd = x.ndim
    f32 = lambda v: _channel_view(np.asarray(v, np.float32), nd)     # noqa: E731
    z = (x.astype(np.float32) - f32(save_mean)) * f32(save_invstd)
    if weight is not None:
        z = z * f32(weight) + f32(bias)
    return z > 0


@impl("batch_norm_grad")
@channels_last_capable
def _batch_norm_grad_impl(node, ins, outs, ctx):
    a = node.attrs
    affine, relu = bool(a["affine"]), a.get("act", "none") == "relu"
    dy, x = ins[0].astype(np.float64), ins[1].astype(np.float64)
    if a.get("dy_sum"):          # the unfused add's store: the float32 sum, rounded to bf16
        dy = ins[0].astype(np.float32) + ins[-1].astype(np.float32)
        dy = bf16.round_to(dy, node.inputs[0].dtype).astype(np.float64)
    save_mean, save_invstd = ins[2 + affine], ins[3 + affine]
    if relu:
        dy = dy * relu_mask(ins[1], save_mean, save_invstd,
                            *((ins[2], ins[4 + affine]) if affine else ()))
    axes, nd = (0,) + tuple(range(2, x.ndim)), x.ndim
    invstd = save_invstd.astype(np.float64)
    xhat = (x - _channel_view(save_mean.astype(np.float64), nd)) * _channel_view(invstd, nd)
    sum_dy, sum_dy_xhat = dy.sum(axis=axes), (dy * xhat).sum(axis=axes)
    m = _reduced_count(x.shape)
    scale = invstd * (ins[2].astype(np.float64) if affine else 1.0) / m
    outs[0][...] = _channel_view(scale, nd) * (
        m * dy - _channel_view(sum_dy, nd) - xhat * _channel_view(sum_dy_xhat, nd))
    if affine:
        outs[1][...] = sum_dy_xhat
        outs[2][...] = sum_dy
