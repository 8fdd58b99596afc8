"""Launchers of the collective ops (ops/collective.py) through NCCL (cupy.cuda.nccl), and the
parameter broadcast of a data-parallel step; kernels in collective.cu. ZeRO-1's
reduce_scatter runs on the communication stream as all_reduce does; zero_shard, all_gather and
all_reduce_norm run in order on the step's stream, and so does broadcast_buffers (rank 0's
BatchNorm statistics at the end of a step). all_reduce_sum (nn.SyncBatchNorm's statistics, in
the forward and backward passes) is forked onto the communication stream and joined at once:
every NCCL call of a step then goes out on that one stream in program order, the same order
on every rank, beside the gradient buckets and never concurrently with them.

A bucket's all_reduce is forked onto the context's communication stream (side_stream.py):
an event recorded on ctx.stream at this point of the step, waited for by the communication
stream, then the copies and the NCCL call there, then an event that the next all_reduce_join
makes ctx.stream wait for. Captured, the two streams become two branches of the step's one
CUDA graph, joined before the optimizer; the backward kernels after the fork run beside the
all-reduce.

Nothing is allocated while capturing: the communication stream is made at the first eager
call (ctx.extras), each bucket's events, flat buffer and copy tables are node memory made at
the first eager run on its buffers (Executable warms up eagerly before capturing), and the
communicator when the step is compiled (the parameter broadcast).
"""
from __future__ import annotations

from typing import Any, Callable

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ...distributed.group import lookup_group
from ...errors import CaptureError, ShapeError
from .runtime.launch import (BLOCK, MULTI_TENSOR_CHUNK, _buffers_key, _capturing, _check,
                             _chunk_jobs, _kernel, _node_memory)
from .runtime.graph import NCCL_GROUPS_KEY
from .runtime.side_stream import fork_events, forked, join

NCCL_DTYPES = {"float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "int32": "NCCL_INT32",
               "int64": "NCCL_INT64", "uint8": "NCCL_UINT8", "float16": "NCCL_FLOAT16"}
NCCL_FLOAT16 = 6             # ncclFloat16 (ncclHalf) in nccl.h; by number, as NCCL_BFLOAT16
NCCL_BFLOAT16 = 9           # ncclBfloat16 in nccl.h (NCCL >= 2.10); CuPy may not name it
EXTRAS_KEY = "collective"
BF16_OPS = frozenset({"all_reduce", "all_reduce_join"})   # bf16 gradients (uint16 bits)
# float16 gradients (a model.half()): ncclFloat16, summed in float16 (REDUCE_DTYPES), one
# all-reduce a gradient (the flat bucket buffer is float32's)
FP16_OPS = BF16_OPS


def kernel_names() -> dict[str, set[str]]:
    return {"collective.cu": {"bucket_pack_kernel", "bucket_unpack_kernel",
                              "bucket_pack_bf16_kernel", "bucket_unpack_bf16_kernel"}}


def _nccl():
    from cupy.cuda import nccl

    return nccl


def _nccl_dtype(nccl, array) -> int:
    name = NCCL_DTYPES.get(str(array.dtype))
    if name is None:
        raise ShapeError(f"NCCL collectives take {sorted(NCCL_DTYPES)}, got {array.dtype}")
    return getattr(nccl, name, NCCL_FLOAT16 if name == "NCCL_FLOAT16" else None)


def _communicator(group, ctx):
    """The group's communicator; during a capture, the group is noted as one whose NCCL work
    the graph holds (runtime/graph.py: the group releases the graph before destroying it)."""
    if _capturing(ctx):
        if not group.has_nccl:
            raise CaptureError("all_reduce: the NCCL communicator is made when the step is "
                               "compiled, before any capture")
        ctx.extras.setdefault(NCCL_GROUPS_KEY, set()).add(group.id)
    return group.nccl_communicator(cp.cuda.Device().id)


def _launch_on(stream, name: str, args: tuple, blocks: int) -> None:
    _kernel("collective.cu", name)((blocks,), (BLOCK,), args, stream=stream)


def _bucket_memory(ins, outs, flat: bool) -> dict:
    memory = fork_events()
    if flat:
        sizes = [a.size for a in ins]
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        table = lambda arrays: cp.asarray(np.array(   # noqa: E731
            [(a.data.ptr, a.size, off) for a, off in zip(arrays, offsets)], dtype=np.int64))
        memory.update(flat=cp.empty(int(sum(sizes)), np.float32), pack=table(ins),
                      unpack=table(outs), jobs=cp.asarray(_chunk_jobs(sizes)))
    return memory


