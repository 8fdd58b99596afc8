"""Data parallelism without GPUs: the bucketing plan, the graph transform, the sharded loader
order (against PyTorch's DistributedSampler), the launcher, the rendezvous over localhost, and
real two-process CPU training runs whose ranks communicate through the store."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import losses, nn, optim
from stepgraph.distributed import (Bucket, DataParallel, DistEnv, GradientInfo, plan_buckets,
                                   rendezvous)
from stepgraph.distributed.launch import (LaunchArgs, LaunchError, free_port, launch,
                                          parse_launch_args, worker_env)
from stepgraph.data import BatchLoader, epoch_order, shard_order
from stepgraph.errors import DistributedError
from tests.reference import assert_close_to_reference, assert_state_changes_close

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")
MiB = 2**20


def env_of(rank: int, world: int, port: int) -> DistEnv:
    return DistEnv(rank, world, rank, "127.0.0.1", port)


# ---- the bucketing plan --------------------------------------------------------------------

def grads(*sizes_mb, ready=None, dtype="float32"):
    ready = ready or [10 * (len(sizes_mb) - i) for i in range(len(sizes_mb))]   # reverse order
    return [GradientInfo(i, int(mb * MiB), dtype, r) for i, (mb, r) in
            enumerate(zip(sizes_mb, ready))]


def test_buckets_follow_the_backward_order_and_the_cap():
    # Forward order 0..4; the backward finalises 4 first. 10 + 10 fit 25 MiB, the next does not.
    buckets = plan_buckets(grads(10, 10, 10, 10, 10), 25 * MiB)
    assert [b.indices for b in buckets] == [(4, 3), (2, 1), (0,)]
    assert [b.ready for b in buckets] == [20, 40, 50]      # each its last gradient's node
    assert [b.nbytes for b in buckets] == [20 * MiB, 20 * MiB, 10 * MiB]


def test_a_gradient_larger_than_the_cap_is_a_bucket_of_its_own():
    buckets = plan_buckets(grads(1, 100, 1, 1), 25 * MiB)
    assert [b.indices for b in buckets] == [(3, 2), (1,), (0,)]


def test_buckets_hold_one_dtype_and_ties_go_to_the_later_parameter():
    infos = [GradientInfo(0, 8, "float32", 5), GradientInfo(1, 8, "float32", 5),
             GradientInfo(2, 8, "float64", 3)]
    buckets = plan_buckets(infos, 25 * MiB)
    assert buckets == [Bucket((2,), 8, "float64", 3), Bucket((1, 0), 16, "float32", 5)]
    with pytest.raises(ValueError):
        plan_buckets(infos, 0)


def test_per_dtype_buckets_gather_small_gradients_across_the_other_dtype():
    """A bf16 model's gradients alternate bf16 weight blocks and float32 LayerNorm pairs: by
    default each change of dtype closes a bucket (seven buckets here); per dtype the float32
    ones share one bucket, launched after its last gradient, and the bf16 ones fill theirs
    by the cap (three buckets)."""
    infos = [GradientInfo(i, 3 * 1024 if i % 2 else 2 * MiB, "float32" if i % 2 else "bfloat16",
                          100 - i) for i in range(7)]
    assert len(plan_buckets(infos, 5 * MiB)) == 7
    buckets = plan_buckets(infos, 5 * MiB, per_dtype=True)
    assert [(b.dtype, b.indices) for b in buckets] == [
        ("bfloat16", (6, 4)), ("float32", (5, 3, 1)), ("bfloat16", (2, 0))]
    assert [b.ready for b in buckets] == [96, 99, 100]
    assert sorted(i for b in buckets for i in b.indices) == list(range(7))


def test_every_gradient_is_in_exactly_one_bucket():
    rng = np.random.default_rng(0)
    infos = [GradientInfo(i, int(rng.integers(1, 8 * MiB)), "float32", int(rng.integers(0, 50)))
             for i in range(40)]
    buckets = plan_buckets(infos, 10 * MiB)
    assert sorted(i for b in buckets for i in b.indices) == list(range(40))
    assert all(b.nbytes <= 10 * MiB or len(b.indices) == 1 for b in buckets)
    assert [b.ready for b in buckets] == sorted(b.ready for b in buckets)


# ---- the graph transform (a world of one: no other process needed) ------------------------

def small_step(dp, on_bad_batch="raise", seed=0):
    nn.init.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 3))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)
    step = sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1, momentum=0.9),
                                 (x, y), on_bad_batch=on_bad_batch, distributed=dp)
    return model, step, (x, y)


def test_buckets_by_dtype_is_a_switch_of_the_step(monkeypatch):
    """Buckets per dtype (the default): a bf16 step's float32 LayerNorm gradients do not close
    the bf16 buckets around them, as they do with STEPGRAPH_BUCKETS_BY_DTYPE=0: fewer
    all-reduces, each of one dtype, every gradient averaged once."""
    def reduces():
        nn.init.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.LayerNorm(32), nn.Linear(32, 32),
                              nn.LayerNorm(32), nn.Linear(32, 3))
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)
        step = sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1), (x, y),
                                     precision="bf16", distributed=DataParallel())
        plan = next(iter(step.executables.values())).plan
        found = [n for n in plan.steps if n.op == "all_reduce"]
        assert all(len({v.dtype for v in n.inputs}) == 1 for n in found)
        return found

    by_dtype = reduces()
    monkeypatch.setenv("STEPGRAPH_BUCKETS_BY_DTYPE", "0")
    closing = reduces()
    assert len(by_dtype) < len(closing)
    assert sum(len(n.inputs) for n in by_dtype) == sum(len(n.inputs) for n in closing)
    assert sorted({v.dtype for n in by_dtype for v in n.inputs}) == ["bfloat16", "float32"]


def test_all_reduces_sit_after_their_last_gradient_and_feed_the_update():
    # A cap of ~4 KiB splits the five weight/bias gradients (4 KiB, 128 B, ...) into buckets.
    _, step, _ = small_step(DataParallel(bucket_cap_mb=4200 / MiB))
    plan = next(iter(step.executables.values())).plan
    nodes = plan.steps
    position = {v: i for i, n in enumerate(nodes) for v in n.outputs}
    reduces = [n for n in nodes if n.op == "all_reduce"]
    assert len(reduces) >= 3
    for n in reduces:
        assert position[n.outputs[0]] == max(position[v] for v in n.inputs) + 1 or all(
            nodes[i].op == "all_reduce" for i in range(max(position[v] for v in n.inputs) + 1,
                                                        nodes.index(n)))
    joins = [i for i, n in enumerate(nodes) if n.op == "all_reduce_join"]
    assert len(joins) == 1 and nodes[joins[0] + 1].op == "guard_check"
    assert nodes[joins[0] + 2].op == "all_reduce_max"
    update = next(n for n in nodes if n.op == "sgd_update")
    means = {v for n in reduces for v in n.outputs}
    k, p = update.attrs["n_scalars"], update.attrs["n_params"]
    assert set(update.inputs[k + p:k + 2 * p]) == means
    assert all(v in means for v in nodes[joins[0] + 1].inputs[3:])    # guard reads the means


def test_a_world_of_one_trains_exactly_like_a_plain_step():
    model_a, plain, (x, y) = small_step(False)
    model_b, dist, _ = small_step(True)
    for _ in range(3):
        la, lb = plain(x, y), dist(x, y)
    assert float(la) == float(lb)
    for k, v in model_a.state_dict().items():
        np.testing.assert_array_equal(v, model_b.state_dict()[k])


def test_distributed_argument_is_checked():
    with pytest.raises(TypeError, match="DataParallel"):
        small_step("yes")
    with pytest.raises(ValueError, match="strategy"):
        DataParallel(strategy="ring")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DataParallel(bucket_cap_mb=0)


# ---- the sharded loader --------------------------------------------------------------------

@pytest.mark.parametrize("n", [3, 10, 11, 17])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_shards_match_torch_distributed_sampler(n, world):
    torch_data = pytest.importorskip("torch.utils.data")
    for rank in range(world):
        expected = list(torch_data.DistributedSampler(range(n), num_replicas=world, rank=rank,
                                                      shuffle=False))
        loader = BatchLoader(np.arange(n), np.arange(n), 4, shuffle=False, rank=rank,
                             world_size=world)
        assert loader.order(0).tolist() == expected
        assert loader.samples == len(expected)
        assert len(loader) == -(-len(expected) // 4)


def test_every_rank_shards_the_same_seeded_permutation():
    n, world, seed = 23, 3, 5
    for epoch in (0, 1):
        order = epoch_order(seed, epoch, n)
        shards = [BatchLoader(np.arange(n), np.arange(n), 4, seed=seed, rank=r,
                              world_size=world).order(epoch) for r in range(world)]
        padded = np.concatenate([order, order[:24 - n]])
        interleaved = np.stack(shards, axis=1).reshape(-1)
        np.testing.assert_array_equal(interleaved, padded)
        np.testing.assert_array_equal(shard_order(order, 1, world), shards[1])


def test_the_ranks_batches_together_are_a_single_process_batch():
    n, world, local = 48, 2, 6
    x = np.arange(n, dtype=np.float32)[:, None]
    single = list(BatchLoader(x, np.arange(n), local * world, seed=2).epoch(0))
    ranks = [list(BatchLoader(x, np.arange(n), local, seed=2, rank=r, world_size=world)
                  .epoch(0)) for r in range(world)]
    assert len(single) == len(ranks[0]) == len(ranks[1]) == 4
    for i, (xs, ys) in enumerate(single):
        together = np.concatenate([ranks[r][i][1] for r in range(world)])
        assert sorted(together.tolist()) == sorted(ys.tolist())


def test_transform_sees_distinct_batch_indices_per_rank():
    seen = {}

    def transform(xb, epoch, batch):
        seen.setdefault(batch, 0)
        seen[batch] += 1
        return xb

    for r in range(2):
        list(BatchLoader(np.zeros((8, 1), np.float32), np.zeros(8), 2, rank=r, world_size=2,
                         transform=transform).epoch(0))
    assert sorted(seen) == list(range(4)) and set(seen.values()) == {1}


def test_bad_rank_is_refused():
    from stepgraph.data import LoaderError

    with pytest.raises(LoaderError, match="rank"):
        BatchLoader(np.zeros(4), np.zeros(4), 2, rank=2, world_size=2)


# ---- the launcher --------------------------------------------------------------------------

def test_launch_arguments():
    args = parse_launch_args(["--gpus", "2", "--timeout", "5", "--", "python", "-c", "x"])
    assert args == LaunchArgs(2, ("python", "-c", "x"), "127.0.0.1", 0, 5.0)
    for bad, match in ((["--gpus", "2", "python"], "after `--`"), (["--gpus", "2", "--"],
                       "no command"), (["--gpus", "0", "--", "x"], "--gpus must be >= 1"),
                       (["--gpus", "1", "--master-port", "70000", "--", "x"], "master-port"),
                       (["--gpus", "1", "--timeout", "0", "--", "x"], "--timeout")):
        with pytest.raises(LaunchError, match=match):
            parse_launch_args(bad)
    with pytest.raises(SystemExit):
        parse_launch_args(["--", "x"])          # --gpus is required


def test_worker_environment():
    env = worker_env({"PATH": "/bin"}, 1, 2, "127.0.0.1", 29500, 7.0)
    assert env == {"PATH": "/bin", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                   "NCCL_NVLS_ENABLE": "0", "STEPGRAPH_DIST_TIMEOUT": "7.0"}
    assert DistEnv.from_environ(env) == DistEnv(1, 2, 1, "127.0.0.1", 29500)
    assert DistEnv.from_environ({}) is None
    with pytest.raises(DistributedError, match="MASTER_PORT"):
        DistEnv.from_environ({"WORLD_SIZE": "2", "RANK": "0"})
    with pytest.raises(DistributedError, match="RANK must be in"):
        DistEnv.from_environ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_PORT": "1"})


def python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def test_launch_runs_every_rank_and_reports_success(tmp_path):
    code = ("import os, pathlib; pathlib.Path(r'%s', os.environ['RANK']).write_text("
            "os.environ['WORLD_SIZE'] + os.environ['NCCL_NVLS_ENABLE'])" % tmp_path)
    assert launch(LaunchArgs(3, python(code))) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "2"]
    assert {p.read_text() for p in tmp_path.iterdir()} == {"30"}


def test_one_failing_rank_stops_the_others():
    code = ("import os, sys, time\n"
            "if os.environ['RANK'] == '1': sys.exit(3)\n"
            "time.sleep(60)")
    lines = []
    start = time.monotonic()
    assert launch(LaunchArgs(2, python(code)), grace=2.0, log=lines.append) == 3
    assert time.monotonic() - start < 20
    assert "rank 1" in lines[0] and "code 3" in lines[0]


def test_the_launcher_reports_the_failing_rank_not_the_peer_it_ended():
    """Seen at once, rank 0 ended by its watchdog (status 75, its peer died) and rank 1's
    own failure: the exit code and the line name rank 1; rank 2, still running, is stopped."""
    from stepgraph.distributed.group import FAULT_EXIT_CODE
    from stepgraph.distributed.launch import _supervise

    class Proc:
        def __init__(self, code, pid):
            self.code, self.pid, self.signals = code, pid, []

        def poll(self):
            return self.code

        def send_signal(self, signum):
            self.signals.append(signum)
            self.code = -signum

        def wait(self, timeout=None):
            return self.code

    procs = [Proc(FAULT_EXIT_CODE, 100), Proc(3, 101), Proc(None, 102)]
    lines = []
    assert _supervise(procs, [], 0.1, lines.append) == 3
    assert "rank 1 (pid 101) exited with code 3" in lines[0]
    assert procs[2].signals == [signal.SIGTERM]


def test_signals_are_forwarded_to_every_rank(tmp_path):
    child = ("import os, pathlib, signal, sys, time\n"
             "def bye(s, f):\n"
             "    pathlib.Path(r'%s', os.environ['RANK']).write_text(str(s)); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, bye)\n"
             "pathlib.Path(r'%s', 'up' + os.environ['RANK']).write_text('')\n"
             "time.sleep(60)") % (tmp_path, tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "stepgraph", "launch", "--gpus", "2", "--",
                             sys.executable, "-c", child], cwd=ROOT)
    deadline = time.monotonic() + 20
    while not ((tmp_path / "up0").exists() and (tmp_path / "up1").exists()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 128 + signal.SIGTERM
    assert (tmp_path / "0").read_text() == (tmp_path / "1").read_text() == str(signal.SIGTERM)


def test_cli_launch_usage_errors(capsys):
    from stepgraph.cli import main, without_gpus

    assert main(["launch", "--gpus", "2", "python"]) == 2
    assert "after `--`" in capsys.readouterr().err
    assert without_gpus(["train", "--gpus", "2", "--epochs", "1", "--gpus=3"]) == \
        ["train", "--epochs", "1"]


# ---- the rendezvous and host collectives ---------------------------------------------------

def in_threads(world: int, port: int, body, timeout: float = 10.0):
    results, errors = [None] * world, []

    def run(rank):
        try:
            group = rendezvous(env_of(rank, world, port), timeout)
            try:
                results[rank] = body(group)
            finally:
                group.destroy()
        except Exception as err:     # reported by the test
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


def test_rendezvous_and_host_collectives():
    def body(group):
        mine = [np.full(3, group.rank + 1, np.float32), np.arange(4, dtype=np.float32)]
        group.barrier()
        means = group.all_reduce_mean(mine)
        flags = group.all_reduce_max([np.array([group.rank, 0], np.int32)])
        shared = group.broadcast([np.full(2, group.rank, np.int64)])
        return means, flags, shared

    results = in_threads(3, free_port(), body)
    for means, flags, shared in results:
        np.testing.assert_array_equal(means[0], np.full(3, 2.0, np.float32))
        np.testing.assert_array_equal(means[1], np.arange(4, dtype=np.float32))
        np.testing.assert_array_equal(flags[0], [2, 0])
        np.testing.assert_array_equal(shared[0], [0, 0])


def test_a_rank_that_never_arrives_is_named_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank\(s\) \[1, 2\] of 3 never arrived"):
        rendezvous(env_of(0, 3, free_port()), timeout=1.0)
    assert time.monotonic() - start < 10


def test_a_missing_rank_zero_is_named_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedError, match="rank 0 never arrived"):
        rendezvous(env_of(1, 2, free_port()), timeout=1.0)
    assert time.monotonic() - start < 10


def test_a_rank_that_stops_answering_is_named_within_the_timeout():
    port, failures = free_port(), []

    def rank(r):
        group = rendezvous(env_of(r, 2, port), timeout=1.0)
        if r == 1:          # dies: leaves without a word
            group._closed = True
            group.store.close()
            return
        start = time.monotonic()
        try:
            group.all_reduce_mean([np.ones(3, np.float32)], "all_reduce of bucket 0")
        except DistributedError as err:
            failures.append((str(err), time.monotonic() - start))
        group.destroy()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    (message, waited), = failures
    assert "all_reduce of bucket 0 timed out" in message and "[1] of 2" in message
    assert waited < 10


def test_a_rank_claimed_twice_is_refused():
    port = free_port()
    with pytest.raises(DistributedError, match="already claimed RANK=1"):
        in_threads(2, port, lambda g: rendezvous(env_of(1, 2, port), 2.0))


# ---- real two-process CPU runs -------------------------------------------------------------

def launch_workers(out: Path, *args: str, timeout: float = 120) -> None:
    result = subprocess.run([sys.executable, "-m", "stepgraph", "launch", "--gpus", "2",
                             "--timeout", "30", "--", sys.executable, str(WORKER), "--out",
                             str(out), *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]


def test_two_cpu_processes_train_like_one_on_the_global_batch(tmp_path):
    """The ranks see different halves of each global batch; each rank's losses and parameter
    changes are judged by the tolerance policy against one torch process over the union batch
    (dist_reference.py, float64, with float32's error as the measure): a rank that skipped an
    all-reduce keeps its own half's gradient there, far past the bound."""
    sys.path.insert(0, str(WORKER.parent))
    import dist_reference
    import torch

    # A 10 KiB cap: several buckets, each averaged as soon as the backward has finished it.
    launch_workers(tmp_path, "--model", "mlp", "--steps", "5", "--global-batch", "16",
                   "--bucket-cap-mb", "0.01")
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in (0, 1)]
    ref64, ref32 = (dist_reference.torch_reference("mlp", 5, 16, dtype)
                    for dtype in (torch.float64, torch.float32))
    for r, record in enumerate(ranks):
        state = {k[len("state/"):]: record[k] for k in record.files if k.startswith("state/")}
        assert_state_changes_close(ref64.initial, state, ref64.states[r], ref32.states[r],
                                   f"rank {r}: ")
        assert_close_to_reference([record[f"loss/{i}"] for i in range(5)], ref64.losses[r],
                                  ref32.losses[r], f"rank {r}: losses")
        for key, value in state.items():
            np.testing.assert_array_equal(value, ranks[0][f"state/{key}"], err_msg=key)
    assert list(ranks[0]["plan/ops"]).count("all_reduce") > 1


