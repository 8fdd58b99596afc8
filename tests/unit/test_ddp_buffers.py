"""Data-parallel BatchNorm on two real CPU processes (ranks talk through the store): rank 0's
running statistics broadcast to every rank inside each step (DDP's broadcast_buffers), and
nn.SyncBatchNorm's statistics over the global batch, judged against torch by the tolerance
policy (tests/reference.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stepgraph as sg
from tests.reference import assert_close_to_reference, assert_state_changes_close

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")
STEPS, BATCH = 4, 16


def launch_workers(out: Path, *args: str) -> list:
    result = subprocess.run([sys.executable, "-m", "stepgraph", "launch", "--gpus", "2",
                             "--timeout", "60", "--", sys.executable, str(WORKER), "--out",
                             str(out), *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return [np.load(out / f"rank{r}.npz") for r in (0, 1)]


def entries(record, prefix: str) -> dict:
    return {k[len(prefix):]: record[k] for k in record.files if k.startswith(prefix)}


def assert_bit_identical(ranks: list) -> None:
    """Parameters, BatchNorm buffers and optimizer state: the same bits on every rank."""
    for prefix in ("state/", "optimizer/"):
        mine = entries(ranks[0], prefix)
        assert mine, prefix
        for other in ranks[1:]:
            theirs = entries(other, prefix)
            assert list(theirs) == list(mine)
            for key, value in mine.items():
                np.testing.assert_array_equal(theirs[key], value, err_msg=prefix + key)


def judge(ranks: list, ref64, ref32, trained, steps: int = STEPS) -> None:
    """Each rank's parameter changes and losses over `steps` against the references' by the
    policy (tests/cuda/test_ddp_cuda.py's two-GPU mirrors judge theirs here too)."""
    for r, record in enumerate(ranks):
        assert_state_changes_close(ref64.initial, entries(record, "state/"), ref64.states[r],
                                   ref32.states[r], f"rank {r}: ", trained=trained,
                                   counters=steps)
        assert_close_to_reference([record[f"loss/{i}"] for i in range(steps)],
                                  ref64.losses[r], ref32.losses[r], f"rank {r}: losses")


def trained_names() -> list[str]:
    import dist_worker

    return [k for k, _ in dist_worker.make_model("bncnn", 8)[0].named_parameters()]


@pytest.fixture(autouse=True)
def worker_path():
    sys.path.insert(0, str(WORKER.parent))
    yield
    sys.path.remove(str(WORKER.parent))


def test_every_rank_holds_rank_zeros_batchnorm_statistics(tmp_path):
    """Each rank trains on its own half of every global batch, so its BatchNorm's running
    statistics differ from the other's within a step; after it they are rank 0's on both (and
    the parameters and momentum buffers the same bits), and they are what one torch process
    computes for rank 0's halves (float64, float32's error the measure), while the
    parameters follow the union batch's averaged gradient."""
    import dist_reference
    import torch

    ranks = launch_workers(tmp_path, "--model", "bncnn", "--steps", str(STEPS),
                           "--global-batch", str(BATCH))
    assert_bit_identical(ranks)
    assert list(ranks[0]["plan/ops"])[-1] == "broadcast_buffers"
    ref64, ref32 = (dist_reference.torch_reference("bncnn", STEPS, BATCH, dtype)
                    for dtype in (torch.float64, torch.float32))
    judge(ranks, ref64, ref32, trained_names())
    # the two ranks' own statistics do differ: rank 1's halves would give other values
    other = dist_reference.torch_reference("bncnn", STEPS, BATCH, torch.float64)
    assert not np.allclose(other.states[0]["1.running_mean"],
                           _rank_one_statistics("bncnn")["1.running_mean"])


def _rank_one_statistics(name: str) -> dict:
    """The running statistics rank 1 would keep of its own halves (float64 torch)."""
    import dist_reference
    import torch

    initial = dist_reference.initial_state(name, 8)
    twin = dist_reference.torch_twin(name, 8).double()
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    for shards in dist_reference.rank_batches(name, STEPS, BATCH, 8, 2):
        with torch.no_grad():
            twin(torch.from_numpy(shards[1][0]).double())
    return {k: b.numpy() for k, b in twin.named_buffers()}


def test_sync_batchnorm_on_two_ranks_is_batchnorm_on_the_global_batch(tmp_path):
    """SyncBatchNorm normalises by the statistics of both ranks' halves together: each rank's
    losses, the trained parameters and the running statistics are those of one torch process
    running plain BatchNorm over the concatenated global batch (float64 the reference,
    float32's error the measure); a rank normalising by its own half is far past the bound."""
    import dist_reference
    import torch

    ranks = launch_workers(tmp_path, "--model", "bncnn", "--steps", str(STEPS),
                           "--global-batch", str(BATCH), "--sync-bn")
    assert_bit_identical(ranks)
    ops = list(ranks[0]["plan/ops"])
    assert ops.count("all_reduce_sum") == 8      # 2 BatchNorms x (2 forward + 2 backward)
    assert ops.count("running_stats_update") == 2
    ref64, ref32 = (dist_reference.torch_sync_reference("bncnn", STEPS, BATCH, dtype)
                    for dtype in (torch.float64, torch.float32))
    judge(ranks, ref64, ref32, trained_names())


def test_sync_batchnorm_is_batchnorm_in_a_world_of_one():
    """Without a process group of more than one rank (and in eval mode), SyncBatchNorm is
    BatchNorm: the same op, the same bits."""
    import dist_worker

    sg.distributed.destroy()
    runs = []
    for sync in (False, True):
        model, step, losses = dist_worker.train("bncnn", 3, 8, sync_bn=sync)
        ops = [n.op for n in next(iter(step.executables.values())).plan.steps]
        runs.append((model.state_dict(), losses, ops))
    (plain, plain_losses, plain_ops), (synced, sync_losses, sync_ops) = runs
    assert sync_ops == plain_ops and "all_reduce_sum" not in sync_ops
    assert plain_losses == sync_losses
    for key, value in plain.items():
        np.testing.assert_array_equal(synced[key], value, err_msg=key)


def test_convert_sync_batchnorm_keeps_the_parameters_and_buffers():
    """As torch's: every BatchNorm (1d/2d/3d, nested) becomes a SyncBatchNorm holding the same
    Parameter and Buffer objects, training flag and options; other modules stay."""
    from stepgraph import nn

    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4, momentum=0.3),
                        nn.Sequential(nn.BatchNorm1d(4, affine=False)), nn.ReLU())
    net[1].eval()
    bn = net[1]
    keys = list(net.state_dict())
    out = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    assert out is net and type(out[0]) is nn.Conv2d and type(out[3]) is nn.ReLU
    assert type(out[1]) is nn.SyncBatchNorm and type(out[2][0]) is nn.SyncBatchNorm
    assert out[1].weight is bn.weight and out[1].running_var is bn.running_var
    assert out[1].momentum == 0.3 and not out[1].training and out[2][0].training
    assert out[2][0].weight is None and out[2][0].affine is False
    assert list(out.state_dict()) == keys
    single = nn.SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm3d(2))
    assert type(single) is nn.SyncBatchNorm and single.num_features == 2


