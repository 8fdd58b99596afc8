"""Data parallelism on two GPUs (marker multigpu: skipped with fewer; the torchrun test of
four ranks wants four, and the last tests run at every GPU of a host of more than two):
two ranks started by `stepgraph launch` or torchrun, each fed its own half of every global
batch, train like one process on the union batch (float32 and bf16: parameter changes judged
by the tolerance policy against torch float64, tests/unit/dist_reference.py), hold
bit-identical parameters that did change, and average their gradients with
NCCL inside the step's CUDA graph (or, with sharded optimizer state, reduce-scatter them and
all-gather the parameters there, training like the unsharded step); they exit promptly after
their last step, and a rank killed mid-run is named by the others, which end instead of
hanging in NCCL.

Most tests launch tests/unit/dist_worker.py (every rank initialises differently, so the
broadcast from rank 0 is exercised too), then run the one-process reference here. Every
process runs under a subprocess timeout of at most LAUNCH_TIMEOUT_S, with
STEPGRAPH_DIST_TIMEOUT at RANK_TIMEOUT_S, so no test can hang: a stuck run fails in
about a minute (scripts/dp-check runs this file within a fixed time)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import child_pythonpath
from tests.reference import assert_close_to_reference, assert_state_changes_close

pytestmark = [pytest.mark.cuda, pytest.mark.multigpu]

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "unit" / "dist_worker.py"
sys.path.insert(0, str(WORKER.parent))

# A two-rank run of these sizes takes seconds (resnet's first compile about 15 s): a process
# still running after LAUNCH_TIMEOUT_S is stuck. A rank waits RANK_TIMEOUT_S for the others.
LAUNCH_TIMEOUT_S = 60
RANK_TIMEOUT_S = 30


def run_ranks(command: list[str], timeout: float = LAUNCH_TIMEOUT_S, env=None) -> tuple:
    """(exit code, stdout, stderr) of a launcher `command`. One still running after `timeout`
    is sent SIGTERM, which it forwards to its ranks (dist_worker dumps their stacks then:
    $STEPGRAPH_STACKS_DIR), and the test fails with the end of its stderr. With
    $STEPGRAPH_DP_LOG set, every run's command, exit code and stderr are appended there."""
    import os
    import signal

    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        code = f"stuck after {timeout} s"
    if os.environ.get("STEPGRAPH_DP_LOG"):
        with open(os.environ["STEPGRAPH_DP_LOG"], "a") as log:
            log.write(f"== {' '.join(command[1:])}\n== exit {code}\n{err}\n")
    assert code == 0, f"exit {code}: " + err[-4000:]
    return code, out, err


def launch_workers(out: Path, *args: str, timeout: float = LAUNCH_TIMEOUT_S,
                   world: int = 2) -> list:
    run_ranks([sys.executable, "-m", "stepgraph", "launch", "--gpus", str(world), "--timeout",
               str(RANK_TIMEOUT_S), "--", sys.executable, str(WORKER), "--device", "cuda",
               "--out", str(out), *args], timeout)
    return [np.load(out / f"rank{r}.npz") for r in range(world)]


def parameters(record) -> dict:
    return {k[len("state/"):]: record[k] for k in record.files if k.startswith("state/")}


def assert_same_on_every_rank(ranks: list, keys=None) -> None:
    """The ranks hold bit-identical values of `keys` (default: every state entry, and the
    optimizer's state where the worker recorded it, but for sharded slots: each rank holds
    its own chunk, "<slot>.zero.bucket<b>")."""
    for name, value in parameters(ranks[0]).items():
        if keys is None or name in keys:
            for r in ranks[1:]:
                np.testing.assert_array_equal(value, r[f"state/{name}"], err_msg=name)
    if keys is None:
        for name in (k for k in ranks[0].files
                     if k.startswith("optimizer/") and ".zero.bucket" not in k):
            for r in ranks[1:]:
                np.testing.assert_array_equal(ranks[0][name], r[name], err_msg=name)


