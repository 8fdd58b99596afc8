"""sdpa and its gradient through cuDNN's fused flash attention (the cuDNN frontend's `sdpa` and
`sdpa_backward` graph ops): the path bf16 attention takes wherever cuDNN runs it.

On the gpt workload's attention (64 x 6 heads, T 256, head dim 64, causal, dropout 0.2, bf16;
NVIDIA H200, docs/perf-notes.md 2026-11-25) cuDNN's forward took 41 µs and its gradient 96 µs,
against 104 and 417 µs for the own kernels (attention.cu), which keep float32 operands and
every problem cuDNN does not take:
  - operands other than bf16 (cuDNN's fused attention has no float32 form);
  - head dims that differ (E != Ev) or are not a multiple of 8;
  - a causal mask over L < S queries (sdpa's diagonal is the bottom-right one; cuDNN runs
    that one only without dropout; for L == S both diagonals are the same);
  - an operand whose address is not 16-byte aligned or whose strides are not whole groups
    of 8 elements;
  - cuDNN absent, or no plan of it building for the problem (the reason is kept: `reason`).
The forward decides for the node's problem, and the gradient follows it: with dropout the two
must draw the same mask, so a gradient whose forward ran on cuDNN runs there too.

Arithmetic: float32 scores, softmax statistics and accumulation; the probabilities are
rounded to bf16 for the product with v (the own kernels round them to TF32), and each output
once, on store. The saved lse is cuDNN's softmax stats (natural-log logsumexp of the scaled,
masked scores, float32), which is sdpa's lse. The gradient runs cuDNN's deterministic
algorithm unless the context allows otherwise (compile_train_step(deterministic=False)), so
its bits are the same on every run; it measured no slower.

Dropout: cuDNN draws the mask with its own Philox generator, keyed by a 64-bit seed that
sdpa_seed.cu derives on the device from the node's seed, its site and the step
counter (offset 0). The mask is therefore fixed by (seed, site, step), the same eager and
replayed, the same in the forward and the gradient, fresh at every step, with the dropout op's
keep probability and 1 / (1 - p) scaling. Which elements it keeps is cuDNN's mapping, not the
flat-index rule the dropout op, the own kernels and the NumPy reference share: `keep_mask`
reads it back (cuDNN's rng dump) for the tests.

Plans are built at a problem's first (eager) call and kept for the process; the workspace
comes from conv.py's grow-only scratch pool, taken at that call, so a capture never allocates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cupy as cp  # imports without a GPU
import numpy as np

from ....errors import BackendUnavailableError, CaptureError
from ..conv import conv_cudnn
from ..runtime.launch import _capturing, _kernel

USE_CUDNN = True                 # tests set False to run the own kernels on bf16 operands
SEED_SOURCE = "sdpa_seed.cu"
SEED_KERNEL = "sdpa_dropout_seed_kernel"
ALIGN_ELEMENTS = 8               # 16 bytes of bf16
FORWARD = ("q", "k", "v", "o")
BACKWARD = ("q", "k", "v", "o", "do", "dq", "dk", "dv")


def kernel_names() -> dict[str, set[str]]:
    return {SEED_SOURCE: {SEED_KERNEL}}


@dataclass(frozen=True)
class Problem:
    """What one cuDNN attention graph computes: the key of its memoised plan. dims (B, H, L,
    S, D); strides: (batch, head, row) element strides of each operand of FORWARD or
    BACKWARD, in that order (columns contiguous)."""

    backward: bool
    dims: tuple[int, int, int, int, int]
    strides: tuple[tuple[int, int, int], ...]
    scale: float
    causal: bool
    dropout_p: float
    deterministic: bool
    device: int
    dump: bool = False           # forward only: also write the dropout mask (keep_mask)


@dataclass
class Plan:
    graph: Any
    uids: dict[str, int]
    workspace: int


_PLANS: dict[Problem, Plan] = {}
_FAILED: dict[Problem, str] = {}
FORWARDS_KEY = "sdpa_cudnn_forwards"     # ctx.extras: _forward_key of each forward run here


def shape_reason(e: int, ev: int, causal: bool, rows: int, keys: int) -> str | None:
    """Why a bf16 attention of head dims e, ev over `rows` queries and `keys` keys does not
    run on cuDNN, whatever its buffers (None when it may)."""
    if not USE_CUDNN:
        return "the cuDNN attention path is switched off (attention_cudnn.USE_CUDNN)"
    if e != ev or e % ALIGN_ELEMENTS:
        return f"head dims {e} and {ev}: cuDNN needs equal ones, multiples of 8"
    if causal and rows != keys:
        return f"a causal mask over {rows} queries and {keys} keys (bottom-right diagonal)"
    return conv_cudnn.unavailable_reason()


def unsupported(pb, attn, arrays: list, layouts: list) -> str | None:
    """Why this attention problem does not run on cuDNN (None when it may): the module
    docstring's list, but for plans that fail to build, which `forward` finds out."""
    if any(a.dtype != np.uint16 for a in arrays):
        return "cuDNN's fused attention runs bf16 operands only"
    if any(a.data.ptr % (2 * ALIGN_ELEMENTS) for a in arrays) or any(
            s % ALIGN_ELEMENTS for h in layouts for s in (h.batch, h.head, h.row)):
        return "an operand is not 16-byte aligned or its strides are not multiples of 8"
    return shape_reason(pb.E, pb.Ev, attn.causal, pb.L, pb.S)


