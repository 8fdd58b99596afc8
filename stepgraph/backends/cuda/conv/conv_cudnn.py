"""conv2d and its two gradients through cuDNN (NVIDIA's cuDNN frontend, `import cudnn`): a
family of candidate paths beside conv.py's own kernels, and the only one that runs groups > 1
or dilation != 1. conv3d and its gradients (conv3d.py) run only here: the same graphs over
5-D NCDHW tensors (a geometry gives its tensors' dims and the convolution's per-axis
padding, stride and dilation: `cudnn_dims`, `cudnn_conv`).

One `cudnn.pygraph` per problem and heuristic (op, geometry with dilation and groups, dtype,
precision, fused bias / ReLU, layout, determinism), memoised for the process:
  conv2d             conv_fprop (then bias add and ReLU in the same graph when asked: "fused")
  conv2d_grad_input  conv_dgrad
  conv2d_grad_weight conv_wgrad (conv.py adds db with a reduce_sum launch)
float32 in and out, float32 accumulation; or bfloat16 in and out (precision="bf16": x, w, the
bias, y, dy, dx, dw all bf16 raw bits in uint16 arrays; float16 the same with HALF data, for
precision="fp16" and model.half()) with float32 compute and intermediate
data types, so cuDNN accumulates in float32, adds the fused bias and applies the ReLU in
float32 and rounds each output once, on store: the NumPy emulation's rounding point (its
einsum sums in another order, so results may differ in the last bf16 place where a sum lies
near a rounding boundary). Heuristic modes A and FALLBACK rank the engine
configurations; each that builds, up to MAX_PLANS (fewer for grouped and for small problems:
_limits), is a candidate path "cudnn:<i>" (i = its
index in the ranked list) that conv.py's autotuner times against the own kernels on the real
buffers. Heuristic mode B (slower to query, ranked by a different model) adds up to
MAX_PLANS_B more, those A's candidates do not already hold, as "cudnn:B<i>" (its own list,
its own graph). Filters, applied before building:
  - precision "fp32" excludes tensor-core engines (on float32 they compute in TF32) and engines
    that down-convert inputs or reduce in lower precision; "tf32" lets them compete;
  - bfloat16 and float16 problems let tensor cores compete (they compute 16-bit products
    exactly and accumulate in float32) but exclude engines that reduce in lower precision, so
    that every sum stays float32 as the compute type says;
  - nondeterministic engines (atomics) are excluded unless the context opts in
    (ctx.deterministic False: compile_train_step(deterministic=False)), so every path gives the
    same bits on every run, as the own kernels and the GEMMs do;
  - engines compiled at run time (NVRTC inside cuDNN) are excluded, building one costs seconds
    per problem at the first call, except for grouped convolutions (depthwise ones above all):
    since cuDNN 9.10 its fast NHWC depthwise kernels (conv2d_c1_k1_nhwc_specialized and their
    dgrad / wgrad twins, what torch's cudnn.benchmark finds) are such engines, and the
    precompiled grouped kernels left took 3-6x their time on an H200 (ConvNeXt's and
    MobileNet's convolutions, docs/perf-notes.md), at most MAX_RUNTIME_COMPILED a problem,
    built by worker processes in parallel or loaded from disk (cudnn_compiled.py);
  - plans needing more than workspace_limit() bytes of workspace are skipped.
The workspace comes from conv.py's grow-only scratch pool (ctx.extras["conv_scratch"]): the
largest that a problem's plans need is taken at its first eager call, so a capture never
allocates. Each context has one cuDNN handle (ctx.extras["cudnn_handle"]) bound to its stream
(shared by the contexts of one stream).

Building a plan is the costly step (cuDNN finalises the engine configuration), so a problem
whose choice is already known (conv.py: this process's, or the on-disk cache's) builds only
the chosen candidate's plan (`only`: the ranked list it belongs to, then that one index);
every candidate is built only where the problem must be timed. Each build is a job
(runtime/ahead.py) memoised by (problem, only): when a plan is bound (CudaBackend.prepare),
conv.py's `start_plans` asks for each conv node's candidates inside `starting_ahead()`, which
queues the very builds its first launch will ask for on the ahead lane and binds nothing; the
launch then waits for its own build (or runs it, if the lane has not reached it) and a build
that failed raises there. Built ahead or at the launch, a problem's Plans are the same (the
same function of the problem, the library and the GPU), so the autotuner's candidates and
choices are too. The frontend's calls on the shared handle take `_FRONTEND` (cuDNN: a handle
is used by one thread at a time; the bindings hold the GIL today, the lock keeps the rule if
they stop).

Layouts: "NCHW" tensors as the graph's NCHW ops hold them; "NHWC" (channels-last nodes,
compile/layout.py) with x, dy, y, dx stored (N, H, W, C) and the filter (O, kh, kw, C/groups)
(cuDNN's KRSC): the graph's tensors keep logical NCHW dims with those strides.

Without the frontend or a loadable libcudnn the family is simply absent (the path functions
return {}), and `unavailable_reason()` says why; an op that only cuDNN runs (groups > 1,
dilation != 1) then raises BackendUnavailableError saying to install the cuda extra.
"""
from __future__ import annotations

