"""`stepgraph bench --gpus N`: data-parallel throughput, scaling and exposed communication.

On 1..N GPUs, for each framework (stepgraph's data-parallel step; PyTorch DDP in eager mode;
PyTorch DDP under torch.compile, `torch.compile(DDP(model))` as PyTorch documents compiled
DDP), each workload (resnet, gpt; BENCHMARKS.md's per-GPU batch), each precision and each
world size (1, 2, 4, ... and N), the ranks are started as processes (`stepgraph launch` for
stepgraph, torchrun for PyTorch; one rank is multigpu_rank.py); each rank trains on its own
batch of the workload's size (weak scaling, as DDP is used), and rank 0 writes its timing to a
JSON file this process reads. A row's throughput is samples (gpt: tokens) per second over all
ranks; its scaling is that throughput over `gpus` times the same framework's one-GPU
throughput (1.0 is perfect).

Exposed communication, how much the gradient all-reduces add to a step beyond its compute:
- "vs 1 GPU" (every row above one GPU): its step time minus the same framework's one-GPU step
  time at the same per-GPU batch. It also holds whatever else changes with the world size
  (the NCCL setup, host contention between the ranks).
- "vs no-op" (--no-comm): its step time minus the step time of the same N ranks with each
  gradient bucket's all-reduce replaced by a no-op (multigpu_rank.py says how in each
  framework): the all-reduces' own cost, as far as the backward pass does not hide it.
--bucket-caps runs the N-GPU measurement at each bucket cap (MiB; both frameworks default to
25) and names the fastest per framework, workload and precision.

    stepgraph bench --gpus 4 [--models resnet,gpt] [--precision fp32,bf16]
        [--frameworks stepgraph,torch-ddp,torch-ddp-compile] [--no-comm]
        [--bucket-caps [1,5,25,100]] [--compile-mode default] [--out bench-out]

The table is printed to stdout and written, with every row's notes, to a JSON file in OUT
(json_path names it); a failed launch's stderr is kept beside it in OUT/multigpu-logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .multigpu_rank import BUCKET_CAP_MB, FRAMEWORKS, MODELS, parse_worker, run_rank
from .workloads import PRECISIONS

BUCKET_SWEEP = (1.0, 5.0, 25.0, 100.0)     # --bucket-caps without a list
# torch.compile's DDPOptimizer wants DDP's first bucket (1 MiB, kept small so that the first
# all-reduce starts early) no larger than the others: it refuses a smaller bucket_cap_mb.
MIN_COMPILED_CAP_MB = 1.0
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
LOG_FOLDER = "multigpu-logs"


@dataclass(frozen=True)
class MultiGpuConfig:
    """What `stepgraph bench --gpus N` runs."""

    gpus: int
    models: tuple[str, ...] = MODELS
    frameworks: tuple[str, ...] = FRAMEWORKS
    steps: int = 50
    warmup: int = 10
    timeout: float = 900.0    # seconds for one launch (one Measurement)
    precisions: tuple[str, ...] = ("fp32",)
    bucket_caps: tuple[float, ...] = ()      # the sweep at `gpus` GPUs (MiB); () none
    no_comm: bool = False                    # also each world size > 1 with no-op all-reduces
    compile_mode: str = "default"            # torch.compile's mode for torch-ddp-compile
    out: str = "bench-out"
    device: str = "cuda"                     # "cpu" and tiny: smoke tests only
    tiny: bool = False


@dataclass(frozen=True)
class Measurement:
    """One launch: a framework's step on a workload at a precision on `gpus` ranks, with
    gradient buckets of `bucket_cap_mb`, its all-reduces issued or (collectives False)
    replaced by no-ops."""

    framework: str
    model: str
    precision: str
    gpus: int
    bucket_cap_mb: float = BUCKET_CAP_MB
    collectives: bool = True

    def label(self) -> str:
        comm = "" if self.collectives else ", no-op all-reduces"
        return (f"{self.framework} {self.model} {self.precision} {self.gpus} GPU(s), bucket "
                f"{self.bucket_cap_mb:g} MiB{comm}")


@dataclass(frozen=True)
class ScalingRow:
    """One measurement's result; error set when the run failed."""

    framework: str
    model: str
    gpus: int
    throughput: float = 0.0      # samples (gpt: tokens) per second over all ranks
    unit: str = "samples/s"
    step_ms: float = 0.0
    scaling: float | None = None
    error: str = ""
    precision: str = "fp32"
    bucket_cap_mb: float = BUCKET_CAP_MB
    collectives: bool = True
    exposed_ms: float | None = None          # step ms - the 1-GPU step ms
    exposed_noop_ms: float | None = None     # step ms - the no-op all-reduces' step ms
    silenced_all_reduces: int = 0            # no-op rows: bucket all-reduces not issued
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class BucketChoice:
    """The fastest bucket cap of a framework on a workload and precision at `gpus` GPUs."""

    framework: str
    model: str
    precision: str
    gpus: int
    best_mb: float
    step_ms: float
    step_ms_by_cap: tuple[tuple[float, float], ...]    # (cap MiB, step ms), caps ascending


