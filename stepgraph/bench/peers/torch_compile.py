"""torch.compile on the whole training step, each mode of `spec.compile_modes` tried in turn and
the fastest kept.

The compiled function is the training step (forward + loss, backward, optimizer.step), as the
torch.compile tutorials compile one; `zero_grad(set_to_none=True)` runs before it, outside, since
Dynamo does not trace it (it is marked `torch._disable_dynamo`, a graph break of its own). Dynamo
breaks the graph at `loss.backward()` (the AOTAutograd backward runs from the forward's graph)
and around the optimizer's `_use_grad` wrapper, so one step runs three compiled regions, and in
"reduce-overhead" mode every one of them, the optimizer update included, replays as a CUDA graph
(cudagraph trees; `torch.compiler.cudagraph_mark_step_begin()` opens each step).

The optimizer step is compiled with the rest: compiled on its own in the default mode, its
Inductor kernels are launched one by one from Python every step, after a guard check over every
parameter, gradient and state tensor, where eager runs one fused AdamW/SGD kernel, and the step
stays host-bound (docs/BENCHMARKS.md). The optimizer is foreach (Inductor writes its own fused
update kernels), capturable on CUDA so its step counter lives on the device inside the graph.

Compiled autograd (a mode ending in COMPILED_AUTOGRAD) does not remove the break at
`loss.backward()`: the autograd engine traces the backward it runs (the AOT backward and the
gradient accumulation) into a graph of its own, compiled in the step's mode, so the step is still
three compiled regions, the backward's reached through a cache lookup on the autograd graph
(docs/BENCHMARKS.md). Whether that is faster is measured, like the modes.

Modes: spec.compile_modes ("reduce-overhead" alone in a default run; with `stepgraph bench
--fair` every mode, "max-autotune" and "max-autotune-no-cudagraphs" included, see
peers/__init__.py). Each mode gets MODE_TIMEOUT_S for its compile, its CUDA graph
recording and its probe; a mode past it is noted as timed out and the search goes on with the
others. Each mode's compile time (the compile and the recording steps) is noted apart from its
step time. The mode that wins on a workload's first precision is reused for its other precisions
(one compile each instead of one per mode).

The optimizer stays foreach rather than fused: Inductor writes its own fused update kernels from
the foreach ops (the compiled-optimizer recipe of PyTorch's docs), which the fused kernel, an
opaque call, would leave it no way to fuse or to place in its CUDA graphs' schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stepgraph.bench import inductor_cache
from stepgraph.bench.peers import (
    COMPILE_MODE_TIMEOUT_S,
    KernelCensus,
    PeerTimeout,
    PreparedStep,
    RunSpec,
    deadline,
)
from stepgraph.bench.peers.torch_eager import (
    build_training,
    device_batches,
    layout_for,
    profiler_census,
    release,
    seconds_per_step,
    set_precision,
    start_memory_count,
    synchronizer,
)

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
COMPILED_AUTOGRAD = "+compiled-autograd"  # suffix of a mode: its backward under compiled autograd
MODE_TIMEOUT_S = COMPILE_MODE_TIMEOUT_S  # read at each search, so a test can shorten it
PROBE_SECONDS = 0.3  # timed per mode, after its compile and CUDA graph recording steps
PROBE_SETUP_STEPS = 3  # cudagraph trees warm up on call 1, record on call 2, replay from 3
PROBE_MAX_STEPS = 500
# Optimizer state torch.optim creates inside step() itself, from the first gradient (SGD's
# momentum buffers), rather than in `_init_group`, which Dynamo runs eagerly outside the graph
# (AdamW's moments and step counter): under torch.compile it is an output of the compiled step.
STATE_MADE_IN_STEP = ("momentum_buffer",)
_chosen_modes: dict[str, str] = {}  # workload -> the mode its first searched precision kept


@dataclass
class _Candidate:
    """One compiled step under one mode."""

    mode: str
    run_step: Callable[[int], torch.Tensor]
    close: Callable[[], None]
    us: float = float("inf")
    compile_s: float = 0.0  # torch.compile and the first PROBE_SETUP_STEPS steps


class ModeTimeout(PeerTimeout):
    """One torch.compile mode ran past MODE_TIMEOUT_S: that mode is dropped, not the row."""


def _split_mode(mode: str) -> tuple[str, bool]:
    """(the torch.compile mode, whether the backward runs under compiled autograd)."""
    return mode.removesuffix(COMPILED_AUTOGRAD), mode.endswith(COMPILED_AUTOGRAD)


def _describe(mode: str) -> str:
    torch_mode, compiled_autograd = _split_mode(mode)
    suffix = " with compiled autograd" if compiled_autograd else ""
    return f'torch.compile(mode="{torch_mode}"){suffix}'


def _compile(spec: RunSpec, mode: str, layout: str) -> _Candidate:
    torch_mode, compiled_autograd = _split_mode(mode)
    training = build_training(spec, layout, capturable=spec.device == "cuda")
    train_step = torch.compile(training.step_body(spec.precision, spec.device), mode=torch_mode)
    if compiled_autograd:
        train_step = _with_compiled_autograd(train_step, torch_mode)
    batches = device_batches(spec, layout)
    cuda_graphs = spec.device == "cuda" and torch_mode in CUDA_GRAPH_MODES
    return _Candidate(mode, _step_runner(train_step, training.optimizer, batches, cuda_graphs),
                      batches.clear)


def _with_compiled_autograd(train_step, torch_mode: str):
    """train_step with its `loss.backward()` run by compiled autograd, the backward graph
    compiled in the step's own mode (so under reduce-overhead it is a CUDA graph too).

    Enabled around each step by the context manager of PyTorch's compiled autograd tutorial
    (`compiled_autograd._enable` in torch 2.13), which PyTorch's own benchmark suite uses too
    (`torch._dynamo.utils.maybe_enable_compiled_autograd`), rather than by the tutorial's other
    way, `torch._dynamo.config.compiled_autograd = True` before torch.compile: with that flag
    every call of the compiled step rebuilds the torch.compile context for the backward (a copy
    of Inductor's whole config), 0.4-1.1 ms more a step on a CPU. Scoped to the step, compiled
    autograd stays off for the other candidates and peers. dynamic=False: the shapes never
    change (what the flag's path passes too, Dynamo's shapes being static by default)."""
    from torch._dynamo import compiled_autograd

    compile_backward = torch.compile(mode=torch_mode)  # torch.compile(model=None): a compiler

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with compiled_autograd._enable(compile_backward, dynamic=False):
            return train_step(x, y)

    return step


def _step_runner(train_step, optimizer: torch.optim.Optimizer, batches, cuda_graphs: bool):
    """run_step(i): zero_grad(set_to_none) and the compiled step on batch i.

    Under CUDA graphs (cudagraph trees) every step opens with
    `torch.compiler.cudagraph_mark_step_begin()`, the documented call for training loops, after
    which the graphs free the previous step's outputs. Optimizer state made inside the first
    step (STATE_MADE_IN_STEP) is such an output, kept across steps: the next step would find
    it overwritten ("accessing tensor output of CUDAGraphs that has been overwritten by a
    subsequent run"). It is cloned outside torch.compile once, after that first step, as the
    error and the cudagraph trees docs say to do with an output that must outlive its step."""
    clone_pending = cuda_graphs

    def run_step(i: int) -> torch.Tensor:
        nonlocal clone_pending
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(*batches[i])
        if clone_pending:
            _clone_state_made_in_step(optimizer)
            clone_pending = False
        return loss

    return run_step


def _clone_state_made_in_step(optimizer: torch.optim.Optimizer) -> None:
    """Replace each STATE_MADE_IN_STEP tensor by a copy in memory of its own."""
    for state in optimizer.state.values():
        for key in STATE_MADE_IN_STEP:
            if isinstance(state.get(key), torch.Tensor):
                state[key] = state[key].clone()


def _probe(candidate: _Candidate, n_batches: int, synchronize, started: float) -> None:
    """Run the compile and recording steps (their time, since `started`, is the candidate's
    compile_s), then measure µs per step over about PROBE_SECONDS."""
    for i in range(PROBE_SETUP_STEPS):
        candidate.run_step(i % n_batches)
    synchronize()
    candidate.compile_s = time.perf_counter() - started
    candidate.us = seconds_per_step(candidate.run_step, n_batches, synchronize, PROBE_SECONDS,
                                    PROBE_MAX_STEPS, setup_steps=0) * 1e6


def _modes_to_try(spec: RunSpec) -> tuple[list[str], str]:
    chosen = _chosen_modes.get(spec.workload.name)
    if chosen in spec.compile_modes:
        return [chosen], f'mode "{chosen}" (fastest on this workload\'s first precision)'
    if spec.device != "cuda":  # CPU smoke tests: no CUDA graphs, one compile is enough
        return list(spec.compile_modes[:1]), ""
    return list(spec.compile_modes), ""


def _search(spec: RunSpec, layout: str, synchronize) -> tuple[_Candidate, list[str]]:
    """Compile and probe each mode; returns the fastest candidate and notes on all of them."""
    modes, reused = _modes_to_try(spec)
    notes = [reused] if reused else []
    best: _Candidate | None = None
    tried: list[str] = []
    last_error: BaseException | None = None
    for mode in modes:
        if len(modes) == 1:  # nothing to compare: the harness compiles it in its setup
            best = _compile(spec, mode, layout)
            break
        started = time.perf_counter()
        candidate = None
        try:
            with deadline(MODE_TIMEOUT_S, f"torch.compile mode {mode!r}", ModeTimeout):
                candidate = _compile(spec, mode, layout)
                _probe(candidate, len(spec.batches), synchronize, started)
        except (Exception, ModeTimeout) as error:  # one mode failing must not hide the others
            last_error = error
            if isinstance(error, ModeTimeout):
                tried.append(f"{mode} timed out (over {MODE_TIMEOUT_S:g} s)")
            else:
                first_line = (str(error).strip().splitlines() or [""])[0][:120]
                tried.append(f"{mode} failed ({type(error).__name__}: {first_line})")
            if candidate is not None:
                candidate.close()
            if best is None:  # start the next mode clean; a reset would also drop the best's
                torch._dynamo.reset()
            continue
        tried.append(f"{mode} {candidate.us:.0f} µs/step (compile {candidate.compile_s:.0f} s)")
        if best is None or candidate.us < best.us:
            if best is not None:
                best.close()
            best = candidate
        else:
            candidate.close()
    if best is None:
        raise last_error or RuntimeError("no torch.compile mode to try")
    if len(modes) > 1:
        _chosen_modes[spec.workload.name] = best.mode
    notes.append(f"{_describe(best.mode)} on the whole step"
                 + (f", compile {best.compile_s:.0f} s" if best.compile_s else "")
                 + ("; tried: " + "; ".join(tried) if tried else ""))
    return best, notes


def prepare(spec: RunSpec) -> PreparedStep:
    """The whole step under torch.compile, in the fastest of the modes tried."""
    from torch._dynamo.utils import counters

    notes = set_precision(spec.precision)
    layout = layout_for(spec)
    memory = start_memory_count(spec.device)
    torch._dynamo.reset()  # a fresh cache per run: earlier workloads must not count as warm-up
    skips_before = counters["inductor"]["cudagraph_skips"]
    cache_before = inductor_cache.counts()
    synchronize = synchronizer(spec.device)
    best, search_notes = _search(spec, layout, synchronize)
    notes += search_notes + [f"memory format {layout}; optimizer foreach, capturable on CUDA"]
    cache = inductor_cache.state(cache_before, inductor_cache.counts())
    if cache["cache"] != "none":   # the on-disk caches (--compile-cache): was the compile reused
        notes.append(f"Inductor caches {cache['cache']}: " + ", ".join(
            f"{key.split('.')[1]} {n}" for key, n in cache.items() if key != "cache" and n))
    skips = counters["inductor"]["cudagraph_skips"] - skips_before
    if skips and spec.device == "cuda" and _split_mode(best.mode)[0] in CUDA_GRAPH_MODES:
        notes.append(f"Inductor skipped CUDA graphs {skips} time(s) "
                     "(TORCH_LOGS=perf_hints says why)")

    def census() -> KernelCensus | None:
        if spec.device != "cuda":
            return None
        return profiler_census(lambda: best.run_step(0), synchronize)

    def read_loss(loss: torch.Tensor) -> float:
        return float(loss.detach().clone())

    def close() -> None:
        best.close()
        torch._dynamo.reset()
        release(spec.device)

    return PreparedStep(best.run_step, synchronize, read_loss, memory, close, notes, census)
