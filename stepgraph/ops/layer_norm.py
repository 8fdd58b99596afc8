"""LayerNorm family: normalisation over the last axis and its gradient (PyTorch's
F.layer_norm with normalized_shape = the last dim); RMSNorm (F.rms_norm over the last dim);
and the residual add fused before either (add_layer_norm, add_rms_norm), all made by
compile/norm_rewrite.py of what model files write.

x (any rank >= 1) is viewed as (rows, C). The statistics are saved for the backward. The
NumPy reference computes in float64 and casts once.
"""
from __future__ import annotations

import math

import numpy as np

from ..backends.numpy.bf16 import round_to
from ..ir.graph import HALF_DTYPES
from ..ir.ops import _need, defop, impl, vjp
from .dropout import dropped, keep_mask


def _rows(shape) -> int:
    return math.prod(shape[:-1])


def stats_dtype(dtype: str) -> str:
    """The dtype of the saved statistics: float32, or float64 for a float64 input (the NumPy
    reference's exact mode)."""
    return "float64" if dtype == "float64" else "float32"


@defop("layer_norm")
def _layer_norm(ins, attrs):
    """y = (x - mean) * rstd * weight + bias over the last axis of x (any rank >= 1; rows =
    the product of the leading dims); ins (x, [weight (C,) when attrs weight], [bias (C,)
    when attrs bias]); attrs eps. mean = the row mean, rstd = 1 / sqrt(biased var + eps).
    Outputs y (x.shape, x.dtype), mean (rows,), rstd (rows,) (float32; float64 for a float64
    x). Statistics in float32 with two passes (the NumPy reference in float64). After fusion
    y may be stored in bf16 (fuse_layer_norm_casts) and x read in bf16 beside float32
    parameters (compile/norm_casts.py), as layer_norm_grad's x."""
    x = ins[0]
    _need(len(x.shape) >= 1, "layer_norm", f"input must have rank >= 1, got {x.shape}")
    want = 1 + bool(attrs.get("weight")) + bool(attrs.get("bias"))
    _need(len(ins) == want, "layer_norm", f"{want} inputs for weight={attrs.get('weight')}, "
          f"bias={attrs.get('bias')}, got {len(ins)}")
    for v in ins[1:]:
        _need(v.shape == (x.shape[-1],) and v.dtype == x.dtype, "layer_norm",
              f"{v!r} must be ({x.shape[-1]},) {x.dtype} for input {x.shape}")
    stats = ((_rows(x.shape),), stats_dtype(x.dtype))
    return [(x.shape, x.dtype), stats, stats]


@defop("layer_norm_grad")
def _layer_norm_grad(ins, attrs):
    """Gradient of layer_norm. ins (dy, x, [weight when attrs weight], mean, rstd); attrs
    weight, bias as the forward's. xhat = (x - mean) * rstd, g = dy * weight (dy without
    weight); per row dx = rstd * (g - mean(g) - xhat * mean(g * xhat)). Outputs dx, then
    dweight = sum over rows of dy * xhat when attrs weight, dbias = sum over rows of dy when
    attrs bias, then dx rounded to attrs dx_half when given (_dx_half), then the column sum
    of that copy (or of dx) when attrs dx_sum (_dx_sum). dx itself may be stored in bfloat16
    / float16 for a float32 x (compile/norm_casts.py)."""
    ins = _without_half_mask("layer_norm_grad", ins, attrs)
    dy, x = ins[0], ins[1]
    weight, bias = bool(attrs.get("weight")), bool(attrs.get("bias"))
    _need(len(ins) == 4 + weight, "layer_norm_grad",
          f"{4 + weight} inputs for weight={weight}, got {len(ins)}")
    _need(dy.shape == x.shape, "layer_norm_grad", f"dy {dy.shape} vs x {x.shape}")
    c = (x.shape[-1],)
    return [(x.shape, x.dtype)] + [(c, x.dtype)] * (weight + bias) + _dx_half(x, attrs) + \
        _dx_sum(x, attrs)