import functools
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

from ....errors import BackendUnavailableError, CaptureError
from ....ir.graph import ir_dtype
from ..runtime import ahead, setup_log
from ..runtime.launch import _capturing
from ..runtime.scratch import ScratchPool
from . import cudnn_compiled
from .geometry import Geometry

MAX_PLANS = 12                     # candidates per problem, in heuristic rank order
MAX_PLANS_B = 8                    # more from heuristic mode B, not among those already
HEURISTIC_B = True                 # query mode B as well (its candidates "cudnn:B<i>")
# Grouped convolutions: their winner was the first of list A (23 of 24 problems of the
# MobileNet and ConvNeXt files at bf16 on an H200) or of B (1), by 3-10x over the next; more
# candidates only cost builds (MobileNet's first step 9.3 -> 8.1 s, ConvNeXt's 10.3 -> 7.2 s
# with these limits, their steps unchanged).
MAX_PLANS_GROUPED, MAX_PLANS_B_GROUPED = 4, 2
# Problems of fewer multiply-adds than SMALL_MACS run in a few µs on any plan (their launch):
# timing more candidates cannot gain more than that, and each plan's first run loads (and may
# JIT) its kernel. On an H200, MobileNet's squeeze-excitation convolutions (n=128, 1x1 on 1x1
# maps, 16K multiply-adds) took 3.9 s and 1.5 s of its bf16 setup to time 20 candidates, every
# one 2.7-12 µs; the 18 such problems of the conv files at bf16 all chose among A's first three.
SMALL_MACS = 1 << 22
MAX_PLANS_SMALL, MAX_PLANS_B_SMALL = 3, 1
# A plan needing more workspace than the smaller of these is not a candidate. The resnet's
# float32 convolutions at batch 512 run fastest on engines with large workspaces (transformed
# operands): on an H200, 23.0 ms per step with 256 MiB and 6 + 4 candidates, 21.1 ms with 4 GiB
# and 12 + 8. The pool keeps the largest a chosen plan needs (and, while the autotuner
# times a problem, the largest of its candidates), so smaller GPUs get a smaller limit.
MAX_WORKSPACE_BYTES = 4 << 30
WORKSPACE_MEMORY_FRACTION = 16     # ... and at most 1/16 of the GPU's memory
RUNTIME_COMPILED = False           # admit engines cuDNN compiles at plan build (NVRTC) ...
RUNTIME_COMPILED_GROUPED = True    # ... for grouped convolutions only (module docstring),
MAX_RUNTIME_COMPILED = 1           # the first this many of a problem's (A's, then B's): each
                                   # compiles at its build, 0.5-2 s (an H200, MobileNet's first
                                   # step at bf16: 15.8 s with 2 a list, 9.3 s with 1 a list).
                                   # One a problem, not a list: in the conv files at bf16 and
                                   # fp32, B's won no problem where A's was there (7 builds,
                                   # 4.4 s); where A's list had none, B's won one by 10x.
LAYOUTS = ("NCHW", "NHWC")         # of every tensor of a problem (module docstring)
DTYPES = ("float32", "bfloat16", "float16")   # IR dtypes of the problems (module docstring)
# The 16-bit ones: HALF or BFLOAT16 data, float32 compute, tensor cores allowed
HALF_DTYPES = ("bfloat16", "float16")
INSTALL_HINT = "pip install -e '.[cuda]' (nvidia-cudnn-frontend and nvidia-cudnn-cu13)"


