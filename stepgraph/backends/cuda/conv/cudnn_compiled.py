"""cuDNN's runtime-compiled plans without their builds one after another: the engines cuDNN
compiles with NVRTC when their plan is built (conv_cudnn admits them for grouped convolutions,
whose fast depthwise kernels are such engines) take 0.2-2 s a build on an H200, on the GIL.
MobileNet's file at bf16 built 15 of them, 10 s of its first step.

A problem's first runtime-compiled plan, in the order conv_cudnn._build takes candidates
(the one it takes: MAX_RUNTIME_COMPILED is 1), comes from the first of:
- this process's answer from the build workers: when plans are bound (conv_cudnn.start_ahead,
  before the first step runs), `prefetch` sends each such problem that the disk does not hold
  to a pool of worker processes (runtime/worker_pool.py running cudnn_build_worker.py), which
  rank its plans as _build does and build that one, in parallel with each other and with this
  process's own builds (while conv_cudnn's lane waits for an answer, timings run);
- the on-disk cache (namespace "cudnn_compiled", cache.py): each plan built here or by a worker
  is stored serialized (the frontend's graph.serialize; a loaded plan gave the same bits as
  the one built, and loads in 10-20 ms);
- else conv_cudnn builds it in this process, as without either, and `keep` stores it.
A loaded plan is a graph of one plan (`LoadedPlan` runs it). conv_cudnn names an entry by its
problem and candidates_key() (the frontend version, limits and filters), under the device
identity (the GPU, driver, cuDNN version), so a plan from another GPU model or library is never
loaded; cuDNN promises no compatibility of serialized plans beyond that.

build_workers() sizes the pool: half the CPU cores (shared among the ranks of a node), at most
8, and none below 2, where a worker's start (its imports and CUDA context, seconds) costs
more than it saves; $STEPGRAPH_CUDNN_BUILD_WORKERS overrides it (0: every build here).

A build takes 0.2-2 s (a worker's first also its start: imports and a CUDA context, seconds),
so a worker that has not answered BUILD_TIMEOUT_S after taking a problem up, or a problem no
worker has taken up in QUEUE_TIMEOUT_S, is taken as a stall:
the pool is closed (its processes killed), that plan and every later one are built in this
process, and one warning says so, rather than the first step waiting minutes in silence.
"""
from __future__ import annotations

import base64
import os
import threading
import warnings
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any

from ..runtime import ahead, autotune
from ..runtime.worker_pool import Request, WorkerError, WorkerPool

NAMESPACE = "cudnn_compiled"
WORKERS_ENV = "STEPGRAPH_CUDNN_BUILD_WORKERS"
MAX_BUILD_WORKERS = 8
WORKER_MODULE = "stepgraph.backends.cuda.conv.cudnn_build_worker"
BUILD_TIMEOUT_S = 60.0          # a worker's answer, waited for at most this long after it
QUEUE_TIMEOUT_S = 300.0         # took the problem up; a problem not yet taken up, this long


