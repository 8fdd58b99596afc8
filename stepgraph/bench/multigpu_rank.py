"""One rank of a `stepgraph bench --gpus N` measurement (multigpu.py starts them).

    python -m stepgraph.bench.multigpu --worker FRAMEWORK MODEL --steps S --warmup W
        --result FILE [--precision P] [--bucket-cap-mb C] [--no-comm] [--compile-mode M]

Each rank builds the workload's data-parallel step (stepgraph's `distributed=DataParallel(
bucket_cap_mb=C)` step, or PyTorch DDP(bucket_cap_mb=C), eager or under torch.compile), trains
on its own batch of the workload's size, times `steps` steps after `warmup` untimed ones, and
rank 0 writes what it saw to FILE as JSON.

--no-comm replaces each gradient bucket's all-reduce by a no-op, everything else of the step
kept, so that the step time with and without it is the communication the step exposes:
- PyTorch: DDP's own no-op communication hook (torch.distributed.algorithms.ddp_comm_hooks.
  debugging_hooks.noop_hook, documented for exactly this "headroom analysis"); DDP still copies
  the gradients into and out of its buckets.
- stepgraph on CUDA: the bucket's NCCL all-reduce is not issued; its fork onto the
  communication stream, the flat bucket's pack and unpack kernels and the join stay in the
  captured graph. On the CPU backend the bucket's mean over the store becomes a local copy.
Ranks then train apart (each on its own gradients): only the time is meaningful. The other
collectives of a step (the bad-batch guard's verdict, BatchNorm buffers' broadcast, DDP's
buffer broadcast) still run in both frameworks.

--device cpu and --tiny (tests only) run the same code on CPU processes: the CPU backend and
gloo, tiny workload sizes, and torch.compile with the "aot_eager" backend instead of Inductor
(DDPOptimizer still splits the graph at bucket boundaries; no C++ compiles).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .workloads import PRECISIONS, ConvNet, PlainConvNet, ResNet, get_workload, make_batches

FRAMEWORKS = ("stepgraph", "torch-ddp", "torch-ddp-compile")
MODELS = ("resnet", "gpt")
BUCKET_CAP_MB = 25.0        # both frameworks' default (DDP's bucket_cap_mb, stepgraph's)
CPU_COMPILE_BACKEND = "aot_eager"


@dataclass(frozen=True)
class RankOptions:
    """What one rank runs (the worker's arguments)."""

    framework: str
    model: str
    steps: int
    warmup: int
    result: Path
    precision: str = "fp32"
    bucket_cap_mb: float = BUCKET_CAP_MB
    collectives: bool = True           # False: --no-comm
    compile_mode: str = "default"      # torch.compile's mode (torch-ddp-compile on CUDA)
    device: str = "cuda"
    tiny: bool = False


@dataclass
class RankStep:
    """A built rank: run one step, wait for the device, close; what it counted and notes."""

    one_step: Callable[[], object]
    synchronize: Callable[[], object]
    close: Callable[[], object]
    silenced: list[int] = field(default_factory=lambda: [0])   # all-reduces not issued
    notes: list[str] = field(default_factory=list)


# ---- the no-op all-reduce ------------------------------------------------------------------

class _NoAllReduce:
    """An NCCL communicator whose allReduce issues nothing; everything else is the real one's."""

    def __init__(self, communicator, counter: list[int]):
        self._communicator, self._counter = communicator, counter

    def allReduce(self, *args, **kwargs) -> None:     # noqa: N802 (NCCL's name)
        self._counter[0] += 1

    def __getattr__(self, name: str):
        return getattr(self._communicator, name)


def silence_stepgraph_all_reduces(device: str) -> list[int]:
    """Make every gradient bucket's all-reduce of this process a no-op (see the module
    docstring); returns the counter of the all-reduces skipped. Called before the step is
    compiled: the CUDA backend copies its op table when it is made."""
    counter = [0]
    if device == "cuda":
        from ..backends.cuda import collective

        issue = collective._issue_all_reduce

        def issue_nothing(nccl, comm, stream, *args, **kwargs):
            return issue(nccl, _NoAllReduce(comm, counter), stream, *args, **kwargs)

        collective._issue_all_reduce = issue_nothing
        return counter
    from ..ir.ops import IMPLS

    def local_copy(node, ins, outs, ctx) -> None:
        counter[0] += 1
        for out, grad in zip(outs, ins):
            out[...] = grad

    IMPLS["all_reduce"] = local_copy
    return counter


def counting_noop_hook(counter: list[int], bucket):
    """DDP's noop_hook, counting the buckets it was given (`counter` is the hook's state)."""
    from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook

    counter[0] += 1
    return noop_hook(None, bucket)


# ---- the ranks -----------------------------------------------------------------------------

def stepgraph_rank(opts: RankOptions) -> RankStep:
    """This rank's stepgraph data-parallel step (graph=True on CUDA)."""
    import stepgraph as sg
    from .peers import stepgraph_runner as runner

    silenced = silence_stepgraph_all_reduces(opts.device) if not opts.collectives else [0]
    sg.distributed.init()
    workload = get_workload(opts.model, opts.tiny)
    net = runner.build_model(workload)
    batch = make_batches(workload, 1, seed=sg.distributed.get_rank())[0]
    if opts.device == "cuda":
        import cupy as xp

        synchronize = xp.cuda.runtime.deviceSynchronize   # the step runs on its own stream
    else:
        import numpy as xp

        synchronize = _nothing
    x, y = xp.asarray(batch.x), xp.asarray(batch.y)
    deterministic = os.environ.get("STEPGRAPH_DETERMINISTIC", "1") != "0"
    step = sg.compile_train_step(
        net, runner.build_loss(workload), runner.build_optimizer(workload.optimizer, net),
        (x, y), device=opts.device, graph=opts.device == "cuda", precision=opts.precision,
        deterministic=deterministic,
        distributed=sg.distributed.DataParallel(bucket_cap_mb=opts.bucket_cap_mb,
                                                reduce_dtype=communication_dtype(opts)))
    buckets = sum(node.op == "all_reduce" for node, _, _ in step.executable(step.signature).calls)
    notes = [f"{buckets} gradient buckets, all-reduced in {communication_dtype(opts)}"] + (
        [] if deterministic else ["deterministic=False"])
    if opts.device == "cuda":    # a world of one sets up no communicator: import nccl here
        from cupy.cuda import nccl
        notes.append(f"CuPy {xp.__version__}, NCCL {nccl.get_version()}")
    return RankStep(lambda: step(x, y), synchronize, sg.distributed.destroy, silenced, notes)


def communication_dtype(opts: RankOptions) -> str:
    """What the gradients are all-reduced in: bf16 at precision bf16 on CUDA (PyTorch's side
    then registers DDP's bf16_compress_hook, the usual choice of a bf16 DDP run, which needs
    NCCL: gloo's CPU ranks have none), else float32."""
    return "bf16" if opts.precision == "bf16" and opts.device == "cuda" else "fp32"


def _nothing() -> None:
    return None


def torch_layout(workload, precision: str, device: str) -> str:
    """The 1-GPU bench's default memory format (torch_eager.layout_for without its trial):
    channels_last for conv nets on CUDA where cuDNN's tensor cores want NHWC (tf32, bf16)."""
    from .peers.torch_eager import CHANNELS_LAST, NCHW

    conv = isinstance(workload.model, (ConvNet, ResNet, PlainConvNet))
    return CHANNELS_LAST if device == "cuda" and conv and precision != "fp32" else NCHW


def compile_options(opts: RankOptions) -> dict:
    """torch.compile's arguments: Inductor in `compile_mode` on CUDA, aot_eager on the CPU."""
    if opts.device == "cuda":
        return {"mode": opts.compile_mode}
    return {"backend": CPU_COMPILE_BACKEND}


def torch_rank(opts: RankOptions) -> RankStep:
    """This rank's PyTorch DDP step: eager (torch-ddp), or the DDP-wrapped model under
    torch.compile (torch-ddp-compile: `torch.compile(DDP(model))`, PyTorch's documented way,
    where DDPOptimizer compiles one subgraph per bucket so each bucket's all-reduce can start
    when its gradients are final). Fused AdamW/SGD on CUDA, as the 1-GPU eager peer."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from .peers import torch_eager
    from .workloads import initial_parameters

    cuda = opts.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    notes = torch_eager.set_precision(opts.precision)   # as the 1-GPU bench, cudnn.benchmark
    dist.init_process_group("nccl" if cuda else "gloo")
    workload = get_workload(opts.model, opts.tiny)
    layout = torch_layout(workload, opts.precision, opts.device)
    torch.manual_seed(dist.get_rank())                  # each rank its own dropout masks
    net = torch_eager.build_model(workload, initial_parameters(workload), opts.device,
                                  layout).train()
    ddp = DistributedDataParallel(net, device_ids=[local] if cuda else None,
                                  bucket_cap_mb=opts.bucket_cap_mb)
    silenced = [0]
    if not opts.collectives:
        ddp.register_comm_hook(silenced, counting_noop_hook)
    elif communication_dtype(opts) == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import \
            bf16_compress_hook
        ddp.register_comm_hook(None, bf16_compress_hook)
        notes.append("DDP comm hook bf16_compress_hook")
    model = ddp
    if opts.framework == "torch-ddp-compile":
        model = torch.compile(ddp, **compile_options(opts))
        notes.append(f"torch.compile(DDP(model), {compile_options(opts)})")
    optimizer = torch_eager.make_optimizer(workload.optimizer, ddp.parameters(),
                                           **({"fused": True} if cuda else {}))
    loss_fn = torch_eager.loss_function(workload)
    clip = torch_eager.gradient_clipper(workload.optimizer, net)
    batch = make_batches(workload, 1, seed=dist.get_rank())[0]
    x = torch.from_numpy(batch.x).to(opts.device)
    if x.dim() == 4:
        x = x.contiguous(memory_format=torch_eager.MEMORY_FORMATS[layout])
    y = torch.from_numpy(batch.y).long().to(opts.device)

    def one_step():
        optimizer.zero_grad(set_to_none=True)
        with torch_eager.autocast(opts.precision, opts.device):
            loss = loss_fn(model(x), y)
        loss.backward()
        clip()
        optimizer.step()

    notes.append(f"memory format {layout}; optimizer {'fused' if cuda else 'foreach'}")
    notes.append(f"torch {torch.__version__}" + (f", NCCL {torch.cuda.nccl.version()}"
                                                 if cuda else ", gloo"))
    synchronize = torch.cuda.synchronize if cuda else _nothing

    def close() -> None:
        dist.barrier()      # no rank tears the group down under another's last collective
        dist.destroy_process_group()

    return RankStep(one_step, synchronize, close, silenced, notes)


def run_rank(opts: RankOptions) -> dict | None:
    """Time `steps` steps after `warmup` on this rank; rank 0 writes the JSON result (and
    returns it)."""
    built = (stepgraph_rank if opts.framework == "stepgraph" else torch_rank)(opts)
    for _ in range(opts.warmup):
        built.one_step()
    built.synchronize()
    start = time.perf_counter()
    for _ in range(opts.steps):
        built.one_step()
    built.synchronize()
    seconds = (time.perf_counter() - start) / opts.steps
    workload, world = get_workload(opts.model, opts.tiny), int(os.environ.get("WORLD_SIZE", "1"))
    items = workload.tokens_per_step or workload.batch
    timing = None
    if int(os.environ.get("RANK", "0")) == 0:
        timing = {"throughput": world * items / seconds, "step_ms": seconds * 1e3,
                  "unit": "tokens/s" if workload.tokens_per_step else "samples/s",
                  "silenced_all_reduces": built.silenced[0], "notes": built.notes}
        opts.result.write_text(json.dumps(timing))
    built.close()
    return timing


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def parse_worker(argv: list[str]) -> RankOptions:
    """The worker's arguments (those after `--worker`)."""
    parser = argparse.ArgumentParser(prog="stepgraph.bench.multigpu --worker")
    parser.add_argument("framework", choices=FRAMEWORKS)
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("--steps", type=_positive, required=True)
    parser.add_argument("--warmup", type=_positive, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--bucket-cap-mb", type=float, default=BUCKET_CAP_MB)
    parser.add_argument("--no-comm", action="store_true")
    parser.add_argument("--compile-mode", default="default")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    return RankOptions(args.framework, args.model, args.steps, args.warmup, args.result,
                       args.precision, args.bucket_cap_mb, not args.no_comm, args.compile_mode,
                       args.device, args.tiny)
