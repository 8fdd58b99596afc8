"""Attention family: scaled dot-product attention in one op (`sdpa`) and its gradient
(`sdpa_grad`), what F.scaled_dot_product_attention records and what hand-written attention
becomes (compile/attention_rewrite.py).

The op means exactly what the composed path means (bmm(q, k^T), softmax(scale, causal, an
optional additive mask), the dropout op on the (..., L, S) probabilities, bmm with v),
dropout mask included: element (n, i, j) of the probabilities, n the flattened leading index,
is kept by the dropout op's Philox rule at flat index (n * L + i) * S + j of that tensor, with
the node's seed, site and the step counter input (rng.py). The CUDA kernels never hold the
(L, S) scores in memory: they save each query row's logsumexp instead and recompute the
probabilities from it in the backward, where the NumPy reference does the same.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ..ir.graph import FLOAT_DTYPES
from ..ir.ops import _need, defop, impl, vjp
from .dropout import keep_mask
from .pointwise import input_views, read_through
from .shape import view_fits
from .softmax import causal_mask

MAX_HEAD_DIM = 128          # the CUDA kernels' widest head (templates for 32, 64, 96 and 128)

# ---- layouts: operands read through views, results written permuted ------------------------
# compile/attention_views.py lets sdpa and sdpa_grad read a slice or permute of a value in
# place (attrs views: per input None or (shape, strides, offset) over the input's elements,
# as pointwise programs read them, ops/pointwise.py) and write a result straight into the
# permute that read it (attrs out_perms: per output None or that permute's dims; the output
# then holds the result so permuted). Every path of the CUDA backend walks any strides with
# contiguous columns, so neither costs a copy.
VIEW_INPUTS = {"sdpa": 3, "sdpa_grad": 5}      # q, k, v; dout, q, k, v, out
PERMUTED_OUTPUTS = {"sdpa": 1, "sdpa_grad": 3}  # out; dq, dk, dv


def collapsed_stride(shape: tuple, strides: tuple) -> int | None:
    """The element stride of the flattened index over dims `shape` (dims of 1 ignored), or
    None where they do not collapse into one stride: the kernels take an operand's leading
    dims as one batch stride and a head stride (backends/cuda/attention/attention.py)."""
    stride = span = None
    for n, s in zip(reversed(shape), reversed(strides)):
        if n == 1:
            continue
        if stride is None:
            stride = s
        elif s != span:
            return None
        span = s * n
    return 0 if stride is None else stride


class Seen(NamedTuple):
    """An input as the op reads it (its view's shape)."""
    shape: tuple
    dtype: str


def seen_inputs(op: str, ins, attrs) -> list:
    """The inputs as the op reads them: attrs views entries in place of their inputs."""
    views = input_views(attrs, len(ins))
    _need(len(views) == len(ins), op, f"attrs views has {len(views)} entries for {len(ins)} "
          "inputs")
    for i, (x, view) in enumerate(zip(ins, views)):
        _need(view is None or (i < VIEW_INPUTS.get(op, 0) and view_fits(view, x.size)), op,
              f"input {i} {x.shape} cannot be read through the view {view}")
    return [x if view is None else Seen(tuple(view[0]), x.dtype) for x, view in zip(ins, views)]


def out_perms(op: str, attrs, n: int) -> tuple:
    """attrs out_perms, one entry an output (None: the op's own layout)."""
    perms = tuple(attrs.get("out_perms") or ())
    _need(len(perms) <= min(n, PERMUTED_OUTPUTS.get(op, 0)), op,
          f"out_perms {perms} for {n} outputs")
    return perms + (None,) * (n - len(perms))


def unpermuted(shape: tuple, perm) -> tuple:
    """The shape whose transpose by perm is `shape`."""
    return shape if perm is None else tuple(shape[list(perm).index(i)] for i in range(len(perm)))


def _permuted(op: str, specs: list, attrs) -> list:
    out = []
    for (shape, dtype), perm in zip(specs, out_perms(op, attrs, len(specs))):
        if perm is not None:
            _need(sorted(perm) == list(range(len(shape))) and perm[-1] == len(shape) - 1, op,
                  f"out_perms entry {perm} is not a permutation of {len(shape)} axes keeping "
                  "the last")
            shape = tuple(shape[d] for d in perm)
        out.append((shape, dtype))
    return out


def in_layouts(reference):
    """The reference of sdpa or sdpa_grad run on its inputs read through their views, into
    results of the op's own layout, then written permuted where attrs out_perms says."""
    @functools.wraps(reference)
    def run(node, ins, outs, ctx):
        ins = [read_through(view, a) for view, a in zip(input_views(node.attrs, len(ins)), ins)]
        perms = out_perms(node.op, node.attrs, len(outs))
        own = [o if p is None else np.empty(unpermuted(o.shape, p), o.dtype)
               for o, p in zip(outs, perms)]
        reference(node, ins, own, ctx)
        for o, r, p in zip(outs, own, perms):
            if p is not None:
                o[...] = r.transpose(p)
    return run


def lse_dtype(dtype: str) -> str:
    """The dtype of the saved logsumexp rows: float32, float64 for float64 inputs (the NumPy
    reference's exact mode)."""
    return "float64" if dtype == "float64" else "float32"


def group_of(q_shape: tuple, k_shape: tuple) -> int | None:
    """Query heads per key/value head (grouped-query attention: q (..., Hq, L, E), k and v
    (..., Hkv, S, E) with Hq = group * Hkv, query head h reading kv head h // group, as
    torch's enable_gqa repeat_interleave's k and v); 1 for equal leading dims; None where the
    leading dims fit neither way."""
    if q_shape[:-2] == k_shape[:-2]:
        return 1
    if len(q_shape) < 3 or len(q_shape) != len(k_shape) or q_shape[:-3] != k_shape[:-3] \
            or k_shape[-3] < 1 or q_shape[-3] % k_shape[-3]:
        return None
    return q_shape[-3] // k_shape[-3]


def _check_qkv(op: str, q, k, v, attrs) -> None:
    _need(len(q.shape) >= 2 and len(q.shape) == len(k.shape) == len(v.shape), op,
          f"q, k, v must be (..., rows, dim) of one rank, got {q.shape}, {k.shape}, {v.shape}")
    _need(k.shape[:-2] == v.shape[:-2] and group_of(q.shape, k.shape) is not None, op,
          f"q, k, v must share their leading dims (or q's heads be a multiple of k and v's, "
          f"grouped-query attention), got {q.shape}, {k.shape}, {v.shape}")
    _need(q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2], op,
          f"q {q.shape}, k {k.shape}, v {v.shape} do not fit together")
    _need(q.shape[-2] >= 1 and k.shape[-2] >= 1, op,
          f"needs at least one query and one key, got q {q.shape}, k {k.shape}")
    _need(max(q.shape[-1], v.shape[-1]) <= MAX_HEAD_DIM, op,
          f"head dims up to {MAX_HEAD_DIM}, got q {q.shape}, v {v.shape}")
    _need(q.dtype == k.dtype == v.dtype and q.dtype in FLOAT_DTYPES, op,
          f"q, k, v must be one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _need(not attrs.get("causal") or q.shape[-2] <= k.shape[-2], op,
          f"causal needs rows <= keys (else whole rows are masked), got q {q.shape}, "
          f"k {k.shape}")
    p = float(attrs.get("dropout_p", 0.0))
    _need(0.0 <= p < 1.0, op, f"dropout_p must be in [0, 1), got {p}")


