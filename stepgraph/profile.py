"""`stepgraph profile`: where a training step's time goes, op by op, on the GPU.

For a bench workload (`--workload mlp|cnn|resnet|convnet|gpt`) or your own step:
`step.profile(x, y)` in Python, or `stepgraph profile --script FILE` where FILE defines
`make_step()` returning `(step, inputs)`: a compiled CUDA train step and the tuple of arrays
of one call. The timing itself is step_profile.py's.
"""
from __future__ import annotations

import argparse
import runpy

from .api import PRECISIONS
from .step_profile import (OpTiming, StepProfile, profile_executable,  # noqa: F401
                           profile_step)

# Built from the benchmark's own definitions (bench/workloads.py), on its batches.
BENCH_WORKLOADS = ("big", "resnet", "convnet", "gpt")
WORKLOADS = ("mlp", "cnn") + BENCH_WORKLOADS


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
