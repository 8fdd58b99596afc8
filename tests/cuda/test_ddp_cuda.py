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

from tests.helpers import child_pythonpath
from tests.unit.test_ddp_buffers import assert_bit_identical, judge, trained_names

pytestmark = [pytest.mark.cuda, pytest.mark.multigpu]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "unit" / "dist_worker.py"
sys.path.insert(0, str(WORKER.parent))
STEPS, BATCH = 8, 32
LAUNCH_TIMEOUT_S = 120


def launch(cwd: Path, *command: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=child_pythonpath(), STEPGRAPH_DIST_TIMEOUT="30",
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


def test_every_gpu_holds_rank_zeros_batchnorm_statistics(tmp_path):
    import dist_reference
    import torch

    ranks = worker_ranks(tmp_path)
    assert "graph/nodes" in ranks[0].files, "the distributed step was not captured"
    assert list(ranks[0]["plan/ops"])[-1] == "broadcast_buffers"
    assert_bit_identical(ranks)
    judge(ranks, *(dist_reference.torch_reference("bncnn", STEPS, BATCH, dtype)
                   for dtype in (torch.float64, torch.float32)), trained_names(), steps=STEPS)


def test_sync_batchnorm_on_two_gpus_is_batchnorm_on_the_global_batch(tmp_path):
    import dist_reference
    import torch

    ranks = worker_ranks(tmp_path, "--sync-bn")
    assert "graph/nodes" in ranks[0].files, "the distributed step was not captured"
    assert list(ranks[0]["plan/ops"]).count("all_reduce_sum") == 8
    assert_bit_identical(ranks)
    judge(ranks, *(dist_reference.torch_sync_reference("bncnn", STEPS, BATCH, dtype)
                   for dtype in (torch.float64, torch.float32)), trained_names(), steps=STEPS)


def test_ddp_script_on_two_gpus_trains_like_one_process(tmp_path):
    """scripts/ddp_train.py under `stepgraph run` on two GPUs (backend "nccl",
    torch.cuda.set_device(LOCAL_RANK)) against the script on one torch process, judged as the
    CPU test judges its two processes."""
    from tests.compat.test_ddp_script import check_ddp_script

    check_ddp_script(tmp_path, lambda script, *argv: launch(
        tmp_path, sys.executable, "-m", "stepgraph", "run", script, *argv).stdout)