def build_workers() -> int:
    """How many worker processes may build plans at once (module docstring)."""
    explicit = os.environ.get(WORKERS_ENV)
    if explicit is not None:
        return max(0, int(explicit))
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))   # they share the cores
    workers = min(MAX_BUILD_WORKERS, (os.cpu_count() or 1) // 2 // ranks_here)
    return workers if workers >= 2 else 0


@dataclass(frozen=True)
class CompiledPlan:
    """A built runtime-compiled plan: where it sits in the problem's ranked lists (heuristic
    modes, index), its engine name and workspace bytes, and its serialized graph."""
    modes: tuple[str, ...]
    index: int
    name: str
    workspace: int
    blob: bytes


class LoadedPlan:
    """A deserialized graph of one plan, run as conv_cudnn runs a ranked graph's plan."""

    def __init__(self, graph):
        self.graph = graph

    def execute_plan_at_index(self, operands, workspace, index: int, handle) -> None:
        self.graph.execute(operands, workspace, handle=handle)


_pool: WorkerPool | None = None
_asked: dict[Any, Request] = {}         # problem -> the workers' answer (CompiledPlan | None)
_lock = threading.Lock()


def _stored(p, key: str) -> CompiledPlan | None:
    disk = autotune.disk(NAMESPACE, p.device)
    value = None if disk is None else disk.get(key, _valid)
    if value is None:
        return None
    return CompiledPlan(tuple(value["modes"]), value["index"], value["name"],
                        value["workspace"], base64.b64decode(value["blob"]))


def _valid(value) -> bool:
    return (isinstance(value["modes"], list) and isinstance(value["index"], int)
            and isinstance(value["name"], str) and isinstance(value["workspace"], int)
            and isinstance(value["blob"], str))


def _store(p, key: str, plan: CompiledPlan) -> None:
    disk = autotune.disk(NAMESPACE, p.device)
    if disk is not None:
        disk.put(key, {"modes": list(plan.modes), "index": plan.index, "name": plan.name,
                       "workspace": plan.workspace, "blob": base64.b64encode(plan.blob).decode()})


def prefetch(p, key: str, want: tuple[tuple[str, ...], int] | None = None) -> None:
    """Have the workers build p's first runtime-compiled plan (`want`: the plan at that
    (modes, index), only if it is runtime-compiled), unless it is asked for already, the disk
    holds one under `key`, or there are no workers."""
    global _pool
    size = build_workers()
    if size == 0 or p in _asked or _stored(p, key) is not None:
        return
    with _lock:
        if p not in _asked and (_pool is None or not _pool.closed):
            if _pool is None:
                _pool = WorkerPool(WORKER_MODULE, size)
            _asked[p] = _pool.submit((p, want))


def take(cudnn, p, key: str, modes: tuple[str, ...], index: int, handle,
         frontend: threading.RLock) -> tuple[CompiledPlan, LoadedPlan] | None:
    """p's runtime-compiled plan at (modes, index) from the workers' answer or the disk (under
    `key`), and its graph loaded holding `frontend` (conv_cudnn's lock of the frontend's calls);
    None when neither holds that plan (conv_cudnn then builds it)."""
    with _lock:
        asked = _asked.pop(p, None)
    plan = None
    if asked is not None:
        plan = _answer(p, asked)
        if plan is not None:
            _store(p, key, plan)
    if plan is None:
        plan = _stored(p, key)
    if plan is None or (plan.modes, plan.index) != (tuple(modes), index):
        return None
    try:
        with frontend:
            graph = cudnn.pygraph(handle=handle)
            graph.deserialize(handle, plan.blob)
    except Exception:   # a blob this library or GPU does not load after all: built here
        return None
    return plan, LoadedPlan(graph)


def _answer(p, asked: Request) -> CompiledPlan | None:
    """The workers' plan for p, None where they failed or the pool is closed; a stall closes
    the pool (module docstring)."""
    try:
        with ahead.waiting_elsewhere():             # holding no GIL: timings may run
            return asked.wait(BUILD_TIMEOUT_S, QUEUE_TIMEOUT_S)
    except (WorkerError, CancelledError):           # failed, died, or the pool was closed
        return None
    except TimeoutError:
        _stalled(p, asked)
        return None


def _stalled(p, asked: Request) -> None:
    with _lock:
        pool = _pool
        if pool is None or pool.closed:
            return
        pool.close()
    where = (f"worker {asked.worker_pid} took it up and did not answer in {BUILD_TIMEOUT_S:.0f} s"
             if asked.taken_at is not None
             else f"no worker took it up in {QUEUE_TIMEOUT_S:.0f} s")
    warnings.warn(f"stepgraph: cuDNN's plan build workers stalled on {p.op} ({where}); cuDNN "
                  f"plans are built in this process from now on. {WORKERS_ENV}=0 builds them "
                  f"here from the start.", RuntimeWarning, stacklevel=2)


def keep(p, key: str, modes: tuple[str, ...], index: int, name: str, workspace: int, graph,
         frontend: threading.RLock) -> None:
    """Store under `key` the runtime-compiled plan just built at (modes, index) of p's lists
    (`graph` holds it built), for later processes; nothing where the frontend cannot
    serialize it."""
    try:
        with frontend:
            blob = bytes(graph.serialize(as_bytes=True))
    except Exception:   # the frontend's several "not supported" types: built again next time
        return
    _store(p, key, CompiledPlan(tuple(modes), index, name, workspace, blob))