def _dx_half(x, attrs) -> list:
    """The normalisation gradients' optional last output: dx rounded to attrs dx_half
    (bfloat16 or float16) as well as stored in x's float32, for the half GEMM that reads it
    beside a float32 reader (compile/norm_casts.py: the cast it replaces); with attrs
    dx_half_dropout = p, that copy then goes through the gradient of a dropout of keep mask
    ins[-1] (compile/norm_casts.py fuse_norm_grad_casts: the dropout_grad that read it)."""
    half = attrs.get("dx_half")
    if half is None:
        return []
    _need(half in HALF_DTYPES and x.dtype == "float32", "dx_half",
          f"a bfloat16 or float16 copy of a float32 dx, got {half} of {x.dtype}")
    return [(x.shape, half)]


def _dx_sum(x, attrs) -> list:
    """The normalisation gradients' optional very last output (attrs dx_sum): the sum over
    rows of the dx copy the node stores last (the dx_half copy, after its dropout, where there
    is one, else dx), in that copy's dtype: the bias gradient of the Linear whose output the
    norm's input was (compile/norm_casts.py fuse_norm_grad_bias_sums: the column sum that
    Linear's weight-gradient GEMM took of the copy it read)."""
    if not attrs.get("dx_sum"):
        return []
    return [((x.shape[-1],), attrs.get("dx_half") or x.dtype)]


def _without_half_mask(op: str, ins, attrs) -> list:
    """A normalisation gradient's inputs without the keep mask of attrs dx_half_dropout (its
    last input, a uint8 of dy's shape), after checking it."""
    if attrs.get("dx_half_dropout") is None:
        return list(ins)
    mask = ins[-1]
    _need(bool(attrs.get("dx_half")) and mask.dtype == "uint8" and mask.shape == ins[0].shape,
          op, f"dx_half_dropout needs a dx_half copy and a uint8 mask of dy's shape "
          f"{ins[0].shape}, got {mask!r}")
    return list(ins[:-1])


def _store_dx(node, outs, dx: np.ndarray, ins) -> None:
    """dx into outs[0], and into the dx_half copy when the node has one: rounded from the
    float32 dx, as the cast it replaces rounded it, then dropped by the keep mask (ins[-1])
    where attrs dx_half_dropout folds a dropout's gradient in; then, with attrs dx_sum, the
    stored copy's column sum into the last output, summed as reduce_sum sums it."""
    a = node.attrs
    outs, total = (outs[:-1], outs[-1]) if a.get("dx_sum") else (outs, None)
    outs[0][...] = dx
    if a.get("dx_half_dropout") is not None:
        half = round_to(outs[0], a["dx_half"])
        outs[-1][...] = dropped(half, ins[-1], a["dx_half_dropout"])
    elif a.get("dx_half"):
        outs[-1][...] = outs[0]
    if total is not None:       # the copy as stored (the backend rounds a half one after us)
        at = len(outs) - 1 if a.get("dx_half") else 0
        copy, dtype = outs[at], node.outputs[at].dtype
        if dtype in HALF_DTYPES:
            copy = round_to(copy, dtype)
        total[...] = copy.reshape(-1, copy.shape[-1]).sum(axis=0)


@vjp("layer_norm")
def _layer_norm_vjp(emit, node, dy, wants) -> list:
    weight, bias = bool(node.attrs.get("weight")), bool(node.attrs.get("bias"))
    x, (_, mean, rstd) = node.inputs[0], node.outputs
    ins = [dy[0], x] + ([node.inputs[1]] if weight else []) + [mean, rstd]
    return emit("layer_norm_grad", ins, weight=weight, bias=bias)