def _dims(pb) -> tuple[int, int, int, int, int]:
    return (pb.bh // pb.heads, pb.heads, pb.L, pb.S, pb.E)


def _strides(pb, layouts: list) -> tuple[tuple[int, int, int], ...]:
    """Each operand's (batch, head, row) strides, a dim of one given its packed stride (a
    zero stride, which the own kernels' layout gives such a dim, is not a layout cuDNN
    takes)."""
    b, h = pb.bh // pb.heads, pb.heads
    out = []
    for lay, rows in zip(layouts, (pb.L, pb.S, pb.S, pb.L, pb.L, pb.L, pb.S, pb.S)):
        head = lay.head if h > 1 else rows * lay.row
        batch = lay.batch if b > 1 else h * head
        out.append((batch, head, lay.row))
    return tuple(out)


def _problem(ctx, pb, attn, layouts: list, backward: bool, dump: bool = False) -> Problem:
    return Problem(backward, _dims(pb), _strides(pb, layouts), float(attn.scale),
                   bool(attn.causal), float(attn.dropout_p),
                   bool(getattr(ctx, "deterministic", True)), cp.cuda.runtime.getDevice(), dump)


def _graph(cudnn, p: Problem, handle) -> tuple[Any, dict[str, Any]]:
    """The problem's pygraph, planned, and its operand tensors by name."""
    b, h, l, s, d = p.dims
    bf16, f32, i64 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT, cudnn.data_type.INT64
    graph = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32,
                          handle=handle)
    rows = dict(q=l, k=s, v=s, o=l, do=l, dq=l, dk=s, dv=s)
    layout = dict(zip(BACKWARD if p.backward else FORWARD, p.strides))

    def shape(name: str) -> dict:
        return dict(dim=[b, h, rows[name], d], stride=[*layout[name], 1])

    def scalar(name: str):
        return graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i64)

    inputs = ("q", "k", "v") + (("o", "do") if p.backward else ())
    ops = {n: graph.tensor(name=n, data_type=bf16, **shape(n)) for n in inputs}
    stats = dict(dim=[b, h, l, 1], stride=[h * l, l, 1, 1])
    kw: dict[str, Any] = {"attn_scale": p.scale}
    if p.causal:        # L == S here: top-left is sdpa's bottom-right diagonal
        kw.update(diagonal_band_right_bound=0,
                  diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT)
    if p.dropout_p > 0.0:
        ops["seed"], ops["offset"] = scalar("seed"), scalar("offset")
        kw["dropout"] = (p.dropout_p, ops["seed"], ops["offset"])
    if p.backward:
        ops["stats"] = graph.tensor(name="stats", data_type=f32, **stats)
        grads = graph.sdpa_backward(q=ops["q"], k=ops["k"], v=ops["v"], o=ops["o"],
                                    dO=ops["do"], stats=ops["stats"], name="sdpa_backward",
                                    use_deterministic_algorithm=p.deterministic, **kw)
        for name, t in zip(("dq", "dk", "dv"), grads):
            t.set_output(True).set_data_type(bf16).set_dim(shape(name)["dim"]) \
                .set_stride(shape(name)["stride"])
            ops[name] = t
    else:
        if p.dump:
            ops["dump"] = graph.tensor(name="dump", dim=[b, h, l, s],
                                       stride=[h * l * s, l * s, s, 1], data_type=f32)
            kw["rng_dump"] = ops["dump"]
        o, st = graph.sdpa(q=ops["q"], k=ops["k"], v=ops["v"], generate_stats=True,
                           name="sdpa", **kw)
        o.set_output(True).set_data_type(bf16).set_dim(shape("o")["dim"]) \
            .set_stride(shape("o")["stride"])
        st.set_output(True).set_data_type(f32).set_dim(stats["dim"]).set_stride(stats["stride"])
        ops["o"], ops["stats"] = o, st
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph, ops


