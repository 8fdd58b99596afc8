"""torch.distributed's names for training scripts (`import torch.distributed as dist` under
`import stepgraph as torch` or `stepgraph run`), mapped onto stepgraph's process group.

    dist.init_process_group(backend="nccl")    # or "gloo": distributed.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(model, device_ids=[local_rank])          # nn/parallel.py
    dist.all_reduce(metric, op=dist.ReduceOp.SUM)       # eager, outside the step
    dist.destroy_process_group()

The backend a script names only says what torch would use: stepgraph's data-parallel steps
average gradients with NCCL on CUDA and through the launcher's store on the CPU, whichever
is asked for. The collectives here (all_reduce, broadcast, barrier) are eager, for metrics
and flags outside the compiled step: they go through the store on every backend (a few
bytes; a sync, as torch's). A torch.distributed name stepgraph lacks raises
UnsupportedOpError naming it (an AttributeError).
"""
from __future__ import annotations

import datetime
import enum
import os
from urllib.parse import urlparse

import numpy as np

from ..errors import UnsupportedOpError

BACKENDS = ("nccl", "gloo")
_backend: str | None = None


class ReduceOp(enum.Enum):
    """torch.distributed.ReduceOp: what all_reduce combines the ranks' tensors with."""

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"


_REDUCE = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply,
           ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}


class Work:
    """What an async_op=True collective returns: already complete (the eager collectives
    here finish before they return)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def is_available() -> bool:
    return True


def _check_backend(backend) -> str:
    """torch's backend string ("nccl", "gloo", "cpu:gloo,cuda:nccl", None) -> a name."""
    if backend is None:
        return "nccl" if _cuda() else "gloo"
    names = [part.split(":")[-1].strip().lower() for part in str(backend).split(",")]
    bad = [n for n in names if n not in BACKENDS]
    if bad:
        raise UnsupportedOpError(
            f"torch.distributed.init_process_group(backend={backend!r}) is not supported by "
            f"stepgraph: use backend='nccl' or 'gloo' (stepgraph's steps use NCCL on CUDA "
            "and the launcher's store on the CPU either way)")
    return names[-1]


def _cuda() -> bool:
    from ..backends import cuda_available

    return cuda_available()


def _env_of(init_method, world_size: int, rank: int):
    """The DistEnv init_process_group's arguments name: the launcher's variables (env://,
    the default), with rank and world_size where given; tcp://host:port with both."""
    from .detect import DistEnv, detect_launch

    if init_method in (None, "env://"):
        env = detect_launch()
        if env is None and world_size in (-1, 1) and rank in (-1, 0):
            return None                                      # a world of one
        if env is None:
            env = DistEnv(rank, world_size, int(os.environ.get("LOCAL_RANK", rank)),
                          os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          int(os.environ.get("MASTER_PORT", "0") or 0))
        elif (world_size not in (-1, env.world_size)) or (rank not in (-1, env.rank)):
            raise ValueError(f"init_process_group(world_size={world_size}, rank={rank}) "
                             f"contradicts the launcher's WORLD_SIZE={env.world_size}, "
                             f"RANK={env.rank}")
        return env
    url = urlparse(str(init_method))
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise UnsupportedOpError(
            f"torch.distributed.init_process_group(init_method={init_method!r}) is not "
            "supported by stepgraph: use init_method='env://' (the default, under torchrun "
            "or `stepgraph launch`) or 'tcp://HOST:PORT' with rank and world_size")
    if world_size < 1 or rank < 0:
        raise ValueError("init_process_group with a tcp:// init_method needs rank and "
                         "world_size")
    env = DistEnv(rank, world_size, int(os.environ.get("LOCAL_RANK", rank)), url.hostname,
                  url.port)
    env.check()
    return env


