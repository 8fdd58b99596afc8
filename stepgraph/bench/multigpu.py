"""`stepgraph bench --gpus N`: data-parallel throughput and scaling on 1..N GPUs.

For each framework (stepgraph's data-parallel step, PyTorch DDP in eager mode), each workload
(resnet, gpt; BENCHMARKS.md's per-GPU batch) and each world size (1, 2, 4, ... and N), the
ranks are started as processes (`stepgraph launch` for stepgraph, torchrun for PyTorch); each
rank trains on its own batch of the workload's size (weak scaling, as DDP is used), and rank 0
writes its timing to a JSON file this process reads. A row's throughput is samples (gpt:
tokens) per second over all ranks; its scaling is that throughput over `gpus` times the same
framework's one-GPU throughput (1.0 is perfect).

    stepgraph bench --gpus 8 [--models resnet,gpt] [--frameworks stepgraph,torch-ddp]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

FRAMEWORKS = ("stepgraph", "torch-ddp")
MODELS = ("resnet", "gpt")


@dataclass(frozen=True)
class MultiGpuConfig:
    """What `stepgraph bench --gpus N` runs."""

    gpus: int
    models: tuple[str, ...] = MODELS
    frameworks: tuple[str, ...] = FRAMEWORKS
    steps: int = 50
    warmup: int = 10
    timeout: float = 900.0    # seconds for one (framework, model, world size) launch


@dataclass(frozen=True)
class ScalingRow:
    """One (framework, model, world size) measurement; error set when the run failed."""

    framework: str
    model: str
    gpus: int
    throughput: float = 0.0      # samples (gpt: tokens) per second over all ranks
    unit: str = "samples/s"
    step_ms: float = 0.0
    scaling: float | None = None
    error: str = ""


def _names(value: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{what}: expected a comma list of {', '.join(allowed)}"
                                         f", got {value!r}")
    return names


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def parse_config(argv: list[str]) -> MultiGpuConfig:
    """The configuration from `stepgraph bench --gpus N ...`'s arguments (SystemExit on a
    usage error, as argparse does)."""
    parser = argparse.ArgumentParser(prog="stepgraph bench --gpus N",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=_positive, required=True,
                        help="largest world size; 1, 2, 4, ... up to it and it are run")
    parser.add_argument("--models", type=lambda v: _names(v, MODELS, "--models"),
                        default=MODELS)
    parser.add_argument("--frameworks", type=lambda v: _names(v, FRAMEWORKS, "--frameworks"),
                        default=FRAMEWORKS)
    parser.add_argument("--steps", type=_positive, default=50, help="timed steps per rank")
    parser.add_argument("--warmup", type=_positive, default=10, help="untimed steps first")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one world size may take before it is stopped")
    args = parser.parse_args(argv)
    return MultiGpuConfig(args.gpus, args.models, args.frameworks, args.steps, args.warmup,
                          args.timeout)


def world_sizes(gpus: int) -> list[int]:
    """1, 2, 4, ... below `gpus`, then `gpus`."""
    sizes, w = [], 1
    while w < gpus:
        sizes.append(w)
        w *= 2
    return sizes + [gpus]


def with_scaling(rows: list[ScalingRow]) -> list[ScalingRow]:
    """Rows with scaling = throughput / (gpus * the one-GPU throughput of the same framework
    and model); None where there is no successful one-GPU row."""
    single = {(r.framework, r.model): r.throughput for r in rows
              if r.gpus == 1 and not r.error and r.throughput > 0}
    out = []
    for r in rows:
        base = single.get((r.framework, r.model))
        scaling = r.throughput / (r.gpus * base) if base and not r.error else None
        out.append(ScalingRow(r.framework, r.model, r.gpus, r.throughput, r.unit, r.step_ms,
                              scaling, r.error))
    return out


def render_table(rows: list[ScalingRow]) -> str:
    """The rows as a fixed-width text table, one line per row."""
    header = ("framework", "model", "GPUs", "throughput", "step ms", "scaling")
    lines = []
    for r in rows:
        if r.error:
            lines.append((r.framework, r.model, str(r.gpus), "failed: " + r.error, "", ""))
            continue
        lines.append((r.framework, r.model, str(r.gpus), f"{r.throughput:,.0f} {r.unit}",
                      f"{r.step_ms:.2f}", "" if r.scaling is None else f"{r.scaling:.2f}"))
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))]
                     + [fmt.format(*row).rstrip() for row in lines])


def launch_command(framework: str, model: str, world: int, config: MultiGpuConfig,
                   result: Path) -> list[str]:
    """The command that starts `world` ranks of one measurement."""
    worker = ["-m", "stepgraph.bench.multigpu", "--worker", framework, model, "--steps",
              str(config.steps), "--warmup", str(config.warmup), "--result", str(result)]
    if framework == "stepgraph":
        return [sys.executable, "-m", "stepgraph", "launch", "--gpus", str(world), "--",
                sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={world}", *worker]


def measure(framework: str, model: str, world: int, config: MultiGpuConfig) -> ScalingRow:
    """One measurement, run as `world` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rank0.json"
        try:
            # NVLink multicast stays off for torchrun's ranks too, as `stepgraph launch` sets.
            done = subprocess.run(launch_command(framework, model, world, config, result),
                                  capture_output=True, text=True, timeout=config.timeout,
                                  env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
        except subprocess.TimeoutExpired:
            return ScalingRow(framework, model, world, error=f"timed out after "
                                                            f"{config.timeout:g} s")
        if done.returncode != 0 or not result.exists():
            last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
            return ScalingRow(framework, model, world, error=last[:120])
        timing = json.loads(result.read_text())
    return ScalingRow(framework, model, world, timing["throughput"], timing["unit"],
                      timing["step_ms"])


def run(config: MultiGpuConfig) -> list[ScalingRow]:
    rows = [measure(f, m, w, config) for m in config.models for f in config.frameworks
            for w in world_sizes(config.gpus)]
    return with_scaling(rows)


# ---- one rank ------------------------------------------------------------------------------

def _stepgraph_rank(model: str):
    """(run one step, synchronise, close) of this rank's stepgraph data-parallel step."""
    import cupy

    import stepgraph as sg
    from .peers import stepgraph_runner as runner
    from .workloads import get_workload, make_batches

    sg.distributed.init()
    workload = get_workload(model)
    net = runner.build_model(workload)
    batch = make_batches(workload, 1, seed=sg.distributed.get_rank())[0]
    x, y = cupy.asarray(batch.x), cupy.asarray(batch.y)
    step = sg.compile_train_step(net, runner.build_loss(workload),
                                 runner.build_optimizer(workload.optimizer, net), (x, y),
                                 device="cuda", graph=True, distributed=True)
    return (lambda: step(x, y)), cupy.cuda.Device().synchronize, sg.distributed.destroy


def _torch_rank(model: str):
    """(run one step, synchronise, close) of this rank's PyTorch DDP (eager) step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from .peers import torch_eager
    from .workloads import get_workload, initial_parameters, make_batches

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch_eager.set_precision("fp32")      # strict float32, cudnn.benchmark: as the 1-GPU bench
    dist.init_process_group("nccl")
    workload = get_workload(model)
    net = torch_eager.build_model(workload, initial_parameters(workload), "cuda")
    ddp = DistributedDataParallel(net, device_ids=[local])
    loss_fn = torch_eager.loss_function(workload)
    optimizer = torch_eager.make_optimizer(workload.optimizer, ddp.parameters())
    batch = make_batches(workload, 1, seed=dist.get_rank())[0]
    x, y = torch.from_numpy(batch.x).cuda(), torch.from_numpy(batch.y).long().cuda()

    def one_step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        if workload.optimizer.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), workload.optimizer.max_grad_norm)
        optimizer.step()

    return one_step, torch.cuda.synchronize, dist.destroy_process_group


def worker(framework: str, model: str, steps: int, warmup: int, result: Path) -> None:
    """Time `steps` steps after `warmup` on this rank; rank 0 writes the JSON result."""
    from .workloads import get_workload

    rank_of = {"stepgraph": _stepgraph_rank, "torch-ddp": _torch_rank}[framework]
    one_step, synchronize, close = rank_of(model)
    for _ in range(warmup):
        one_step()
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        one_step()
    synchronize()
    seconds = (time.perf_counter() - start) / steps
    workload, world = get_workload(model), int(os.environ.get("WORLD_SIZE", "1"))
    items = workload.tokens_per_step or workload.batch
    if int(os.environ.get("RANK", "0")) == 0:
        result.write_text(json.dumps({
            "throughput": world * items / seconds, "step_ms": seconds * 1e3,
            "unit": "tokens/s" if workload.tokens_per_step else "samples/s"}))
    close()


def main(argv: list[str] | None = None) -> int:
    """`stepgraph bench --gpus N`: run every measurement and print the table; 2 on a usage
    error. `--worker FRAMEWORK MODEL ...` is one rank of a measurement."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        parser = argparse.ArgumentParser(prog="stepgraph.bench.multigpu --worker")
        parser.add_argument("framework", choices=FRAMEWORKS)
        parser.add_argument("model", choices=MODELS)
        parser.add_argument("--steps", type=_positive, required=True)
        parser.add_argument("--warmup", type=_positive, required=True)
        parser.add_argument("--result", type=Path, required=True)
        args = parser.parse_args(argv[1:])
        worker(args.framework, args.model, args.steps, args.warmup, args.result)
        return 0
    try:
        config = parse_config(argv)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 2
    print(render_table(run(config)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
