"""`stepgraph bench`: run every workload on stepgraph and on each installed peer in one process,
time the steps the same way for all, and report a table (printed last), JSON and a bar chart.

Two configurations of the peers: a default run compiles each peer once, quickly (torch.compile
in one mode, "reduce-overhead"; tinygrad without its BEAM kernel search), each row within
DEFAULT_PEER_TIMEOUT_S, so that it finishes in minutes with a progress line per row; `--fair`
gives each peer its fastest documented configuration (every torch.compile mode, tinygrad's
BEAM search), at up to FAIR_PEER_TIMEOUT_S a row. A peer's measured row is kept in a cache file
(result_cache.py) and reused by a later run with the same peer versions, device, workload,
precision and options; the table marks those rows and names the file.

Timing rule (BENCHMARKS.md): data already on the device, warm-up first, then `repeats` runs of
N steps each with ONE device sync at the end of a run; N is sized so a run lasts about
`target_seconds`. The figure is the median over runs of (run time / N); the spread is the
range of the runs around that median.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from stepgraph.bench import inductor_cache
from stepgraph.bench import workloads as wl
from stepgraph.bench.floor import StepFloor, measure_floors, render_floors
from stepgraph.bench.peers import (
    COMPILE_MODE_TIMEOUT_S,
    COMPILE_MODES,
    DEFAULT_COMPILE_MODES,
    DEFAULT_TINYGRAD_BEAM,
    FAIR_COMPILE_MODES,
    FAIR_TINYGRAD_BEAM,
    PeerInfo,
    PeerTimeout,
    PreparedStep,
    RunSpec,
    Unsupported,
    deadline,
    select_peers,
)
from stepgraph.bench.result_cache import PeerResultCache, peer_key, restore_row, row_fields
from stepgraph.errors import BackendUnavailableError

# One peer's whole budget with --fair: torch compile's search gives each of its modes up to
# COMPILE_MODE_TIMEOUT_S, and the timing comes after (3600 s for five modes of 600 s).
FAIR_PEER_TIMEOUT_S = COMPILE_MODE_TIMEOUT_S * (len(FAIR_COMPILE_MODES) + 1)
# ... and in a default run: a build, one compile without autotuning or kernel search (the
# slowest, torch.compile's Inductor and Triton compiling a step cold, takes about a minute),
# warm-up and timing (about 2 s); a peer that hangs costs at most this.
DEFAULT_PEER_TIMEOUT_S = 180.0
SETUP_STEPS = 3  # JAX compiles on call 1, TinyJit captures on call 2, cudagraph trees record
STATUS_OK, STATUS_MISSING, STATUS_FAILED, STATUS_NA = "ok", "missing", "failed", "n/a"
LIBRARIES = ("stepgraph", "torch", "jax", "jaxlib", "optax", "tinygrad", "cupy", "nvmath-python",
             "numpy", "matplotlib")
CUPY_DISTRIBUTIONS = ("cupy", "cupy-cuda13x", "cupy-cuda12x")


class NoGpuError(BackendUnavailableError):
    """The benchmark was asked to run on CUDA but neither CuPy nor PyTorch sees a CUDA device."""


@dataclass
class BenchConfig:
    """Everything one benchmark run is asked to do."""

    workloads: list[str] = field(default_factory=lambda: list(wl.DEFAULT_WORKLOADS))
    precisions: list[str] = field(default_factory=lambda: ["fp32"])
    peers: list[str] | None = None  # None: all of them
    repeats: int = 5
    target_seconds: float = 0.3  # length of one timed run
    warmup_steps: int = 10
    warmup_seconds: float = 0.2
    max_steps_per_repeat: int = 20000
    batches: int = 4  # pre-made batches the steps rotate among
    seed: int = 0
    out_dir: str = "bench-out"
    device: str = "cuda"  # "cpu" only for smoke tests
    tiny: bool = False  # CPU smoke-test model sizes
    compile_modes: tuple[str, ...] = DEFAULT_COMPILE_MODES  # torch.compile modes to try
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S  # one peer's build + compile + timing; 0: none
    tinygrad_beam: int = DEFAULT_TINYGRAD_BEAM  # tinygrad's BEAM search width; 0: no search
    floor: bool = False  # also measure each (workload, precision)'s step floor (floor.py)
    fair: bool = False  # the peers' fastest configurations (--fair): the three fields above
    use_cache: bool = True  # reuse peers' rows from the cache file (--no-cache: measure again)
    compile_cache: str = ""  # --compile-cache: Inductor's and Triton's cache folder ("": torch's)


@dataclass
class PeerResult:
    """One row of the report: a system on a workload at a precision, measured or not."""

    workload: str
    precision: str
    peer: str
    status: str  # ok | missing | failed | n/a
    reason: str = ""  # why not ok (the exception's last line), empty when ok
    is_stepgraph: bool = False
    step_us: float | None = None  # median over repeats
    step_us_min: float | None = None
    step_us_max: float | None = None
    repeats_us: list[float] = field(default_factory=list)
    steps_per_repeat: int = 0
    tflops: float | None = None
    tokens_per_s: float | None = None  # workloads that train on tokens (gpt)
    speed_vs_best_peer: float | None = None  # best non-stepgraph step_us / this step_us
    setup_s: float | None = None  # build + first SETUP_STEPS steps: compile, capture, tuning
    memory_bytes: int | None = None
    memory_kind: str = ""  # "peak" or "resident"
    final_loss: float | None = None
    kernels_per_step: int | None = None  # kernels or CUDA graph nodes one step launches
    layout_conversions: int | None = None  # of those, NCHW<->NHWC layout transposes
    census_source: str = ""  # how the kernels were counted
    notes: list[str] = field(default_factory=list)
    traceback: str = ""
    # the arithmetic when it differs from what `precision` names (stepgraph's fp32 attention)
    precision_label: str = ""
    cached: str = ""  # reused from the cache file: the date of the run that measured it

    @property
    def spread_percent(self) -> float | None:
        """Half the min-max range of the repeats, relative to the median."""
        if self.step_us is None or self.step_us_min is None or self.step_us_max is None:
            return None
        return 50.0 * (self.step_us_max - self.step_us_min) / self.step_us


@dataclass
class BenchReport:
    """All rows of a run plus what is needed to read them later."""

    date: str
    device: str
    host: str
    python: str
    versions: dict[str, str | None]
    config: BenchConfig
    workloads: dict[str, dict[str, Any]]
    results: list[PeerResult]
    floors: list[StepFloor] = field(default_factory=list)  # with --floor
    cache_file: str = ""  # where peers' rows are kept between runs ("" when off)


# ---------------------------------------------------------------- device


def cuda_device_name() -> str | None:
    """Name of CUDA device 0 as CuPy or PyTorch sees it; None when neither sees one."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # no driver, no CuPy, or a CuPy that cannot load its CUDA libraries
        pass
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return None