def _names(value: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [n for n in names if n not in allowed]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{what}: expected a comma list of {', '.join(allowed)}"
                                         f", got {value!r}")
    return names


def _caps(value: str) -> tuple[float, ...]:
    try:
        caps = tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        caps = ()
    if not caps or any(not c > 0 for c in caps):
        raise argparse.ArgumentTypeError(f"--bucket-caps: expected a comma list of positive "
                                         f"MiB, got {value!r}")
    return tuple(sorted(set(caps)))


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def build_parser() -> argparse.ArgumentParser:
    """The `stepgraph bench --gpus N` command line."""
    parser = argparse.ArgumentParser(prog="stepgraph bench --gpus N",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=_positive, required=True,
                        help="largest world size; 1, 2, 4, ... up to it and it are run")
    parser.add_argument("--models", type=lambda v: _names(v, MODELS, "--models"),
                        default=MODELS, help=f"comma-separated: {','.join(MODELS)} (default: "
                                             "both)")
    parser.add_argument("--frameworks", type=lambda v: _names(v, FRAMEWORKS, "--frameworks"),
                        default=FRAMEWORKS,
                        help=f"comma-separated: {','.join(FRAMEWORKS)} (default: all); "
                             "torch-ddp-compile is torch.compile(DDP(model))")
    parser.add_argument("--precision", type=lambda v: _names(v, PRECISIONS, "--precision"),
                        default=("fp32",), help="comma-separated: fp32,tf32,bf16 (default: "
                                                "fp32)")
    parser.add_argument("--steps", type=_positive, default=50, help="timed steps per rank")
    parser.add_argument("--warmup", type=_positive, default=10, help="untimed steps first")
    parser.add_argument("--no-comm", action="store_true",
                        help="also run every world size above one with each gradient "
                             "bucket's all-reduce replaced by a no-op, for the exposed "
                             "communication 'vs no-op' column")
    parser.add_argument("--bucket-caps", type=_caps, nargs="?", default=(),
                        const=BUCKET_SWEEP,
                        help="bucket caps in MiB to sweep at --gpus GPUs, naming the fastest "
                             "(without a list: "
                             f"{','.join(f'{c:g}' for c in BUCKET_SWEEP)}; default: only "
                             f"{BUCKET_CAP_MB:g}, both frameworks' default)")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                        help="torch.compile mode of torch-ddp-compile (default: default)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one launch may take before it is stopped")
    parser.add_argument("--out", default="bench-out",
                        help="folder of the JSON file (default: bench-out)")
    # Smoke tests only: CPU processes (stepgraph's CPU backend, gloo) at tiny sizes.
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    return parser