def checksums(ranks: list) -> list[float]:
    """Each rank's sum of its state and optimizer entries, in float64 (for the log)."""
    return [float(sum(np.asarray(r[k], np.float64).sum() for k in r.files
                      if k.startswith(("state/", "optimizer/")))) for r in ranks]


def assert_trained(ranks: list, model: str, size: int = 8) -> None:
    """Every parameter moved from the start the ranks share (rank 0's initialisation): ranks
    that agree because none of them trained fail here."""
    import dist_reference

    start = dist_reference.initial_state(model, size)
    for r, record in enumerate(ranks):
        for name in trained_names(model, size):
            assert np.any(record[f"state/{name}"] != start[name]), f"rank {r}: {name} unchanged"


def trained_names(model: str, size: int = 8) -> list[str]:
    import dist_worker

    return [k for k, _ in dist_worker.make_model(model, size)[0].named_parameters()]


def assert_ranks_match_torch(ranks: list, model: str, steps: int, batch: int, size: int = 8,
                             **options) -> None:
    """Each rank's losses and state changes judged by the tolerance policy against one torch
    process over the union of the ranks' batches (dist_reference.py): float64 the reference,
    float32's error the measure. Parameters are shared, and so are BatchNorm's running
    statistics: rank 0's, from its shards alone (broadcast_buffers)."""
    import dist_reference
    import torch

    ref64, ref32 = (dist_reference.torch_reference(model, steps, batch, dtype, size,
                                                   len(ranks), **options)
                    for dtype in (torch.float64, torch.float32))
    for r, record in enumerate(ranks):
        assert_state_changes_close(ref64.initial, parameters(record), ref64.states[r],
                                   ref32.states[r], f"rank {r}: ",
                                   trained=trained_names(model, size), counters=steps)
        assert_close_to_reference([record[f"loss/{i}"] for i in range(steps)],
                                  ref64.losses[r], ref32.losses[r], f"rank {r}: losses")


@pytest.mark.parametrize("model", ["mlp", "cnn", "resnet"])
def test_two_ranks_train_like_one_on_the_global_batch(tmp_path, model):
    """The ranks see different halves of each global batch (resnet's BatchNorm normalises by
    its rank's half, as DDP's does, and the reference does the same; every rank keeps rank
    0's running statistics): a missing all-reduce
    leaves each rank with its half's gradient, which the judge against the union batch and
    the ranks' agreement both catch."""
    steps, batch, size = 8, 32, (16 if model == "resnet" else 8)
    ranks = launch_workers(tmp_path, "--model", model, "--steps", str(steps), "--global-batch",
                           str(batch), "--size", str(size))
    assert_same_on_every_rank(ranks)        # parameters and rank 0's running statistics
    assert_ranks_match_torch(ranks, model, steps, batch, size)


@pytest.mark.parametrize("strategy,model,precision", [
    ("flat", "cnn", "fp32"), ("grouped", "cnn", "fp32"), ("flat", "bncnn", "tf32"),
    ("flat", "bncnn", "bf16")])
def test_parameters_stay_bit_identical_across_ranks_for_100_steps(tmp_path, strategy, model,
                                                                  precision):
    """After 100 steps every rank holds the same bits in every precision: parameters,
    BatchNorm's running statistics (rank 0's, broadcast in the step) and the optimizer's
    momentum; a checksum per rank is printed for the log."""
    # A small bucket cap gives several buckets: each its own all-reduce beside the backward
    # (bncnn's gradients are 10 KB in all).
    cap = "0.02" if model == "cnn" else "0.002"
    ranks = launch_workers(tmp_path, "--model", model, "--steps", "100", "--global-batch", "32",
                           "--strategy", strategy, "--bucket-cap-mb", cap,
                           "--precision", precision)
    assert list(ranks[0]["plan/ops"]).count("all_reduce") > 1
    print(f"{model} {precision}: checksums", checksums(ranks))
    assert any(k.startswith("optimizer/") for k in ranks[0].files)
    assert_same_on_every_rank(ranks)
    assert_trained(ranks, model)


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
    assert_same_on_every_rank(ranks)
    assert_ranks_match_torch(ranks, "mlp", 10, 32)