@impl("layer_norm")
def _layer_norm_impl(node, ins, outs, ctx):
    a, x = node.attrs, ins[0].astype(np.float64)
    rest = list(ins[1:])
    mean = x.mean(axis=-1, keepdims=True)
    var = np.square(x - mean).mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + a["eps"])
    y = (x - mean) * rstd
    if a.get("weight"):
        y = y * rest.pop(0)
    if a.get("bias"):
        y = y + rest.pop(0)
    outs[0][...] = y
    outs[1][...] = mean.reshape(-1)
    outs[2][...] = rstd.reshape(-1)


@impl("layer_norm_grad")
def _layer_norm_grad_impl(node, ins, outs, ctx):
    grads = _without_half_mask(node.op, ins, node.attrs)
    _store_dx(node, outs, _layer_norm_grads(node, grads, outs), ins)


def _layer_norm_grads(node, ins, outs) -> np.ndarray:
    """dweight and dbias into outs (as attrs ask); dx returned in float64."""
    a = node.attrs
    weight, bias = bool(a.get("weight")), bool(a.get("bias"))
    dy, x = ins[0].astype(np.float64), ins[1].astype(np.float64)
    c = x.shape[-1]
    mean = ins[-2].astype(np.float64).reshape(x.shape[:-1] + (1,))
    rstd = ins[-1].astype(np.float64).reshape(x.shape[:-1] + (1,))
    xhat = (x - mean) * rstd
    g = dy * ins[2].astype(np.float64) if weight else dy
    rest = list(outs[1:])
    if weight:
        rest.pop(0)[...] = (dy * xhat).reshape(-1, c).sum(axis=0)
    if bias:
        rest.pop(0)[...] = dy.reshape(-1, c).sum(axis=0)
    return rstd * (g - g.mean(axis=-1, keepdims=True)
                   - xhat * (g * xhat).mean(axis=-1, keepdims=True))


# ---- residual add + LayerNorm (made only by compile/norm_rewrite.py) -----------------------

def _stored(v: np.ndarray, dtype: str) -> np.ndarray:
    """float64 v as a node storing IR dtype `dtype` holds it, widened back to float64: the
    unfused add's rounding of the residual sum, which the LayerNorm then reads."""
    if dtype == "float64":
        return v
    return round_to(v.astype(np.float32), dtype).astype(np.float64)


@defop("add_layer_norm")
def _add_layer_norm(ins, attrs):
    """s = a + b (stored in a's dtype, as the add it replaces stores it) and y = layer_norm(s)
    in one op: compile/norm_rewrite.py makes it of a residual add whose sum a LayerNorm reads
    (pre-norm transformer blocks: x = x + f(ln(x))). ins (a, b, [weight], [bias]); a and b of
    one shape and dtype, or a float32 and b bfloat16 / float16, widened exactly as it is read
    (precision="bf16": the cast to float32 that autocast put between the residual branch's
    bf16 output and the float32 residual add, folded in by the rewrite); attrs eps, weight,
    bias as layer_norm's. Outputs y, mean, rstd as layer_norm's of s, then s (a.shape,
    a.dtype): the residual stream that the next add and the backward read.
        With attrs dropout = p (and seed, site: compile/norm_rewrite.py folds in the dropout
    that only the add read, x + dropout(h)), b is first dropped as that dropout op dropped it
    (the same keep mask and rounding, stored in b's dtype); the step counter (int64 scalar)
    is then the last input and the uint8 keep mask of b's shape the last output."""
    ins, mask = _dropout_operands("add_layer_norm", ins, attrs)
    _check_residual("add_layer_norm", ins[0], ins[1])
    return _layer_norm([ins[0], *ins[2:]], attrs) + [(ins[0].shape, ins[0].dtype)] + mask


def _check_residual(op: str, a, b) -> None:
    """A residual add's operands: one shape and dtype, or a float32 a and a half b."""
    widened = a.dtype == "float32" and b.dtype in HALF_DTYPES
    _need(a.shape == b.shape and (a.dtype == b.dtype or widened), op,
          f"a {a.shape} {a.dtype} and b {b.shape} {b.dtype} must match (or a float32 and b "
          f"bfloat16 / float16)")