def _check_mask(op: str, ins, first: int, attrs, q, k) -> int:
    """The index after the operands and the optional additive mask (at `first`), checking
    that the mask broadcasts to the (..., L, S) scores of q and k."""
    if not attrs.get("mask"):
        return first
    _need(len(ins) > first, op, "attrs mask=True needs the mask input after q, k, v")
    mask = ins[first]
    scores = q.shape[:-1] + (k.shape[-2],)
    fits = len(mask.shape) <= len(scores) and all(
        m in (1, s) for m, s in zip(mask.shape[::-1], scores[::-1]))
    _need(fits and mask.dtype in FLOAT_DTYPES, op,
          f"the mask must be float and broadcast to the scores {scores}, got {mask!r}")
    return first + 1


def _check_step(op: str, ins, first: int, attrs, q=None, k=None) -> None:
    first = _check_mask(op, ins, first, attrs, q, k)
    dropout = float(attrs.get("dropout_p", 0.0)) > 0.0
    _need(len(ins) == first + dropout, op,
          f"{first + dropout} inputs (the step counter with dropout_p > 0), got {len(ins)}")
    if dropout:
        _need(ins[-1].shape == () and ins[-1].dtype == "int64", op,
              f"the step counter must be an int64 scalar, got {ins[-1]!r}")


