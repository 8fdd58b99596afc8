"""Launchers of a data-parallel run without GPUs: what torchrun, Slurm and mpirun set and
which store the ranks meet through (detect_launch), a real two-process run under torchrun,
how fast a run ends after its last step, and a rank killed mid-run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from stepgraph.distributed import DistEnv, detect_launch, rendezvous, slurm_hosts
from stepgraph.distributed.launch import free_port
from stepgraph.errors import DistributedError

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")


# ---- what each launcher sets ---------------------------------------------------------------

def torchrun_env(rank=1, world=4, local=1, node=0, agent="True", **extra):
    """The variables torchrun (torch 2.x) gives a worker (seen with --nproc_per_node 2)."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
           "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": "2",
           "ROLE_RANK": str(rank), "MASTER_ADDR": "node01", "MASTER_PORT": "44689",
           "TORCHELASTIC_RUN_ID": "run7", "TORCHELASTIC_RESTART_COUNT": "2",
           "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": agent}
    env.update(extra)
    return env


def test_torchrun_uses_its_agents_store_under_the_run_namespace():
    env = detect_launch(torchrun_env(rank=3, local=1, node=1))
    assert env == DistEnv(3, 4, 1, "node01", 44689, "torchrun", "torch", 1, "stepgraph/run7/2/")


def test_torchrun_without_an_agent_store_has_rank_zero_serve_ours():
    env = detect_launch(torchrun_env(agent="False"))
    assert (env.launcher, env.store, env.namespace) == ("torchrun", "own", "")


def test_srun_torchrun_is_a_torchrun_run():
    env = detect_launch(torchrun_env(SLURM_PROCID="0", SLURM_NTASKS="2",
                                     SLURM_NODELIST="gpu[1-2]"))
    assert env.launcher == "torchrun" and env.rank == 1 and env.world_size == 4