def _dropout_operands(op: str, ins, attrs) -> tuple[list, list]:
    """An add_<norm>'s inputs without the step counter of attrs dropout, and the keep mask's
    output spec ([] without dropout)."""
    p = attrs.get("dropout")
    if p is None:
        return list(ins), []
    _need(0.0 < float(p) < 1.0 and "seed" in attrs and "site" in attrs, op,
          f"dropout needs 0 < p < 1, a seed and a site, got {attrs}")
    step = ins[-1]
    _need(step.dtype == "int64" and step.shape == (), op,
          f"the last input must be the int64 step counter, got {step!r}")
    return list(ins[:-1]), [(ins[1].shape, "uint8")]


def _sum_at(node) -> int:
    """Where an add_<norm>'s residual stream s is among its outputs: last, or before the keep
    mask of attrs dropout."""
    return -2 if node.attrs.get("dropout") is not None else -1


@defop("add_layer_norm_grad")
def _add_layer_norm_grad(ins, attrs):
    """Gradient of add_layer_norm when both y and s have one: ins (dy, s, [weight], mean,
    rstd, ds), attrs weight, bias. dx = layer_norm_grad's dx of dy plus ds (the gradient the
    residual stream brings: the sum autodiff would add after the LayerNorm's gradient), the
    sum rounded once to s's dtype; dx is the gradient of a and of b. Then dweight, dbias,
    the dx_half copy and its column sum as layer_norm_grad's."""
    return _residual_grad("add_layer_norm_grad", ins, attrs, _layer_norm_grad, 5)


def _residual_grad(op: str, ins, attrs, norm_grad, least: int) -> list:
    """The outputs of an add_<norm>_grad: its norm's gradient (norm_grad) of ins without ds,
    which must have s's shape (the last input, or the one before dx_half_dropout's mask); at
    least `least` inputs besides that mask."""
    grads = _without_half_mask(op, ins, attrs)
    _need(len(grads) >= least, op, f"at least {least} inputs, got {len(grads)}")
    ds, x = grads[-1], grads[1]
    _need(ds.shape == x.shape, op, f"ds {ds.shape} vs s {x.shape}")
    return norm_grad(grads[:-1] + list(ins[len(grads):]), attrs)


def _residual_vjp(emit, node, dy, wants, norm: str, attrs: dict) -> list:
    """The VJP of add_<norm> (outputs y, its statistics, s[, mask]): dy of y and ds of s make
    one add_<norm>_grad (<norm>_grad without ds, ds itself without dy); a's and b's gradient
    is the same value, cast to b's dtype where b is a widened half (what the folded cast's
    VJP did), then through dropout_grad where attrs dropout dropped b (the folded dropout's
    VJP). attrs: the gradient op's (weight, [bias])."""
    p, at = node.attrs.get("dropout"), _sum_at(node)
    y_grad, ds = dy[0], dy[at]
    b, s, stats = node.inputs[1], node.outputs[at], node.outputs[1:at]
    step = [] if p is None else [None]

    def of_b(g):
        if not wants(1):
            return None
        if g.dtype != b.dtype:
            g = emit("cast", [g], dtype=b.dtype)[0]
        if p is not None:
            g = emit("dropout_grad", [g, node.outputs[-1]], p=p, per_channel=False)[0]
        return g
    params = sum(map(bool, attrs.values()))
    if y_grad is None:
        return [ds, of_b(ds)] + [None] * params + step
    ins = [y_grad, s] + ([node.inputs[2]] if attrs["weight"] else []) + list(stats)
    if ds is None:
        grads = emit(f"{norm}_grad", ins, **attrs)
    else:
        grads = emit(f"add_{norm}_grad", ins + [ds], **attrs)
    return [grads[0], of_b(grads[0]), *grads[1:]] + step


@vjp("add_layer_norm")
def _add_layer_norm_vjp(emit, node, dy, wants) -> list:
    return _residual_vjp(emit, node, dy, wants, "layer_norm",
                         {"weight": bool(node.attrs.get("weight")),
                          "bias": bool(node.attrs.get("bias"))})


