"""Data parallelism on two GPUs (marker multigpu: skipped with fewer): two ranks started by
`stepgraph launch` train like one process on the same global batch, hold bit-identical
parameters, and average their gradients with NCCL inside the step's CUDA graph.

Each test launches tests/unit/dist_worker.py on 2 GPUs (every rank initialises differently,
so the broadcast from rank 0 is exercised too), then runs the one-process reference here."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.cuda, pytest.mark.multigpu]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "unit" / "dist_worker.py"
sys.path.insert(0, str(WORKER.parent))

# Relative error of the parameters after the run against the one-process reference. The
# ranks' smaller GEMMs add their rows in another order (and cuDNN may plan them otherwise).
TOLERANCE = {"mlp": 1e-4, "cnn": 1e-4, "resnet": 2e-3}


def launch_workers(out: Path, *args: str, timeout: float = 540) -> list:
    result = subprocess.run([sys.executable, "-m", "stepgraph", "launch", "--gpus", "2",
                             "--timeout", "120", "--", sys.executable, str(WORKER), "--device",
                             "cuda", "--out", str(out), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return [np.load(out / f"rank{r}.npz") for r in (0, 1)]


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def parameters(record) -> dict:
    return {k[len("state/"):]: record[k] for k in record.files if k.startswith("state/")}


@pytest.mark.parametrize("model", ["mlp", "cnn", "resnet"])
def test_two_ranks_train_like_one_on_the_global_batch(tmp_path, model):
    import dist_worker

    steps, batch, size = 8, 32, (16 if model == "resnet" else 8)
    # resnet: every rank gets the whole global batch, so that its per-rank BatchNorm
    # statistics are the single process's (stepgraph, like DDP, does not sync them); its
    # loss is then the reference's on every rank, else the ranks' mean is.
    duplicate = model == "resnet"
    ranks = launch_workers(tmp_path, "--model", model, "--steps", str(steps), "--global-batch",
                           str(batch), "--size", str(size), *(("--duplicate",) * duplicate))
    reference, _, losses = dist_worker.train(model, steps, batch, device="cuda", size=size)
    expected = reference.state_dict()
    for name, value in parameters(ranks[0]).items():
        np.testing.assert_array_equal(value, ranks[1][f"state/{name}"], err_msg=name)
        assert rel(value, expected[name]) < TOLERANCE[model], name
    per_rank = np.array([[r[f"loss/{i}"] for i in range(steps)] for r in ranks])
    np.testing.assert_allclose(per_rank[0] if duplicate else per_rank.mean(axis=0), losses,
                               rtol=1e-3)


@pytest.mark.parametrize("strategy", ["flat", "grouped"])
def test_parameters_stay_bit_identical_across_ranks_for_100_steps(tmp_path, strategy):
    # A small bucket cap gives several buckets: each its own all-reduce beside the backward.
    ranks = launch_workers(tmp_path, "--model", "cnn", "--steps", "100", "--global-batch", "32",
                           "--strategy", strategy, "--bucket-cap-mb", "0.02")
    assert list(ranks[0]["plan/ops"]).count("all_reduce") > 1
    for name, value in parameters(ranks[0]).items():
        np.testing.assert_array_equal(value, ranks[1][f"state/{name}"], err_msg=name)
    assert parameters(ranks[0])


def test_the_all_reduce_is_inside_the_step_graph(tmp_path):
    """The ranks see different data, so identical parameters after graph replays mean the
    averaging ran inside them; the captured graph holds the NCCL work besides the plain step's
    nodes (an NCCL kernel per bucket and the guard flags' all-reduce, at least)."""
    import dist_worker

    ranks = launch_workers(tmp_path, "--model", "mlp", "--steps", "10", "--global-batch", "32")
    assert "graph/nodes" in ranks[0].files, "the distributed step was not captured"
    _, plain, _ = dist_worker.train("mlp", 10, 16, device="cuda")      # one rank's batch
    plain_nodes = next(iter(plain.executables.values())).captured.node_count
    buckets = list(ranks[0]["plan/ops"]).count("all_reduce")
    assert buckets >= 1
    for r in ranks:
        assert int(r["graph/nodes"]) >= plain_nodes + buckets + 1
    for name, value in parameters(ranks[0]).items():
        np.testing.assert_array_equal(value, ranks[1][f"state/{name}"], err_msg=name)
