"""Choosing among interchangeable kernels for one problem by timing them.

Several ops have more than one implementation whose speed no size rule predicts (conv paths,
cuBLASLt against the tiled GEMM): each candidate is timed on the real buffers as a captured
graph replay (graph.time_on_device) and the fastest is kept. The choice is keyed by the problem
(op, shapes, options, candidates) and shared by every context of the backend, like cuBLASLt's
algorithm choices in GemmCache: two steps compiled from the same model run the same kernels,
so their results agree bit for bit.

Choices also persist on disk (stepgraph/cache.py), keyed by the device identity and the
problem, so a later process on the same GPU, driver and library versions runs the same kernel
without timing, and compiles only that one. When it must time, the candidates whose kernels
name themselves (`compiling`) are timed after the others, once those kernels are compiled
(side by side, compiler.compile_parallel).
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Callable, Hashable

from .... import cache
from . import compiler, setup_log
from .graph import EagerMs, time_on_device


def compiling(run: Callable[[], None], *kernels: tuple[str, str]) -> Callable[[], None]:
    """`run`, naming the (file, kernel name) pairs its launch compiles: run_fastest compiles
    those of every candidate in parallel before timing them."""
    run.kernels = tuple(kernels)
    return run


def searching(run: Callable[[], None]) -> Callable[[], None]:
    """`run`, marked as one whose first call times candidates of its own (a cuBLASLt GEMM's
    algorithms): run_fastest times it last, under the cut the others set (enclosing_cut),
    first with a light search (light_search), and again after a full one where it comes
    within the cut of the best."""
    run.searches = True
    return run


def marked_like(run: Callable[[], None], original: Callable[[], None]) -> Callable[[], None]:
    """`run` (a launch that wraps `original`) with original's marks (compiling, searching)."""
    for mark in ("kernels", "searches"):
        if hasattr(original, mark):
            setattr(run, mark, getattr(original, mark))
    return run


# While run_fastest times a candidate: .cut, the device ms past which it cannot win; .light,
# whether a search inside it may keep to its library's own ranking
_enclosing = threading.local()


def enclosing_cut() -> float | None:
    """While run_fastest times a candidate: the device ms past which it cannot win (None
    before anything was timed, and outside a timing). A search inside the candidate's first
    call (gemm.py's algorithms) drops its own candidates past it: none of them could make
    the candidate win."""
    return getattr(_enclosing, "cut", None)


def light_search() -> bool:
    """Whether a search inside the candidate being timed may keep to its library's ranking
    (gemm.py: the cuBLASLt heuristic's candidates, without the split-K configurations it did
    not offer, up to 160 more): true the first time run_fastest times a `searching`
    candidate. A search kept light is searched in full at the next call outside such a
    timing."""
    return getattr(_enclosing, "light", False)


def tighter(*cuts: float | None) -> float | None:
    """The smallest of `cuts` that are set (None when none is)."""
    return min((c for c in cuts if c is not None), default=None)


def device_identity(device_id: int) -> dict:
    """What a cached choice depends on besides the problem: the GPU model, the driver, CUDA,
    cuBLASLt, cuDNN, CuPy and stepgraph versions, and the kernel sources."""
    return dict(_device_identity(device_id))


@functools.cache
def _device_identity(device_id: int) -> tuple:
    import cupy as cp

    from ....version import __version__

    props = cp.cuda.runtime.getDeviceProperties(device_id)
    return tuple({"gpu": props["name"].decode(), "sm": f"{props['major']}{props['minor']}",
                  "driver": cp.cuda.runtime.driverGetVersion(),
                  "cuda": cp.cuda.runtime.runtimeGetVersion(),
                  "cublaslt": _version("nvmath.bindings.cublasLt", "get_version"),
                  "cudnn": _version("cudnn", "backend_version"),
                  "cupy": cp.__version__, "stepgraph": __version__,
                  "kernels": compiler.sources_digest()}.items())


def _version(module: str, function: str):
    """module.function(), or None where the library is missing (its paths are then too)."""
    try:
        import importlib
        return int(getattr(importlib.import_module(module), function)())
    except Exception:   # ImportError, a library that fails to load: no version to key on
        return None


_caches: dict[tuple[str, int], cache.ChoiceCache] = {}


def choices(ctx, namespace: str) -> cache.ChoiceCache | None:
    """The on-disk choices of `namespace` for ctx's device (None when the cache is off)."""
    if not cache.enabled():
        return None
    device = getattr(ctx, "device_id", None)
    if device is None:      # a CudaContext: its work runs on the current device
        import cupy as cp
        device = cp.cuda.runtime.getDevice()
    return disk(namespace, device)


def disk(namespace: str, device: int) -> cache.ChoiceCache | None:
    """The on-disk entries of `namespace` for GPU `device` (None when the cache is off)."""
    if not cache.enabled():
        return None
    key = (namespace, device)
    if key not in _caches:
        _caches[key] = cache.ChoiceCache(namespace, device_identity(device))
    return _caches[key]


def stored_choice(ctx, key: Hashable, valid: Callable[[str], bool]) -> str | None:
    """The path chosen for problem `key` by an earlier process, if the disk holds one that
    passes `valid`; None without one, with the cache off, or while capturing (no file I/O
    then)."""
    disk = None if ctx.stream.is_capturing() else choices(ctx, "paths")
    return None if disk is None else disk.get(repr(key), valid)


