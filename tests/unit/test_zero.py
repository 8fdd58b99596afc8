"""ZeRO stage 1 (DataParallel(shard_optimizer=True)) on the NumPy backend: the graph it builds,
and real two-process runs through `stepgraph launch` against the unsharded data-parallel step.

Tolerances: without gradient clipping the sharded step computes every parameter element with
the same float32 operations, in the same order, as the unsharded one (the gradients are averaged
by the same rank-order sum), so the results are compared bit for bit. With clipping the global
norm is sqrt of the sum of the shards' squared norms instead of one sum over every gradient: the
clip coefficient differs in its last bits, and the parameter changes are compared to rtol 1e-5
with an absolute slack of a few float32 ulps of the parameters' scale.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import nn, optim
from stepgraph.errors import PlanError

sys.path.insert(0, str(Path(__file__).parent))
import dist_worker  # noqa: E402
from test_distributed import launch_workers  # noqa: E402


def test_a_world_of_one_sharded_step_is_the_plain_step_bit_for_bit():
    kwargs = dict(optimizer="adamw", max_grad_norm=0.1, bucket_cap_mb=0.01)
    plain, _, plain_losses = dist_worker.train("mlp", 4, 16, **kwargs)
    model, step, losses_ = dist_worker.train("mlp", 4, 16, distributed=True,
                                             shard_optimizer=True, **kwargs)
    assert losses_ == plain_losses
    for key, value in plain.state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[key], value)
    ops = [n.op for n in next(iter(step.executables.values())).plan.steps]
    buckets = ops.count("reduce_scatter")
    assert buckets > 1 and ops.count("zero_shard") == buckets == ops.count("all_gather")
    assert "all_reduce" not in ops and ops.count("all_reduce_norm") == 1
    # Every gradient is reduced before the update, every parameter gathered after it.
    update = ops.index("adam_update")
    assert max(i for i, op in enumerate(ops) if op == "reduce_scatter") < update
    assert min(i for i, op in enumerate(ops) if op == "all_gather") == update + 1


def test_parameter_groups_are_refused_with_shard_optimizer():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = optim.SGD([{"params": model[0].parameters()},
                     {"params": model[1].parameters(), "lr": 0.01}], lr=0.1)
    x, y = np.ones((2, 4), np.float32), np.zeros(2, np.int64)
    with pytest.raises(PlanError, match="parameter groups"):
        sg.compile_train_step(model, sg.losses.cross_entropy, opt, (x, y),
                              distributed=sg.distributed.DataParallel(shard_optimizer=True))


def run_pair(tmp_path: Path, name: str, *args: str) -> list:
    out = tmp_path / name
    out.mkdir()
    launch_workers(out, "--model", "mlp", "--steps", "4", "--global-batch", "16",
                   "--bucket-cap-mb", "0.01", *args)
    return [dict(np.load(out / f"rank{r}.npz")) for r in (0, 1)]


def slots(record: dict) -> dict:
    """The optimizer's per-element state (momentum, Adam moments) a rank holds."""
    return {k: v for k, v in record.items()
            if k.startswith("optimizer/") and not k.endswith("lr_schedule")}


def initial_parameters() -> dict:
    """Rank 0's initialisation, which the step broadcasts to every rank."""
    dist_worker.nn_init.manual_seed(0)
    return dist_worker.make_model("mlp", 8)[0].state_dict()


