"""Collective family: the ops a data-parallel step uses to average gradients across ranks
(compile/distribute.py inserts them; backends/cuda/collective.py runs them through NCCL).

attrs group names the process group (distributed/group.py) and world_size its size. No VJPs:
the ops are inserted after the backward pass. The numpy references talk through the group's
store, so CPU processes really communicate; every rank gets the same bits.
"""
from __future__ import annotations

from ..backends.numpy.bf16 import round_bf16
from ..distributed.group import lookup_group
from ..ir.ops import _need, defop, impl

COLLECTIVE_OPS = ("all_reduce", "all_reduce_join", "all_reduce_max")
# The dtypes a bucket of each gradient dtype may be summed in (attrs reduce_dtype).
REDUCE_DTYPES = {"float32": ("float32",), "float64": ("float64",),
                 "bfloat16": ("float32", "bfloat16")}


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
    """Wait until every all_reduce before it has finished. ins: those all_reduces' inputs and
    outputs (read by nothing; listed so that they stay alive, unmoved, until here)."""
    return []


@defop("all_reduce_max", mutates=lambda attrs: tuple(range(attrs["n"])))
def _all_reduce_max(ins, attrs):
    """ins[i] = elementwise maximum over ranks of ins[i], in place, in program order (a
    guard's flags: every rank skips a step that any rank found bad). attrs n = len(ins)."""
    _need(len(ins) == attrs["n"], "all_reduce_max", f"attrs n={attrs['n']}, {len(ins)} inputs")
    return []


@impl("all_reduce")
def _all_reduce_impl(node, ins, outs, ctx):
    """bf16 gradients arrive widened to float32 (the backend rounds the outputs back once):
    summed in float32 as they are, or rounded to bf16 after every partial sum, as a bf16
    all-reduce does (attrs reduce_dtype "bfloat16")."""
    group = lookup_group(node.attrs["group"])
    narrow = node.attrs.get("reduce_dtype") == "bfloat16"
    means = group.all_reduce_mean(list(ins), f"all_reduce of gradient bucket "
                                             f"{node.attrs.get('bucket')}",
                                  round_sum=round_bf16 if narrow else None)
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