@pytest.mark.parametrize("optimizer,clip", [("sgd", None), ("adamw", "0.05")])
def test_sharded_optimizer_state_trains_like_unsharded_on_two_gpus(tmp_path, optimizer, clip):
    """ZeRO-1 (DataParallel(shard_optimizer=True)) and the unsharded data-parallel step, both
    judged by the policy against torch over the union batch (NCCL's reduce-scatter may add the
    ranks in another order than its all-reduce, so they need not agree bit for bit); the
    ranks' parameters are bit-identical, and each rank holds half the optimizer state."""
    args = ["--model", "cnn", "--steps", "10", "--global-batch", "32", "--bucket-cap-mb",
            "0.02", "--optimizer", optimizer] + (["--max-grad-norm", clip] if clip else [])
    (tmp_path / "full").mkdir()
    (tmp_path / "zero").mkdir()
    full = launch_workers(tmp_path / "full", *args)
    zero = launch_workers(tmp_path / "zero", *args, "--shard-optimizer")
    for ranks in (full, zero):
        assert_same_on_every_rank(ranks)
        assert_ranks_match_torch(ranks, "cnn", 10, 32, optimizer=optimizer,
                                 max_grad_norm=float(clip) if clip else None)

    def slots(record) -> int:
        return sum(record[k].size for k in record.files
                   if k.startswith("optimizer/") and not k.endswith("lr_schedule"))

    buckets = list(zero[0]["plan/ops"]).count("reduce_scatter")
    for r in zero:
        assert slots(full[0]) / 2 <= slots(r) <= slots(full[0]) / 2 + 2 * buckets


def test_the_reduce_scatter_and_all_gather_are_inside_the_step_graph(tmp_path):
    """Each bucket's reduce-scatter (pack kernel + NCCL), the parameter shard (pack + copy)
    and the all-gather (NCCL + unpack) are nodes of the captured graph: at least three more
    per bucket than the unsharded data-parallel step, whose all-reduces they replace."""
    args = ["--model", "cnn", "--steps", "10", "--global-batch", "32", "--bucket-cap-mb",
            "0.02"]
    (tmp_path / "full").mkdir()
    (tmp_path / "zero").mkdir()
    full = launch_workers(tmp_path / "full", *args)
    zero = launch_workers(tmp_path / "zero", *args, "--shard-optimizer")
    ops = list(zero[0]["plan/ops"])
    buckets = ops.count("reduce_scatter")
    assert buckets > 1 and ops.count("all_gather") == ops.count("zero_shard") == buckets
    assert "all_reduce" not in ops
    assert buckets == list(full[0]["plan/ops"]).count("all_reduce")
    for r in zero:
        assert "graph/nodes" in r.files, "the sharded step was not captured"
        assert int(r["graph/nodes"]) >= int(full[0]["graph/nodes"]) + 3 * buckets
    assert_same_on_every_rank(zero)
    assert_trained(zero, "cnn")


def gpu_count() -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def start_ranks(world: int, args: list[str],
                timeout: float = RANK_TIMEOUT_S) -> list[subprocess.Popen]:
    """`world` processes with the variables `stepgraph launch` sets but no launcher watching
    them: what each rank does by itself at the end of a run, or when a peer dies."""
    import os

    from stepgraph.distributed.launch import free_port

    port = free_port()
    return [subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world),
                                      LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                                      STEPGRAPH_DIST_TIMEOUT=str(timeout),
                                      PYTHONPATH=child_pythonpath()))
            for r in range(world)]


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, float]]:
    """(exit code, stderr, time.time() at exit as seen here) of each process; kills them all
    if one outlives `timeout`, so that no test hangs."""
    import time

    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            out.append((p.returncode, err, time.time()))
    finally:
        for p in procs:        # SIGTERM first: a dist_worker rank dumps its stacks then
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
    return out


