"""The systems the benchmark compares, and the interface each of them implements.

A peer module has one `prepare(spec) -> PreparedStep` function per row it contributes. It imports
its library lazily or at module level (an ImportError means "missing"), builds the model from
`spec.workload`, loads `spec.parameters`, copies `spec.batches` to the device and returns a
step function that runs one whole training step without any host synchronisation.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stepgraph.bench.workloads import Batch, LayerParams, Workload


class Unsupported(Exception):
    """The peer cannot run this workload, precision or device; the message says why ('n/a')."""


class PeerTimeout(BaseException):
    """A peer ran past its time limit (`stepgraph bench --peer-timeout`): its row is 'failed'
    and the run goes on. A BaseException, so that a peer's own `except Exception` (a
    configuration search that skips a failing candidate) does not swallow it."""


# `stepgraph bench --fair` searches every torch.compile mode, the autotuning ones included: they
# are the modes a reviewer asks for, and on convnet the full search is what decides the row
# (docs/BENCHMARKS.md). Each mode has its own time budget, COMPILE_MODE_TIMEOUT_S: one that runs
# past it is reported as timed out and the others are kept. A mode ending in
# "+compiled-autograd" is that torch.compile mode with the backward run by compiled autograd
# (torch_compile.py).
COMPILE_MODES = ("reduce-overhead", "default", "max-autotune-no-cudagraphs", "max-autotune",
                 "reduce-overhead+compiled-autograd", "default+compiled-autograd")
FAIR_COMPILE_MODES = ("reduce-overhead", "default", "max-autotune",
                      "max-autotune-no-cudagraphs", "reduce-overhead+compiled-autograd")
# A default run (no --fair) compiles one mode, "reduce-overhead": Inductor's kernels replayed
# as CUDA graphs, the like-for-like of stepgraph's graph row (both remove the per-kernel
# launch cost that decides these small steps), compiled without the Triton autotuning of
# every GEMM and conv shape that makes the max-autotune modes take minutes per workload; it
# was the fastest mode of the full search on mlp (H100, 2026-11-23, docs/BENCHMARKS.md).
DEFAULT_COMPILE_MODES = ("reduce-overhead",)
# Seconds one torch.compile mode of a search may take (compile, CUDA graph recording, probe):
# max-autotune's Triton search of every GEMM and conv shape takes minutes on the vision
# workloads; this leaves it room to spare.
COMPILE_MODE_TIMEOUT_S = 600.0
# tinygrad's kernel search (its BEAM setting: the width of the beam search over each kernel's
# optimisations); 0 turns it off. --fair: 2, a narrow beam, so that the search fits a peer's
# budget; a default run: 0, tinygrad's own unsearched kernels (the search takes minutes).
FAIR_TINYGRAD_BEAM = 2
DEFAULT_TINYGRAD_BEAM = 0


@contextlib.contextmanager
def deadline(seconds: float, what: str = "--peer-timeout",
             error: type[PeerTimeout] = PeerTimeout):
    """Raise `error` in the main thread once `seconds` have passed (0: no limit).

    Nestable: an outer deadline due sooner stands as it is (this one adds nothing); otherwise
    this one is armed, and on exit the outer one is re-armed with what is left of it. Best
    effort: the signal handler runs between Python bytecodes, so a long call into C++ (an XLA
    or Inductor compile) finishes before the exception is raised.
    """
    if seconds <= 0 or not hasattr(signal, "setitimer") \
            or threading.current_thread() is not threading.main_thread():
        yield
        return
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    if outer_left and outer_left <= seconds:
        yield
        return

    def expire(signum, frame):
        raise error(f"no result within {seconds:g} s ({what})")

    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL,
                             max(outer_left - (time.monotonic() - start), 1e-3))


@dataclass
class RunSpec:
    """What a peer is asked to run."""

    workload: Workload
    precision: str  # "fp32" | "tf32" | "bf16"
    device: str  # "cuda" | "cpu" (the CPU only for smoke tests)
    batches: list[Batch]
    parameters: list[LayerParams]
    seed: int = 0
    # torch.compile modes the torch compile peer tries, keeping the fastest (torch_compile.py).
    compile_modes: tuple[str, ...] = DEFAULT_COMPILE_MODES
    tinygrad_beam: int = DEFAULT_TINYGRAD_BEAM  # tinygrad's BEAM search width (tinygrad_jit.py)


@dataclass
class KernelCensus:
    """What one training step launches on the device, as far as the library lets us count."""

    kernels: int | None  # kernels (or CUDA graph nodes) per step; None: not counted
    layout_conversions: int | None = None  # of those, NCHW<->NHWC transposes; None: not counted
    source: str = ""  # how it was counted ("torch.profiler", "XLA HLO", "CUDA graph nodes", ...)


@dataclass
class MemoryReading:
    """Device memory a peer used, and what kind of figure the library could give."""

    bytes: int
    kind: str  # "peak" (high-water mark) or "resident" (held after the timed steps)


def _no_memory_reading() -> MemoryReading | None:
    return None


def _nothing() -> None:
    return None


def _no_census() -> KernelCensus | None:
    return None


@dataclass
class PreparedStep:
    """A ready-to-time training step. `run_step(i)` trains on batch i and returns a loss handle
    without synchronising; `read_loss` turns a handle into a float (that one may sync)."""

    run_step: Callable[[int], Any]
    synchronize: Callable[[], None]
    read_loss: Callable[[Any], float]
    memory: Callable[[], MemoryReading | None] = _no_memory_reading
    close: Callable[[], None] = _nothing
    notes: list[str] = field(default_factory=list)
    # Counts the kernels of one step; called once after the timed runs (it may run a step).
    census: Callable[[], KernelCensus | None] = _no_census
    # The arithmetic when it is not what the run's precision names for every system (stepgraph's
    # fp32 attention: 3xTF32 products), shown in the table's precision column.
    precision_label: str = ""


@dataclass(frozen=True)
class PeerInfo:
    """One row of the table: a display name and where its `prepare` function lives."""

    name: str
    module: str  # under stepgraph.bench.peers
    entry: str  # function name in that module
    library: str  # the distribution whose version the report names
    is_stepgraph: bool = False
    default: bool = True  # among the rows of a run that names no peers


PEERS: tuple[PeerInfo, ...] = (
    PeerInfo("stepgraph eager", "stepgraph_runner", "prepare_eager", "stepgraph", True),
    PeerInfo("stepgraph graph", "stepgraph_runner", "prepare_graph", "stepgraph", True),
    # the graph row without its device-side guard (asked for by name): the guard's cost, and
    # the update overlapping the backward pass that no guard allows (stepgraph_runner.py)
    PeerInfo("stepgraph unguarded", "stepgraph_runner", "prepare_graph_unguarded", "stepgraph",
             True, default=False),
    # the workload written as a PyTorch training script (zero_grad / backward / step) and
    # captured by the loop (stepgraph/loop): what it costs beside compile_train_step
    PeerInfo("stepgraph loop", "stepgraph_runner", "prepare_loop", "stepgraph", True,
             default=False),
    PeerInfo("torch eager", "torch_eager", "prepare", "torch"),
    PeerInfo("torch graph", "torch_graph", "prepare", "torch"),
    PeerInfo("torch compile", "torch_compile", "prepare", "torch"),
    PeerInfo("jax jit", "jax_jit", "prepare", "jax"),
    PeerInfo("tinygrad jit", "tinygrad_jit", "prepare", "tinygrad"),
)

# Short names accepted by --peers, besides the display names.
PEER_ALIASES: dict[str, str] = {
    "stepgraph": "stepgraph eager,stepgraph graph",
    "stepgraph_eager": "stepgraph eager",
    "stepgraph_graph": "stepgraph graph",
    "stepgraph_unguarded": "stepgraph unguarded",
    "stepgraph_loop": "stepgraph loop",
    "torch": "torch eager,torch graph,torch compile",
    "torch_eager": "torch eager",
    "torch_graph": "torch graph",
    "torch_compile": "torch compile",
    "jax": "jax jit",
    "jax_jit": "jax jit",
    "tinygrad": "tinygrad jit",
    "tinygrad_jit": "tinygrad jit",
}


def select_peers(names: list[str] | None) -> list[PeerInfo]:
    """The peers called `names` (display names or PEER_ALIASES keys) in table order; None: all."""
    if not names:
        return [p for p in PEERS if p.default]
    wanted: set[str] = set()
    for name in names:
        key = name.strip()
        expanded = PEER_ALIASES.get(key.replace(" ", "_").replace("-", "_").lower(), key)
        wanted.update(part.strip() for part in expanded.split(","))
    known = {p.name for p in PEERS}
    unknown = sorted(wanted - known)
    if unknown:
        choices = ", ".join(sorted(PEER_ALIASES))
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; expected one of {choices}")
    return [p for p in PEERS if p.name in wanted]