def require_device(config: BenchConfig) -> str:
    """The device's name; raises NoGpuError when a CUDA run finds no CUDA device."""
    if config.device == "cpu":
        return f"CPU ({platform.processor() or platform.machine()})"
    name = cuda_device_name()
    if name is None:
        raise NoGpuError("this benchmark needs an NVIDIA GPU: neither CuPy nor PyTorch sees a "
                         "CUDA device on this machine. Run it on a machine with a GPU.")
    return name


def library_versions() -> dict[str, str | None]:
    """Installed versions of the libraries the report compares (None: not installed)."""
    from importlib import metadata
    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        candidates = CUPY_DISTRIBUTIONS if name == "cupy" else (name,)
        versions[name] = None
        for dist in candidates:
            try:
                versions[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return versions


# ---------------------------------------------------------------- timing


@dataclass
class Timing:
    """Measured step times of one prepared peer."""

    repeats_us: list[float]
    steps_per_repeat: int
    final_loss: float

    @property
    def median_us(self) -> float:
        return statistics.median(self.repeats_us)


def warm_up(prepared: PreparedStep, n_batches: int, config: BenchConfig) -> float:
    """Run doubling chunks of steps (one sync each) until both warm-up minimums are met;
    returns the last chunk's seconds per step, used to size the timed runs."""
    done, chunk, elapsed = 0, 1, 0.0
    while True:
        start = time.perf_counter()
        for i in range(chunk):
            prepared.run_step((done + i) % n_batches)
        prepared.synchronize()
        seconds = time.perf_counter() - start
        done, elapsed = done + chunk, elapsed + seconds
        if done >= config.warmup_steps and elapsed >= config.warmup_seconds:
            return seconds / chunk
        chunk = min(chunk * 2, 4096)


def steps_per_repeat(seconds_per_step: float, config: BenchConfig) -> int:
    """N such that one timed run lasts about config.target_seconds (at least 3 steps)."""
    wanted = math.ceil(config.target_seconds / max(seconds_per_step, 1e-7))
    return max(3, min(wanted, config.max_steps_per_repeat))


def time_repeats(prepared: PreparedStep, n_batches: int, steps: int, repeats: int) -> Timing:
    """`repeats` runs of `steps` steps, each closed by a single device sync."""
    repeats_us, loss = [], None
    for _ in range(repeats):
        prepared.synchronize()
        start = time.perf_counter()
        for i in range(steps):
            loss = prepared.run_step(i % n_batches)
        prepared.synchronize()
        repeats_us.append((time.perf_counter() - start) / steps * 1e6)
    return Timing(repeats_us, steps, prepared.read_loss(loss))


# ---------------------------------------------------------------- running peers


def _error_line(error: BaseException) -> str:
    """The traceback's last line, "Type: message", cut to the message's first line (notes and
    multi-line detail stay in the JSON's full traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _load_prepare(peer: PeerInfo):
    module = importlib.import_module(f"stepgraph.bench.peers.{peer.module}")
    return getattr(module, peer.entry)


def measure_peer(peer: PeerInfo, spec: RunSpec, config: BenchConfig) -> PeerResult:
    """Prepare, warm up and time one peer; any failure becomes the row's status and reason."""
    result = PeerResult(spec.workload.name, spec.precision, peer.name, STATUS_OK,
                        is_stepgraph=peer.is_stepgraph)
    prepared = None
    try:
        with deadline(config.peer_timeout_s):
            start = time.perf_counter()
            prepared = _load_prepare(peer)(spec)
            for i in range(SETUP_STEPS):
                prepared.run_step(i % len(spec.batches))
            prepared.synchronize()
            result.setup_s = time.perf_counter() - start
            per_step = warm_up(prepared, len(spec.batches), config)
            steps = steps_per_repeat(per_step, config)
            _record_timing(result, time_repeats(prepared, len(spec.batches), steps,
                                                config.repeats), spec.workload)
            result.notes = list(prepared.notes)
            result.precision_label = prepared.precision_label
            _record_memory(result, prepared)
            _record_census(result, prepared)
    except Unsupported as error:
        result.status, result.reason = STATUS_NA, str(error)
    except ImportError as error:
        result.status, result.reason = STATUS_MISSING, _error_line(error)
    except (Exception, PeerTimeout) as error:  # a peer must never take the whole run down
        result.status, result.reason = STATUS_FAILED, _error_line(error)
        result.traceback = traceback.format_exc()
        print(result.traceback, file=sys.stderr)
    finally:
        close = prepared.close if prepared is not None else None
        prepared = None  # drop our reference first, so close() can really free the memory
        _close(close)
    return result


def _record_timing(result: PeerResult, timing: Timing, workload: wl.Workload) -> None:
    result.repeats_us = timing.repeats_us
    result.steps_per_repeat = timing.steps_per_repeat
    result.step_us = timing.median_us
    result.step_us_min, result.step_us_max = min(timing.repeats_us), max(timing.repeats_us)
    result.tflops = wl.flops_per_step(workload) / (timing.median_us * 1e-6) / 1e12
    if workload.tokens_per_step:
        result.tokens_per_s = workload.tokens_per_step / (timing.median_us * 1e-6)
    result.final_loss = timing.final_loss


def _record_memory(result: PeerResult, prepared: PreparedStep) -> None:
    try:
        reading = prepared.memory()
    except Exception as error:  # memory is a side figure: never fail a timed row over it
        result.notes.append(f"memory reading failed: {_error_line(error)}")
        return
    if reading is not None:
        result.memory_bytes, result.memory_kind = reading.bytes, reading.kind


def _record_census(result: PeerResult, prepared: PreparedStep) -> None:
    try:
        census = prepared.census()
    except Exception as error:  # a side figure too: the timed row stands without it
        result.notes.append(f"kernel count failed: {_error_line(error)}")
        return
    if census is not None:
        result.kernels_per_step = census.kernels
        result.layout_conversions = census.layout_conversions
        result.census_source = census.source


def _close(close) -> None:
    """Let the peer free its device memory before the next one runs."""
    gc.collect()
    if close is not None:
        try:
            close()
        except Exception as error:
            print(f"stepgraph bench: cleanup failed: {_error_line(error)}", file=sys.stderr)
        gc.collect()
    _empty_torch_cache()


def _empty_torch_cache() -> None:
    """A torch peer that failed half-way never ran its close(): hand its cached blocks back
    to the driver anyway, or the peers after it may run out of memory."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def loss_curve(peer: PeerInfo, spec: RunSpec, steps: int, warmup: int = 0) -> list[float]:
    """The loss of each of `steps` training steps, read back one by one: a correctness check
    (does the peer train, do peers agree), not a timing. Errors propagate. `warmup` steps on
    the first batch train first, unread: a peer that trains such steps while it prepares (the
    torch graph peer's side-stream warm-up) is compared with another from the same state."""
    prepared = _load_prepare(peer)(spec)
    try:
        for _ in range(warmup):
            prepared.run_step(0)
        return [prepared.read_loss(prepared.run_step(i % len(spec.batches)))
                for i in range(steps)]
    finally:
        close = prepared.close
        prepared = None
        _close(close)


def fill_speed_vs_best_peer(results: list[PeerResult]) -> None:
    """Per (workload, precision), the fastest non-stepgraph row's time over each row's time."""
    groups: dict[tuple[str, str], list[PeerResult]] = {}
    for r in results:
        groups.setdefault((r.workload, r.precision), []).append(r)
    for rows in groups.values():
        peer_times = [r.step_us for r in rows
                      if r.status == STATUS_OK and not r.is_stepgraph and r.step_us]
        if not peer_times:
            continue
        best = min(peer_times)
        for r in rows:
            if r.status == STATUS_OK and r.step_us:
                r.speed_vs_best_peer = best / r.step_us


def make_spec(workload: wl.Workload, precision: str, config: BenchConfig) -> RunSpec:
    """The shared data and initial parameters every peer gets for one (workload, precision)."""
    return RunSpec(workload, precision, config.device,
                   wl.make_batches(workload, config.batches, config.seed),
                   wl.initial_parameters(workload, config.seed), config.seed,
                   tuple(config.compile_modes), config.tinygrad_beam)


def run_benchmark(config: BenchConfig, cache: PeerResultCache | None = None) -> BenchReport:
    """Measure every selected peer on every selected workload and precision, reusing the
    peers' rows `cache` holds (default: the cache file; config.use_cache False measures them
    again), with a progress line on stderr before and after each row.

    Raises NoGpuError when config.device is "cuda" and no CUDA device is visible.
    """
    if config.compile_cache:   # before anything compiles: inductor_cache.py
        inductor_cache.use(config.compile_cache)
    device_name = require_device(config)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if cache is None:   # a CPU run is a smoke test (--device cpu is hidden): it keeps nothing
        cache = PeerResultCache(enabled=None if config.device == "cuda" else False)
    peers = select_peers(config.peers)
    results: list[PeerResult] = []
    total = len(config.precisions) * len(config.workloads) * len(peers)
    started = time.perf_counter()
    for precision in config.precisions:
        for name in config.workloads:
            workload = wl.get_workload(name, config.tiny)
            spec = make_spec(workload, precision, config)
            for peer in peers:
                elapsed = _minutes(time.perf_counter() - started)
                _progress(f"stepgraph bench [{len(results) + 1}/{total}, {elapsed}]: {name} "
                          f"{precision} {peer.name} ...")
                key = None if peer.is_stepgraph else peer_key(peer, config, device_name,
                                                              workload, precision)
                result = _cached(cache, key) if config.use_cache else None
                if result is None:
                    result = measure_peer(peer, spec, config)
                    if config.device == "cuda":
                        restore_primary_context()
                    if key is not None and result.status == STATUS_OK:
                        cache.put(key, row_fields(result), date)
                results.append(result)
                _progress(f"  -> {describe_result(results[-1])}")
    fill_speed_vs_best_peer(results)
    floors = []
    if config.floor and config.device == "cuda":
        _progress("stepgraph bench: measuring the GEMM peak and the copy bandwidth (--floor) ...")
        floors = measure_floors(config.workloads, config.precisions, config.tiny)
    _progress(f"stepgraph bench: done in {_minutes(time.perf_counter() - started)}")
    return BenchReport(date, device_name, platform.node(), platform.python_version(),
                       library_versions(), config, describe_workloads(config), results, floors,
                       str(cache.path) if cache.enabled else "")


def _cached(cache: PeerResultCache, key) -> PeerResult | None:
    """The row the cache holds for `key` (None for stepgraph's rows, which it never holds)."""
    if key is None:
        return None
    hit = cache.get(key)
    return None if hit is None else restore_row(PeerResult, hit)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _minutes(seconds: float) -> str:
    """m:ss"""
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def restore_primary_context() -> None:
    """Make the device's primary CUDA context current again. tinygrad creates and makes
    current a context of its own; CuPy, PyTorch and JAX handles made in the primary context
    then fail in the next peer ('invalid resource handle', cuDNN stream mismatch)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return
    err, device = driver.cuDeviceGet(0)
    if err == driver.CUresult.CUDA_SUCCESS:
        err, context = driver.cuDevicePrimaryCtxRetain(device)
        if err == driver.CUresult.CUDA_SUCCESS:
            driver.cuCtxSetCurrent(context)
            driver.cuDevicePrimaryCtxRelease(device)


def describe_workloads(config: BenchConfig) -> dict[str, dict[str, Any]]:
    """Batch, parameter count and FLOPs per step of each selected workload, for the JSON."""
    described = {}
    for name in config.workloads:
        w = wl.get_workload(name, config.tiny)
        described[name] = {"batch": w.batch, "input_shape": list(w.input_shape),
                           "parameters": wl.parameter_count(w),
                           "flops_per_step": wl.flops_per_step(w), "loss": w.loss,
                           "label_smoothing": w.label_smoothing,
                           "optimizer": asdict(w.optimizer), "model": asdict(w.model)}
    return described


# ---------------------------------------------------------------- reporting


def describe_result(r: PeerResult) -> str:
    """One-line progress summary of a row."""
    if r.status != STATUS_OK:
        return f"{r.status}: {r.reason}"
    line = f"{r.step_us:.1f} us/step, setup {r.setup_s:.2f} s, loss {r.final_loss:.4f}"
    if r.cached:
        line = f"cached (measured {r.cached}): {line}"
    if r.tokens_per_s is not None:
        line += f", {r.tokens_per_s:,.0f} tokens/s"
    if r.kernels_per_step is not None:
        line += f", {r.kernels_per_step} kernels"
        if r.layout_conversions:
            line += f" ({r.layout_conversions} layout conversions)"
    return line


def _fmt(value: float | None, pattern: str) -> str:
    return "—" if value is None else pattern.format(value)


def _memory_cell(r: PeerResult) -> str:
    if r.memory_bytes is None:
        return "—"
    mark = "*" if r.memory_kind == "resident" else ""
    return f"{r.memory_bytes / 2**20:.1f} MiB{mark}"


def _row_cells(r: PeerResult) -> list[str]:
    spread = r.spread_percent
    note = r.reason if r.status != STATUS_OK else ""
    if len(note) > 80:
        note = note[:77] + "..."
    return [r.workload, r.precision_label or r.precision,
            r.peer + (f" {CACHED_MARK}" if r.cached else ""), r.status,
            _fmt(r.step_us, "{:.1f}"),
            "—" if spread is None else f"±{spread:.1f}%", _fmt(r.tflops, "{:.2f}"),
            _fmt(r.tokens_per_s, "{:,.0f}"), _fmt(r.speed_vs_best_peer, "{:.2f}x"),
            _fmt(r.setup_s, "{:.2f}"), _memory_cell(r), _fmt(r.kernels_per_step, "{:d}"),
            _fmt(r.layout_conversions, "{:d}"), note]


CACHED_MARK = "(cached)"  # after the system's name: a row an earlier run measured
TABLE_HEADER = ["workload", "prec", "system", "status", "µs/step", "spread", "TFLOP/s",
                "tokens/s", "vs best peer", "setup s", "memory", "kernels", "layout", "note"]
TEXT_COLUMNS = {"workload", "prec", "system", "status", "note"}  # left-aligned; figures right
TOKENS_COLUMN = TABLE_HEADER.index("tokens/s")


def render_table(report: BenchReport) -> str:
    """The results as an aligned plain-text table, with a header naming device and date; a
    tokens/s column when a workload trains on tokens."""
    rows = [TABLE_HEADER] + [_row_cells(r) for r in report.results]
    if all(r.tokens_per_s is None for r in report.results):
        rows = [row[:TOKENS_COLUMN] + row[TOKENS_COLUMN + 1:] for row in rows]
    numeric = [name not in TEXT_COLUMNS for name in rows[0]]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [f"stepgraph bench — {report.device} — {report.date}",
             f"µs/step: median of {report.config.repeats} timed runs; "
             "vs best peer: fastest non-stepgraph µs / this µs (>1 is faster)"]
    for index, row in enumerate(rows):
        cells = [cell.rjust(widths[c]) if numeric[c] else cell.ljust(widths[c])
                 for c, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("kernels: kernels (or CUDA graph nodes) one step launches; layout: of those, "
                 "NCHW<->NHWC conversions (how each was counted: the JSON's census_source)")
    lines.append("memory: peak allocated during the peer's run; * = held after the timed steps "
                 "(the library keeps no peak); setup s = build + compile + first "
                 f"{SETUP_STEPS} steps")
    if report.config.compile_cache:
        lines.append(f"compile cache: {report.config.compile_cache} (the torch compile row's "
                     "notes say whether its compile found it warm)")
    if any(r.cached for r in report.results):
        lines.append(f"{CACHED_MARK}: measured by an earlier run with the same peer versions, "
                     f"device, workload, precision and options, kept in {report.cache_file} "
                     "(--no-cache measures again)")
    return "\n".join(lines)


def report_to_json(report: BenchReport) -> dict[str, Any]:
    """The report as plain JSON-ready data."""
    data = asdict(report)
    for row, result in zip(data["results"], report.results):
        row["spread_percent"] = result.spread_percent
    for row, floor in zip(data["floors"], report.floors):
        row.update(gemm_us=floor.gemm_us, optimizer_us=floor.optimizer_us,
                   floor_us=floor.floor_us)
    return data


def output_stem(config: BenchConfig) -> str:
    """File name stem naming what was run, so runs at other settings don't overwrite it."""
    return f"bench_{'-'.join(config.workloads)}_{'-'.join(config.precisions)}"


def write_json(report: BenchReport, path: Path) -> None:
    """Write the full report (device, versions, date, every number) as JSON."""
    path.write_text(json.dumps(report_to_json(report), indent=2, ensure_ascii=False) + "\n")


def write_chart(report: BenchReport, path: Path) -> None:
    """A horizontal bar chart of µs per step, one panel per (workload, precision)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups: dict[tuple[str, str], list[PeerResult]] = {}
    for r in report.results:
        groups.setdefault((r.workload, r.precision), []).append(r)
    figure, axes = plt.subplots(len(groups), 1, squeeze=False,
                                figsize=(9, 1.0 + 0.45 * sum(len(v) for v in groups.values())
                                         + 0.6 * len(groups)))
    for axis, ((workload, precision), rows) in zip(axes[:, 0], groups.items()):
        _draw_panel(axis, f"{workload} ({precision})", rows)
    figure.suptitle(f"stepgraph bench — {report.device}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _draw_panel(axis, title: str, rows: list[PeerResult]) -> None:
    measured = [r.step_us for r in rows if r.status == STATUS_OK and r.step_us]
    top, bottom = (max(measured), min(measured)) if measured else (1.0, 1.0)
    log = top / bottom > 20  # eager and graph rows differ by 10-50x: keep the small bars visible
    positions = list(range(len(rows)))
    axis.barh(positions, [r.step_us if r.status == STATUS_OK else 0.0 for r in rows],
              color=["tab:orange" if r.is_stepgraph else "tab:blue" for r in rows])
    axis.set_yticks(positions, [r.peer for r in rows])
    axis.invert_yaxis()
    if log:
        axis.set_xscale("log")
        axis.set_xlim(bottom / 3, top * 4)
    else:
        axis.set_xlim(0, top * 1.25)
    label_start = bottom / 2.5 if log else 0.01 * top  # where a row without a bar is labelled
    for y, r in zip(positions, rows):
        if r.status == STATUS_OK:
            at = r.step_us * 1.08 if log else r.step_us + 0.01 * top
            axis.text(at, y, f"{r.step_us:.1f} µs", va="center", fontsize=8)
        else:
            axis.text(label_start, y, r.status, va="center", fontsize=8)
    axis.set_xlabel("µs per training step (lower is better)" + (", log scale" if log else ""))
    axis.set_title(title, fontsize=10)


def write_outputs(report: BenchReport) -> list[Path]:
    """JSON and PNG into config.out_dir; returns the paths written."""
    out = Path(report.config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = output_stem(report.config)
    json_path, chart_path = out / f"{stem}.json", out / f"{stem}.png"
    write_json(report, json_path)
    write_chart(report, chart_path)
    return [json_path, chart_path]


# ---------------------------------------------------------------- command line


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The `stepgraph bench` command line."""
    parser = argparse.ArgumentParser(
        prog="stepgraph bench",
        description="Training-step time of stepgraph and its peers on the same GPU data.")
    parser.add_argument("--workloads", default=",".join(wl.DEFAULT_WORKLOADS),
                        help=f"comma-separated: {','.join(wl.WORKLOAD_NAMES)} "
                             f"(default: {','.join(wl.DEFAULT_WORKLOADS)})")
    parser.add_argument("--precision", default="fp32",
                        help="comma-separated: fp32,tf32,bf16 (default: fp32)")
    parser.add_argument("--peers", default=None,
                        help="comma-separated systems (default: all): stepgraph, torch, "
                             "torch_eager, torch_graph, torch_compile, jax, tinygrad, ...")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (default: 5)")
    parser.add_argument("--target-seconds", type=float, default=0.3,
                        help="length of one timed run in seconds (default: 0.3)")
    parser.add_argument("--batches", type=int, default=4,
                        help="pre-made device batches the steps rotate among (default: 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-out", help="output folder (default: bench-out)")
    parser.add_argument("--fair", action="store_true",
                        help="give each peer its fastest documented configuration: every "
                             "torch.compile mode searched (--compile-modes "
                             f"{','.join(FAIR_COMPILE_MODES)}), tinygrad's BEAM kernel search "
                             f"(--tinygrad-beam {FAIR_TINYGRAD_BEAM}), --peer-timeout "
                             f"{FAIR_PEER_TIMEOUT_S:.0f}; options given explicitly win. Takes "
                             "far longer (each compile mode up to "
                             f"{COMPILE_MODE_TIMEOUT_S:.0f} s)")
    parser.add_argument("--no-cache", action="store_true",
                        help="measure every peer again instead of reusing its row from the "
                             "cache file of earlier runs (the new rows replace the cached)")
    parser.add_argument("--compile-modes", default=None,
                        help="torch.compile modes the torch compile row tries, each within "
                             f"{COMPILE_MODE_TIMEOUT_S:.0f} s, keeping the fastest: any of "
                             f"{','.join(COMPILE_MODES)} "
                             f"(default: {','.join(DEFAULT_COMPILE_MODES)}; --fair: "
                             f"{','.join(FAIR_COMPILE_MODES)})")
    parser.add_argument("--floor", action="store_true",
                        help="also measure each workload's step floor: the larger of the GEMM "
                             "FLOPs it needs at the best measured GEMM peak (cuBLAS or "
                             "cuBLASLt) and its optimizer's bytes at the measured copy "
                             "bandwidth, and each row's distance from it")
    parser.add_argument("--peer-timeout", type=float, default=None,
                        help="seconds one peer may take (build, compile, timing) before its "
                             "row fails and the run goes on; 0: no limit "
                             f"(default: {DEFAULT_PEER_TIMEOUT_S:.0f}; --fair: "
                             f"{FAIR_PEER_TIMEOUT_S:.0f}, room for every torch.compile mode's "
                             "own budget)")
    parser.add_argument("--compile-cache", metavar="DIR", default="",
                        help="keep Inductor's and Triton's caches (FX graph, AOTAutograd, "
                             "autotuning choices, kernels) in DIR, so that a later run given "
                             "DIR reuses the torch compile row's compiles (docs/BENCHMARKS.md)")
    parser.add_argument("--tinygrad-beam", type=int, default=None,
                        help="tinygrad's BEAM kernel search width; 0: no search "
                             f"(default: {DEFAULT_TINYGRAD_BEAM}; --fair: {FAIR_TINYGRAD_BEAM})")
    # Smoke tests only: run the peers on the CPU at tiny sizes.
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    return parser


def parse_config(argv: list[str] | None) -> BenchConfig:
    """BenchConfig from command-line arguments; ValueError names a bad choice."""
    args = build_parser().parse_args(argv)
    peer_options(args)
    workloads, precisions = _csv(args.workloads), _csv(args.precision)
    for name in workloads:
        wl.get_workload(name)
    for precision in precisions:
        if precision not in wl.PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; expected one of "
                             f"{', '.join(wl.PRECISIONS)}")
    if args.repeats < 1 or args.batches < 1:
        raise ValueError("--repeats and --batches must be at least 1")
    if args.peer_timeout < 0:
        raise ValueError("--peer-timeout must be 0 (no limit) or positive")
    if args.tinygrad_beam < 0:
        raise ValueError("--tinygrad-beam must be 0 (no search) or positive")
    compile_modes = _csv(args.compile_modes)
    unknown = [mode for mode in compile_modes if mode not in COMPILE_MODES]
    if unknown or not compile_modes:
        raise ValueError(f"unknown torch.compile mode(s) {', '.join(unknown) or '(none)'}; "
                         f"expected some of {', '.join(COMPILE_MODES)}")
    peers = _csv(args.peers) if args.peers else None
    select_peers(peers)
    return BenchConfig(workloads=workloads, precisions=precisions, peers=peers,
                       repeats=args.repeats, target_seconds=args.target_seconds,
                       batches=args.batches, seed=args.seed, out_dir=args.out,
                       device=args.device, tiny=args.tiny, compile_modes=tuple(compile_modes),
                       peer_timeout_s=args.peer_timeout, floor=args.floor,
                       tinygrad_beam=args.tinygrad_beam, fair=args.fair,
                       use_cache=not args.no_cache, compile_cache=args.compile_cache)


def peer_options(args: argparse.Namespace) -> None:
    """Fill the peer options not given (None) with the default run's values, or with
    --fair's: the full torch.compile search, tinygrad's BEAM search and a peer budget that
    leaves each compile mode its own."""
    defaults = ((",".join(FAIR_COMPILE_MODES), FAIR_PEER_TIMEOUT_S, FAIR_TINYGRAD_BEAM)
                if args.fair else
                (",".join(DEFAULT_COMPILE_MODES), DEFAULT_PEER_TIMEOUT_S, DEFAULT_TINYGRAD_BEAM))
    for name, value in zip(("compile_modes", "peer_timeout", "tinygrad_beam"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark from command-line arguments; returns the process exit code
    (0 done, 2 bad arguments or no GPU). The table is the last thing printed to stdout."""
    try:
        config = parse_config(argv)
        report = run_benchmark(config)
    except SystemExit as done:  # argparse's --help or usage error
        return done.code if isinstance(done.code, int) else 2
    except (ValueError, NoGpuError) as error:
        print(f"stepgraph bench: {error}", file=sys.stderr)
        return 2
    for path in write_outputs(report):
        print(f"wrote {path}")
    if report.floors:
        print(render_floors(report.floors, report.results))
    print(render_table(report))
    return 0