def test_cuda_buffer_broadcast_and_sync_sums_call_nccl_in_order(monkeypatch):
    """broadcast_buffers: one NCCL group of byte broadcasts from rank 0 on the step's stream
    (float32 statistics and the int64 counter alike). all_reduce_sum: an NCCL_SUM on the
    communication stream, forked after ctx.stream's work and joined at once (the next
    kernels read the sums), so every NCCL call of a step goes out on one stream in program
    order."""
    pytest.importorskip("cupy")
    from types import SimpleNamespace

    from stepgraph.backends.cuda import collective
    from stepgraph.backends.cuda.runtime import launch, side_stream
    from stepgraph.distributed import group as group_module
    from stepgraph.ir.graph import Node
    from tests.unit.test_distributed import FakeArray, FakeGroup, fake_cuda

    calls = []
    cp, Stream = fake_cuda(calls)
    nccl = SimpleNamespace(NCCL_UINT8=1, NCCL_SUM=0, NCCL_FLOAT32=7,
                           groupStart=lambda: calls.append(("groupStart",)),
                           groupEnd=lambda: calls.append(("groupEnd",)))
    for module in (collective, side_stream, launch):
        monkeypatch.setattr(module, "cp", cp)
    monkeypatch.setattr(collective, "_nccl", lambda: nccl)
    monkeypatch.setattr(collective, "_check", lambda *a, **k: None)
    fake = FakeGroup(calls)
    fake.comm.bcast = lambda buff, count, dtype, root, stream: calls.append(
        ("bcast", buff, count, dtype, root, stream))
    monkeypatch.setitem(group_module._GROUPS, "g", fake)
    ctx = SimpleNamespace(stream=Stream("main"), extras={}, capturing=False)
    node = Node("broadcast_buffers", [], [], {"group": "g", "n": 3})
    collective.broadcast_buffers(ctx, node, [FakeArray(8, "float32", 0x100),
                                             FakeArray(1, "int64", 0x200),
                                             FakeArray(0, "float32", 0x300)])
    main = ctx.stream.ptr
    assert calls == [("groupStart",), ("bcast", 0x100, 32, 1, 0, main),
                     ("bcast", 0x200, 8, 1, 0, main), ("groupEnd",)]
    calls.clear()
    node = Node("all_reduce_sum", [], [], {"group": "g", "world_size": 2})
    collective.all_reduce_sum(ctx, node, [FakeArray(9, ptr=0x400)], [FakeArray(9, ptr=0x500)])
    comm = ctx.extras["collective"].stream.ptr
    assert [c[0] for c in calls] == ["record", "wait", "allReduce", "record", "wait"]
    assert calls[0][1] == "main" and calls[1][1] == "comm"
    assert calls[2] == ("allReduce", 0x400, 0x500, 9, 0, comm)
    assert calls[-1] == ("wait", "main", calls[-2][2])
    assert ctx.extras["collective"].pending is None