def test_launch_help_prints_the_usage(capsys):
    from stepgraph.cli import main

    assert main(["launch", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: stepgraph launch --gpus N") and "--master-port" in out


def test_stepgraph_launch_variables():
    env = detect_launch({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29501"})
    assert env == DistEnv(1, 2, 1, "127.0.0.1", 29501, "stepgraph", "own", 0, "")
    assert detect_launch({}) is None


def test_slurm_master_is_the_first_node_of_the_list():
    base = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
            "SLURM_NODEID": "2", "SLURM_NODELIST": "gpu[07-09,12],cpu1"}
    assert detect_launch(base) == DistEnv(5, 8, 1, "gpu07", 29517, "slurm", "own", 2)
    env = detect_launch(dict(base, MASTER_ADDR="10.0.0.1", MASTER_PORT="3000"))
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 3000)
    with pytest.raises(DistributedError, match="SLURM_NTASKS must be an integer"):
        detect_launch(dict(base, SLURM_NTASKS="two"))
    with pytest.raises(DistributedError, match=r"RANK must be in \[0, 8\), got 9"):
        detect_launch(dict(base, SLURM_PROCID="9"))


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[8-10],b", ["a8", "a9", "a10", "b"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
    ("x[009-011]-ib,y2", ["x009-ib", "x010-ib", "x011-ib", "y2"]),
])
def test_slurm_node_lists(nodelist, hosts):
    assert slurm_hosts(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node[a-b]", ""])
def test_malformed_slurm_node_lists_are_refused(bad):
    with pytest.raises(DistributedError, match="Slurm node"):
        slurm_hosts(bad)


def test_open_mpi_needs_a_master_address():
    base = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    with pytest.raises(DistributedError, match="mpirun names no master host: set MASTER_ADDR"):
        detect_launch(base)
    env = detect_launch(dict(base, MASTER_ADDR="node02"))
    assert env == DistEnv(2, 4, 0, "node02", 29517, "mpi", "own")


def test_mpich_ranks_and_their_local_rank():
    base = {"PMI_RANK": "3", "PMI_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "4000"}
    assert detect_launch(dict(base, MPI_LOCALRANKID="1")) == \
        DistEnv(3, 4, 1, "h", 4000, "mpi", "own")
    with pytest.raises(DistributedError, match="set LOCAL_RANK"):
        detect_launch(base)


# ---- store selection -----------------------------------------------------------------------

def test_ranks_meet_through_torchruns_store_without_binding_its_port():
    """torchrun's agent holds MASTER_PORT with a torch TCPStore: rank 0 must not try to serve
    there (it would fail: address in use) but use it, and collectives must work over it."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = free_port()
    agent = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=10))
    results, errors = [None, None], []

    def rank(r):
        try:
            env = DistEnv(r, 2, r, "127.0.0.1", port, "torchrun", "torch", 0, "stepgraph/t/0/")
            group = rendezvous(env, timeout=10.0)
            results[r] = group.all_reduce_mean([np.full(3, r + 1.0, np.float32)])[0]
            group.destroy()
        except Exception as err:        # reported below
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for r in (0, 1):
        np.testing.assert_array_equal(results[r], np.full(3, 1.5, np.float32))
    # The collective's keys lived under the namespace and were deleted by their last reader.
    assert agent.check(["stepgraph/t/0/rendezvous/claims/0"])
    assert not agent.check(["stepgraph/t/0/all_reduce/1/0"])


# ---- real runs -----------------------------------------------------------------------------

def parameters(record) -> dict:
    return {k: record[k] for k in record.files if k.startswith("state/")}


def test_two_processes_under_torchrun_end_with_identical_parameters(tmp_path):
    sys.path.insert(0, str(WORKER.parent))
    import dist_worker

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           "2", str(WORKER), "--out", str(tmp_path), "--steps", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, STEPGRAPH_DIST_TIMEOUT="30"))
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in (0, 1)]
    model, _, _ = dist_worker.train("mlp", 4, 16)           # rank 0's initialisation
    assert parameters(ranks[0])
    for key, value in parameters(ranks[0]).items():
        np.testing.assert_array_equal(value, ranks[1][key], err_msg=key)
        np.testing.assert_allclose(value, model.state_dict()[key[len("state/"):]], rtol=1e-5,
                                   atol=1e-6)


def start_ranks(world: int, script: list[str], timeout: float) -> list[subprocess.Popen]:
    """`world` processes of `script` with the variables `stepgraph launch` sets, but no
    launcher watching them (what each process does by itself is under test)."""
    port = free_port()
    return [subprocess.Popen(
        [sys.executable, *script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(world),
                            LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                            STEPGRAPH_DIST_TIMEOUT=str(timeout), PYTHONPATH=str(ROOT)))
        for r in range(world)]


def test_a_two_process_run_exits_promptly_after_its_last_step(tmp_path):
    procs = start_ranks(2, [str(WORKER), "--out", str(tmp_path), "--steps", "3"], 60)
    ended = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        ended.append(time.time())
        assert p.returncode == 0, err[-3000:]
    last = [float(np.load(tmp_path / f"rank{r}.npz")["time/last_step"]) for r in (0, 1)]
    # From the last step to the process's end: writing the record, destroying the group
    # (the leaving barrier, the store) and the interpreter's exit. A hang at exit would show
    # as the timeout (60 s) or the leaving barrier's 10 s.
    for r in (0, 1):
        assert ended[r] - last[r] < 3.0, (r, ended[r] - last[r])


KILLED = """
import os, pathlib, sys, time
import numpy as np
import stepgraph as sg
from stepgraph import losses, nn, optim

sg.distributed.init()
nn.init.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
x, y = np.ones((4, 4), np.float32), np.zeros(4, np.int64)
step = sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1), (x, y),
                             distributed=True)
for i in range(100000):
    float(step(x, y))
    if i == 2:
        pathlib.Path(sys.argv[1], os.environ["RANK"]).write_text("")
        if os.environ["RANK"] == sys.argv[2]:
            raise RuntimeError("this rank fails")
