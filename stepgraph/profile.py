"""`stepgraph profile`: where a training step's time goes, op by op, on the GPU.

For a bench workload (`--workload mlp|cnn|resnet|convnet|gpt`) or your own step:
`step.profile(x, y)` in Python, or `stepgraph profile --script FILE` where FILE defines
`make_step()` returning `(step, inputs)`: a compiled CUDA train step and the tuple of arrays
of one call.

Times each op of the plan alone on the device and counts the kernels it launches (by
capturing it into a graph and counting nodes), then times the eager step and the whole-step
graph replay and compares them with the sum of op times: the eager excess is what launches
and host gaps cost, which the graph removes.
"""
from __future__ import annotations

import argparse
import runpy
import statistics
from dataclasses import dataclass

from .api import PRECISIONS
from .compile.executable import Executable, phase_of

# Built from the benchmark's own definitions (bench/workloads.py), on its batches.
BENCH_WORKLOADS = ("big", "resnet", "convnet", "gpt")
WORKLOADS = ("mlp", "cnn") + BENCH_WORKLOADS


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


def load_script_step(path: str):
    """(step, inputs) from make_step() of the Python file `path`, run as a module named
    "__stepgraph_profile__" (so its `if __name__ == "__main__":` block does not run)."""
    namespace = runpy.run_path(path, run_name="__stepgraph_profile__")
    make_step = namespace.get("make_step")
    if not callable(make_step):
        raise ValueError(f"{path} must define make_step() returning (step, inputs)")
    made = make_step()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], (tuple, list))):
        raise ValueError(f"{path}: make_step() must return (step, inputs), inputs a tuple of "
                         f"the arrays of one call; got {type(made).__name__}")
    return made[0], tuple(made[1])


def build_workload(name: str, precision: str = "fp32"):
    """A compiled train step of a BENCHMARKS.md workload on random data resident on the GPU."""
    import cupy as cp
    import numpy as np

    from . import compile_train_step, losses, models, optim

    rng = np.random.default_rng(0)
    if name == "mlp":
        model, loss, opt = models.mlp(), losses.cross_entropy, optim.AdamW(lr=1e-3)
        x, y = rng.random((128, 784), dtype=np.float32), rng.integers(0, 10, 128)
    elif name == "cnn":
        model, loss, opt = models.cnn(), losses.nll_loss, optim.SGD(lr=0.01, momentum=0.5)
        x, y = rng.random((64, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, 64)
    elif name in BENCH_WORKLOADS:
        # The benchmark's own definition (stepgraph bench --workloads resnet,convnet,gpt).
        from .bench import workloads as wl
        from .bench.peers import stepgraph_runner as runner
        workload = wl.get_workload(name)
        model, loss = runner.build_model(workload), runner.build_loss(workload)
        opt = runner.build_optimizer(workload.optimizer, model)
        batch = wl.make_batches(workload, 1)[0]
        x, y = batch.x, batch.y
    else:
        raise ValueError(f"unknown workload {name!r} (profile supports {', '.join(WORKLOADS)})")
    x, y = cp.asarray(x), cp.asarray(y)
    step = compile_train_step(model, loss=loss, optimizer=opt, example_inputs=(x, y),
                              device="cuda", graph=True, precision=precision)
    return step, (x, y)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepgraph profile", description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="mlp", choices=WORKLOADS)
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--script", default=None,
                        help="profile your own step: a Python file defining make_step() that "
                        "returns (step, inputs), a compiled CUDA train step and one call's "
                        "arrays (--workload and --precision are then ignored)")
    args = parser.parse_args(argv)
    from .backends import cuda_available
    if not cuda_available():
        print("stepgraph profile needs a CUDA GPU (CuPy found none)")
        return 2
    if args.script:
        from .errors import StepgraphError
        try:
            step, inputs = load_script_step(args.script)
            print(step.profile(*inputs, iters=args.iters).table())
        except (StepgraphError, ValueError, OSError) as err:
            print(f"error: {err}")
            return 2
        return 0
    from .errors import UnsupportedPrecisionError
    try:
        step, feed = build_workload(args.workload, args.precision)
    except UnsupportedPrecisionError as err:
        print(f"error: {err}")
        return 2
    exe = step.executable(step.signature)
    exe.feed(feed)
    print(profile_executable(exe, args.workload, args.iters).table())
    return 0
