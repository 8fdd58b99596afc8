"""One rank of a small data-parallel training run, for the distributed tests.

    stepgraph launch --gpus 2 -- python tests/unit/dist_worker.py --out DIR [options]

trains a model for --steps steps on synthetic data through a sharded BatchLoader and writes
DIR/rank<R>.npz: the model's state_dict, the per-rank losses under "loss/<i>", and the step's
op list (plan) under "plan/ops". `train(...)` runs the same thing in this process, one rank
(world of one, global batch), for the reference.

For finding a hang (scripts/dp-check): --progress prints each stage to stderr, reading every
step's loss (a sync, so a stuck step is named); --stacks DIR (default $STEPGRAPH_STACKS_DIR)
appends every thread's Python stack to DIR/rank<R>-stacks.txt after --stacks-after seconds
(default $STEPGRAPH_STACKS_AFTER or 35) and when the process is sent SIGTERM (a launcher or
test stopping it), then ends as SIGTERM would.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import stepgraph as sg  # noqa: E402
from stepgraph import losses, models, optim  # noqa: E402
from stepgraph.data import BatchLoader  # noqa: E402
from stepgraph.nn import init as nn_init  # noqa: E402
from stepgraph.train import small_cnn  # noqa: E402

CLASSES = 10
STARTED = time.monotonic()     # progress lines count from the worker's imports
DUMP_FILES: list = []          # kept open: faulthandler writes to their descriptors


def make_model(name: str, size: int):
    if name == "mlp":
        return models.mlp(size * size, 64, CLASSES, dropout=0.0), "flat"
    if name == "cnn":
        return small_cnn(CLASSES), "image"
    if name == "resnet":
        return models.resnet(CLASSES, widths=(8, 16, 32), in_channels=1), "image"
    if name == "bncnn":     # BatchNorm's running statistics, small enough for the CPU tests
        return sg.nn.Sequential(sg.nn.Conv2d(1, 8, 3, padding=1, bias=False),
                                sg.nn.BatchNorm2d(8), sg.nn.ReLU(), sg.nn.MaxPool2d(2),
                                sg.nn.Flatten(), sg.nn.Linear(8 * (size // 2) ** 2, 16),
                                sg.nn.BatchNorm1d(16), sg.nn.ReLU(),
                                sg.nn.Linear(16, CLASSES)), "image"
    raise ValueError(name)


def make_data(n: int, size: int, layout: str, seed: int = 1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 1, size, size)).astype(np.float32)
    y = rng.integers(0, CLASSES, n).astype(np.int64)
    return (x.reshape(n, -1) if layout == "flat" else x), y


def log(line: str) -> None:
    """A progress line on stderr, naming the rank and the seconds since STARTED."""
    print(f"[rank {os.environ.get('RANK', '-')} {time.monotonic() - STARTED:6.2f}s] {line}",
          file=sys.stderr, flush=True)


def dump_stacks_on_hang(folder: str, after: float) -> None:
    """Every thread's stack into folder/rank<R>-stacks.txt after `after` seconds (the process
    goes on) and at SIGTERM (then it ends as SIGTERM would)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / f"rank{os.environ.get('RANK', '0')}-stacks.txt"
    out = open(path, "a", buffering=1)
    out.write(f"== pid {os.getpid()} {' '.join(sys.argv[1:])}\n")
    faulthandler.dump_traceback_later(after, file=out)
    faulthandler.register(signal.SIGTERM, file=out, all_threads=True, chain=True)
    DUMP_FILES.append(out)