@pytest.mark.parametrize("optimizer,clip", [("sgd", None), ("adamw", "0.05")])
def test_two_processes_with_sharded_state_train_like_unsharded(tmp_path, optimizer, clip):
    extra = ["--optimizer", optimizer] + (["--max-grad-norm", clip] if clip else [])
    full = run_pair(tmp_path, "full", *extra)
    zero = run_pair(tmp_path, "zero", *extra, "--shard-optimizer")
    for key, before in initial_parameters().items():
        key = f"state/{key}"
        np.testing.assert_array_equal(zero[0][key], zero[1][key])   # the ranks agree
        assert not np.array_equal(zero[0][key], before)            # and it trained
        if clip is None:
            np.testing.assert_array_equal(zero[0][key], full[0][key])
        else:
            # A few float32 ulps of the parameters' scale: the changes are ~1e-2.
            np.testing.assert_allclose(zero[0][key] - before, full[0][key] - before,
                                       rtol=1e-5, atol=1e-6 * np.abs(before).max())
    steps = 4 if clip is None else 1     # the first step's loss precedes any update
    for r in (0, 1):
        for i in range(steps):
            assert zero[r][f"loss/{i}"] == full[r][f"loss/{i}"]
    # Each rank holds half of the optimizer state (up to one padding element per bucket
    # and slot), in shard-sized entries only.
    total = sum(v.size for v in slots(full[0]).values())
    for r in (0, 1):
        mine = slots(zero[r])
        assert mine and all(".zero.bucket" in k for k in mine)
        assert total / 2 <= sum(v.size for v in mine.values()) <= total / 2 + len(mine)


def test_cuda_launchers_reduce_scatter_on_the_comm_stream_and_gather_in_order(monkeypatch):
    """The ZeRO-1 launchers' NCCL calls, streams and kernels, faked (no GPU): the bucket is
    packed and reduce-scattered on the communication stream, joined, then the parameter shard
    is cut out of the packed parameters, all-gathered and unpacked on the step's stream."""
    pytest.importorskip("cupy")
    from types import SimpleNamespace

    from test_distributed import FakeArray, FakeComm, FakeGroup, fake_cuda

    from stepgraph.backends.cuda import collective
    from stepgraph.backends.cuda.runtime import launch, side_stream
    from stepgraph.distributed import group as group_module
    from stepgraph.ir.graph import Node

    calls = []
    cp, Stream = fake_cuda(calls)
    cp.zeros = lambda n, dtype: FakeArray(n, dtype, 0xA000)
    cp.multiply = lambda a, b, out: calls.append(("square", a.data.ptr, out.data.ptr))
    cp.sqrt = lambda a, out: calls.append(("sqrt", out.data.ptr))

    class Comm(FakeComm):
        def reduceScatter(self, send, recv, count, dtype, op, stream):
            self.calls.append(("reduceScatter", send, recv, count, op, stream))

        def allGather(self, send, recv, count, dtype, stream):
            self.calls.append(("allGather", send, recv, count, stream))

    nccl = SimpleNamespace(NCCL_AVG=4, NCCL_SUM=0, NCCL_FLOAT32=7)
    for module in (collective, side_stream, launch):
        monkeypatch.setattr(module, "cp", cp)
    monkeypatch.setattr(collective, "_nccl", lambda: nccl)
    monkeypatch.setattr(collective, "_check", lambda *a, **k: None)
    monkeypatch.setattr(collective, "_kernel", lambda file, name: (
        lambda grid, block, args, stream: calls.append(("kernel", name, grid, stream.name))))
    group = FakeGroup(calls)
    group.rank, group.comm = 1, Comm(calls)
    monkeypatch.setitem(group_module._GROUPS, "g", group)
    ctx = SimpleNamespace(stream=Stream("main"), extras={}, capturing=False)
    attrs = {"group": "g", "world_size": 2, "bucket": 0, "chunk": 1505}
    grads = [FakeArray(3000, ptr=0x100), FakeArray(10, ptr=0x200)]
    shard = FakeArray(1505, ptr=0x300)
    collective.IMPLS["reduce_scatter"](Node("reduce_scatter", [], [], attrs), grads, [shard],
                                       ctx)
    collective.IMPLS["all_reduce_join"](Node("all_reduce_join", [], [], attrs), [], [], ctx)
    comm = ctx.extras["collective"].stream.ptr
    assert calls[0][:2] == ("record", "main") and calls[1][:2] == ("wait", "comm")
    assert calls[2] == ("kernel", "bucket_pack_kernel", (4,), "comm")   # 3000 + 10: 4 jobs
    assert calls[3] == ("reduceScatter", 0xA000, 0x300, 1505, 4, comm)
    assert calls[-1] == ("wait", "main", calls[-2][2])

    del calls[:]
    params = [FakeArray(3000, ptr=0x500), FakeArray(10, ptr=0x600)]
    param_shard = FakeArray(1505, ptr=0x700)
    collective.IMPLS["zero_shard"](Node("zero_shard", [], [], attrs), params, [param_shard], ctx)
    collective.IMPLS["all_gather"](Node("all_gather", [], [], dict(attrs, n=2)),
                                   [param_shard] + params, [], ctx)
    norm, out = FakeArray(1, ptr=0x800), FakeArray(1, ptr=0x900)
    collective.IMPLS["all_reduce_norm"](Node("all_reduce_norm", [], [], attrs), [norm], [out],
                                        ctx)
    assert calls == [
        ("kernel", "bucket_pack_kernel", (4,), "main"),
        ("memcpy", 0x700, 0xA000 + 1505 * 4, 1505 * 4),             # rank 1's chunk
        ("allGather", 0x700, 0xA000, 1505, ctx.stream.ptr),
        ("kernel", "bucket_unpack_kernel", (4,), "main"),
        ("square", 0x800, 0x900), ("allReduce", 0x900, 0x900, 1, 0, ctx.stream.ptr),
        ("sqrt", 0x900)]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")     # the inf batch's matmul