@functools.cache
def _load() -> tuple[Any, str | None]:
    """(the cudnn module, None), or (None, why it cannot be used). The frontend imports
    without libcudnn, so asking the library's version is what proves that it loaded."""
    try:
        import cudnn

        cudnn.backend_version()
    except Exception as err:    # ImportError, OSError, the binding's RuntimeError: all say no
        return None, f"{type(err).__name__}: {err}"
    return cudnn, None


def unavailable_reason() -> str | None:
    """Why the cuDNN paths cannot run here (None when they can)."""
    return _load()[1]


def available() -> bool:
    """Whether the cuDNN paths can run here (frontend importable and libcudnn loaded)."""
    return _load()[0] is not None


def needed(g: Geometry) -> bool:
    """Whether only cuDNN runs this convolution (the own kernels: groups 1, dilation 1; in
    channels-last between permutes, conv.py's _through_nchw)."""
    return not g.plain


def _cudnn(op: str, g: Geometry):
    """The cudnn module, or None when absent; raises when the op cannot run without it."""
    cudnn, why = _load()
    if cudnn is None and needed(g):
        raise BackendUnavailableError(
            f"{op} with groups={g.groups}, dilation={g.dilation} runs only through "
            f"cuDNN, which is not usable here ({why}): {INSTALL_HINT}")
    return cudnn


# ---- problems and their plans ----------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    """What one cuDNN graph computes: the key of its memoised Plans."""
    op: str                  # conv2d, conv2d_grad_input or conv2d_grad_weight (or conv3d...)
    g: Geometry
    dtype: str               # IR dtype of every operand: float32, bfloat16 or float16
    precision: str
    bias: bool = False       # conv2d: bias add in the graph
    relu: bool = False       # conv2d: ReLU in the graph, after the bias
    layout: str = "NCHW"
    device: int = 0
    deterministic: bool = True   # False: engines with the NONDETERMINISTIC note compete too


@dataclass(frozen=True)
class Candidate:
    """One buildable plan: its path name ("cudnn:<i>" or "cudnn:B<i>"), the graph it belongs
    to (Plans.graphs), its index in that graph's ranked list, engine name, workspace bytes."""
    path: str
    graph: int
    index: int
    name: str
    workspace: int


@dataclass
class Plans:
    """A problem's built cuDNN graphs (one per heuristic list) with their operand uids by name,
    and the candidates. `reason` says why there are none."""
    graphs: list[tuple[Any, dict[str, int]]]
    entries: list[Candidate]
    reason: str = ""

    @property
    def workspace(self) -> int:
        return max((c.workspace for c in self.entries), default=0)


# The build of every candidate of each problem, and of one candidate's plan alone
# (plans_for's only): jobs, done or under way (runtime/ahead.py)
_PLANS: dict[Problem, ahead.Job] = {}
_CHOSEN: dict[tuple[Problem, str], ahead.Job] = {}
_FRONTEND = threading.RLock()     # held by each frontend call on a handle (module docstring)
_ahead = threading.local()        # .on: inside starting_ahead() on this thread


def _strides(dims: list[int], layout: str) -> list[int]:
    """Strides of a tensor of logical dims (N, C, *spatial): row-major, or with layout "NHWC"
    (4-D only) the channels innermost."""
    if layout == "NHWC":
        n, c, h, w = dims
        return [h * w * c, 1, w * c, c]
    strides = [1]
    for d in reversed(dims[1:]):
        strides.insert(0, strides[0] * d)
    return strides