"""


@pytest.mark.parametrize("victim, message", [
    (1, "rank(s) [1] of 3 died"), (0, "rank 0, which serves it, is gone")])
def test_a_killed_rank_is_named_by_the_others_well_within_the_timeout(tmp_path, victim,
                                                                        message):
    script = tmp_path / "run.py"
    script.write_text(KILLED)
    procs = start_ranks(3, [str(script), str(tmp_path), "none"], timeout=60)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / str(r)).exists() for r in range(3)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
            time.sleep(0.05)
        killed_at = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)
        for r in {0, 1, 2} - {victim}:
            _, err = procs[r].communicate(timeout=60)
            waited = time.monotonic() - killed_at
            assert procs[r].returncode not in (0, None)
            assert message in err, err[-2000:]
            assert waited < 15, waited      # the timeout is 60 s: the drop was noticed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


def test_a_rank_that_raises_is_named_by_the_others_at_once(tmp_path):
    """Its exception ends it (atexit: no leaving barrier), its connection drops without
    leaving, and the rank waiting for it in the next all-reduce fails naming it."""
    script = tmp_path / "run.py"
    script.write_text(KILLED)
    procs = start_ranks(2, [str(script), str(tmp_path), "1"], timeout=60)
    try:
        _, err1 = procs[1].communicate(timeout=120)
        failed_at = time.monotonic()
        assert procs[1].returncode == 1 and "this rank fails" in err1, err1[-2000:]
        _, err0 = procs[0].communicate(timeout=60)
        assert procs[0].returncode == 1 and "rank(s) [1] of 2 died" in err0, err0[-2000:]
        assert time.monotonic() - failed_at < 10          # the timeout is 60 s
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


# ---- bf16 gradients ------------------------------------------------------------------------

def bf16_all_reduce_in_threads(world: int, grads: np.ndarray, reduce_dtype: str) -> list:
    """Each rank r runs the numpy all_reduce node on bf16 bits of grads[r]; the bits of every
    rank's mean."""
    from stepgraph.backends.numpy import bf16
    from stepgraph.backends.numpy.backend import NumpyBackend
    from stepgraph.ir.graph import Node, Value

    port, results, errors = free_port(), [None] * world, []

    def rank(r):
        try:
            group = rendezvous(DistEnv(r, world, r, "127.0.0.1", port), timeout=10.0)
            n = grads.shape[1]
            node = Node("all_reduce", [Value((n,), "bfloat16")], [Value((n,), "bfloat16")],
                        {"group": group.id, "world_size": world, "bucket": 0,
                         "reduce_dtype": reduce_dtype})
            out = np.empty(n, np.uint16)
            NumpyBackend().run_node(node, [bf16.to_bits(grads[r])], [out])
            results[r] = out
            group.destroy()
        except Exception as err:       # reported below
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return results


def test_bf16_gradients_are_summed_in_float32_unless_bf16_communication_is_asked_for():
    from stepgraph.backends.numpy import bf16

    world, n = 4, 4096
    rng = np.random.default_rng(0)
    # Gradients of one sign and mixed scales: partial sums grow, so bf16 partial sums lose
    # the small terms' low bits.
    grads = bf16.round_bf16(np.abs(rng.standard_normal((world, n))) *
                            rng.choice([1.0, 1e-2], (world, n))).astype(np.float32)
    exact = grads.astype(np.float64).mean(axis=0)
    wide = bf16_all_reduce_in_threads(world, grads, "float32")
    narrow = bf16_all_reduce_in_threads(world, grads, "bfloat16")
    for r in range(1, world):
        np.testing.assert_array_equal(wide[r], wide[0])
        np.testing.assert_array_equal(narrow[r], narrow[0])
    # float32 sums of bf16 values are exact here (8 significant bits each, exponents close),
    # so the mean is the exact mean rounded to bf16 once: bit for bit.
    np.testing.assert_array_equal(wide[0], bf16.to_bits(exact))
    # bf16 sums round every partial sum: each rounding costs up to 2^-8 of that partial sum
    # (<= the full sum, all terms positive), the mean's one more.
    narrow_err = np.abs(bf16.from_bits(narrow[0]) - exact)
    wide_err = np.abs(bf16.from_bits(wide[0]) - exact)
    assert np.all(narrow_err <= world * 2.0**-8 * exact)
    assert np.all(wide_err <= 2.0**-8 * exact)
    assert (narrow[0] != wide[0]).mean() > 0.1
    assert narrow_err.mean() > 1.2 * wide_err.mean()      # seeded: 1.4 times


