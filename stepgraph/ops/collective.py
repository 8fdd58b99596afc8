"""Collective family: the ops a data-parallel step uses to average gradients across ranks
(compile/distribute.py inserts them; backends/cuda/collective.py runs them through NCCL), and
those of a step with sharded optimizer state (ZeRO-1): reduce_scatter, zero_shard,
all_reduce_norm and all_gather; broadcast_buffers, rank 0's buffers on every rank at the end of
a step; all_reduce_sum, the one collective of a forward pass (nn.SyncBatchNorm's statistics).

attrs group names the process group (distributed/group.py) and world_size its size. Only
all_reduce_sum has a VJP (the others are inserted after the backward pass). The numpy
references talk through the group's store, so CPU processes really communicate; every rank
gets the same bits.
"""
from __future__ import annotations

import math

import numpy as np

from ..backends.numpy.bf16 import round_bf16
from ..distributed.group import lookup_group
from ..ir.ops import _need, defop, impl, vjp

COLLECTIVE_OPS = ("all_reduce", "all_reduce_join", "all_reduce_max", "reduce_scatter",
                  "zero_shard", "all_reduce_norm", "all_gather", "broadcast_buffers",
                  "all_reduce_sum")
# The dtypes a bucket of each gradient dtype may be summed in (attrs reduce_dtype).
# float16 gradients (a model.half()'s) are summed in float16, as torch's DDP all-reduces them.
REDUCE_DTYPES = {"float32": ("float32",), "float64": ("float64",),
                 "bfloat16": ("float32", "bfloat16"), "float16": ("float16",)}


def reduce_dtype_of(grad_dtype: str, bf16_communication: bool) -> str:
    """What a bucket of `grad_dtype` gradients is summed in: its own dtype, except bf16,
    summed in float32 unless bf16 communication was asked for."""
    if grad_dtype == "bfloat16" and not bf16_communication:
        return "float32"
    return grad_dtype


@defop("all_reduce")
def _all_reduce(ins, attrs):
    """outs[i] = mean over ranks of ins[i]: one bucket of gradients (attrs bucket, its index;
    strategy "flat" or "grouped", how CUDA issues it). All inputs share one float dtype;
    attrs reduce_dtype is what the sums are taken in (REDUCE_DTYPES: bf16 gradients in float32,
    rounded to bf16 once at the end, or in bfloat16, rounded at every partial sum). On a
    backend with streams it runs beside the backward pass and is waited for by the next
    all_reduce_join; its inputs must stay untouched until then."""
    _need(len(ins) > 0, "all_reduce", "needs at least one input")
    dtype = ins[0].dtype
    _need(dtype in REDUCE_DTYPES, "all_reduce",
          f"averages {sorted(REDUCE_DTYPES)} gradients, got {dtype}")
    _need(all(v.dtype == dtype for v in ins), "all_reduce",
          f"a bucket holds one dtype, got {sorted({v.dtype for v in ins})}")
    reduce = attrs.get("reduce_dtype", reduce_dtype_of(dtype, False))
    _need(reduce in REDUCE_DTYPES[dtype], "all_reduce",
          f"{dtype} gradients are summed in {' or '.join(REDUCE_DTYPES[dtype])}, not {reduce}")
    return [(v.shape, v.dtype) for v in ins]


@defop("all_reduce_join")
def _all_reduce_join(ins, attrs):
    """Wait until every all_reduce (or reduce_scatter) before it has finished. ins: those
    collectives' inputs and outputs (read by nothing; listed so that they stay alive,
    unmoved, until here)."""
    return []


@defop("all_reduce_max", mutates=lambda attrs: tuple(range(attrs["n"])))
def _all_reduce_max(ins, attrs):
    """ins[i] = elementwise maximum over ranks of ins[i], in place, in program order (a
    guard's flags: every rank skips a step that any rank found bad). attrs n = len(ins)."""
    _need(len(ins) == attrs["n"], "all_reduce_max", f"attrs n={attrs['n']}, {len(ins)} inputs")
    return []