@defop("sdpa")
def _sdpa(ins, attrs):
    """out (..., L, Ev) = dropout(softmax(scale * q @ k^T + M)) @ v; ins q (..., L, E),
    k (..., S, E), v (..., S, Ev) of one float dtype and the same leading dims (or grouped
    heads: q (..., Hq, L, E), k and v (..., Hkv, S, .) with Hq a multiple of Hkv, query head
    h reading kv head h // (Hq / Hkv), group_of), E, Ev <= MAX_HEAD_DIM (128), L, S >= 1,
    then with attrs mask=True an additive float mask broadcasting to (..., L, S) of q's
    leading dims (no gradient: F.scaled_dot_product_attention and
    compile/attention_rewrite.py give it only masks that need none), then the int64 step
    counter when dropout_p > 0. attrs scale (float), causal (bool: M = -inf where key j >
    query i + (S - L), L <= S; otherwise 0; plus the mask where given). A row the mask
    blocks wholly (-inf at every key) gives out 0, lse -inf and no gradient, as torch's
    scaled_dot_product_attention gives (its safe softmax; softmax alone gives NaN there),
    dropout_p (float in [0, 1), default 0), and with dropout_p > 0 seed and site: the
    probabilities are dropped as the dropout op drops a (..., L, S) tensor of its own (mask
    from Philox at the element's flat index, survivors scaled by 1 / (1 - dropout_p)).
    Outputs out and lse (..., L) = logsumexp over keys of scale * q @ k^T + M (float32;
    float64 for float64 inputs), which sdpa_grad reads."""
    ins = seen_inputs("sdpa", ins, attrs)
    q, k, v = ins[:3]
    _check_qkv("sdpa", q, k, v, attrs)
    _check_step("sdpa", ins, 3, attrs, q, k)
    return _permuted("sdpa", [(q.shape[:-1] + (v.shape[-1],), q.dtype),
                              (q.shape[:-1], lse_dtype(q.dtype))], attrs)


@defop("sdpa_grad")
def _sdpa_grad(ins, attrs):
    """dq, dk, dv of sdpa; ins (dout, q, k, v, out, lse [, mask] [, step]) with the forward's
    attrs; with grouped heads dk and dv sum over the query heads of their kv head.
    P = exp(scale * q @ k^T + M - lse) (0 where masked, and in wholly blocked rows),
    K = keep mask / (1 - dropout_p)
    (1 without dropout), dP = (dout @ v^T) * K, D = rowsum(dP * P) (= rowsum(dout * out),
    which the CUDA kernels sum); dS = P * (dP - D);
    dq = scale * dS @ k, dk = scale * dS^T @ q, dv = (P * K)^T @ dout."""
    ins = seen_inputs("sdpa_grad", ins, attrs)
    dout, q, k, v, out, lse = ins[:6]
    _check_qkv("sdpa_grad", q, k, v, attrs)
    _check_step("sdpa_grad", ins, 6, attrs, q, k)
    want = q.shape[:-1] + (v.shape[-1],)
    _need(dout.shape == want and out.shape == want, "sdpa_grad",
          f"dout {dout.shape} and out {out.shape} must be {want}")
    _need(lse.shape == q.shape[:-1], "sdpa_grad", f"lse {lse.shape} must be {q.shape[:-1]}")
    return _permuted("sdpa_grad", [(q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype)],
                     attrs)


@vjp("sdpa")
def _sdpa_vjp(emit, node, dy, wants) -> list:
    _need(not node.attrs.get("views") and not node.attrs.get("out_perms"), "sdpa",
          "the gradient of an sdpa reading views or writing permuted (a rewrite of the "
          "differentiated graph) is not defined")
    q, k, v = node.inputs[:3]
    out, lse = node.outputs
    rest = node.inputs[3:]              # the mask (no gradient) and the step counter
    grads = emit("sdpa_grad", [dy[0], q, k, v, out, lse] + rest, **node.attrs)
    return list(grads) + [None] * len(rest)


# ---- NumPy reference: the composed path's arithmetic, op for op -----------------------------

def _as_3d(x: np.ndarray) -> np.ndarray:
    return x.reshape((-1,) + x.shape[-2:])


def _scores(node, q: np.ndarray, k: np.ndarray, extra: list, lead: tuple) -> np.ndarray:
    """scale * q @ k^T (+ the mask, the first of `extra` with attrs mask, broadcast over the
    leading dims `lead` of the unflattened q) with -inf where the causal mask hides (the
    softmax op's input)."""
    x = np.matmul(q, k.transpose(0, 2, 1))
    scale = node.attrs.get("scale", 1.0)
    if scale != 1.0:
        x = x * x.dtype.type(scale)
    if node.attrs.get("mask"):
        x = x + _as_3d(np.broadcast_to(extra[0], lead + x.shape[-2:])).astype(x.dtype)
    if node.attrs.get("causal"):
        x = np.where(causal_mask(*x.shape[-2:]), x.dtype.type(-np.inf), x)
    return x