def test_a_guard_skips_the_same_steps_with_sharded_state():
    """The guard reads the gradient shards (its flags max-reduced across ranks): a batch with
    a non-finite input is skipped by the sharded step as by the plain one, parameters kept."""
    x, y = dist_worker.make_data(48, 8, "flat")
    x[16] = np.inf                                     # the second batch's first sample

    def run(distributed):
        dist_worker.nn_init.manual_seed(0)
        model = dist_worker.make_model("mlp", 8)[0]
        step = sg.compile_train_step(model, sg.losses.cross_entropy,
                                     optim.AdamW(lr=1e-2, max_grad_norm=1.0), (x[:16], y[:16]),
                                     on_bad_batch="skip", distributed=distributed)
        for i in range(3):
            step(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)])
        return model.state_dict(), step.skipped_steps

    plain, plain_skipped = run(False)
    zero, zero_skipped = run(sg.distributed.DataParallel(shard_optimizer=True,
                                                         bucket_cap_mb=0.01))
    assert plain_skipped == zero_skipped == 1
    for key, value in plain.items():
        assert np.all(np.isfinite(zero[key]))
        np.testing.assert_array_equal(zero[key], value)


def test_a_sharded_channels_last_conv_step_keeps_its_weight_permutes():
    """A channels-last step's float32 conv weights are copies the update writes
    (compile/weight_permutes.py); a sharded update writes its rank's shard only, so a sharded
    step keeps the permutes, and in a world of one trains as the plain step does."""
    from test_update_permutes import (ConvNet, assert_same_training, batches, channels_last_step,
                                      initial_weights, plan_nodes)
    from test_weight_permutes import update_copies, weight_permutes

    data, start = batches(), initial_weights()
    plain, sharded = (channels_last_step(ConvNet, start, lambda: optim.SGD(lr=0.1), data[0],
                                         distributed=distributed)
                      for distributed in (False, sg.distributed.DataParallel(shard_optimizer=True)))
    assert len(update_copies(plan_nodes(plain))) == 2 and not weight_permutes(plan_nodes(plain))
    nodes = plan_nodes(sharded)
    assert not update_copies(nodes) and len(weight_permutes(nodes)) == 2
    assert_same_training(sharded, plain, data)