def parse_config(argv: list[str]) -> MultiGpuConfig:
    """The configuration from `stepgraph bench --gpus N ...`'s arguments (SystemExit on a
    usage error, as argparse does)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.gpus == 1 and (args.no_comm or args.bucket_caps):
        parser.error("--no-comm and --bucket-caps need --gpus 2 or more (one GPU has no "
                     "all-reduce)")
    if "torch-ddp-compile" in args.frameworks and args.bucket_caps \
            and min(args.bucket_caps) < MIN_COMPILED_CAP_MB:
        parser.error(f"--bucket-caps below {MIN_COMPILED_CAP_MB:g} MiB: torch.compile's "
                     "DDPOptimizer refuses buckets smaller than DDP's first one (1 MiB); "
                     "leave torch-ddp-compile out of --frameworks to measure them")
    return MultiGpuConfig(args.gpus, args.models, args.frameworks, args.steps, args.warmup,
                          args.timeout, args.precision, args.bucket_caps, args.no_comm,
                          args.compile_mode, args.out, args.device, args.tiny)


def world_sizes(gpus: int) -> list[int]:
    """1, 2, 4, ... below `gpus`, then `gpus`."""
    sizes, w = [], 1
    while w < gpus:
        sizes.append(w)
        w *= 2
    return sizes + [gpus]


def plan(config: MultiGpuConfig) -> list[Measurement]:
    """Every launch of a run, per workload, precision and framework: each world size at the
    default bucket cap; with no_comm each world size above one again with no-op all-reduces;
    with bucket_caps the largest world size at each other cap."""
    runs = []
    for model in config.models:
        for precision in config.precisions:
            for framework in config.frameworks:
                runs += _framework_plan(Measurement(framework, model, precision, 1), config)
    return runs


def _framework_plan(first: Measurement, config: MultiGpuConfig) -> list[Measurement]:
    sizes = world_sizes(config.gpus)
    runs = [replace(first, gpus=w) for w in sizes]
    if config.no_comm:
        runs += [replace(first, gpus=w, collectives=False) for w in sizes if w > 1]
    return runs + [replace(first, gpus=config.gpus, bucket_cap_mb=cap)
                   for cap in config.bucket_caps if cap != BUCKET_CAP_MB]


def with_scaling(rows: list[ScalingRow]) -> list[ScalingRow]:
    """Rows with scaling = throughput / (gpus * the one-GPU throughput of the same framework,
    model and precision); None where there is no successful one-GPU row."""
    single = {(r.framework, r.model, r.precision): r.throughput for r in rows
              if r.gpus == 1 and r.collectives and not r.error and r.throughput > 0}
    out = []
    for r in rows:
        base = single.get((r.framework, r.model, r.precision))
        out.append(replace(r, scaling=r.throughput / (r.gpus * base)
                           if base and not r.error else None))
    return out


def with_exposed(rows: list[ScalingRow]) -> list[ScalingRow]:
    """Rows above one GPU with their exposed communication: exposed_ms = step ms minus the
    one-GPU step ms of the same framework, model and precision; exposed_noop_ms = step ms
    minus the step ms of the no-op all-reduce row at the same world size. None where the
    reference row is missing or failed."""
    ok = [r for r in rows if not r.error and r.step_ms > 0]
    single = {(r.framework, r.model, r.precision): r.step_ms for r in ok
              if r.gpus == 1 and r.collectives}
    noop = {(r.framework, r.model, r.precision, r.gpus): r.step_ms for r in ok
            if not r.collectives}
    out = []
    for r in rows:
        if r.error or r.gpus == 1 or not r.collectives:
            out.append(r)
            continue
        base = single.get((r.framework, r.model, r.precision))
        floor = noop.get((r.framework, r.model, r.precision, r.gpus))
        out.append(replace(r, exposed_ms=None if base is None else r.step_ms - base,
                           exposed_noop_ms=None if floor is None else r.step_ms - floor))
    return out


def best_bucket_caps(rows: list[ScalingRow]) -> list[BucketChoice]:
    """Per framework, model, precision and world size measured at more than one bucket cap
    (with its all-reduces): the cap of the shortest step."""
    groups: dict[tuple, dict[float, float]] = {}
    for r in rows:
        if r.collectives and not r.error and r.step_ms > 0:
            key = (r.framework, r.model, r.precision, r.gpus)
            groups.setdefault(key, {})[r.bucket_cap_mb] = r.step_ms
    choices = []
    for key, by_cap in groups.items():
        if len(by_cap) > 1:
            best = min(by_cap, key=by_cap.get)
            choices.append(BucketChoice(*key, best, by_cap[best], tuple(sorted(by_cap.items()))))
    return choices


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:+.2f}"


def render_table(rows: list[ScalingRow]) -> str:
    """The rows as a fixed-width text table, one line per row."""
    header = ("framework", "model", "precision", "GPUs", "bucket_MiB", "all-reduce",
              "throughput", "step_ms", "scaling", "exposed_ms_vs_1_GPU", "exposed_ms_vs_no-op")
    lines = []
    for r in rows:
        head = (r.framework, r.model, r.precision, str(r.gpus), f"{r.bucket_cap_mb:g}",
                "on" if r.collectives else "no-op")
        if r.error:
            lines.append((*head, "failed: " + r.error, "", "", "", ""))
            continue
        lines.append((*head, f"{r.throughput:,.0f} {r.unit}", f"{r.step_ms:.2f}",
                      "" if r.scaling is None else f"{r.scaling:.2f}", _ms(r.exposed_ms),
                      _ms(r.exposed_noop_ms)))
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" if i < 3 or i == 5 else f"{{:>{w}}}"
                    for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))]
                     + [fmt.format(*row).rstrip() for row in lines])


def render_bucket_choices(choices: list[BucketChoice]) -> str:
    """One line per sweep: the fastest cap, then the step ms at every cap."""
    lines = []
    for c in choices:
        steps = ", ".join(f"{cap:g}: {ms:.2f}" for cap, ms in c.step_ms_by_cap)
        lines.append(f"best bucket cap, {c.framework} {c.model} {c.precision} at {c.gpus} "
                     f"GPUs: {c.best_mb:g} MiB ({c.step_ms:.2f} ms; step ms by cap: {steps})")
    return "\n".join(lines)


LEGEND = ("exposed_ms_vs_1_GPU: step ms minus the same framework's 1-GPU step ms (same per-GPU "
          "batch); exposed_ms_vs_no-op: step ms minus the step ms of the same GPUs with the "
          "gradient all-reduces replaced by no-ops (--no-comm rows, all-reduce no-op).")


def launch_command(m: Measurement, config: MultiGpuConfig, result: Path) -> list[str]:
    """The command that starts the `m.gpus` ranks of one measurement."""
    options = ["--precision", m.precision, "--bucket-cap-mb", f"{m.bucket_cap_mb:g}"]
    options += [] if m.collectives else ["--no-comm"]
    if m.framework == "torch-ddp-compile":
        options += ["--compile-mode", config.compile_mode]
    options += ["--device", "cpu"] if config.device == "cpu" else []
    options += ["--tiny"] if config.tiny else []
    worker = ["-m", "stepgraph.bench.multigpu", "--worker", m.framework, m.model, "--steps",
              str(config.steps), "--warmup", str(config.warmup), *options, "--result",
              str(result)]
    if m.framework == "stepgraph":
        return [sys.executable, "-m", "stepgraph", "launch", "--gpus", str(m.gpus), "--",
                sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={m.gpus}", *worker]


ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b|\berror\b", re.IGNORECASE)


def error_of(stderr: str, returncode: int) -> str:
    """The line of a failed launch's stderr that says why: the last naming an error (torchrun
    ends with its own summary), else the last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    named = [line for line in lines if ERROR_LINE.search(line)
             and "ChildFailedError" not in line and "error_file" not in line]
    return ((named or lines or [f"exit code {returncode}"])[-1])[:200]