def train(model_name: str, steps: int, global_batch: int, device: str = "cpu",
          distributed: bool = False, init_seed: int = 0, size: int = 8,
          duplicate: bool = False, graph: bool | None = None, strategy: str = "flat",
          bucket_cap_mb: float = 25.0, precision: str = "fp32", reduce_dtype: str = "fp32",
          optimizer: str = "sgd", max_grad_norm: float | None = None,
          shard_optimizer: bool = False, progress: bool = False, sync_bn: bool = False):
    """(model, step, losses) after `steps` steps. Distributed: this rank's shard of each
    global batch (duplicate: every rank gets the whole global batch, so per-rank BatchNorm
    statistics equal a single process's). progress: log each stage and each step's loss
    (read at once: a sync per step). sync_bn: the model's BatchNorms converted to
    nn.SyncBatchNorm (statistics of the global batch)."""
    group = sg.distributed.init() if distributed else None
    rank, world = (group.rank, group.world_size) if group else (0, 1)
    nn_init.manual_seed(init_seed)
    model, layout = make_model(model_name, size)
    if sync_bn:
        model = sg.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    x, y = make_data(steps * global_batch, size, layout)
    if duplicate or world == 1:
        loader = BatchLoader(x, y, global_batch, seed=3, device=device)
    else:
        loader = BatchLoader(x, y, global_batch // world, seed=3, device=device, rank=rank,
                             world_size=world)
    loss_fn = losses.cross_entropy
    opt = (optim.SGD(lr=0.05, momentum=0.9, max_grad_norm=max_grad_norm) if optimizer == "sgd"
           else optim.AdamW(lr=1e-2, weight_decay=0.01, max_grad_norm=max_grad_norm))
    dp = sg.distributed.DataParallel(bucket_cap_mb, strategy, reduce_dtype=reduce_dtype,
                                     shard_optimizer=shard_optimizer) if distributed else False
    step = sg.compile_train_step(model, loss_fn, opt, (x[:loader.batch_size],
                                                       y[:loader.batch_size]),
                                 device=device, graph=graph, distributed=dp,
                                 precision=precision)
    if progress:
        log("compiled (parameters broadcast from rank 0)")
    out = []
    for i, (bx, by) in enumerate(loader.epoch(0)):
        out.append(step(bx, by))
        if progress:     # on CUDA step 0 runs eagerly, step 1 is captured, later ones replay
            log(f"step {i} loss {float(out[-1]):.6f}")
    return model, step, [float(v) for v in out]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--duplicate", action="store_true")
    parser.add_argument("--strategy", default="flat")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--reduce-dtype", default="fp32")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"))
    parser.add_argument("--max-grad-norm", type=float, default=None)
    parser.add_argument("--shard-optimizer", action="store_true")
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--sync-bn", action="store_true")
    parser.add_argument("--stacks", default=os.environ.get("STEPGRAPH_STACKS_DIR"))
    parser.add_argument("--stacks-after", type=float,
                        default=float(os.environ.get("STEPGRAPH_STACKS_AFTER", "35")))
    args = parser.parse_args(argv)
    if args.stacks:
        dump_stacks_on_hang(args.stacks, args.stacks_after)
    if args.progress:
        log(f"started: LOCAL_RANK={os.environ.get('LOCAL_RANK')} "
            f"WORLD_SIZE={os.environ.get('WORLD_SIZE')} "
            f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    rank = sg.distributed.init().rank
    if args.progress:
        log(f"rendezvous done; {versions()}")
    # Each rank initialises differently: the broadcast from rank 0 must make them agree.
    model, step, losses_ = train(args.model, args.steps, args.global_batch, args.device, True,
                                 init_seed=rank, size=args.size, duplicate=args.duplicate,
                                 strategy=args.strategy, bucket_cap_mb=args.bucket_cap_mb,
                                 precision=args.precision, reduce_dtype=args.reduce_dtype,
                                 optimizer=args.optimizer, max_grad_norm=args.max_grad_norm,
                                 shard_optimizer=args.shard_optimizer,
                                 progress=args.progress, sync_bn=args.sync_bn)
    exe = next(iter(step.executables.values()))
    record = {f"state/{k}": v for k, v in model.state_dict().items()}
    record.update({f"loss/{i}": np.float32(v) for i, v in enumerate(losses_)})
    record.update({f"optimizer/{k}": v for k, v in step.state_dict().items()
                   if k.startswith("optimizer.") and k != "optimizer.step"})
    record["plan/ops"] = np.array([n.op for n in exe.plan.steps])
    captured = getattr(exe, "captured", None)
    if captured is not None and getattr(captured, "node_count", None) is not None:
        record["graph/nodes"] = np.int64(captured.node_count)
    record["time/last_step"] = np.float64(time.time())    # for the exit-time test
    np.savez(Path(args.out) / f"rank{rank}.npz", **record)
    if args.progress:     # else at exit: the same teardown, unlogged
        log(f"wrote rank{rank}.npz; destroying the process group")
        sg.distributed.destroy()
        log("process group destroyed")
    return 0


def versions() -> str:
    """The current GPU, CuPy's and NCCL's versions (what a GPU log should name)."""
    try:
        import cupy
        from cupy.cuda import nccl

        nccl_version = nccl.get_version() if getattr(nccl, "available", True) else "missing"
        return (f"GPU {cupy.cuda.Device().id} of {cupy.cuda.runtime.getDeviceCount()}, "
                f"CuPy {cupy.__version__}, NCCL {nccl_version}")
    except Exception as err:        # a CPU run: nothing of the GPU to name
        return f"no GPU stack ({type(err).__name__}: {err})"


if __name__ == "__main__":
    raise SystemExit(main())