def _graph(cudnn, p: Problem, handle) -> tuple[Any, dict[str, Any]]:
    """The problem's pygraph (validated, not yet planned) and its operand tensors by name."""
    g, f32 = p.g, cudnn.data_type.FLOAT
    io = {"bfloat16": cudnn.data_type.BFLOAT16,
          "float16": cudnn.data_type.HALF}.get(p.dtype, f32)
    # Compute and intermediates float32 in both (every op of the graph takes these global
    # types): a bf16 graph rounds only what it writes.
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32,
                          handle=handle)
    dims = g.cudnn_dims()

    def tensor(name: str, kind: str):
        return graph.tensor(name=name, dim=dims[kind], stride=_strides(dims[kind], p.layout),
                            data_type=io)

    conv = g.cudnn_conv()
    if p.op in ("conv2d", "conv3d"):
        ops = {"x": tensor("x", "x"), "w": tensor("w", "w")}
        out, kind = graph.conv_fprop(image=ops["x"], weight=ops["w"], **conv), "y"
        if p.bias or p.relu:    # virtual: the sum stays float32 until the last op stores it
            out.set_data_type(f32)
        if p.bias:
            ops["b"] = tensor("b", "b")
            out = graph.bias(input=out, bias=ops["b"])
        if p.relu:
            out = graph.relu(input=out)
        name = "y"
    elif p.op.endswith("_grad_input"):
        ops = {"dy": tensor("dy", "y"), "w": tensor("w", "w")}
        out, kind, name = graph.conv_dgrad(loss=ops["dy"], filter=ops["w"], **conv), "x", "dx"
    else:
        ops = {"x": tensor("x", "x"), "dy": tensor("dy", "y")}
        out, kind, name = graph.conv_wgrad(image=ops["x"], loss=ops["dy"], **conv), "w", "dw"
    out.set_output(True).set_data_type(io)
    out.set_dim(dims[kind]).set_stride(_strides(dims[kind], p.layout))
    ops[name] = out
    graph.validate()
    graph.build_operation_graph()
    return graph, ops


# (path prefix, heuristic modes) of each ranked list a problem draws from
HEURISTICS = (("", ("A", "FALLBACK")), ("B", ("B",)))