def _check_bucket(ins, outs) -> None:
    if not ins or len(ins) != len(outs):
        raise ShapeError(f"all_reduce: {len(ins)} inputs, {len(outs)} outputs")
    for i, (a, o) in enumerate(zip(ins, outs)):
        _check(f"all_reduce input {i}", a, dtype=str(ins[0].dtype))
        _check(f"all_reduce output {i}", o, dtype=str(ins[0].dtype), shape=a.shape)


def all_reduce_mean(ctx, node, ins: list, outs: list) -> None:
    """outs[i] = mean over ranks of ins[i] (NCCL_AVG), on the communication stream. One
    gradient: one out-of-place all-reduce; several: "flat" packs them into the bucket's
    buffer for one all-reduce and unpacks the means, "grouped" issues one all-reduce each
    inside an NCCL group. bf16 gradients: see the module docstring."""
    _check_bucket(ins, outs)
    group = lookup_group(node.attrs["group"])
    if group.world_size == 1:      # nothing to average: copies, in order on ctx.stream
        for a, o in zip(ins, outs):
            cp.cuda.runtime.memcpyAsync(o.data.ptr, a.data.ptr, a.nbytes,
                                        cp.cuda.runtime.memcpyDeviceToDevice, ctx.stream.ptr)
        return
    nccl = _nccl()
    comm = _communicator(group, ctx)
    bf16 = ins[0].dtype == np.uint16
    widen = bf16 and node.attrs.get("reduce_dtype", "float32") == "float32"
    flat = widen or (node.attrs.get("strategy", "flat") == "flat" and len(ins) > 1
                     and ins[0].dtype == np.float32)
    memory = _node_memory(node, ("all_reduce", flat) + _buffers_key(ins + outs), ctx,
                          lambda: _bucket_memory(ins, outs, flat))
    dtype = (nccl.NCCL_FLOAT32 if widen else NCCL_BFLOAT16 if bf16
             else _nccl_dtype(nccl, ins[0]))
    with forked(ctx, EXTRAS_KEY, "all_reduce", memory) as stream:
        _issue_all_reduce(nccl, comm, stream, dtype, memory, ins, outs, flat,
                          "_bf16" if widen else "")


def _issue_all_reduce(nccl, comm, stream, dtype: int, memory: dict, ins: list, outs: list,
                      flat: bool, kind: str = "") -> None:
    """The bucket's all-reduce on `stream` (all_reduce_mean); kind "_bf16": the flat
    buffer holds the bf16 gradients widened to float32."""
    if flat:
        buffer, jobs = memory["flat"], memory["jobs"]
        _launch_on(stream, f"bucket_pack{kind}_kernel",
                   (memory["pack"], jobs, buffer, np.int32(MULTI_TENSOR_CHUNK)), len(jobs))
        comm.allReduce(buffer.data.ptr, buffer.data.ptr, buffer.size, dtype, nccl.NCCL_AVG,
                       stream.ptr)
        _launch_on(stream, f"bucket_unpack{kind}_kernel",
                   (memory["unpack"], jobs, buffer, np.int32(MULTI_TENSOR_CHUNK)), len(jobs))
    elif len(ins) == 1:
        comm.allReduce(ins[0].data.ptr, outs[0].data.ptr, ins[0].size, dtype, nccl.NCCL_AVG,
                       stream.ptr)
    else:
        _grouped(nccl, lambda: [comm.allReduce(a.data.ptr, o.data.ptr, a.size, dtype,
                                               nccl.NCCL_AVG, stream.ptr)
                                for a, o in zip(ins, outs)])


def _grouped(nccl, issue: Callable[[], Any]) -> None:
    nccl.groupStart()
    try:
        issue()
    finally:
        nccl.groupEnd()


def all_reduce_join(ctx, node) -> None:
    """ctx.stream waits for the all-reduces issued since the last join."""
    join(ctx, EXTRAS_KEY)


def _in_place(ctx, node, ins: list, what: str, call) -> None:
    """call(nccl, comm, a) for each of ins, grouped, in order on ctx.stream: a collective that
    rewrites its inputs in place; nothing with one rank."""
    group = lookup_group(node.attrs["group"])
    for i, a in enumerate(ins):
        _check(f"{what} input {i}", a, dtype=None)
    if group.world_size == 1:
        return
    nccl = _nccl()
    comm = _communicator(group, ctx)
    _grouped(nccl, lambda: [call(nccl, comm, a) for a in ins])