def test_bf16_partial_sums_lose_small_gradients():
    from stepgraph.backends.numpy import bf16

    # 1 + 2^-9 is a tie between 1 and 1 + 2^-7 in bf16 and rounds to 1: in bf16 sums the
    # three small gradients vanish; in float32 they survive into the mean, 1/4 + 3 * 2^-11,
    # rounded to the nearest bf16, 1/4 + 2^-9.
    grads = np.array([[1.0], [2.0**-9], [2.0**-9], [2.0**-9]], np.float32)
    wide = bf16_all_reduce_in_threads(4, grads, "float32")[0]
    narrow = bf16_all_reduce_in_threads(4, grads, "bfloat16")[0]
    assert bf16.from_bits(wide)[0] == 0.25 + 2.0**-9
    assert bf16.from_bits(narrow)[0] == 0.25


def test_bf16_buckets_say_what_they_are_summed_in():
    from stepgraph import losses, nn, optim
    import stepgraph as sg
    from stepgraph.distributed import DataParallel

    def reduce_dtypes(dp):
        nn.init.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        x, y = np.ones((4, 6), np.float32), np.zeros(4, np.int64)
        step = sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1), (x, y),
                                     precision="bf16", distributed=dp)
        nodes = next(iter(step.executables.values())).plan.steps
        return {(n.inputs[0].dtype, n.attrs["reduce_dtype"]) for n in nodes
                if n.op == "all_reduce"}

    assert ("bfloat16", "float32") in reduce_dtypes(True)
    assert ("bfloat16", "bfloat16") in reduce_dtypes(DataParallel(reduce_dtype="bf16"))
    with pytest.raises(ValueError, match="reduce_dtype must be one of"):
        DataParallel(reduce_dtype="float16")


def test_a_bf16_data_parallel_plan_has_cuda_kernels_for_its_collectives():
    """The CUDA backend refuses a bf16 plan with an op on bf16 values outside its BF16_OPS:
    the all-reduce and the join that holds its bf16 inputs and outputs must be listed."""
    pytest.importorskip("cupy")
    from stepgraph import losses, nn, optim
    import stepgraph as sg
    from stepgraph.backends.cuda.backend import declared_bf16_ops
    from stepgraph.compile.autocast import check_bf16_support

    nn.init.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
    x, y = np.ones((8, 6), np.float32), np.zeros(8, np.int64)
    step = sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1), (x, y),
                                 distributed=True, precision="bf16")
    graph = next(iter(step.executables.values())).plan.graph
    joins = [n for n in graph.nodes if n.op == "all_reduce_join"]
    assert any(v.dtype == "bfloat16" for v in joins[0].inputs)
    check_bf16_support(graph, declared_bf16_ops(), "cuda")


