"""`step.profile(x, y)`: the per-op device times of a compiled CUDA train step (StepProfile).

Times each op of the plan alone on the device and counts the kernels it launches (by
capturing it into a graph and counting nodes), then times the eager step and the whole-step
graph replay and compares them with the sum of op times: the eager excess is what launches
and host gaps cost, which the graph removes.

Apart from profile.py (the `stepgraph profile` command, which builds its workloads with
compile_train_step): TrainStep.profile runs this, so it must not import the API back (an
import circle api -> profile -> api otherwise).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from .compile.executable import Executable, phase_of


@dataclass(frozen=True)
class OpTiming:
    label: str           # the op as the user wrote it, e.g. "Linear(784,512)+ReLU forward"
    op: str
    kernels: int | None  # graph nodes the op alone captures into
    us: float            # median device time


@dataclass(frozen=True)
class StepProfile:
    workload: str
    device: str
    ops: list[OpTiming]
    eager_step_us: float
    graph_step_us: float
    graph_nodes: int | None
    arena_bytes: int

    @property
    def sum_op_us(self) -> float:
        return sum(o.us for o in self.ops)

    @property
    def kernels(self) -> int | None:
        counts = [o.kernels for o in self.ops]
        return None if None in counts else sum(counts)

    def table(self) -> str:
        total = self.sum_op_us or 1.0
        lines = [f"stepgraph profile: {self.workload} on {self.device}",
                 f"{'op':<44}{'kernels':>8}{'time µs':>10}{'share':>8}"]
        for o in sorted(self.ops, key=lambda o: -o.us):
            k = "?" if o.kernels is None else str(o.kernels)
            lines.append(f"{o.label[:43]:<44}{k:>8}{o.us:>10.1f}{o.us / total:>8.1%}")
        lines += [
            f"sum of op times        {self.sum_op_us:10.1f} µs over {len(self.ops)} ops, "
            f"{self.kernels if self.kernels is not None else '?'} kernels",
            f"eager step (wall)      {self.eager_step_us:10.1f} µs",
            f"graph replay           {self.graph_step_us:10.1f} µs, "
            f"{self.graph_nodes if self.graph_nodes is not None else '?'} graph nodes",
            f"launch and host gaps   {self.eager_step_us - self.sum_op_us:10.1f} µs in eager mode, "
            f"{self.graph_step_us - self.sum_op_us:.1f} µs in the graph",
            f"arena                  {self.arena_bytes / 2**20:10.2f} MiB",
        ]
        return "\n".join(lines)


def _profile_ops(exe: Executable, repeats: int) -> list[tuple[int | None, float]]:
    """(kernels, median device µs) of each op. Each op is captured alone, `repeats` times in
    a row, into one graph: its node count over `repeats` is the op's kernel count, and the
    replay time over `repeats` is its device time without host launch gaps (eager event
    timings would mostly measure the host). Repeating an update op trains the model further:
    a profile is not a training run."""
    import cupy as cp

    from .backends.cuda.runtime.graph import capture
    from .backends.cuda.runtime.side_stream import join_all

    stream, results = exe.ctx.stream, []
    for node, ins, outs in exe.calls:
        def run_op(node=node, ins=ins, outs=outs):
            for _ in range(repeats):
                exe.backend.run_node(node, ins, outs, exe.ctx)
            join_all(exe.ctx)   # an op forked onto a side stream (an overlapped update)
        captured = capture(run_op, exe.ctx)
        times = []
        for _ in range(5):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            captured.launch()
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / repeats)
        nodes = captured.node_count
        results.append((None if nodes is None else nodes // repeats, statistics.median(times)))
    return results


def _time_step(run, stream, iters: int) -> float:
    import cupy as cp

    start, end = cp.cuda.Event(), cp.cuda.Event()
    run()
    start.record(stream)
    for _ in range(iters):
        run()
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / iters


def profile_executable(exe: Executable, workload: str, iters: int = 50) -> StepProfile:
    """Profile one compiled executable whose inputs are already fed (this trains it)."""
    import cupy as cp

    exe.run(use_graph=False)  # warm-up: plans GEMMs, builds device tables
    ops = [OpTiming(f"{n.label or n.op} {phase_of(n)}", n.op, k, t)
           for (n, _, _), (k, t) in zip(exe.calls, _profile_ops(exe, repeats=20))]
    eager = _time_step(exe.run_eager, exe.ctx.stream, iters)
    exe.run(use_graph=True)
    graph_us = _time_step(lambda: exe.run(use_graph=True), exe.ctx.stream, iters * 4)
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    return StepProfile(workload, name, ops, eager, graph_us, exe.captured.node_count,
                       exe.plan.arena_bytes)


def profile_step(step, arrays, iters: int = 50, name: str | None = None) -> StepProfile:
    """Profile a compiled CUDA train step on one batch (step.profile). Profiling runs its ops
    many times, which would train it: its parameters and all its state are put back after."""
    saved = step.state_dict()
    internal = {k: step.backend.to_numpy(v) for k, v in step.state.items()
                if k not in saved}                   # loss history, guard counters
    exe = step._prepare(tuple(arrays))
    try:
        return profile_executable(exe, name or f"{type(step.model).__name__} step", iters)
    finally:
        step.load_state_dict(saved)
        for k, v in internal.items():
            step.backend.copy_into(step.state[k], v)
        step._host_step = None