def _check_bucket(op: str, ins, attrs) -> str:
    """The one float dtype of a bucket that attrs chunk * world_size elements hold."""
    _need(len(ins) > 0, op, "needs at least one input")
    dtype = ins[0].dtype
    _need(dtype in ("float32", "float64"), op, f"shards float32 or float64 buckets, got {dtype}")
    _need(all(v.dtype == dtype for v in ins), op,
          f"a bucket holds one dtype, got {sorted({v.dtype for v in ins})}")
    total, padded = sum(v.size for v in ins), attrs["chunk"] * attrs["world_size"]
    _need(padded - attrs["world_size"] < total <= padded, op,
          f"{total} elements do not fill {attrs['world_size']} chunks of {attrs['chunk']}")
    return dtype


@defop("reduce_scatter")
def _reduce_scatter(ins, attrs):
    """out (chunk,) = this rank's chunk of the mean over ranks of the bucket's flat buffer:
    ins (one bucket's gradients) flattened and concatenated in order, zero-padded to
    chunk * world_size elements (distributed/zero.py's layout); rank r gets elements
    [r * chunk, (r + 1) * chunk). Waited for by the next all_reduce_join, as all_reduce."""
    return [((attrs["chunk"],), _check_bucket("reduce_scatter", ins, attrs))]


@defop("zero_shard")
def _zero_shard(ins, attrs):
    """out (chunk,) = this rank's chunk of the bucket's parameters ins, laid out as
    reduce_scatter lays out their gradients (padding zeros): what the rank's update writes."""
    return [((attrs["chunk"],), _check_bucket("zero_shard", ins, attrs))]


@defop("all_reduce_norm")
def _all_reduce_norm(ins, attrs):
    """out = sqrt(sum over ranks of ins[0]^2): the global norm of gradients from the norm of
    each rank's shard (their squared norms add up: the shards do not overlap)."""
    _need(len(ins) == 1 and ins[0].shape == (), "all_reduce_norm",
          f"takes one scalar norm, got {ins}")
    return [((), ins[0].dtype)]


@defop("all_gather", mutates=lambda attrs: tuple(range(1, attrs["n"] + 1)))
def _all_gather(ins, attrs):
    """ins (shard (chunk,), the bucket's n parameters): every parameter, in place, takes its
    elements of the concatenation of every rank's shard (the inverse of zero_shard's layout),
    so the ranks end with identical parameters."""
    _need(len(ins) == attrs["n"] + 1, "all_gather", f"attrs n={attrs['n']}, {len(ins)} inputs")
    shard, params = ins[0], ins[1:]
    _need(shard.shape == (attrs["chunk"],), "all_gather",
          f"shard must be ({attrs['chunk']},), got {shard.shape}")
    dtype = _check_bucket("all_gather", params, attrs)
    _need(shard.dtype == dtype, "all_gather", f"shard {shard.dtype}, parameters {dtype}")
    return []


@defop("broadcast_buffers", mutates=lambda attrs: tuple(range(attrs["n"])))
def _broadcast_buffers(ins, attrs):
    """ins[i] = rank 0's ins[i], in place, every dtype (bits are copied): the buffers a
    data-parallel step updates (BatchNorm's running statistics, the counter), at its end, so
    that every rank holds rank 0's (compile/distribute.py broadcast_buffers). attrs n =
    len(ins)."""
    _need(len(ins) == attrs["n"], "broadcast_buffers",
          f"attrs n={attrs['n']}, {len(ins)} inputs")
    return []


@defop("all_reduce_sum")
def _all_reduce_sum(ins, attrs):
    """out = sum over ranks of ins[0] (float32 or float64, any shape), in a forward pass:
    nn.SyncBatchNorm's per-channel sums over the global batch. Every rank gets the same bits
    (summed in rank order on the CPU). Its VJP is itself: with y = sum_r x_r on every rank
    and the ranks' losses summed, d/dx_r = sum over ranks of dL_s/dy."""
    _need(len(ins) == 1, "all_reduce_sum", f"takes one tensor, got {len(ins)}")
    _need(ins[0].dtype in ("float32", "float64"), "all_reduce_sum",
          f"sums float32 or float64, got {ins[0].dtype}")
    return [(ins[0].shape, ins[0].dtype)]


@vjp("all_reduce_sum")
def _all_reduce_sum_vjp(emit, node, dy, wants):
    return emit("all_reduce_sum", [dy[0]], **node.attrs)