def step_of(node, extra: list):
    """The step counter among the inputs after q, k, v (and out, lse): 0 without dropout."""
    rest = extra[1:] if node.attrs.get("mask") else extra
    return rest[0] if rest else 0


def dropout_keep(node, shape: tuple, dtype, step) -> np.ndarray | None:
    """The kept-and-scaled factor (mask / (1 - p), of `dtype`) of the (n, L, S) probabilities,
    as the dropout op draws it; None without dropout."""
    p = float(node.attrs.get("dropout_p", 0.0))
    if p == 0.0:
        return None
    return keep_mask(shape, p, node.attrs, step) * np.dtype(dtype).type(1.0 / (1.0 - p))


def _kv_heads(q: np.ndarray, x: np.ndarray) -> np.ndarray:
    """k or v with each kv head repeated for the query heads of its group (the reference
    may copy; the CUDA kernels index kv head h // group instead)."""
    group = group_of(q.shape, x.shape)
    return x if group == 1 else np.repeat(x, group, axis=-3)


def _kv_grad(g: np.ndarray, shape: tuple) -> np.ndarray:
    """The gradient of repeated kv heads summed back over each group: `shape` (k's or v's)."""
    if g.shape == shape:
        return g
    return g.reshape(shape[:-2] + (-1,) + shape[-2:]).sum(axis=-3)


def _blocked(lse: np.ndarray) -> np.ndarray:
    """The rows (..., 1) whose every key is masked: lse -inf."""
    return lse == -np.inf


@impl("sdpa")
@in_layouts
def _sdpa_impl(node, ins, outs, ctx):
    q = _as_3d(ins[0])
    k, v = (_as_3d(_kv_heads(ins[0], x)) for x in ins[1:3])
    x = _scores(node, q, k, list(ins[3:]), ins[0].shape[:-2])
    m = x.max(axis=-1, keepdims=True)
    blocked = _blocked(m)
    e = np.exp(x - np.where(blocked, 0.0, m))          # 0 across a wholly blocked row
    total = e.sum(axis=-1, keepdims=True)
    p = e / np.where(blocked, 1.0, total)
    keep = dropout_keep(node, p.shape, p.dtype, step_of(node, list(ins[3:])))
    if keep is not None:
        p = p * keep
    outs[0][...] = np.matmul(p, v).reshape(outs[0].shape)
    outs[1][...] = np.where(blocked, -np.inf, m + np.log(total)).reshape(outs[1].shape)


@impl("sdpa_grad")
@in_layouts
def _sdpa_grad_impl(node, ins, outs, ctx):
    dout, q = _as_3d(ins[0]), _as_3d(ins[1])
    k, v = (_as_3d(_kv_heads(ins[1], x)) for x in ins[2:4])
    lse = ins[5].reshape(q.shape[:2] + (1,)).astype(q.dtype)
    blocked = _blocked(lse)
    # exp(s - lse) carries lse's rounding (|lse| * eps, large for large scores) as one factor
    # per row, so the rows sum to 1 + delta; D = rowsum(dP * P) then picks up delta * D, which
    # dq and dk amplify. Renormalising removes the factor (the CUDA kernels take D from
    # rowsum(dout * out) instead, which the forward normalised exactly).
    p = np.exp(_scores(node, q, k, list(ins[6:]), ins[1].shape[:-2])
               - np.where(blocked, 0.0, lse))
    p = np.where(blocked, 0.0, p)                       # no gradient through a blocked row
    p /= np.where(blocked, 1.0, p.sum(axis=-1, keepdims=True))
    keep = dropout_keep(node, p.shape, p.dtype, step_of(node, list(ins[6:])))
    dp = np.matmul(dout, v.transpose(0, 2, 1))
    kept = p
    if keep is not None:
        dp, kept = dp * keep, p * keep
    # D as the softmax gradient sums it, rowsum(dP * P): equal to rowsum(dout * out), and
    # exactly dP where a row has one key (the gradients of q and k then vanish exactly).
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    scale = q.dtype.type(node.attrs.get("scale", 1.0))
    q_lead = ins[1].shape[:-2]
    outs[0][...] = (np.matmul(ds, k) * scale).reshape(outs[0].shape)
    dk = (np.matmul(ds.transpose(0, 2, 1), q) * scale).reshape(q_lead + k.shape[-2:])
    dv = np.matmul(kept.transpose(0, 2, 1), dout).reshape(q_lead + v.shape[-2:])
    outs[1][...] = _kv_grad(dk, outs[1].shape)
    outs[2][...] = _kv_grad(dv, outs[2].shape)


# ---- packed heads: what compile/attention.py rewrites a GPT's attention into ----------------

