"""Launchers of the collective ops (ops/collective.py) through NCCL (cupy.cuda.nccl), and the
parameter broadcast of a data-parallel step; kernels in collective.cu.

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
from .runtime.launch import (BLOCK, UPDATE_CHUNK, _buffers_key, _capturing, _check,
                             _chunk_jobs, _kernel, _node_memory)
from .runtime.side_stream import fork_events, forked, join

NCCL_DTYPES = {"float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "int32": "NCCL_INT32",
               "int64": "NCCL_INT64", "uint8": "NCCL_UINT8"}
NCCL_BFLOAT16 = 9           # ncclBfloat16 in nccl.h (NCCL >= 2.10); CuPy may not name it
EXTRAS_KEY = "collective"
BF16_OPS = frozenset({"all_reduce", "all_reduce_join"})   # bf16 gradients (uint16 bits)


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
    return getattr(nccl, name)


def _communicator(group, ctx):
    if not group.has_nccl and _capturing(ctx):
        raise CaptureError("all_reduce: the NCCL communicator is made when the step is "
                           "compiled, before any capture")
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
                   (memory["pack"], jobs, buffer, np.int32(UPDATE_CHUNK)), len(jobs))
        comm.allReduce(buffer.data.ptr, buffer.data.ptr, buffer.size, dtype, nccl.NCCL_AVG,
                       stream.ptr)
        _launch_on(stream, f"bucket_unpack{kind}_kernel",
                   (memory["unpack"], jobs, buffer, np.int32(UPDATE_CHUNK)), len(jobs))
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


def all_reduce_max(ctx, node, ins: list) -> None:
    """ins[i] = elementwise max over ranks of ins[i], in place, on ctx.stream (in order)."""
    group = lookup_group(node.attrs["group"])
    for i, a in enumerate(ins):
        _check(f"all_reduce_max input {i}", a, dtype=None)
    if group.world_size == 1:
        return
    nccl = _nccl()
    comm = _communicator(group, ctx)
    _grouped(nccl, lambda: [comm.allReduce(a.data.ptr, a.data.ptr, a.size,
                                           _nccl_dtype(nccl, a), nccl.NCCL_MAX, ctx.stream.ptr)
                            for a in ins])


def broadcast_parameters(backend, group, arrays: list) -> None:
    """Rank 0's values of `arrays` (device arrays) on every rank, in place, in order on the
    backend's stream; makes the group's communicator on the backend's GPU."""
    nccl = _nccl()
    comm = group.nccl_communicator(backend.device_id)
    for i, a in enumerate(arrays):
        _check(f"broadcast array {i}", a, dtype=None)
    _grouped(nccl, lambda: [comm.bcast(a.data.ptr, a.size, _nccl_dtype(nccl, a), 0,
                                       backend.stream.ptr) for a in arrays])


IMPLS: dict[str, Callable] = {
    "all_reduce": lambda node, ins, outs, ctx: all_reduce_mean(ctx, node, ins, outs),
    "all_reduce_join": lambda node, ins, outs, ctx: all_reduce_join(ctx, node),
    "all_reduce_max": lambda node, ins, outs, ctx: all_reduce_max(ctx, node, ins),
}