def run_fastest(ctx, key: Hashable, paths: dict[str, Callable[[], None]], default: str) -> None:
    """Run the fastest of `paths` (name -> launch) for problem `key`: the choice on disk when
    there is a valid one, else timing every candidate at the first eager call with that key
    (and storing the winner); during a capture with no choice yet, `default`."""
    chosen = ctx.paths
    if key not in chosen and not ctx.stream.is_capturing() and len(paths) > 1:
        name = stored_choice(ctx, key, lambda value: value in paths)
        if name is None:
            name = _fastest(ctx, paths, key)
            disk = choices(ctx, "paths")
            if disk is not None:
                disk.put(repr(key), name)
        chosen[key] = name
    paths[chosen.get(key, default)]()


# A candidate is timed in full (captured, replayed) only while it may still win: once one
# has been timed, a later one whose eager runs (two, graph.time_on_device) both imply more than
# SLOWER times the best's device time is dropped after them. The slow cuDNN engines of an odd
# convolution (ms a call) then cost three runs, not a capture and ten; so do a deep GEMM's
# configurations that split it badly. The eager runs wait behind the host gate until they are
# enqueued, so their elapsed time is the device's (where the gate opened by itself, the bound
# is the elapsed time less the host's): a fast kernel behind a slow launch (a cuDNN plan's host
# work can exceed its kernel's time) is never dropped for its launch, and a slow one is not
# kept for it. (A fixed 0.5 ms margin over the best stood in for that bound first; at 0.05 ms,
# ConvNeXt's and MobileNet's bf16 steps on an H200 got 3-4% slower, fast convolutions with slow
# launches dropped. Elapsed less host time, ungated, kept 262 slow candidates of the U-Net and
# MobileNet files at fp32 whose launch's host work outlasted them.)
SLOWER = 2.0


def give_up_above(best_ms: float) -> float | None:
    """The device time past which a candidate cannot beat `best_ms` (None: nothing timed)."""
    if best_ms == float("inf"):
        return None
    return SLOWER * best_ms


def _fastest(ctx, paths: dict[str, Callable[[], None]], key: Hashable = None) -> str:
    """The name of the fastest of `paths`, each timed on the device (the first in full), a
    later one only until it is clearly slower than the best so far. Those that compile
    kernels of their own (`compiling`) come after the others: their compiles, started when
    the plan was built, go on while the others are timed; then all of them are waited for,
    side by side. Those that search (`searching`) come last, their searches cut short by the
    best of all the others (enclosing_cut) and kept light (light_search); one that comes
    within the cut of the best but not under it is searched in full and timed again. A conv's
    GEMM path timed up to 160 cuBLASLt configurations for 0.05-0.36 s a problem, and lost by
    1.5-5x to a direct kernel or cuDNN in 20 of 21 such problems of the U-Net and MobileNet
    files at fp32 on an H200."""
    own = [name for name, run in paths.items() if getattr(run, "kernels", ())]
    search = [name for name, run in paths.items() if getattr(run, "searches", False)]
    order = [name for name in paths if name not in own and name not in search] + \
        [name for name in own if name not in search] + search
    first_own = next((name for name in order if name in own), None)
    best_name, best = order[0], float("inf")
    times, started = {}, time.perf_counter()
    outer, light = enclosing_cut(), light_search()
    for name in order:
        run = paths[name]
        if name == first_own:
            compiler.compile_parallel(k for o in own for k in paths[o].kernels)
        begun = time.perf_counter()
        cut = tighter(give_up_above(best), outer)
        ms = _timed_within(ctx, run, cut, light=light or name in search)
        if name in search and not light and cut is not None and best <= ms <= cut:
            ms = min(ms, _timed_within(ctx, run, cut, light=False))
        times[name] = (round(ms, 4), "eager" if isinstance(ms, EagerMs) else "graph",
                       round(time.perf_counter() - begun, 4))
        if ms < best:
            best_name, best = name, ms
    _log_timings(key, times, best_name, time.perf_counter() - started)
    return best_name


def _timed_within(ctx, run: Callable[[], None], cut: float | None, light: bool) -> float:
    """time_on_device(run) with `cut` and `light` set for the searches inside it."""
    outer = enclosing_cut(), light_search()
    _enclosing.cut, _enclosing.light = cut, light
    try:
        return time_on_device(ctx, run, give_up_above=cut)
    finally:
        _enclosing.cut, _enclosing.light = outer


def _log_timings(key: Hashable, times: dict, chosen: str, seconds: float) -> None:
    """With STEPGRAPH_AUTOTUNE_LOG=FILE, one JSON line per timed problem: its key, each
    candidate's ms, how it was timed (a graph replay, or an eager run past the cut) and the
    host seconds its timing took (its first run's lazy work included), the choice, and the
    host seconds the whole timing took (waits for compiles included): why a problem runs
    the kernel it runs, and what choosing it cost the setup; `end`: time.perf_counter() then."""
    setup_log.write({"key": repr(key), "ms": times, "chosen": chosen,
                     "s": round(seconds, 4), "end": time.perf_counter()})


def run_family(paths: dict[str, Callable[[], None]], family: str, fallback: str) -> None:
    """Run the first path of `family` (named `family` or `family:variant`), else `fallback`:
    how tests force one implementation."""
    paths[next((name for name in paths if name.split(":")[0] == family), fallback)]()