def _round_fp16(x) -> np.ndarray:
    """float32 x rounded to the nearest float16 value, as float32."""
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


@impl("all_reduce")
def _all_reduce_impl(node, ins, outs, ctx):
    """bf16 and float16 gradients arrive widened to float32 (the backend rounds the outputs
    back once): summed in float32 as they are, or rounded to bf16 (float16) after every
    partial sum, as a bf16 (float16) all-reduce does (attrs reduce_dtype)."""
    group = lookup_group(node.attrs["group"])
    narrow = {"bfloat16": round_bf16, "float16": _round_fp16}.get(node.attrs.get("reduce_dtype"))
    means = group.all_reduce_mean(list(ins), f"all_reduce of gradient bucket "
                                             f"{node.attrs.get('bucket')}", round_sum=narrow)
    for out, mean in zip(outs, means):
        out[...] = mean


@impl("all_reduce_join")
def _all_reduce_join_impl(node, ins, outs, ctx):
    """The numpy all_reduce has finished when it returns: nothing to wait for."""


@impl("all_reduce_max")
def _all_reduce_max_impl(node, ins, outs, ctx):
    group = lookup_group(node.attrs["group"])
    for array, top in zip(ins, group.all_reduce_max(list(ins), "all_reduce of guard flags")):
        array[...] = top


def _flat_padded(arrays, padded: int) -> np.ndarray:
    flat = np.zeros(padded, dtype=arrays[0].dtype)
    offset = 0
    for a in arrays:
        flat[offset:offset + a.size] = a.reshape(-1)
        offset += a.size
    return flat


def _my_chunk(node, flat: np.ndarray, rank: int) -> np.ndarray:
    chunk = node.attrs["chunk"]
    return flat[rank * chunk:(rank + 1) * chunk]


@impl("reduce_scatter")
def _reduce_scatter_impl(node, ins, outs, ctx):
    """The mean of the whole flat buffer, as all_reduce takes it (summed in rank order), so a
    shard holds the same bits as the unsharded step's averaged gradients."""
    group = lookup_group(node.attrs["group"])
    flat = _flat_padded(ins, node.attrs["chunk"] * node.attrs["world_size"])
    (mean,) = group.all_reduce_mean([flat], f"reduce_scatter of gradient bucket "
                                            f"{node.attrs.get('bucket')}")
    outs[0][...] = _my_chunk(node, mean, group.rank)


@impl("zero_shard")
def _zero_shard_impl(node, ins, outs, ctx):
    rank = lookup_group(node.attrs["group"]).rank
    flat = _flat_padded(ins, node.attrs["chunk"] * node.attrs["world_size"])
    outs[0][...] = _my_chunk(node, flat, rank)


@impl("all_reduce_norm")
def _all_reduce_norm_impl(node, ins, outs, ctx):
    group = lookup_group(node.attrs["group"])
    squares = group.all_gather(np.asarray(ins[0], np.float64).reshape(1) ** 2,
                               "all_reduce of the gradient norm")
    outs[0][...] = math.sqrt(float(sum(s[0] for s in squares)))


@impl("all_gather")
def _all_gather_impl(node, ins, outs, ctx):
    group = lookup_group(node.attrs["group"])
    flat = np.concatenate(group.all_gather(ins[0], f"all_gather of parameter bucket "
                                                   f"{node.attrs.get('bucket')}"))
    offset = 0
    for p in ins[1:]:
        p[...] = flat[offset:offset + p.size].reshape(p.shape)
        offset += p.size


@impl("broadcast_buffers")
def _broadcast_buffers_impl(node, ins, outs, ctx):
    group = lookup_group(node.attrs["group"])
    for array, value in zip(ins, group.broadcast(list(ins), what="buffer broadcast")):
        array[...] = value


@impl("all_reduce_sum")
def _all_reduce_sum_impl(node, ins, outs, ctx):
    """Every rank's tensor summed in rank order (the same bits on every rank)."""
    group = lookup_group(node.attrs["group"])
    parts = group.all_gather(np.ascontiguousarray(ins[0]), "all_reduce_sum of SyncBatchNorm "
                                                           "statistics")
    total = parts[0].copy()
    for part in parts[1:]:
        total += part
    outs[0][...] = total
