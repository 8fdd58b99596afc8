"""memory_format="auto" decided by timing the step both ways where the rule is unsure.

compile/layout.py's rule (channels-last where the convolutions cuDNN runs on its NHWC
tensor-core kernels carry half the convolution FLOPs) is an estimate: what a layout costs also
depends on the conversions it adds, on the norms, pools and joins between the convolutions and
on which kernels the autotuner finds for each shape. Where that estimate is close (the
tensor-core convolutions carry less than layout.SURE_SHARE of the FLOPs: mixed channel counts,
or none that vote), a TrainStep whose memory_format is still "auto" when it builds its first
step (CUDA, tf32 or bf16, cuDNN present, no data parallelism) builds the step in both layouts,
the rule's first, runs each a few times from the same parameters and optimizer state (restored
afterwards, so the measurement leaves no trace in training) and keeps the faster. The other is
dropped, with the state only it bound (its weight copies, bf16 or float32).

Where the rule is sure it decides alone: building the second layout costs a first compile
seconds (cuDNN plans and kernels of every convolution in the other layout), and on every net
timed both ways with a sure rule the rule's layout was the faster (layout.SURE_SHARE says
where). STEPGRAPH_LAYOUT_MEASURE=always times every step with convolutions; =0 none.

The decision is stored in the on-disk choice cache (namespace "layout", stepgraph/cache.py:
keyed by the GPU and library identity and a digest of the step's graph), so a later process
building the same step on the same kind of GPU builds one layout only. The step's
`layout_choice` says what was decided and how.

A captured training loop (stepgraph/loop/) and compile_predict keep the rule: a loop's forward
evaluated ahead of its step and its predictors are built before the step exists, and must lay
their tensors out as the step does.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field

import numpy as np

from .executable import Executable
from .layout import channels_last_pays, rule_is_sure

# "0": the rule decides, nothing is timed; "always": every step with convolutions is timed;
# unset (or anything else): the steps the rule is unsure of (layout.rule_is_sure).
MEASURE_ENV = "STEPGRAPH_LAYOUT_MEASURE"
CANDIDATES = ("channels_last", "contiguous")
CONV_OPS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")
ROUNDS = 3            # timed rounds, the candidates alternating; each keeps its fastest
RUNS = 5              # steps per round
NAMESPACE = "layout"


@dataclass(frozen=True)
class LayoutChoice:
    """How a step's memory format was decided: source "measured" (step_us holds each
    candidate's µs a step, the fastest round's), "cached" (an earlier process measured this
    step on this kind of GPU) or "rule" (layout.channels_last_pays: a step without
    convolutions, one the rule is sure of, or one whose second layout did not fit in memory
    beside the first)."""

    memory_format: str
    source: str
    step_us: dict[str, float] = field(default_factory=dict)


def enabled() -> bool:
    return os.environ.get(MEASURE_ENV, "1") != "0"


def _always() -> bool:
    return os.environ.get(MEASURE_ENV) == "always"


def has_convolutions(plan) -> bool:
    return any(n.op in CONV_OPS for n in plan.graph.nodes)


def problem(plan, precision: str, deterministic: bool) -> str:
    """What a stored decision is keyed by: the precision, the determinism and a digest of the
    contiguous step's graph (each node's op, operand shapes and dtypes and plain attributes)."""
    digest = hashlib.sha256()
    for n in plan.graph.nodes:
        digest.update(repr((n.op, [(v.shape, v.dtype) for v in n.inputs],
                            [(v.shape, v.dtype) for v in n.outputs],
                            sorted((k, a) for k, a in n.attrs.items() if _plain(a)))).encode())
    return f"precision={precision} deterministic={deterministic} graph={digest.hexdigest()}"


def _plain(value) -> bool:
    """Whether an attribute's repr is the same in every process (numbers, strings, tuples of
    them), so it can key a stored choice."""
    if isinstance(value, (tuple, list)):
        return all(map(_plain, value))
    return value is None or isinstance(value, (bool, int, float, str))


def _disk(compiled):
    """The on-disk layout decisions for the step's GPU (None off CUDA or with the cache off)."""
    if compiled.device != "cuda":
        return None
    from ..backends.cuda.runtime import autotune

    return autotune.choices(compiled.ctx, NAMESPACE)


