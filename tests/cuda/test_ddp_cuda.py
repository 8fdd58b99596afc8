"""Two-GPU mirrors of the CPU data-parallel BatchNorm and DDP-script tests
(tests/unit/test_ddp_buffers.py, tests/compat/test_ddp_script.py): rank 0's running
statistics broadcast with NCCL inside the step's CUDA graph, nn.SyncBatchNorm's global sums
all-reduced with NCCL in the forward and backward passes, and the DDP tutorial-style script
run by `stepgraph run` on two GPUs, each judged against one torch process by the tolerance
policy and checked bit-identical across ranks. Marker multigpu: skipped with fewer than two
GPUs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.reference import assert_close_to_reference, assert_state_changes_close

pytestmark = [pytest.mark.cuda, pytest.mark.multigpu]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "unit" / "dist_worker.py"
sys.path.insert(0, str(WORKER.parent))
STEPS, BATCH = 8, 32
LAUNCH_TIMEOUT_S = 120


def launch(cwd: Path, *command: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), STEPGRAPH_DIST_TIMEOUT="30",
               NCCL_NVLS_ENABLE="0")
    done = subprocess.run([sys.executable, "-m", "stepgraph", "launch", "--gpus", "2", "--",
                           *command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def worker_ranks(out: Path, *args: str) -> list:
    launch(ROOT, sys.executable, str(WORKER), "--device", "cuda", "--out", str(out), "--model",
           "bncnn", "--steps", str(STEPS), "--global-batch", str(BATCH), *args)
    return [np.load(out / f"rank{r}.npz") for r in (0, 1)]


def entries(record, prefix: str) -> dict:
    return {k[len(prefix):]: record[k] for k in record.files if k.startswith(prefix)}


def assert_bit_identical(ranks: list) -> None:
    for prefix in ("state/", "optimizer/"):
        mine = entries(ranks[0], prefix)
        for key, value in mine.items():
            np.testing.assert_array_equal(entries(ranks[1], prefix)[key], value,
                                          err_msg=prefix + key)


def judge(ranks: list, ref64, ref32) -> None:
    import dist_worker

    trained = [k for k, _ in dist_worker.make_model("bncnn", 8)[0].named_parameters()]
    for r, record in enumerate(ranks):
        assert_state_changes_close(ref64.initial, entries(record, "state/"), ref64.states[r],
                                   ref32.states[r], f"rank {r}: ", trained=trained,
                                   counters=STEPS)
        assert_close_to_reference([record[f"loss/{i}"] for i in range(STEPS)],
                                  ref64.losses[r], ref32.losses[r], f"rank {r}: losses")


def test_every_gpu_holds_rank_zeros_batchnorm_statistics(tmp_path):
    import dist_reference
    import torch

    ranks = worker_ranks(tmp_path)
    assert "graph/nodes" in ranks[0].files, "the distributed step was not captured"
    assert list(ranks[0]["plan/ops"])[-1] == "broadcast_buffers"
    assert_bit_identical(ranks)
    judge(ranks, *(dist_reference.torch_reference("bncnn", STEPS, BATCH, dtype)
                   for dtype in (torch.float64, torch.float32)))


def test_sync_batchnorm_on_two_gpus_is_batchnorm_on_the_global_batch(tmp_path):
    import dist_reference
    import torch

    ranks = worker_ranks(tmp_path, "--sync-bn")
    assert "graph/nodes" in ranks[0].files, "the distributed step was not captured"
    assert list(ranks[0]["plan/ops"]).count("all_reduce_sum") == 8
    assert_bit_identical(ranks)
    judge(ranks, *(dist_reference.torch_sync_reference("bncnn", STEPS, BATCH, dtype)
                   for dtype in (torch.float64, torch.float32)))


def test_ddp_script_on_two_gpus_trains_like_one_process(tmp_path):
    """scripts/ddp_train.py under `stepgraph run` on two GPUs (backend "nccl",
    torch.cuda.set_device(LOCAL_RANK)) against the script on one torch process."""
    import torch

    from tests.compat.test_training_scripts import SCRIPTS, judge as judge_printed
    from tests.compat.test_training_scripts import numbers, run_script

    gen = np.random.default_rng(0)
    x = gen.standard_normal((320, 1, 8, 8)).astype(np.float32)
    y = gen.integers(0, 10, 320).astype(np.int64)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    np.savez(tmp_path / "data64.npz", x=x.astype(np.float64), y=y)
    for out in ("t32", "t64", "ours"):
        (tmp_path / out).mkdir()
    argv = ["--epochs", "2", "--batch-size", "32", "--init", "init.pt"]
    t32 = run_script("ddp_train", "torch", argv + ["--out", "t32"], tmp_path)
    t64 = run_script("ddp_train", "torch", argv + ["--out", "t64", "--data", "data64.npz"],
                     tmp_path, float64=True)
    ours = launch(tmp_path, sys.executable, "-m", "stepgraph", "run",
                  str(SCRIPTS / "ddp_train.py"), *argv, "--out", "ours").stdout
    for what, pattern in (("training losses", r"step \d+ loss ([0-9.]+)"),
                          ("test loss", r"test loss ([0-9.]+)")):
        judge_printed(numbers(ours, pattern), numbers(t64, pattern), numbers(t32, pattern),
                      what)
    load = lambda name: {k: v.cpu().numpy() for k, v in torch.load(  # noqa: E731
        tmp_path / name, weights_only=True).items()}
    rank0, rank1 = load("ours/final_rank0.pt"), load("ours/final_rank1.pt")
    for key, value in rank0.items():
        np.testing.assert_array_equal(rank1[key], value, err_msg=key)
    init = load("init.pt")
    trained = [k for k in init if "running" not in k and "num_batches" not in k]
    assert_state_changes_close(init, rank0, load("t64/final_rank0.pt"),
                               load("t32/final_rank0.pt"), "final state: ", trained=trained,
                               counters=16)