def _plan(ctx, p: Problem) -> Plan | None:
    """The problem's plan, built at its first call (None, and the reason kept in _FAILED,
    where cuDNN builds none)."""
    if p in _PLANS:
        return _PLANS[p]
    if p in _FAILED:
        return None
    if _capturing(ctx):
        raise CaptureError("sdpa: its cuDNN plan is built at the first eager call; run the step "
                           "eagerly once before capturing")
    cudnn = conv_cudnn._load()[0]
    try:
        with conv_cudnn._FRONTEND:      # the handle is shared with the lane's conv builds
            graph, ops = _graph(cudnn, p, conv_cudnn.handle(ctx))
    except Exception as err:     # the frontend's several "not supported" types
        _FAILED[p] = f"{type(err).__name__}: {str(err)[:300]}"
        return None
    plan = _PLANS[p] = Plan(graph, {n: t.get_uid() for n, t in ops.items()},
                            int(graph.get_workspace_size()))
    return plan


def reason(p: Problem) -> str | None:
    """Why cuDNN built no plan for the problem (None when it did or has not tried)."""
    return _FAILED.get(p)


def _seeds(ctx, attn, step, role: str):
    """The (seed, offset) int64 pair cuDNN's dropout reads, derived on the device from the
    step counter by a one-thread kernel queued now; None without dropout. One buffer per
    context, node site and role (forward, gradient or dump), made at the first eager call.
    The gradient reads the forward's buffer where there is one: the forward of the same step
    ran before it (on cuDNN, or the gradient would not follow it there) and wrote the same
    (seed, site, step) value, so its own launch would only repeat it."""
    if attn.dropout_p == 0.0:
        return None
    table = ctx.extras.setdefault("sdpa_cudnn_seeds", {})
    if role == "gradient" and (attn.seed, attn.site, "forward") in table:
        return table[(attn.seed, attn.site, "forward")]
    key = (attn.seed, attn.site, role)
    if key not in table:
        if _capturing(ctx):
            raise CaptureError("sdpa: its dropout seed buffer is made at the first eager call")
        with ctx.stream:
            table[key] = cp.zeros(2, np.int64)
    seeds = table[key]
    _kernel(SEED_SOURCE, SEED_KERNEL)((1,), (1,), (step, np.uint64(attn.seed & (2**64 - 1)),
                                                    np.uint32(attn.site), seeds),
                                      stream=ctx.stream)
    return seeds


def _execute(ctx, plan: Plan, pointers: dict[str, int]) -> None:
    scratch, h = conv_cudnn._workspace(ctx, plan.workspace), conv_cudnn.handle(ctx)
    with conv_cudnn._FRONTEND:          # the handle is shared with the lane's conv builds
        plan.graph.execute({plan.uids[n]: ptr for n, ptr in pointers.items()},
                           None if scratch is None else scratch.data.ptr, handle=h)