def _check_packed(op: str, qkv, attrs) -> tuple:
    """(lead, T, heads, head dim) of a packed (..., T, 3 * heads * D) projection."""
    heads = int(attrs.get("heads", 0))
    _need(len(qkv.shape) >= 2 and heads >= 1 and qkv.shape[-1] % (3 * heads) == 0, op,
          f"qkv must be (..., T, 3 * heads * D) with heads = {heads}, got {qkv.shape}")
    d = qkv.shape[-1] // (3 * heads)
    _need(qkv.shape[-2] >= 1 and 1 <= d <= MAX_HEAD_DIM, op,
          f"needs T >= 1 and a head dim in [1, {MAX_HEAD_DIM}], got {qkv.shape} with {heads} "
          f"heads")
    _need(qkv.dtype in FLOAT_DTYPES, op, f"qkv must be float, got {qkv.dtype}")
    _need(not attrs.get("mask"), op, "packed heads take no mask")
    p = float(attrs.get("dropout_p", 0.0))
    _need(0.0 <= p < 1.0, op, f"dropout_p must be in [0, 1), got {p}")
    return qkv.shape[:-2], qkv.shape[-2], heads, d


@defop("sdpa_qkv")
def _sdpa_qkv(ins, attrs):
    """sdpa on heads packed as a projection lays them out: ins qkv (..., T, 3 * H * D) [,
    step]; attrs heads (H) and sdpa's. q, k, v = the three thirds of the last axis, each
    viewed (..., T, H, D) and moved to (..., H, T, D); out = sdpa(q, k, v) moved back and
    flattened to (..., T, H * D); lse (..., H, T) as sdpa's (dropout indices included)."""
    lead, t, heads, d = _check_packed("sdpa_qkv", ins[0], attrs)
    _check_step("sdpa_qkv", ins, 1, attrs)
    return [(lead + (t, heads * d), ins[0].dtype), (lead + (heads, t), lse_dtype(ins[0].dtype))]


@defop("sdpa_qkv_grad")
def _sdpa_qkv_grad(ins, attrs):
    """dqkv (qkv's shape: dq, dk, dv side by side as qkv holds q, k, v) of sdpa_qkv; ins
    (dout (..., T, H * D), qkv, out, lse [, step]) with the forward's attrs."""
    dout, qkv, out, lse = ins[:4]
    lead, t, heads, d = _check_packed("sdpa_qkv_grad", qkv, attrs)
    _check_step("sdpa_qkv_grad", ins, 4, attrs)
    _need(dout.shape == out.shape == lead + (t, heads * d) and lse.shape == lead + (heads, t),
          "sdpa_qkv_grad", f"dout {dout.shape}, out {out.shape}, lse {lse.shape} do not fit "
          f"qkv {qkv.shape} with {heads} heads")
    return [(qkv.shape, qkv.dtype)]


def heads_of(x: np.ndarray, heads: int) -> np.ndarray:
    """A (..., T, H * D) array viewed (never copied: outputs are written through it) as
    (..., H, T, D)."""
    split = np.reshape(x, x.shape[:-1] + (heads, x.shape[-1] // heads), copy=False)
    return np.moveaxis(split, -2, -3)


def qkv_heads(qkv: np.ndarray, heads: int) -> list[np.ndarray]:
    """q, k, v of a packed (..., T, 3 * H * D) array, as (..., H, T, D) views."""
    split = np.reshape(qkv, qkv.shape[:-1] + (3, heads, qkv.shape[-1] // (3 * heads)),
                       copy=False)
    return [np.moveaxis(split[..., i, :, :], -2, -3) for i in range(3)]


@impl("sdpa_qkv")
def _sdpa_qkv_impl(node, ins, outs, ctx):
    heads = node.attrs["heads"]
    q, k, v = qkv_heads(ins[0], heads)
    out = np.empty(q.shape[:-1] + (v.shape[-1],), q.dtype)
    _sdpa_impl(node, [q, k, v] + list(ins[1:]), [out, outs[1]], ctx)
    heads_of(outs[0], heads)[...] = out


@impl("sdpa_qkv_grad")
def _sdpa_qkv_grad_impl(node, ins, outs, ctx):
    heads = node.attrs["heads"]
    dout, qkv, out, lse = ins[:4]
    q, k, v = qkv_heads(qkv, heads)
    grads = [np.empty(x.shape, x.dtype) for x in (q, k, v)]
    _sdpa_grad_impl(node, [heads_of(dout, heads), q, k, v, heads_of(out, heads), lse]
                    + list(ins[4:]), grads, ctx)
    for view, g in zip(qkv_heads(outs[0], heads), grads):
        view[...] = g