def _log_failure(m: Measurement, config: MultiGpuConfig, text: str) -> None:
    """Keep a failed launch's stderr in OUT/multigpu-logs/ for whoever reads the table."""
    folder = Path(config.out) / LOG_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9.]+", "_", m.label()).strip("_")
    (folder / f"{name}.log").write_text(text)


def launch_env(config: MultiGpuConfig) -> dict[str, str]:
    """The ranks' environment: NVLink multicast off for torchrun's ranks too (as `stepgraph
    launch` sets); CPU ranks one thread each (torchrun's default above one process), so
    that every world size of a CPU smoke run shares the cores alike."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    if config.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    return env


def measure(m: Measurement, config: MultiGpuConfig) -> ScalingRow:
    """One measurement, run as `m.gpus` processes."""
    failed = lambda error: ScalingRow(m.framework, m.model, m.gpus, error=error,  # noqa: E731
                                      precision=m.precision, bucket_cap_mb=m.bucket_cap_mb,
                                      collectives=m.collectives)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "rank0.json"
        try:
            done = subprocess.run(launch_command(m, config, result), capture_output=True,
                                  text=True, timeout=config.timeout, env=launch_env(config))
        except subprocess.TimeoutExpired as expired:
            stderr = expired.stderr or b""
            _log_failure(m, config, stderr.decode(errors="replace")
                         if isinstance(stderr, bytes) else stderr)
            return failed(f"timed out after {config.timeout:g} s")
        if done.returncode != 0 or not result.exists():
            _log_failure(m, config, done.stderr)
            return failed(error_of(done.stderr, done.returncode))
        timing = json.loads(result.read_text())
    return ScalingRow(m.framework, m.model, m.gpus, timing["throughput"], timing["unit"],
                      timing["step_ms"], precision=m.precision, bucket_cap_mb=m.bucket_cap_mb,
                      collectives=m.collectives,
                      silenced_all_reduces=timing.get("silenced_all_reduces", 0),
                      notes=tuple(timing.get("notes", ())))


def run(config: MultiGpuConfig) -> list[ScalingRow]:
    """Every measurement of plan(config), in order, with scaling and exposed communication."""
    runs, rows, started = plan(config), [], time.perf_counter()
    for i, m in enumerate(runs):
        minutes = (time.perf_counter() - started) / 60
        print(f"stepgraph bench --gpus [{i + 1}/{len(runs)}, {minutes:.1f} min]: {m.label()}"
              " ...", file=sys.stderr, flush=True)
        rows.append(measure(m, config))
        row = rows[-1]
        print(f"  -> {'failed: ' + row.error if row.error else f'{row.step_ms:.2f} ms/step'}",
              file=sys.stderr, flush=True)
    return with_exposed(with_scaling(rows))


def json_path(config: MultiGpuConfig) -> Path:
    """OUT/bench_gpus<N>_<models>_<precisions>_<frameworks>[_no-comm][_caps<C-C>].json: runs
    that measure different things into one folder keep apart."""
    caps = "-".join(f"{c:g}" for c in config.bucket_caps)
    return Path(config.out) / (f"bench_gpus{config.gpus}_{'-'.join(config.models)}_"
                               f"{'-'.join(config.precisions)}_{'-'.join(config.frameworks)}"
                               + ("_no-comm" if config.no_comm else "")
                               + (f"_caps{caps}" if caps else "") + ".json")


def report_to_json(config: MultiGpuConfig, rows: list[ScalingRow],
                   choices: list[BucketChoice]) -> dict:
    return {"config": asdict(config), "rows": [asdict(r) for r in rows],
            "best_bucket_caps": [asdict(c) for c in choices],
            "legend": LEGEND}


def main(argv: list[str] | None = None) -> int:
    """`stepgraph bench --gpus N`: run every measurement, print the table and write the JSON;
    2 on a usage error. `--worker FRAMEWORK MODEL ...` is one rank of a measurement."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        run_rank(parse_worker(argv[1:]))
        # The result is written and the process group destroyed: leave without the
        # interpreter's teardown, where a torch rank's gloo threads, still joinable, can abort
        # it ("terminate called without an active exception", exit 134) after a good run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    try:
        config = parse_config(argv)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 2
    rows = run(config)
    choices = best_bucket_caps(rows)
    path = json_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report_to_json(config, rows, choices), indent=2) + "\n")
    print(render_table(rows))
    print(LEGEND)
    if choices:
        print(render_bucket_choices(choices))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