@pytest.mark.parametrize("reduce_dtype", ["fp32", "bf16"])
def test_bf16_two_ranks_train_like_one_on_the_global_batch(tmp_path, reduce_dtype):
    """Parameter changes judged by the policy against torch float64 over the union batch,
    with the one-rank bf16 run's own error as the measure: the two-rank run rounds in other
    places (each rank's half-batch gradient to bf16 before the average, the mean once more),
    errors of the kind and size bf16 itself makes."""
    import dist_reference
    import dist_worker
    import torch

    steps, batch = 8, 32
    ranks = launch_workers(tmp_path, "--model", "mlp", "--steps", str(steps), "--global-batch",
                           str(batch), "--precision", "bf16", "--reduce-dtype", reduce_dtype,
                           "--bucket-cap-mb", "0.02")
    assert_same_on_every_rank(ranks)
    ref64 = dist_reference.torch_reference("mlp", steps, batch, torch.float64)
    one = dist_worker.train("mlp", steps, batch, device="cuda", precision="bf16")[0]
    assert_state_changes_close(ref64.initial, parameters(ranks[0]), ref64.states[0],
                               {k: np.asarray(v) for k, v in one.state_dict().items()},
                               "bf16: ")


def test_two_ranks_under_torchrun_hold_identical_parameters(tmp_path):
    import os

    pytest.importorskip("torch")       # torchrun is torch's

    run_ranks([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
               "2", str(WORKER), "--device", "cuda", "--out", str(tmp_path),
               "--model", "cnn", "--steps", "10", "--global-batch", "32"],
              env=dict(os.environ, NCCL_NVLS_ENABLE="0",
                       STEPGRAPH_DIST_TIMEOUT=str(RANK_TIMEOUT_S)))
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in (0, 1)]
    assert "graph/nodes" in ranks[0].files
    assert_same_on_every_rank(ranks)
    assert_ranks_match_torch(ranks, "cnn", 10, 32)


def test_four_ranks_under_torchrun_hold_identical_parameters(tmp_path):
    import os

    pytest.importorskip("torch")       # torchrun is torch's

    if gpu_count() < 4:
        pytest.skip(f"needs 4 GPUs, {gpu_count()} visible")
    run_ranks([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
               "4", str(WORKER), "--device", "cuda", "--out", str(tmp_path),
               "--model", "mlp", "--steps", "10", "--global-batch", "32"],
              env=dict(os.environ, NCCL_NVLS_ENABLE="0",
                       STEPGRAPH_DIST_TIMEOUT=str(RANK_TIMEOUT_S)))
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(4)]
    assert_same_on_every_rank(ranks)
    assert_ranks_match_torch(ranks, "mlp", 10, 32)


def test_two_gpu_ranks_exit_promptly_after_their_last_step(tmp_path):
    procs = start_ranks(2, [str(WORKER), "--device", "cuda", "--out", str(tmp_path), "--model",
                            "cnn", "--steps", "10", "--global-batch", "32"])
    ended = finish(procs, timeout=LAUNCH_TIMEOUT_S)
    for r, (code, err, at) in enumerate(ended):
        assert code == 0, err[-4000:]
        last = float(np.load(tmp_path / f"rank{r}.npz")["time/last_step"])
        # Writing the record, the device's last work, destroying the communicator, the
        # leaving barrier and the interpreter's exit. A communicator left alive hangs at exit
        # (DESIGN.md), a rank stuck in the leaving barrier costs its 10 s: both fail here.
        assert at - last < 8.0, (r, at - last)