def heuristics() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The ranked lists a problem's candidates are drawn from: HEURISTICS, B only when
    HEURISTIC_B."""
    return HEURISTICS if HEURISTIC_B else HEURISTICS[:1]


def _ranked(cudnn, p: Problem, handle, modes: tuple[str, ...]):
    """The problem's graph with the execution plans of `modes` ranked and the filters of the
    module docstring applied; (graph, operand tensors by name, plan count)."""
    graph, ops = _graph(cudnn, p, handle)
    graph.create_execution_plans([getattr(cudnn.heur_mode, m) for m in modes])
    barred = barred_notes(cudnn, p.dtype, p.precision, p.deterministic)
    if barred:
        graph.deselect_numeric_notes(barred)
    if not _admits_runtime_compiled(p):
        graph.deselect_behavior_notes([cudnn.behavior_note.RUNTIME_COMPILATION])
    return graph, ops, graph.get_execution_plan_count()


def barred_notes(cudnn, dtype: str, precision: str, deterministic: bool = True) -> list:
    """The numerical notes whose engines are no candidates for operands of IR dtype `dtype`
    at `precision` (module docstring's filters)."""
    notes = cudnn.numerical_note
    barred = [notes.NONDETERMINISTIC] if deterministic else []
    if dtype in HALF_DTYPES:
        barred += [notes.REDUCED_PRECISION_REDUCTION]
    elif precision == "fp32":
        barred += [notes.TENSOR_CORE, notes.DOWN_CONVERT_INPUTS,
                   notes.REDUCED_PRECISION_REDUCTION]
    return barred


def _limits(p: Problem) -> tuple[int, int]:
    """How many candidates heuristic A's and B's lists may give `p` (module docstring)."""
    if p.g.macs < SMALL_MACS:
        return MAX_PLANS_SMALL, MAX_PLANS_B_SMALL
    if p.g.groups > 1:
        return MAX_PLANS_GROUPED, MAX_PLANS_B_GROUPED
    return MAX_PLANS, MAX_PLANS_B


def _admits_runtime_compiled(p: Problem) -> bool:
    """Whether engines cuDNN compiles at their build compete for `p` (module docstring)."""
    return RUNTIME_COMPILED or (RUNTIME_COMPILED_GROUPED and p.g.groups > 1)


def _runtime_compiled(cudnn, graph, index: int) -> bool:
    """Whether the ranked plan at `index` is an engine cuDNN compiles when it is built (only
    such plans pass the filters where _ranked admits them)."""
    try:
        notes = graph.get_behavior_notes_for_plan_at_index(index)
    except Exception:           # a frontend without per-plan notes: not counted
        return False
    return cudnn.behavior_note.RUNTIME_COMPILATION in list(notes)


def _build(cudnn, p: Problem, handle) -> Plans:
    """Rank the problem's plans by each heuristic of HEURISTICS (B only when HEURISTIC_B) and
    build, in rank order, each that passes the filters and is not a candidate already, up to
    that heuristic's limit."""
    plans, failures = Plans([], []), []
    seconds: dict[str, float] = {}              # host seconds by list ranked, plan built
    admitted = _admits_runtime_compiled(p)      # else none is ranked: no notes to read
    compiled_taken = 0
    for prefix, modes in heuristics():
        limit = _limits(p)[bool(prefix)]
        began = time.perf_counter()
        try:
            with _FRONTEND:
                graph, ops, count = _ranked(cudnn, p, handle, modes)
        except Exception as err:    # the frontend raises several types for "not supported"
            failures.append(f"heuristics {'+'.join(modes)}: {type(err).__name__}: {err}")
            continue
        finally:
            seconds[f"rank {'+'.join(modes)}"] = time.perf_counter() - began
        source = len(plans.graphs)
        plans.graphs.append((graph, _uids(ops)))
        taken = 0
        for index in range(count):
            if taken == limit:
                break
            seen = {c.name for c in plans.entries}
            try:
                name = str(graph.get_plan_name_at_index(index))
            except Exception:       # named once built, then
                name = None
            if name in seen:
                continue
            compiled = admitted and _runtime_compiled(cudnn, graph, index)
            if compiled and compiled_taken == MAX_RUNTIME_COMPILED:
                continue
            began = time.perf_counter()
            try:
                name, workspace, runs_in = _plan_of(cudnn, p, handle, graph, ops, modes, index,
                                                    compiled, plans.graphs)
            except Exception as err:    # barred by a filter, the engine declined, too large
                failures.append(f"[{prefix}{index}] {type(err).__name__}: {str(err)[:200]}")
                continue
            finally:
                seconds[f"{prefix}{index}"] = time.perf_counter() - began
            if name in seen:
                continue
            plans.entries.append(Candidate(f"cudnn:{prefix}{index}",
                                           source if runs_in is None else runs_in, index, name,
                                           workspace))
            taken += 1
            compiled_taken += compiled
    if not plans.entries:
        plans.reason = "no plan built: " + "; ".join(failures[:4])
    setup_log.write({"cudnn_plans": repr(p), "built": [c.path for c in plans.entries],
                     "s": {k: round(v, 4) for k, v in seconds.items()}})
    return plans


def _plan_of(cudnn, p: Problem, handle, graph, ops, modes, index: int, compiled: bool,
             graphs: list) -> tuple[str, int, int | None]:
    """Build the plan at `index` of the graph ranked by `modes`: (engine name, workspace
    bytes, None). A runtime-compiled one (`compiled`) is loaded instead where the build
    workers or the disk hold it (cudnn_compiled), as a graph of its own appended to `graphs`
    (its position is the third value); one built here is stored for later processes."""
    if not compiled:
        with _FRONTEND:
            return (*_build_plan(graph, index), None)
    key = _compiled_key(p)
    loaded = cudnn_compiled.take(cudnn, p, key, modes, index, handle, _FRONTEND)
    if loaded is not None:
        plan, runner = loaded
        graphs.append((runner, _uids(ops)))
        return plan.name, plan.workspace, len(graphs) - 1
    with _FRONTEND:
        name, workspace = _build_plan(graph, index)
    cudnn_compiled.keep(p, key, modes, index, name, workspace, graph, _FRONTEND)
    return name, workspace, None


def _compiled_key(p: Problem) -> str:
    """What names p's runtime-compiled plan on disk (cudnn_compiled): the problem and what
    decides its candidates."""
    return f"{p!r} {candidates_key()!r}"


class WorkspaceTooLarge(Exception):
    """A plan that needs more than workspace_limit() bytes of workspace: not a candidate."""


def _build_plan(graph, index: int) -> tuple[str, int]:
    """Build the graph's execution plan at `index` of its ranked list: (engine name,
    workspace bytes). Raises where a filter bars it, the engine declines it or its workspace
    exceeds workspace_limit()."""
    graph.build_plan_at_index(index)
    name = str(graph.get_plan_name_at_index(index))
    workspace = int(graph.get_workspace_size_plan_at_index(index))
    if workspace > workspace_limit():
        raise WorkspaceTooLarge(f"{name}: workspace {workspace} bytes")
    return name, workspace


@functools.cache
def _device_memory(device: int) -> int:
    import cupy as cp
    return int(cp.cuda.Device(device).mem_info[1])


def workspace_limit() -> int:
    """The most workspace a candidate plan may need: MAX_WORKSPACE_BYTES, and at most
    1/WORKSPACE_MEMORY_FRACTION of the current GPU's memory."""
    import cupy as cp
    return min(MAX_WORKSPACE_BYTES,
               _device_memory(cp.cuda.runtime.getDevice()) // WORKSPACE_MEMORY_FRACTION)


def _uids(ops: dict) -> dict[str, int]:
    """The graph's operand uids by name (what a launch binds its device pointers to)."""
    return {name: t.get_uid() for name, t in ops.items()}


def _ranked_list(path: str) -> tuple[tuple[str, ...], int] | None:
    """(heuristic modes, index in their ranked list) of candidate `path` ("cudnn:<i>" or
    "cudnn:B<i>"); None where it names no list that _build draws from."""
    match = re.fullmatch(r"cudnn:(B?)(\d+)", path)
    lists = dict(heuristics())
    if match is None or match[1] not in lists:
        return None
    return lists[match[1]], int(match[2])


def _build_one(cudnn, p: Problem, handle, path: str) -> Plans:
    """Only the plan of candidate `path`, a choice made when every candidate was built and
    timed: its heuristic's list ranked and filtered as _build does, then the plan at its
    index built. No candidate (and the reason) where that fails: the caller then builds and
    times them all."""
    where = _ranked_list(path)
    if where is None:
        return Plans([], [], f"{path} is not a cuDNN candidate of this build")
    modes, index = where
    try:
        with _FRONTEND:
            graph, ops, count = _ranked(cudnn, p, handle, modes)
        if index >= count:
            return Plans([], [], f"{path}: heuristics {'+'.join(modes)} rank {count} plans")
        compiled = _admits_runtime_compiled(p) and _runtime_compiled(cudnn, graph, index)
        graphs = [(graph, _uids(ops))]
        name, workspace, runs_in = _plan_of(cudnn, p, handle, graph, ops, modes, index,
                                            compiled, graphs)
    except Exception as err:    # as in _build: the frontend's many "not supported" types
        return Plans([], [], f"{path}: {type(err).__name__}: {str(err)[:200]}")
    return Plans(graphs, [Candidate(path, runs_in or 0, index, name, workspace)])


def plans_for(ctx, p: Problem, only: str | None = None) -> Plans:
    """The problem's Plans: built at its first call (never during a capture), or waited for
    where its build was started ahead (start_ahead); a build that failed raises here, once (a
    later call builds again). With `only` (a candidate's path) just that candidate, if it
    still builds: taken from the problem's Plans where every candidate is built (or being
    built) already, else its plan alone is built."""
    if only is not None and p in _PLANS:
        every = _wait(ctx, _PLANS, p)
        return Plans(every.graphs, [c for c in every.entries if c.path == only], every.reason)
    memo, key = _memo(p, only)
    if key not in memo and _capturing(ctx):
        raise CaptureError(f"{p.op}: its cuDNN plans are built at the first eager call; run "
                           "the step eagerly once before capturing")
    _job(ctx, p, only)
    return _wait(ctx, memo, key)


def _memo(p: Problem, only: str | None) -> tuple[dict, Any]:
    """The memo of the build plans_for(_, p, only) does, and its key there."""
    return (_PLANS, p) if only is None else (_CHOSEN, (p, only))


def _job(ctx, p: Problem, only: str | None) -> ahead.Job:
    """The build of the problem's plans (`only`: that candidate's alone), made now if there
    is none (not started: whoever needs it first runs it)."""
    memo, key = _memo(p, only)
    job = memo.get(key)
    if job is None:
        job = memo[key] = ahead.Job(functools.partial(_build_problem, ctx, p, only), p.device)
    return job


def _build_problem(ctx, p: Problem, only: str | None) -> Plans:
    cudnn, h = _load()[0], handle(ctx)
    return _build(cudnn, p, h) if only is None else _build_one(cudnn, p, h, only)


def _wait(ctx, memo: dict, key) -> Plans:
    """The Plans of memo[key]'s build, waited for (run here if the lane has not taken it up).
    Its failure is raised, and the job forgotten, so that a later call builds again."""
    job = memo[key]
    if not job.done() and _capturing(ctx):
        raise CaptureError("a cuDNN plan is still being built: run the step eagerly once "
                           "before capturing")
    try:
        return job.result()
    except Exception:
        if memo.get(key) is job:
            del memo[key]
        raise


@contextmanager
def starting_ahead():
    """Inside it (on this thread), asking for a problem's candidates (`_paths`) starts the
    build plans_for would do on the ahead lane (start_ahead) and answers none: conv.py's
    start_plans runs a node's own code in it, so the builds started are those its first
    launch will ask for, and nothing is bound or allocated."""
    _ahead.on = True
    try:
        yield
    finally:
        _ahead.on = False


def is_starting_ahead() -> bool:
    """Whether this thread is inside starting_ahead()."""
    return getattr(_ahead, "on", False)


def start_ahead(ctx, p: Problem, only: str | None = None) -> None:
    """Queue on the ahead lane the build plans_for(ctx, p, only) would do (nothing where that
    would take every candidate's build, asked for already). The handle is made now, on this
    thread, while no capture of the step can be under way."""
    if only is not None and p in _PLANS:
        return
    handle(ctx)
    want = None if only is None else _ranked_list(only)
    if _admits_runtime_compiled(p) and (only is None or want is not None):
        cudnn_compiled.prefetch(p, _compiled_key(p), want)
    ahead.start(_job(ctx, p, only))


def candidates_key() -> tuple | None:
    """What decides a problem's candidate paths besides the problem and the GPU and cuDNN
    library (autotune.device_identity): None without cuDNN, else the frontend's version and
    this module's limits and filters. conv.py keys its choices by this rather than by the
    candidates' names, which are known only once every plan is built."""
    cudnn = _load()[0]
    if cudnn is None:
        return None
    return (getattr(cudnn, "__version__", None), MAX_PLANS, MAX_PLANS_B if HEURISTIC_B else 0,
            MAX_PLANS_GROUPED, MAX_PLANS_B_GROUPED, SMALL_MACS, MAX_PLANS_SMALL,
            MAX_PLANS_B_SMALL, workspace_limit(), RUNTIME_COMPILED, RUNTIME_COMPILED_GROUPED,
            MAX_RUNTIME_COMPILED)


# ---- handle, workspace, launch ---------------------------------------------------------------

_HANDLES: dict[tuple[int, int], Any] = {}


def handle(ctx):
    """The context's cuDNN handle, bound to ctx.stream: one per (device, stream), made at the
    first eager call and kept for the process (plans built with it outlive any context;
    the backend's contexts share one stream, so they share it)."""
    h = ctx.extras.get("cudnn_handle")
    if h is None:
        import cupy as cp

        key = (cp.cuda.runtime.getDevice(), ctx.stream.ptr)
        h = _HANDLES.get(key)
        if h is None:
            if _capturing(ctx):
                raise CaptureError("a cuDNN handle is made at the first eager conv call; run "
                                   "the step eagerly once before capturing")
            cudnn = _load()[0]
            with _FRONTEND:     # one per key, whichever thread asks first (the lane too)
                h = _HANDLES.get(key)
                if h is None:
                    h = cudnn.create_handle()
                    cudnn.set_stream(handle=h, stream=ctx.stream.ptr)
                    _HANDLES[key] = h
        ctx.extras["cudnn_handle"] = h
    return h


def _workspace(ctx, nbytes: int):
    """A uint8 device buffer of at least nbytes from the context's conv scratch pool (None
    for 0 bytes)."""
    if nbytes == 0:
        return None
    pool = ctx.extras.setdefault("conv_scratch", ScratchPool())
    return pool.get(nbytes, ctx)


def _paths(ctx, p: Problem, arrays: dict[str, Any],
           only: str | None = None) -> dict[str, Callable[[], None]]:
    """{"cudnn:<i>": launch} for each of the problem's plans (`only`: that candidate's alone,
    if it builds), bound to these arrays; none inside starting_ahead(), which starts the
    build instead."""
    if is_starting_ahead():
        start_ahead(ctx, p, only)
        return {}
    plans = plans_for(ctx, p, only)
    if not plans.entries:
        return {}
    if not _capturing(ctx):
        _workspace(ctx, plans.workspace)    # the largest, taken now: a capture cannot allocate
    # Device addresses, not arrays: given an array the frontend asks whether it is a torch
    # tensor, which imports torch (seconds) into a process that never needed it.
    operands = [{uids[name]: a.data.ptr for name, a in arrays.items()}
                for _, uids in plans.graphs]

    def launch(c: Candidate) -> None:
        scratch, h = _workspace(ctx, c.workspace), handle(ctx)
        with _FRONTEND:
            plans.graphs[c.graph][0].execute_plan_at_index(
                operands[c.graph], None if scratch is None else scratch.data.ptr,
                index=c.index, handle=h)

    return {c.path: functools.partial(launch, c) for c in plans.entries}


def _problem(ctx, op: str, g: Geometry, dtype, layout: str = "NCHW", **kw) -> Problem | None:
    cudnn = _cudnn(op, g)
    if cudnn is None or ir_dtype(dtype) not in DTYPES:
        return None
    import cupy as cp

    return Problem(op, g, ir_dtype(dtype), ctx.precision, layout=layout,
                   device=cp.cuda.runtime.getDevice(),
                   deterministic=bool(getattr(ctx, "deterministic", True)), **kw)


# ---- paths of the three ops ------------------------------------------------------------------

def conv2d_paths(ctx, g: Geometry, x, w, y, bias=None, relu: bool = False, layout: str = "NCHW",
                 only: str | None = None, op: str = "conv2d") -> dict[str, Callable[[], None]]:
    """y = conv2d(x, w) (+ bias) (then ReLU) in one cuDNN graph per plan; {} when cuDNN is
    absent or has no plan (raises where only cuDNN could run it: module docstring). With
    `only` (a path name), that candidate alone, its plan alone built ({} if it does not).
    op "conv3d": the same over a 3-D geometry's 5-D tensors (conv3d.py)."""
    p = _problem(ctx, op, g, x.dtype, layout, bias=bias is not None, relu=relu)
    if p is None:
        return {}
    arrays = {"x": x, "w": w, "y": y} | ({} if bias is None else {"b": bias})
    return _paths(ctx, p, arrays, only)


def grad_input_paths(ctx, g: Geometry, dy, w, dx, layout: str = "NCHW",
                     only: str | None = None, op: str = "conv2d_grad_input"
                     ) -> dict[str, Callable[[], None]]:
    """dx of conv2d (op "conv3d_grad_input": conv3d) given dy and w, a cuDNN conv_dgrad per
    plan (see conv2d_paths)."""
    p = _problem(ctx, op, g, dy.dtype, layout)
    return {} if p is None else _paths(ctx, p, {"dy": dy, "w": w, "dx": dx}, only)


def grad_weight_paths(ctx, g: Geometry, dy, x, dw, layout: str = "NCHW",
                      only: str | None = None, op: str = "conv2d_grad_weight"
                      ) -> dict[str, Callable[[], None]]:
    """dw of conv2d (op "conv3d_grad_weight": conv3d) given dy and x, a cuDNN conv_wgrad per
    plan (see conv2d_paths)."""
    p = _problem(ctx, op, g, x.dtype, layout)
    return {} if p is None else _paths(ctx, p, {"x": x, "dy": dy, "dw": dw}, only)


def reason(ctx, op: str, g: Geometry, dtype, layout: str = "NCHW") -> str:
    """Why no cuDNN path runs this problem (for the error of an op that needs one)."""
    why = unavailable_reason()
    if why is not None:
        return why
    if ir_dtype(dtype) not in DTYPES:
        return f"dtype {ir_dtype(dtype)}: the cuDNN paths run {' and '.join(DTYPES)}"
    p = _problem(ctx, op, g, dtype, layout)
    return plans_for(ctx, p).reason