def init_process_group(backend=None, init_method=None, timeout=None, world_size: int = -1,
                       rank: int = -1, store=None, group_name: str = "", pg_options=None,
                       device_id=None) -> None:
    """torch.distributed.init_process_group: stepgraph's distributed.init() over the
    launcher's variables (torchrun, `stepgraph launch`, srun, mpirun), env:// or
    tcp://HOST:PORT. backend "nccl" / "gloo" (or "cpu:gloo,cuda:nccl") accepted; timeout a
    datetime.timedelta or seconds. A second call raises ValueError, as torch's."""
    global _backend
    from .default_group import init, is_initialized

    if is_initialized():
        raise ValueError("trying to initialize the default process group twice!")
    if store is not None:
        raise UnsupportedOpError("torch.distributed.init_process_group(store=...) is not "
                                 "supported by stepgraph: use init_method='env://' under "
                                 "torchrun or `stepgraph launch` (their store is used)")
    name = _check_backend(backend)
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    env = _env_of(init_method, world_size, rank)
    if env is None:
        from .detect import DistEnv

        env = DistEnv(0, 1, 0, "127.0.0.1", 1, "single", "none")
    init(timeout, env)
    _backend = name


def destroy_process_group(group=None) -> None:
    """torch.distributed.destroy_process_group: leave the run (distributed.destroy())."""
    global _backend
    from .default_group import destroy

    destroy()
    _backend = None


def get_backend(group=None) -> str:
    """The backend init_process_group was given ("nccl" or "gloo")."""
    _group_of(group)
    return _backend or ("nccl" if _cuda() else "gloo")


def _group_of(group):
    from .default_group import get_group

    if group is not None and group is not get_group():
        raise UnsupportedOpError("torch.distributed collectives on a group other than the "
                                 "default (new_group) are not supported by stepgraph: use "
                                 "the default group (group=None)")
    found = get_group()
    if found is None:
        raise ValueError("Default process group has not been initialized, please make sure "
                         "to call init_process_group.")
    return found


def barrier(group=None, async_op: bool = False, device_ids=None, timeout=None):
    """torch.distributed.barrier: every rank waits for the others (through the store)."""
    _group_of(group).barrier("barrier")
    return Work() if async_op else None


def _host_values(tensor) -> np.ndarray:
    from ..ir.tensor import Tensor

    if not isinstance(tensor, Tensor):
        raise TypeError(f"torch.distributed collectives take a tensor, got "
                        f"{type(tensor).__name__}")
    return np.array(tensor.numpy(), copy=True)


def _write(tensor, values: np.ndarray) -> None:
    """values into `tensor` in place: an eager tensor's array; a tensor of a training step
    (a loss kept for the script) becomes an eager tensor holding them."""
    from ..functions.factories import tensor as make_tensor

    result = make_tensor(values.astype(values.dtype), dtype=tensor.dtype)
    if tensor.is_eager:
        tensor.array[...] = result.array
    else:
        tensor.value, tensor.tracer, tensor.array = result.value, result.tracer, result.array


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """torch.distributed.all_reduce, eager: `tensor` (on every rank the same shape) becomes
    the ranks' tensors combined by `op` (SUM, AVG, PRODUCT, MIN, MAX), in rank order, so
    every rank gets the same bits. For metrics outside the step: the gradients of a
    DistributedDataParallel model are averaged inside the compiled step."""
    if not isinstance(op, ReduceOp):
        raise UnsupportedOpError(f"torch.distributed.all_reduce(op={op!r}) is not supported "
                                 "by stepgraph: use ReduceOp.SUM, AVG, PRODUCT, MIN or MAX")
    g = _group_of(group)
    values = _host_values(tensor)
    parts = g.all_gather(values, "torch.distributed.all_reduce")
    total = parts[0].copy()
    for part in parts[1:]:
        total = _REDUCE[op](total, part)
    if op is ReduceOp.AVG:
        total = (total / g.world_size) if total.dtype.kind == "f" else total // g.world_size
    _write(tensor, np.asarray(total, values.dtype))
    return Work() if async_op else None


def broadcast(tensor, src: int = 0, group=None, async_op: bool = False, group_src=None):
    """torch.distributed.broadcast, eager: rank `src`'s values in `tensor` on every rank."""
    g = _group_of(group)
    src = src if group_src is None else group_src
    (values,) = g.broadcast([_host_values(tensor)], root=src, what="torch.distributed."
                                                                   "broadcast")
    _write(tensor, values)
    return Work() if async_op else None


TORCH_NAMES = ["ReduceOp", "Work", "all_reduce", "barrier", "broadcast",
               "destroy_process_group", "get_backend", "init_process_group", "is_available"]