def test_two_bf16_processes_train_like_one_on_the_global_batch(tmp_path):
    sys.path.insert(0, str(WORKER.parent))
    import dist_worker
    from stepgraph.nn import init as nn_init

    done = subprocess.run([sys.executable, "-m", "stepgraph", "launch", "--gpus", "2",
                           "--timeout", "30", "--", sys.executable, str(WORKER), "--out",
                           str(tmp_path), "--steps", "5", "--precision", "bf16",
                           "--bucket-cap-mb", "0.01"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in (0, 1)]
    assert list(ranks[0]["plan/ops"]).count("all_reduce") > 1
    nn_init.manual_seed(0)
    before = dist_worker.make_model("mlp", 8)[0].state_dict()
    one = dist_worker.train("mlp", 5, 16, precision="bf16")[0].state_dict()
    fp32 = dist_worker.train("mlp", 5, 16)[0].state_dict()
    for key, start in before.items():
        two = ranks[0][f"state/{key}"]
        np.testing.assert_array_equal(two, ranks[1][f"state/{key}"], err_msg=key)
        # Compare parameter changes. The two runs round in other places (each rank's
        # gradient to bf16 before the average, the mean once more): errors of the kind and
        # size of bf16's own against float32, so the runs may differ by a small multiple of
        # how far the one-process bf16 run is from the float32 run (DESIGN.md's policy).
        bf16_error = np.linalg.norm((one[key] - start) - (fp32[key] - start))
        assert np.linalg.norm((two - start) - (one[key] - start)) <= 2 * bf16_error, key


# ---- the GPU ranks' watchdog ---------------------------------------------------------------

def test_the_watchdog_names_a_rank_whose_connection_drops_and_stops_quietly():
    from stepgraph.distributed.store import StoreClient, StoreServer
    from stepgraph.distributed.watchdog import Watchdog

    server = StoreServer("127.0.0.1", free_port())
    try:
        faults = []
        quiet = Watchdog(0, 2, "127.0.0.1", server.port, 5.0, faults.append)
        start = time.monotonic()
        quiet.stop()                        # a clean exit: ends at once, reports nothing
        assert time.monotonic() - start < 2 and not faults
        watch = Watchdog(0, 2, "127.0.0.1", server.port, 5.0, faults.append)
        peer = StoreClient("127.0.0.1", server.port, 5.0)
        peer.register(1)
        peer._sock.close()                  # killed: its connection drops without leaving
        deadline = time.monotonic() + 5
        while not faults and time.monotonic() < deadline:
            time.sleep(0.01)
        (fault,) = faults
        assert "rank 0: rank(s) [1] of 2 died" in str(fault) and "aborted" in str(fault)
        watch.stop()
    finally:
        server.close()


# ---- ZeRO-1's partition (planning only) ----------------------------------------------------

def test_every_element_of_every_bucket_has_exactly_one_owner():
    from stepgraph.distributed import Bucket, plan_shards

    rng = np.random.default_rng(0)
    for world in (1, 2, 3, 4, 8):
        elements = {i: int(rng.integers(1, 50)) for i in range(12)}
        buckets = [Bucket((11, 10, 9), 0, "float32", 3), Bucket((8, 7, 6, 5, 4), 0, "float32", 7),
                   Bucket((3, 2, 1, 0), 0, "float32", 9)]
        for shards, bucket in zip(plan_shards(buckets, elements, world), buckets):
            total = sum(elements[i] for i in bucket.indices)
            assert shards.padded == shards.chunk * world and 0 <= shards.padded - total < world
            owners = {i: np.zeros(elements[i], int) for i in bucket.indices}
            offset = {}
            for r, slices in enumerate(shards.ranks):
                for s in slices:
                    owners[s.index][s.start:s.stop] += 1
                    offset[(s.index, s.start)] = s.offset
                    # the slice lies inside rank r's chunk of the flat buffer
                    assert r * shards.chunk <= s.offset
                    assert s.offset + s.stop - s.start <= (r + 1) * shards.chunk
            assert all((o == 1).all() for o in owners.values())
            first = bucket.indices[0]
            assert offset[(first, 0)] == 0


def test_a_parameter_straddling_two_chunks_is_split_between_their_ranks():
    from stepgraph.distributed import Bucket, ShardSlice, plan_shards

    (shards,) = plan_shards([Bucket((1, 0), 0, "float32", 0)], {0: 3, 1: 6}, 2)
    # flat buffer: param 1's six elements, then param 0's three; 9 -> padded 10, chunk 5
    assert (shards.chunk, shards.padded) == (5, 10)
    assert shards.ranks == ((ShardSlice(1, 0, 5, 0),),
                            (ShardSlice(1, 5, 6, 5), ShardSlice(0, 0, 3, 6)))
    with pytest.raises(ValueError, match="no element count for parameters \\[0\\]"):
        plan_shards([Bucket((1, 0), 0, "float32", 0)], {1: 6}, 2)


def test_a_fault_aborts_the_communicator_reports_and_ends_the_rank(monkeypatch, capsys):
    from stepgraph.distributed import group as group_module
    from stepgraph.distributed.group import FAULT_EXIT_CODE, ProcessGroup

    calls = []

    class Comm:
        def abort(self):
            calls.append("abort")

    def exit_(code):
        calls.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(group_module.os, "_exit", exit_)
    group = ProcessGroup(DistEnv(0, 2, 0, "127.0.0.1", 1), None, None, 5.0)
    group._nccl = Comm()
    with pytest.raises(SystemExit):
        group._fault(DistributedError("rank 0: rank(s) [1] of 2 died"))
    assert calls == ["abort", FAULT_EXIT_CODE]
    assert "DistributedError: rank 0: rank(s) [1] of 2 died" in capsys.readouterr().err
    group._nccl, group._closed = None, True


class RecordingComm:
    """An NCCL communicator that records what was done to it."""

    def __init__(self, calls: list):
        self.calls = calls

    def abort(self):
        self.calls.append("abort")

    def destroy(self):
        self.calls.append("destroy")


class RecordingStore:
    """The store side of a teardown: how this rank's connection was closed."""

    def __init__(self, calls: list):
        self.calls = calls

    def close(self, leave: bool = True):
        self.calls.append("close, leaving" if leave else "close, dropped")


@pytest.mark.parametrize("barrier", ["met", "failed"])
def test_a_clean_end_destroys_the_communicator_only_after_every_rank_arrived(barrier):
    """NCCL may make ncclCommDestroy wait for every rank of the node: destroying it before
    the leaving barrier would hang a rank whose peer never gets there. A barrier that fails
    (a peer died or never came) aborts the communicator instead."""
    from stepgraph.distributed.group import ProcessGroup

    calls = []
    group = ProcessGroup(DistEnv(0, 2, 0, "127.0.0.1", 1), RecordingStore(calls), None, 5.0)
    group._nccl = RecordingComm(calls)

    def leaving_barrier(what, timeout):
        calls.append(f"barrier {what}")
        if barrier == "failed":
            raise DistributedError("rank 0: leaving failed: rank(s) [1] of 2 died")

    group.barrier = leaving_barrier
    group.destroy()
    last = "destroy" if barrier == "met" else "abort"
    assert calls == ["barrier leaving", "close, leaving", last]
    assert not group.has_nccl


def test_a_group_releases_the_graphs_holding_its_collectives_before_destroying_nccl(
        monkeypatch):
    """NCCL (2.26 on) destroys or aborts a communicator only once every CUDA graph holding
    its work is gone: a step's graph still referenced at exit hung the rank there. Graphs
    captured with the group's collectives are released first; others are not noted."""
    pytest.importorskip("cupy")
    from types import SimpleNamespace

    from stepgraph.backends.cuda import collective
    from stepgraph.backends.cuda.runtime import graph as graph_module
    from stepgraph.distributed.group import ProcessGroup
    from stepgraph.errors import CaptureError

    calls, made = [], []

    class Stream:
        ptr = 7

        def begin_capture(self):
            pass

        def end_capture(self):
            made.append(SimpleNamespace(upload=lambda stream: None))
            return made[-1]

        def is_capturing(self):
            return True

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Comm(RecordingComm):
        def destroy(self):
            calls.append("destroy" if held.graph is None else "destroy, a graph alive")

    group = ProcessGroup(DistEnv(0, 2, 0, "127.0.0.1", 1), RecordingStore(calls), None, 5.0)
    group._nccl = Comm(calls)
    group.barrier = lambda what, timeout: calls.append(f"barrier {what}")
    group.nccl_communicator = lambda device: group._nccl
    monkeypatch.setattr(collective, "cp", SimpleNamespace(
        cuda=SimpleNamespace(Device=lambda: SimpleNamespace(id=0))))
    ctx = SimpleNamespace(stream=Stream(), extras={}, capturing=False)
    plain = graph_module.capture(lambda: None, ctx)
    held = graph_module.capture(lambda: collective._communicator(group, ctx), ctx)
    assert [ref() for ref in group._graphs] == [held] and not ctx.extras
    group.destroy()
    assert calls == ["barrier leaving", "close, leaving", "destroy"]
    assert plain.graph is made[0]
    with pytest.raises(CaptureError, match="released"):
        held.launch()


def test_a_crashed_rank_drops_its_connection_before_aborting_the_communicator():
    """After an uncaught exception the device may hold collectives that wait for peers which
    will never join them: no device wait, no barrier; the connection drops first, so that the
    peers' watchdogs end them, then the communicator is aborted, never destroyed."""
    from stepgraph.distributed.group import ProcessGroup

    calls = []
    group = ProcessGroup(DistEnv(1, 2, 1, "127.0.0.1", 1), RecordingStore(calls), None, 5.0)
    group._nccl = RecordingComm(calls)
    group.barrier = lambda *args, **kwargs: calls.append("barrier")
    group._crashed = True
    group.destroy()
    assert calls == ["close, dropped", "abort"]


def test_an_abort_that_never_returns_does_not_keep_the_rank_alive():
    from stepgraph.distributed.group import _abort

    release = threading.Event()

    class StuckComm:
        def abort(self):
            release.wait(30)

    start = time.monotonic()
    _abort(StuckComm(), wait=0.2)
    assert time.monotonic() - start < 5
    release.set()


def test_a_crashed_rank_under_torchrun_closes_torchruns_store_client():
    """Under torchrun the store is a TorchStoreClient: the crash path's close(leave=False)
    must work on it too (torchrun's agent notices the dead worker itself)."""
    from stepgraph.distributed.group import ProcessGroup
    from stepgraph.distributed.store import TorchStoreClient

    client = TorchStoreClient.__new__(TorchStoreClient)     # no torchrun agent to reach here
    client._store = object()
    calls = []
    group = ProcessGroup(DistEnv(1, 2, 1, "127.0.0.1", 1, "torchrun", "torch"), client, None,
                         5.0)
    group._nccl = RecordingComm(calls)
    group._crashed = True
    group.destroy()
    assert client._store is None and calls == ["abort"]


def test_a_worker_sent_sigterm_dumps_its_stacks_and_ends_as_sigterm_would(tmp_path):
    """scripts/dp-check's hang evidence: a dist_worker rank stopped by its launcher or a
    timeout (SIGTERM) first writes every thread's stack to <dir>/rank<R>-stacks.txt."""
    code = ("import os, signal, sys\n"
            f"sys.path.insert(0, {str(WORKER.parent)!r})\n"
            "import dist_worker\n"
            f"dist_worker.dump_stacks_on_hang({str(tmp_path)!r}, 60)\n"
            "def waiting_for_a_peer():\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    signal.pause()\n"
            "waiting_for_a_peer()\n")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, RANK="1"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    dump = (tmp_path / "rank1-stacks.txt").read_text()
    assert dump.startswith("== pid ") and "in waiting_for_a_peer" in dump


class DictStore:
    """A store for one rank whose peers have already set their values."""

    def __init__(self, values: dict):
        self.values = values

    def set(self, key, value):
        self.values[key] = value

    def get(self, key):
        return self.values.get(key)

    def add(self, key, amount):
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]

    def delete_keys(self, keys):
        for k in keys:
            self.values.pop(k, None)

    def close(self, leave: bool = True):
        pass


@pytest.mark.parametrize("shape", [(), (3,), (2, 2)])
def test_all_gather_keeps_each_ranks_shape_on_two_ranks_as_on_one(shape, monkeypatch):
    """A 0-d value (a SyncBatchNorm count, a step counter) comes back 0-d from each rank."""
    from stepgraph.distributed.group import ProcessGroup

    mine = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    peer = mine + 10
    one = ProcessGroup(DistEnv(0, 1, 0, "127.0.0.1", 1), None, None, 5.0)
    assert one.all_gather(mine)[0].shape == shape
    two = ProcessGroup(DistEnv(0, 2, 0, "127.0.0.1", 1), DictStore({}), None, 5.0)
    monkeypatch.setattr(two, "_gather", lambda prefix, what: [mine.tobytes(), peer.tobytes()])
    parts = two.all_gather(mine)
    assert [p.shape for p in parts] == [shape, shape]
    assert np.array_equal(parts[1], peer)