@impl("add_layer_norm")
def _add_layer_norm_impl(node, ins, outs, ctx):
    _residual_impl(node, ins, outs, ctx, _layer_norm_impl)


@impl("add_layer_norm_grad")
def _add_layer_norm_grad_impl(node, ins, outs, ctx):
    _residual_grad_impl(node, ins, outs, _layer_norm_grads)


def _residual_grad_impl(node, ins, outs, norm_grads) -> None:
    """An add_<norm>_grad's reference: its norm's dx (norm_grads) plus ds in float64, stored
    once."""
    grads = _without_half_mask(node.op, ins, node.attrs)
    _store_dx(node, outs, norm_grads(node, grads[:-1], outs) + grads[-1].astype(np.float64),
              ins)


def _residual_impl(node, ins, outs, ctx, norm_impl) -> None:
    """An add_<norm>'s reference: b dropped as the folded dropout dropped it (attrs dropout;
    its keep mask into the last output), s = a + b as the add stored it, then the norm's
    reference (norm_impl) of s into the outputs before s."""
    p = node.attrs.get("dropout")
    b = ins[1].astype(np.float64)
    if p is not None:
        ins, step, mask, outs = ins[:-1], ins[-1], outs[-1], outs[:-1]
        mask[...] = keep_mask(mask.shape, p, node.attrs, step)
        b = _stored(dropped(ins[1], mask, p).astype(np.float64), node.inputs[1].dtype)
    s = _stored(ins[0].astype(np.float64) + b, node.outputs[_sum_at(node)].dtype)
    outs[-1][...] = s
    norm_impl(node, [s, *ins[2:]], outs[:-1], ctx)


# ---- RMSNorm (made only by compile/norm_rewrite.py, of the form model files write) ---------

@defop("rms_norm")
def _rms_norm(ins, attrs):
    """y = x * rstd [* weight] over the last axis of x (rank >= 1); ins (x, [weight (C,)
    when attrs weight]); attrs eps (> 0). rstd = 1 / sqrt(mean(x^2) + eps) per row. Outputs
    y (x.shape, x.dtype) and rstd (rows,) (float32; float64 for a float64 x)."""
    x = ins[0]
    _need(len(x.shape) >= 1, "rms_norm", f"input must have rank >= 1, got {x.shape}")
    weight = bool(attrs.get("weight"))
    _need(len(ins) == 1 + weight, "rms_norm",
          f"{1 + weight} inputs for weight={weight}, got {len(ins)}")
    _need(float(attrs["eps"]) > 0.0, "rms_norm", f"eps must be positive, got {attrs['eps']}")
    if weight:
        _need(ins[1].shape == (x.shape[-1],) and ins[1].dtype == x.dtype, "rms_norm",
              f"{ins[1]!r} must be ({x.shape[-1]},) {x.dtype} for input {x.shape}")
    return [(x.shape, x.dtype), ((_rows(x.shape),), stats_dtype(x.dtype))]


@defop("rms_norm_grad")
def _rms_norm_grad(ins, attrs):
    """Gradient of rms_norm. ins (dy, x, [weight when attrs weight], rstd). xhat = x * rstd,
    g = dy * weight (dy without weight); per row dx = rstd * (g - xhat * mean(g * xhat)).
    Outputs dx (x.shape, x.dtype), then dweight = sum over rows of dy * xhat when attrs
    weight, then the dx_half copy and its column sum as layer_norm_grad's."""
    ins = _without_half_mask("rms_norm_grad", ins, attrs)
    dy, x = ins[0], ins[1]
    weight = bool(attrs.get("weight"))
    _need(len(ins) == 3 + weight, "rms_norm_grad",
          f"{3 + weight} inputs for weight={weight}, got {len(ins)}")
    _need(dy.shape == x.shape, "rms_norm_grad", f"dy {dy.shape} vs x {x.shape}")
    return [(x.shape, x.dtype)] + [((x.shape[-1],), x.dtype)] * weight + \
        _dx_half(x, attrs) + _dx_sum(x, attrs)