def all_reduce_max(ctx, node, ins: list) -> None:
    """ins[i] = elementwise max over ranks of ins[i], in place, on ctx.stream (in order)."""
    _in_place(ctx, node, ins, "all_reduce_max", lambda nccl, comm, a: comm.allReduce(
        a.data.ptr, a.data.ptr, a.size, _nccl_dtype(nccl, a), nccl.NCCL_MAX, ctx.stream.ptr))


# ---- ZeRO-1 (compile/distribute.py shard_optimizer_state) ---------------------------------

def _padded_memory(arrays, padded: int, events: bool) -> dict:
    """A zeroed float32 buffer of the bucket's padded flat layout (the tail past the tensors
    stays zero: the shards' padding must not disturb the gradient norm or the guard) and the
    multi-tensor table of `arrays` in it."""
    memory = fork_events() if events else {}
    sizes = [a.size for a in arrays]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    memory.update(flat=cp.zeros(padded, np.float32), jobs=cp.asarray(_chunk_jobs(sizes)),
                  table=cp.asarray(np.array([(a.data.ptr, a.size, off)
                                             for a, off in zip(arrays, offsets)],
                                            dtype=np.int64)))
    return memory


def _check_float32(op: str, arrays) -> None:
    for i, a in enumerate(arrays):
        _check(f"{op} input {i}", a, dtype="float32")


def _pack(stream, memory: dict) -> None:
    _launch_on(stream, "bucket_pack_kernel", (memory["table"], memory["jobs"], memory["flat"],
                                              np.int32(MULTI_TENSOR_CHUNK)), len(memory["jobs"]))


def _copy_on(stream, dst: int, src: int, nbytes: int) -> None:
    cp.cuda.runtime.memcpyAsync(dst, src, nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
                                stream.ptr)


def reduce_scatter_mean(ctx, node, ins: list, outs: list) -> None:
    """outs[0] = this rank's chunk of the mean over ranks of the bucket's padded flat buffer:
    the gradients packed, then NCCL reduceScatter (NCCL_AVG), on the communication stream
    (forked and joined as all_reduce)."""
    _check_float32("reduce_scatter", ins)
    chunk, group = node.attrs["chunk"], lookup_group(node.attrs["group"])
    _check("reduce_scatter output", outs[0], dtype="float32", shape=(chunk,))
    key = ("reduce_scatter",) + _buffers_key(ins + outs)
    memory = _node_memory(node, key, ctx, lambda: _padded_memory(
        ins, chunk * group.world_size, group.world_size > 1))
    if group.world_size == 1:      # nothing to average: in order on ctx.stream
        _pack(ctx.stream, memory)
        _copy_on(ctx.stream, outs[0].data.ptr, memory["flat"].data.ptr, outs[0].nbytes)
        return
    nccl = _nccl()
    comm = _communicator(group, ctx)
    with forked(ctx, EXTRAS_KEY, "reduce_scatter", memory) as stream:
        _pack(stream, memory)
        comm.reduceScatter(memory["flat"].data.ptr, outs[0].data.ptr, chunk,
                           nccl.NCCL_FLOAT32, nccl.NCCL_AVG, stream.ptr)


def zero_shard(ctx, node, ins: list, outs: list) -> None:
    """outs[0] = this rank's chunk of the bucket's parameters, packed, on ctx.stream."""
    _check_float32("zero_shard", ins)
    chunk, group = node.attrs["chunk"], lookup_group(node.attrs["group"])
    _check("zero_shard output", outs[0], dtype="float32", shape=(chunk,))
    memory = _node_memory(node, ("zero_shard",) + _buffers_key(ins + outs), ctx,
                          lambda: _padded_memory(ins, chunk * group.world_size, False))
    _pack(ctx.stream, memory)
    flat = memory["flat"]
    _copy_on(ctx.stream, outs[0].data.ptr, flat.data.ptr + group.rank * outs[0].nbytes,
             outs[0].nbytes)


def all_gather(ctx, node, ins: list) -> None:
    """Every parameter ins[1:] takes its elements of all ranks' shards ins[0]: NCCL allGather
    into the padded flat buffer, then unpacked, in order on ctx.stream."""
    _check_float32("all_gather", ins)
    shard, params = ins[0], ins[1:]
    chunk, group = node.attrs["chunk"], lookup_group(node.attrs["group"])
    memory = _node_memory(node, ("all_gather",) + _buffers_key(ins), ctx,
                          lambda: _padded_memory(params, chunk * group.world_size, False))
    flat = memory["flat"]
    if group.world_size == 1:
        _copy_on(ctx.stream, flat.data.ptr, shard.data.ptr, shard.nbytes)
    else:
        nccl = _nccl()
        _communicator(group, ctx).allGather(shard.data.ptr, flat.data.ptr, chunk,
                                            nccl.NCCL_FLOAT32, ctx.stream.ptr)
    _launch_on(ctx.stream, "bucket_unpack_kernel",
               (memory["table"], memory["jobs"], flat, np.int32(MULTI_TENSOR_CHUNK)),
               len(memory["jobs"]))