KILLED = """
import os, pathlib, sys
import numpy as np
import stepgraph as sg
from stepgraph import losses, nn, optim

sg.distributed.init()
nn.init.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 256)).astype(np.float32)
y = rng.integers(0, 10, 64)
step = sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.01), (x, y),
                             device="cuda", distributed=True)
for i in range(10**7):
    loss = step(x, y)
    if i % 10 == 0:
        float(loss)
    if i == 20:
        pathlib.Path(sys.argv[1], os.environ["RANK"]).write_text("")
"""


def test_a_killed_gpu_rank_is_named_and_the_others_exit(tmp_path):
    """kill -9 of rank 1 mid-run: rank 0 would wait in an NCCL kernel inside the graph
    forever; its watchdog sees rank 1's store connection drop, aborts the communicator and
    ends rank 0 with FAULT_EXIT_CODE and an error naming rank 1, well within the timeout."""
    check_a_killed_rank_is_named(tmp_path, 2)


def check_a_killed_rank_is_named(tmp_path: Path, world: int) -> None:
    """`world` ranks train; the last is killed (-9) once every rank has stepped; rank 0 ends
    within 20 s with FAULT_EXIT_CODE, naming it, and no rank is left running."""
    import re
    import signal
    import time

    from stepgraph.distributed.group import FAULT_EXIT_CODE

    script = tmp_path / "run.py"
    script.write_text(KILLED)
    procs = start_ranks(world, [str(script), str(tmp_path)])
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S - 25  # then 20 s more at most
        while not all((tmp_path / str(r)).exists() for r in range(world)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.1)
        killed_at = time.monotonic()
        procs[-1].send_signal(signal.SIGKILL)
        ended = finish(procs[:-1], timeout=20)
        assert time.monotonic() - killed_at < 20
        code, err, _ = ended[0]
        assert code == FAULT_EXIT_CODE, err[-4000:]
        # a rank that ended on the fault before rank 0 noticed may be named beside it
        named = re.search(rf"rank\(s\) \[([\d, ]+)\] of {world} died", err)
        assert named and world - 1 in {int(r) for r in named.group(1).split(",")}, err[-4000:]
    finally:
        finish(procs, timeout=1)


# ---- every GPU of a larger host (4 or 8): the tests above at the host's world size ----------

@pytest.fixture
def host_gpus() -> int:
    """Every GPU of the host, where it has more than two (the tests above cover two)."""
    n = gpu_count()
    if n <= 2:
        pytest.skip(f"{n} GPUs visible: the two-rank tests cover them")
    return n


def test_every_gpu_of_the_host_trains_like_one_on_the_global_batch(tmp_path, host_gpus):
    steps, batch = 8, 8 * host_gpus
    ranks = launch_workers(tmp_path, "--model", "cnn", "--steps", str(steps), "--global-batch",
                           str(batch), timeout=2 * LAUNCH_TIMEOUT_S, world=host_gpus)
    assert_same_on_every_rank(ranks)
    assert_ranks_match_torch(ranks, "cnn", steps, batch)


def test_every_gpu_of_the_host_holds_the_same_bits_after_100_steps(tmp_path, host_gpus):
    """bf16 with BatchNorm and several buckets, as the two-rank test's hardest case."""
    ranks = launch_workers(tmp_path, "--model", "bncnn", "--steps", "100", "--global-batch",
                           str(8 * host_gpus), "--bucket-cap-mb", "0.002", "--precision",
                           "bf16", timeout=2 * LAUNCH_TIMEOUT_S, world=host_gpus)
    print(f"bncnn bf16, {host_gpus} ranks: checksums", checksums(ranks))
    assert_same_on_every_rank(ranks)
    assert_trained(ranks, "bncnn")


def test_a_killed_rank_of_the_host_is_named_and_the_others_exit(tmp_path, host_gpus):
    check_a_killed_rank_is_named(tmp_path, host_gpus)