def choose(compiled, signature, key) -> tuple[LayoutChoice, Executable]:
    """The Executable of `signature` in the faster memory format, and how it was chosen.
    `compiled` is a TrainStep whose memory_format is "auto"; it is left at the choice."""
    planned = compiled.plan(signature)            # laid out by the rule
    if not has_convolutions(planned):              # nothing to lay out
        compiled.memory_format = "contiguous"
        return LayoutChoice("contiguous", "rule"), compiled.executable_of(planned, key)
    ruled = "channels_last" if channels_last_pays(planned.graph) else "contiguous"
    compiled.memory_format = ruled
    if not _always() and rule_is_sure(planned.graph):
        return LayoutChoice(ruled, "rule"), compiled.executable_of(planned, key)
    other = CANDIDATES[1] if ruled == CANDIDATES[0] else CANDIDATES[0]
    compiled.memory_format = other
    plans = {ruled: planned, other: compiled.plan(signature)}
    compiled.memory_format = ruled
    asked = problem(plans["contiguous"], compiled.precision, compiled.deterministic)
    disk = _disk(compiled)
    stored = None if disk is None else disk.get(asked, lambda value: value in CANDIDATES)
    if stored is not None:
        compiled.memory_format = stored
        return LayoutChoice(stored, "cached"), compiled.executable_of(plans[stored], key)
    exes = {ruled: compiled.executable_of(plans[ruled], key)}
    try:
        exes[other] = compiled.executable_of(plans[other], key)
        step_us = _time(exes, compiled.use_graph)
    except MemoryError:       # both steps' activations at once do not fit: keep the rule's
        _drop_state_of_the_other(compiled, exes[ruled])
        return LayoutChoice(ruled, "rule"), exes[ruled]
    chosen = min(step_us, key=step_us.get)
    compiled.memory_format = chosen
    _drop_state_of_the_other(compiled, exes[chosen])
    if disk is not None:
        disk.put(asked, chosen)
    return LayoutChoice(chosen, "measured", step_us), exes[chosen]


def _drop_state_of_the_other(compiled, kept: Executable) -> None:
    """Free the state only the dropped step bound (its layout's weight copies): nothing
    reads or updates it any more."""
    bound = {v.name for v in kept.plan.graph.state}
    for name in [k for k in compiled.state if k not in bound]:
        del compiled.state[name]


def _time(exes: dict[str, Executable], use_graph: bool) -> dict[str, float]:
    """µs a step of each Executable, from the same parameters and state each time, those
    restored afterwards. Each runs twice first (its warm-up, which autotunes its kernels, and
    its capture), then ROUNDS rounds of RUNS steps alternate between them; the fastest round
    counts. The graphs captured here are dropped: a capture records launch arguments the
    step's setup has not made yet (the guard's mailbox)."""
    backend = next(iter(exes.values())).backend
    saved = _snapshot(exes.values())
    try:
        for exe in exes.values():
            exe.feed([np.zeros(b.shape, b.dtype) for b in exe.input_buffers])
            for _ in range(2):
                exe.run(use_graph)
        best = {fmt: float("inf") for fmt in exes}
        for _ in range(ROUNDS):
            for fmt, exe in exes.items():
                backend.synchronize()
                start = time.perf_counter()
                for _ in range(RUNS):
                    exe.run(use_graph)
                backend.synchronize()
                best[fmt] = min(best[fmt], (time.perf_counter() - start) / RUNS * 1e6)
    finally:
        for buf, copy in saved:
            backend.copy_into(buf, copy)
        backend.synchronize()
        for exe in exes.values():     # the step captures its own graph at its first call
            exe.uncapture()
    return best


def _snapshot(exes) -> list:
    """(buffer, copy) of every parameter and state buffer the Executables write (shared
    between them: bound by name)."""
    seen: dict[int, object] = {}
    for exe in exes:
        for v in (*exe.plan.graph.params, *exe.plan.graph.state):
            buf = exe.buffers[v]
            seen.setdefault(id(buf), buf)
    backend = next(iter(exes)).backend
    return [(buf, backend.copy_result(buf)) for buf in seen.values()]