def all_reduce_norm(ctx, node, ins: list, outs: list) -> None:
    """outs[0] = sqrt(sum over ranks of ins[0]^2), on ctx.stream (in order)."""
    _check("all_reduce_norm input", ins[0], dtype="float32", shape=())
    group = lookup_group(node.attrs["group"])
    with ctx.stream:
        cp.multiply(ins[0], ins[0], out=outs[0])
        if group.world_size > 1:
            nccl = _nccl()
            _communicator(group, ctx).allReduce(outs[0].data.ptr, outs[0].data.ptr, 1,
                                                nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                                ctx.stream.ptr)
        cp.sqrt(outs[0], out=outs[0])


def broadcast_parameters(backend, group, arrays: list) -> None:
    """Rank 0's values of `arrays` (device arrays) on every rank, in place, in order on the
    backend's stream; makes the group's communicator on the backend's GPU. A broadcast
    copies bits: each array goes as its bytes (NCCL_UINT8), so any dtype a model holds (bool
    masks, bf16 bits) goes too."""
    nccl = _nccl()
    comm = group.nccl_communicator(backend.device_id)
    for i, a in enumerate(arrays):
        _check(f"broadcast array {i}", a, dtype=None)
    _grouped(nccl, lambda: [comm.bcast(a.data.ptr, a.nbytes, nccl.NCCL_UINT8, 0,
                                       backend.stream.ptr) for a in arrays if a.nbytes])


def broadcast_buffers(ctx, node, ins: list) -> None:
    """ins[i] = rank 0's ins[i], in place, as bytes (any dtype), in order on ctx.stream."""
    _in_place(ctx, node, [a for a in ins if a.nbytes], "broadcast_buffers",
              lambda nccl, comm, a: comm.bcast(a.data.ptr, a.nbytes, nccl.NCCL_UINT8, 0,
                                               ctx.stream.ptr))


def all_reduce_sum(ctx, node, ins: list, outs: list) -> None:
    """outs[0] = sum over ranks of ins[0] (NCCL_SUM), on the communication stream, which
    ctx.stream waits for at once (the next kernels read the sums)."""
    a, o = ins[0], outs[0]
    _check("all_reduce_sum input", a, dtype=None)
    _check("all_reduce_sum output", o, dtype=str(a.dtype), shape=a.shape)
    group = lookup_group(node.attrs["group"])
    if group.world_size == 1:
        _copy_on(ctx.stream, o.data.ptr, a.data.ptr, a.nbytes)
        return
    nccl = _nccl()
    comm = _communicator(group, ctx)
    memory = _node_memory(node, ("all_reduce_sum",) + _buffers_key(ins + outs), ctx,
                          fork_events)
    with forked(ctx, EXTRAS_KEY, "all_reduce_sum", memory) as stream:
        comm.allReduce(a.data.ptr, o.data.ptr, a.size, _nccl_dtype(nccl, a), nccl.NCCL_SUM,
                       stream.ptr)
    join(ctx, EXTRAS_KEY)


IMPLS: dict[str, Callable] = {
    "all_reduce": lambda node, ins, outs, ctx: all_reduce_mean(ctx, node, ins, outs),
    "all_reduce_join": lambda node, ins, outs, ctx: all_reduce_join(ctx, node),
    "all_reduce_max": lambda node, ins, outs, ctx: all_reduce_max(ctx, node, ins),
    "reduce_scatter": lambda node, ins, outs, ctx: reduce_scatter_mean(ctx, node, ins, outs),
    "zero_shard": lambda node, ins, outs, ctx: zero_shard(ctx, node, ins, outs),
    "all_gather": lambda node, ins, outs, ctx: all_gather(ctx, node, ins),
    "all_reduce_norm": lambda node, ins, outs, ctx: all_reduce_norm(ctx, node, ins, outs),
    "broadcast_buffers": lambda node, ins, outs, ctx: broadcast_buffers(ctx, node, ins),
    "all_reduce_sum": lambda node, ins, outs, ctx: all_reduce_sum(ctx, node, ins, outs),
}
