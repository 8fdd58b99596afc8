"""Data parallelism: one process per GPU, gradients averaged inside each step's graph.

    group = sg.distributed.init()          # RANK, WORLD_SIZE, ... from the launcher
    step = sg.compile_train_step(model, ..., distributed=True)

`init()` finds out who launched the run (detect.py: torchrun, `stepgraph launch`, Slurm's srun,
mpirun) and meets the other ranks through the store there: torchrun's own TCPStore under
torchrun, else the one rank 0 serves (group.py, store.py). A train step
compiled with `distributed=True` (or a `DataParallel` with options) broadcasts rank 0's
parameters and buffers to every rank, then averages the gradients with one all-reduce per
bucket of about 25 MiB (buckets.py), each launched as soon as its last gradient is final
(compile/distribute.py): NCCL on a second stream, joined before the optimizer, on CUDA (inside
the captured graph); through the store on the CPU backend. `stepgraph launch --gpus N -- CMD`
(launch.py) starts the processes. torch.distributed's names for scripts (init_process_group,
all_reduce, ...) are torch_api.py's; nn.parallel.DistributedDataParallel makes a captured
training loop data-parallel.

Buffers (BatchNorm's running statistics): PyTorch DDP's default semantics,
broadcast_buffers=True. Each rank's forward normalises by its own batch, and the running
statistics every rank holds are rank 0's: at the end of every step rank 0's updated buffers
are broadcast to all ranks inside the step's graph (compile/distribute.py broadcast_buffers;
NCCL on CUDA, the store on the CPU). torch broadcasts at the start of the next forward
instead, so rank 0's values are the same bits in both; here the other ranks hold them between
steps too, and every rank's state_dict is the same. DataParallel(broadcast_buffers=False)
keeps each rank's own statistics. nn.SyncBatchNorm normalises by the statistics of the global
batch (nn/sync_batch_norm.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import DistributedError
from .buckets import BUCKET_CAP_MB, Bucket, GradientInfo, cap_bytes_of, plan_buckets
from .detect import DistEnv, detect_launch, slurm_hosts
from .group import ProcessGroup, default_timeout, lookup_group, rendezvous
from .zero import BucketShards, ShardSlice, plan_shards
from .default_group import (destroy, get_group, get_rank, get_world_size, init,
                            is_initialized)
from .torch_api import (ReduceOp, Work, all_reduce, barrier, broadcast, destroy_process_group,
                        get_backend, init_process_group, is_available)

STRATEGIES = ("flat", "grouped")
REDUCE_DTYPES = ("fp32", "bf16")

@dataclass(frozen=True)
class DataParallel:
    """Options of a data-parallel train step (`compile_train_step(distributed=...)`).

    bucket_cap_mb: the bucket size in MiB (DDP's bucket_cap_mb). strategy (CUDA): "flat"
    copies a bucket's gradients into one buffer for one NCCL all-reduce; "grouped" issues one
    all-reduce per gradient inside an NCCL group (no copies). group: the process group
    (default: init()'s).

    reduce_dtype: what bf16 gradients (precision="bf16": those of the bf16 weight copies) are
    summed in across ranks; float32 gradients are always summed in float32.
    "fp32" (default): widened to float32, summed, divided, rounded to bf16 once: the mean is
    the exact mean rounded to bf16 (relative error at most 2^-8), as DDP's float32 gradients
    would give. CUDA moves 4 bytes per element and packs every bf16 bucket into a float32
    buffer. "bf16": sent and summed in bf16, half the bytes on the wire, but every partial sum
    is rounded too: with W ranks the error grows to about W * 2^-8 of the largest partial
    sum, and a small gradient added to a large one can vanish; CUDA issues one NCCL_BFLOAT16
    all-reduce per gradient (no packing).

    shard_optimizer: ZeRO stage 1 (compile/distribute.py shard_optimizer_state): each bucket
    of gradients is reduce-scattered, each rank updates its chunk of the bucket's parameters
    (zero.plan_shards) keeping optimizer state for that chunk only (1/world of it, in state
    entries "optimizer.<slot>.zero.bucket<b>": state_dict() holds this rank's chunks), then
    the parameters are all-gathered. The results are the unsharded step's (the same bits
    without clipping; the clipping norm is summed from the shards' squared norms). One
    parameter group and precision "fp32" only (PlanError otherwise). CUDA: NCCL
    reduceScatter / allGather inside the captured graph.

    broadcast_buffers (DDP's, default True): rank 0's buffers (running statistics) on every
    rank after every step (the module docstring); False: each rank keeps its own."""

    bucket_cap_mb: float = BUCKET_CAP_MB
    strategy: str = "flat"
    group: ProcessGroup | None = None
    reduce_dtype: str = "fp32"
    shard_optimizer: bool = False
    broadcast_buffers: bool = True

    def __post_init__(self):
        cap_bytes_of(self.bucket_cap_mb)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"reduce_dtype must be one of {REDUCE_DTYPES}, got "
                             f"{self.reduce_dtype!r}")


def launched_world_size(environ=None) -> int:
    """WORLD_SIZE as the launcher set it (1 when not launched); no rendezvous."""
    env = detect_launch(environ)
    return 1 if env is None else env.world_size


__all__ = ["BUCKET_CAP_MB", "Bucket", "BucketShards", "DataParallel", "DistEnv",
           "DistributedError", "GradientInfo", "ProcessGroup", "ShardSlice", "default_timeout",
           "destroy", "detect_launch", "get_group", "get_rank", "get_world_size", "init",
           "is_initialized", "launched_world_size", "lookup_group", "plan_buckets",
           "plan_shards", "rendezvous", "slurm_hosts", "ReduceOp", "Work", "all_reduce",
           "barrier", "broadcast", "destroy_process_group", "get_backend", "init_process_group",
           "is_available"]


def __getattr__(name: str):
    """A torch.distributed name stepgraph lacks: UnsupportedOpError, an AttributeError."""
    from ..errors import lookup_torch_name
    return lookup_torch_name(__name__, "torch.distributed", name)