def test_cli_train_on_two_processes_writes_from_rank_zero_and_resumes_alike(tmp_path):
    out = tmp_path / "run"
    base = [sys.executable, "-m", "stepgraph", "train", "--device", "cpu", "--epochs", "1",
            "--batch-size", "64", "--no-progress", "--out", str(out)]
    env = dict(os.environ, STEPGRAPH_DIST_TIMEOUT="60")
    done = subprocess.run(base + ["--gpus", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("test accuracy:") == 1          # rank 0 alone reports
    record = json.loads((out / "metrics.json").read_text())
    assert record["config"]["world_size"] == 2 and len(record["epochs"]) == 1
    assert record["epochs"][0]["test_accuracy"] > 0.5
    refused = subprocess.run(base + ["--epochs", "2", "--resume"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode == 2
    assert "written by a run on 2 process(es)" in refused.stderr and "--gpus 2" in refused.stderr
    resumed = subprocess.run(base + ["--epochs", "2", "--resume", "--gpus", "2"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and resumed.stdout.count("resuming from") == 1
    assert len(json.loads((out / "metrics.json").read_text())["epochs"]) == 2


# ---- the CUDA launchers' call sequence, with NCCL, streams and kernels faked ---------------

class FakeArray:
    def __init__(self, n, dtype="float32", ptr=0x1000):
        self.size, self.dtype, self.shape = n, np.dtype(dtype), (n,)
        self.nbytes = n * self.dtype.itemsize
        self.data = type("Ptr", (), {"ptr": ptr})()


def fake_cuda(calls):
    from types import SimpleNamespace

    class Stream:
        def __init__(self, name="comm", non_blocking=True):
            self.name, self.ptr = name, hash(name) & 0xFFFF

        def is_capturing(self):
            return False

        def wait_event(self, event):
            calls.append(("wait", self.name, event.name))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Event:
        count = 0

        def __init__(self, disable_timing=True):
            Event.count += 1
            self.name = f"event{Event.count}"

        def record(self, stream):
            calls.append(("record", stream.name, self.name))

    cuda = SimpleNamespace(Stream=Stream, Event=Event, Device=lambda *a: SimpleNamespace(id=0),
                           runtime=SimpleNamespace(memcpyDeviceToDevice=3, memcpyAsync=lambda *a:
                                                   calls.append(("memcpy",) + a[:3])))
    cp = SimpleNamespace(cuda=cuda, asarray=lambda a: a,
                         empty=lambda n, dtype: FakeArray(n, dtype, 0x9000))
    return cp, Stream


class FakeComm:
    def __init__(self, calls):
        self.calls = calls

    def allReduce(self, send, recv, count, dtype, op, stream):
        self.calls.append(("allReduce", send, recv, count, op, stream))

    def bcast(self, buff, count, dtype, root, stream):
        self.calls.append(("bcast", buff, count, root))


class FakeGroup:
    def __init__(self, calls, world=2):
        self.world_size, self.rank, self.has_nccl = world, 0, True
        self.comm = FakeComm(calls)

    def nccl_communicator(self, device):
        return self.comm


@pytest.mark.parametrize("strategy", ["flat", "grouped"])
def test_cuda_all_reduce_forks_and_joins_the_communication_stream(monkeypatch, strategy):
    pytest.importorskip("cupy")
    from types import SimpleNamespace

    from stepgraph.backends.cuda import collective
    from stepgraph.backends.cuda.runtime import side_stream
    from stepgraph.distributed import group as group_module
    from stepgraph.ir.graph import Node

    calls = []
    cp, Stream = fake_cuda(calls)
    nccl = SimpleNamespace(NCCL_AVG=4, NCCL_MAX=2, NCCL_FLOAT32=7, NCCL_INT32=2,
                           groupStart=lambda: calls.append(("groupStart",)),
                           groupEnd=lambda: calls.append(("groupEnd",)))
    monkeypatch.setattr(collective, "cp", cp)
    monkeypatch.setattr(side_stream, "cp", cp)      # the communication stream and events
    monkeypatch.setattr(collective, "_nccl", lambda: nccl)
    monkeypatch.setattr(collective, "_check", lambda *a, **k: None)
    monkeypatch.setattr(collective, "_kernel", lambda file, name: (
        lambda grid, block, args, stream: calls.append(("kernel", name, grid, stream.name))))
    from stepgraph.backends.cuda.runtime import launch
    monkeypatch.setattr(launch, "cp", cp)
    fake = FakeGroup(calls)
    monkeypatch.setitem(group_module._GROUPS, "g", fake)
    ctx = SimpleNamespace(stream=Stream("main"), extras={}, capturing=False)
    ins = [FakeArray(3000, ptr=0x100), FakeArray(10, ptr=0x200)]
    outs = [FakeArray(3000, ptr=0x300), FakeArray(10, ptr=0x400)]
    node = Node("all_reduce", [], [], {"group": "g", "strategy": strategy, "bucket": 0})
    collective.all_reduce_mean(ctx, node, ins, outs)
    collective.all_reduce_join(ctx, Node("all_reduce_join", [], [], {"group": "g"}))
    kinds = [c[0] for c in calls]
    assert calls[0][:2] == ("record", "main") and calls[1][:2] == ("wait", "comm")
    assert calls[-2][:2] == ("record", "comm") and calls[-1] == ("wait", "main", calls[-2][2])
    comm = ctx.extras["collective"].stream.ptr
    if strategy == "flat":
        assert [c[1] for c in calls if c[0] == "kernel"] == ["bucket_pack_kernel",
                                                             "bucket_unpack_kernel"]
        assert [c for c in calls if c[0] == "allReduce"] == [
            ("allReduce", 0x9000, 0x9000, 3010, 4, comm)]
        assert calls[2][0] == "kernel" and calls[4][0] == "kernel"   # 3000 + 10: 4 jobs
        assert calls[2][2] == (4,)
    else:
        assert kinds[2:6] == ["groupStart", "allReduce", "allReduce", "groupEnd"]
        assert calls[3] == ("allReduce", 0x100, 0x300, 3000, 4, comm)
    # A second call on the same buffers reuses its memory: no new events.
    before = len(calls)
    collective.all_reduce_mean(ctx, node, ins, outs)
    assert calls[before][2] == calls[0][2]
    collective.all_reduce_max(ctx, Node("all_reduce_max", [], [], {"group": "g", "n": 1}),
                              [FakeArray(2, "int32", 0x500)])
    assert ("allReduce", 0x500, 0x500, 2, 2, ctx.stream.ptr) in calls


def test_cuda_parameter_broadcast_sends_every_array_as_its_bytes(monkeypatch):
    """Rank 0's parameters and buffers go in one NCCL group on the backend's stream, each as
    its bytes: dtypes NCCL has no reduction type for (bool masks) go as well as float32 and
    int64 (BatchNorm's count); an empty array sends nothing."""
    pytest.importorskip("cupy")
    from types import SimpleNamespace

    from stepgraph.backends.cuda import collective

    calls = []
    nccl = SimpleNamespace(NCCL_UINT8=1, groupStart=lambda: calls.append(("groupStart",)),
                           groupEnd=lambda: calls.append(("groupEnd",)))
    monkeypatch.setattr(collective, "_nccl", lambda: nccl)
    monkeypatch.setattr(collective, "_check", lambda *a, **k: None)
    comm = FakeComm(calls)
    comm.bcast = lambda buff, count, dtype, root, stream: calls.append(
        ("bcast", buff, count, dtype, root, stream))
    group = SimpleNamespace(nccl_communicator=lambda device: comm)
    backend = SimpleNamespace(device_id=1, stream=SimpleNamespace(ptr=0x77))
    arrays = [FakeArray(10, "float32", 0x100), FakeArray(1, "int64", 0x200),
              FakeArray(6, "bool", 0x300), FakeArray(0, "float32", 0x400)]
    collective.broadcast_parameters(backend, group, arrays)
    assert calls == [("groupStart",), ("bcast", 0x100, 40, 1, 0, 0x77),
                     ("bcast", 0x200, 8, 1, 0, 0x77), ("bcast", 0x300, 6, 1, 0, 0x77),
                     ("groupEnd",)]


@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_cuda_bf16_buckets_are_widened_or_sent_as_bf16(monkeypatch, reduce_dtype):
    """bf16 gradients (uint16 bits): summed in float32 through the packed float32 buffer
    even with strategy "grouped", or sent as NCCL_BFLOAT16 one by one, unpacked by nothing."""
    pytest.importorskip("cupy")
    from types import SimpleNamespace

    from stepgraph.backends.cuda import collective
    from stepgraph.backends.cuda.runtime import launch, side_stream
    from stepgraph.distributed import group as group_module
    from stepgraph.ir.graph import Node

    calls = []
    cp, Stream = fake_cuda(calls)
    nccl = SimpleNamespace(NCCL_AVG=4, NCCL_FLOAT32=7, groupStart=lambda: None,
                           groupEnd=lambda: None)
    for module in (collective, side_stream, launch):
        monkeypatch.setattr(module, "cp", cp)
    monkeypatch.setattr(collective, "_nccl", lambda: nccl)
    monkeypatch.setattr(collective, "_check", lambda *a, **k: None)
    monkeypatch.setattr(collective, "_kernel", lambda file, name: (
        lambda grid, block, args, stream: calls.append(("kernel", name))))
    fake = FakeGroup(calls)
    fake.comm.allReduce = lambda send, recv, count, dtype, op, stream: calls.append(
        ("allReduce", send, recv, count, dtype))
    monkeypatch.setitem(group_module._GROUPS, "g", fake)
    ctx = SimpleNamespace(stream=Stream("main"), extras={}, capturing=False)
    ins = [FakeArray(30, "uint16", 0x100), FakeArray(10, "uint16", 0x200)]
    outs = [FakeArray(30, "uint16", 0x300), FakeArray(10, "uint16", 0x400)]
    node = Node("all_reduce", [], [], {"group": "g", "strategy": "grouped", "bucket": 0,
                                       "reduce_dtype": reduce_dtype})
    collective.all_reduce_mean(ctx, node, ins, outs)
    work = [c for c in calls if c[0] in ("kernel", "allReduce")]
    if reduce_dtype == "float32":
        assert work == [("kernel", "bucket_pack_bf16_kernel"),
                        ("allReduce", 0x9000, 0x9000, 40, 7),
                        ("kernel", "bucket_unpack_bf16_kernel")]
    else:
        assert work == [("allReduce", 0x100, 0x300, 30, collective.NCCL_BFLOAT16),
                        ("allReduce", 0x200, 0x400, 10, collective.NCCL_BFLOAT16)]
    assert "all_reduce" in collective.BF16_OPS


def test_bucket_kernels_exist_in_collective_cu():
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    from stepgraph.backends.cuda import collective
    from stepgraph.backends.cuda.runtime import compiler

    try:
        nvrtc.getVersion()
    except Exception:
        pytest.skip("libnvrtc is not loadable")
    for filename, names in collective.kernel_names().items():
        assert compiler.compile_to_cubin(compiler.source_path(filename), "sm_90",
                                         tuple(sorted(names)))


class DictStore:
    """The store's get/set, in memory: what nccl_communicator passes the unique id through."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes:
        return self.values[key]


@pytest.mark.parametrize("unique_id", [bytes(range(128)), tuple(range(-64, 64))])
def test_every_rank_gets_the_nccl_unique_id_in_the_type_rank_zero_made(monkeypatch,
                                                                       unique_id):
    """CuPy 14's get_unique_id gives bytes and its NcclCommunicator takes bytes (older CuPy: a
    tuple of ints); the id crosses the store as JSON, so it must come back as it went."""
    cupy = pytest.importorskip("cupy")
    from contextlib import nullcontext
    from types import SimpleNamespace

    from stepgraph.distributed.group import ProcessGroup

    made = []
    nccl = SimpleNamespace(available=True, get_unique_id=lambda: unique_id,
                           NcclCommunicator=lambda world, uid, rank: made.append(
                               (world, uid, rank)) or object())
    monkeypatch.setattr(cupy.cuda, "nccl", nccl, raising=False)
    monkeypatch.setattr(cupy.cuda, "Device", lambda device: nullcontext())
    store = DictStore()
    for rank in (0, 1):
        group = ProcessGroup(DistEnv(rank, 2, rank, "127.0.0.1", 1), store, None, 5.0)
        group.nccl_communicator(rank)
        group._closed = True   # nothing of it to destroy at exit
    assert made == [(2, unique_id, 0), (2, unique_id, 1)]
    assert type(made[0][1]) is type(unique_id)