@vjp("rms_norm")
def _rms_norm_vjp(emit, node, dy, wants) -> list:
    weight = bool(node.attrs.get("weight"))
    ins = [dy[0], node.inputs[0]] + node.inputs[1:1 + weight] + [node.outputs[1]]
    return emit("rms_norm_grad", ins, weight=weight)


def _rstd(x: np.ndarray, eps: float) -> np.ndarray:
    return 1.0 / np.sqrt(np.square(x).mean(axis=-1, keepdims=True) + eps)


@impl("rms_norm")
def _rms_norm_impl(node, ins, outs, ctx):
    x = ins[0].astype(np.float64)
    rstd = _rstd(x, float(node.attrs["eps"]))
    y = x * rstd
    if node.attrs.get("weight"):
        y = y * ins[1].astype(np.float64)
    outs[0][...] = y
    outs[1][...] = rstd.reshape(-1)


@impl("rms_norm_grad")
def _rms_norm_grad_impl(node, ins, outs, ctx):
    grads = _without_half_mask(node.op, ins, node.attrs)
    _store_dx(node, outs, _rms_norm_grads(node, grads, outs), ins)


def _rms_norm_grads(node, ins, outs) -> np.ndarray:
    """dweight into outs[1] (when attrs weight); dx returned in float64."""
    weight = bool(node.attrs.get("weight"))
    dy, x = ins[0].astype(np.float64), ins[1].astype(np.float64)
    c = x.shape[-1]
    rstd = ins[-1].astype(np.float64).reshape(x.shape[:-1] + (1,))
    xhat = x * rstd
    g = dy * ins[2].astype(np.float64) if weight else dy
    if weight:
        outs[1][...] = (dy * xhat).reshape(-1, c).sum(axis=0)
    return rstd * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))


# ---- residual add + RMSNorm (made only by compile/norm_rewrite.py) -------------------------

@defop("add_rms_norm")
def _add_rms_norm(ins, attrs):
    """s = a + b and y = rms_norm(s) in one op, as add_layer_norm is for a LayerNorm (the
    residual add of a pre-norm block whose sum an RMSNorm reads: LLaMA-style models). ins (a,
    b, [weight]), a and b as add_layer_norm's; attrs eps, weight as rms_norm's. Outputs y,
    rstd as rms_norm's of s, then s (a.shape, a.dtype); attrs dropout as add_layer_norm's."""
    ins, mask = _dropout_operands("add_rms_norm", ins, attrs)
    _check_residual("add_rms_norm", ins[0], ins[1])
    return _rms_norm([ins[0], *ins[2:]], attrs) + [(ins[0].shape, ins[0].dtype)] + mask


@defop("add_rms_norm_grad")
def _add_rms_norm_grad(ins, attrs):
    """Gradient of add_rms_norm when both y and s have one: ins (dy, s, [weight], rstd, ds),
    attrs weight. dx = rms_norm_grad's dx of dy plus ds, rounded once to s's dtype; then
    dweight, the dx_half copy and its column sum as rms_norm_grad's."""
    return _residual_grad("add_rms_norm_grad", ins, attrs, _rms_norm_grad, 4)


@vjp("add_rms_norm")
def _add_rms_norm_vjp(emit, node, dy, wants) -> list:
    return _residual_vjp(emit, node, dy, wants, "rms_norm",
                         {"weight": bool(node.attrs.get("weight"))})


@impl("add_rms_norm")
def _add_rms_norm_impl(node, ins, outs, ctx):
    _residual_impl(node, ins, outs, ctx, _rms_norm_impl)


@impl("add_rms_norm_grad")
def _add_rms_norm_grad_impl(node, ins, outs, ctx):
    _residual_grad_impl(node, ins, outs, _rms_norm_grads)