def _forward_key(pb, attn) -> tuple:
    """What names a forward for the gradient that must follow it onto cuDNN."""
    return (_dims(pb), float(attn.scale), bool(attn.causal), float(attn.dropout_p), attn.seed,
            attn.site)


def _pointers(names, arrays, seeds) -> dict[str, int]:
    ptrs = {n: a.data.ptr for n, a in zip(names, arrays)}
    if seeds is not None:
        ptrs["seed"], ptrs["offset"] = seeds.data.ptr, seeds.data.ptr + 8
    return ptrs


def forward(ctx, pb, attn, layouts, q, k, v, out, lse, step) -> bool:
    """Run sdpa's forward on cuDNN if it takes the problem; False (nothing launched) if not."""
    arrays = [q, k, v, out]
    if unsupported(pb, attn, arrays, layouts) is not None:
        return False
    p = _problem(ctx, pb, attn, layouts, backward=False)
    plan = _plan(ctx, p)
    if plan is None:
        return False
    ptrs = _pointers(FORWARD, arrays, _seeds(ctx, attn, step, "forward"))
    _execute(ctx, plan, ptrs | {"stats": lse.data.ptr})
    ctx.extras.setdefault(FORWARDS_KEY, set()).add(_forward_key(pb, attn))
    return True


def backward(ctx, pb, attn, layouts, q, k, v, out, dout, lse, step, dq, dk, dv) -> bool:
    """Run sdpa's gradient on cuDNN if it takes the problem; False (nothing launched) if not.
    Raises where the forward drew its dropout mask on cuDNN and the gradient cannot follow."""
    arrays = [q, k, v, out, dout, dq, dk, dv]
    why = unsupported(pb, attn, arrays, layouts)
    p = None if why is not None else _problem(ctx, pb, attn, layouts, backward=True)
    plan = None if p is None else _plan(ctx, p)
    if plan is None:
        forwards = getattr(ctx, "extras", {}).get(FORWARDS_KEY, ())
        if attn.dropout_p > 0.0 and _forward_key(pb, attn) in forwards:
            raise BackendUnavailableError(
                f"sdpa_grad: the forward drew its dropout mask on cuDNN, whose gradient does not "
                f"run this problem ({why or reason(p)}); compile with attention dropout 0 or "
                f"set stepgraph.backends.cuda.attention_cudnn.USE_CUDNN = False")
        return False
    ptrs = _pointers(BACKWARD, arrays, _seeds(ctx, attn, step, "gradient"))
    _execute(ctx, plan, ptrs | {"stats": lse.data.ptr})
    return True


def keep_mask(ctx, pb, attn, layouts, q, k, v, step) -> np.ndarray:
    """The (bh, L, S) keep mask (bool) that the forward of this problem draws at this step on
    cuDNN: its rng dump, from a twin of the forward's graph that also writes it (the mask
    depends on the seed and the element's position alone; tests/cuda check that the
    forward's output agrees with it). cuDNN leaves the dump unwritten for score tiles its
    causal mask skips: those read False."""
    scratch_out = cp.empty((pb.bh, pb.L, pb.Ev), np.uint16)
    lse = cp.empty(pb.bh * pb.L, np.float32)
    dump = cp.zeros((pb.bh, pb.L, pb.S), np.float32)
    out_layout = type(layouts[0])(pb.heads * pb.L * pb.Ev, pb.L * pb.Ev, pb.Ev)
    p = _problem(ctx, pb, attn, list(layouts[:3]) + [out_layout], backward=False, dump=True)
    plan = _plan(ctx, p)
    if plan is None:
        raise BackendUnavailableError(f"sdpa: no cuDNN plan with an rng dump "
                                                 f"({reason(p)})")
    ptrs = _pointers(FORWARD, [q, k, v, scratch_out], _seeds(ctx, attn, step, "dump"))
    _execute(ctx, plan, ptrs | {"stats": lse.data.ptr, "dump": dump.data.ptr})
    ctx.stream.synchronize()
    return cp.asnumpy(dump) > 0
