"""A PyTorch DDP training script (scripts/ddp_train.py: init_process_group, SyncBatchNorm,
DistributedDataParallel, DistributedSampler, all_reduce of the logged loss) run unchanged by
`stepgraph run` on two CPU processes (`stepgraph launch --gpus 2`), against the same script on
one torch process over the global batch; and torch.distributed's names one by one: the
sampler's order against torch's, the eager collectives on two processes, the refusals."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.compat.test_training_scripts import NUMBER, SCRIPTS, judge, numbers, run_script
from tests.helpers import child_pythonpath
from tests.reference import assert_state_changes_close

ROOT = Path(__file__).resolve().parents[2]


def launch_two(cwd: Path, *command: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=child_pythonpath(), STEPGRAPH_DIST_TIMEOUT="60")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "stepgraph", "launch", "--gpus", "2", "--",
                           sys.executable, "-m", "stepgraph", "run", *command], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_ddp_script_on_two_processes_trains_like_one_on_the_global_batch(tmp_path):
    """Each rank trains on its DistributedSampler half of every global batch: DDP averages the
    gradients inside the step and SyncBatchNorm normalises by both halves, so the losses rank
    0 prints (all-reduced over the ranks), the test loss (eval mode: the running statistics)
    and the final weights are one torch process's over the global batch (float64 the
    reference, float32's error the measure); both ranks end with the same bits, optimizer
    state included."""
    check_ddp_script(tmp_path, lambda script, *argv: launch_two(tmp_path, script, *argv).stdout)


def check_ddp_script(tmp_path: Path, run_ours) -> None:
    """scripts/ddp_train.py on two ranks (run_ours(script, *argv) -> what rank 0 printed)
    against one torch process over the global batch, float32 and float64."""
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
    ours = run_ours(str(SCRIPTS / "ddp_train.py"), *argv, "--out", "ours")
    losses = r"loss " + NUMBER                  # each step's, then the test loss
    judge(numbers(ours, losses), numbers(t64, losses), numbers(t32, losses), "losses")
    assert len(numbers(ours, r"step \d+ loss ([0-9.]+)")) == 8          # rank 0 prints alone
    load = lambda name: {k: v.cpu().numpy() for k, v in torch.load(  # noqa: E731
        tmp_path / name, weights_only=True).items()}
    init, rank0, rank1 = load("init.pt"), load("ours/final_rank0.pt"), load("ours/final_rank1.pt")
    for key, value in rank0.items():
        np.testing.assert_array_equal(rank1[key], value, err_msg=key)
    optimizers = [torch.load(tmp_path / f"ours/optimizer_rank{r}.pt", weights_only=True)
                  for r in (0, 1)]
    for k, entry in optimizers[0]["state"].items():
        np.testing.assert_array_equal(optimizers[1]["state"][k]["momentum_buffer"].cpu().numpy(),
                                      entry["momentum_buffer"].cpu().numpy())
    trained = [k for k in init if "running" not in k and "num_batches" not in k]
    assert_state_changes_close(init, rank0, load("t64/final_rank0.pt"),
                               load("t32/final_rank0.pt"), "final state: ", trained=trained,
                               counters=16)


EAGER_COLLECTIVES = """
    import functools

    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # each rank's lines in a file of its own: two processes' stdout can interleave in the pipe
    print = functools.partial(print, file=open(f"rank{rank}.txt", "w"), flush=True)
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    t = torch.tensor([1.0 + rank, 10.0 * rank])
    dist.all_reduce(t)                                  # SUM
    a = torch.tensor([1.0 + rank, 10.0 * rank])
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    m = torch.tensor([3 - rank, rank], dtype=torch.int64)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    b = torch.tensor([float(rank)] * 3)
    dist.broadcast(b, src=1)
    dist.barrier()
    print(rank, world, t.tolist(), a.tolist(), m.tolist(), b.tolist())
    try:
        dist.init_process_group(backend="gloo")
    except ValueError as err:
        print(rank, "twice:", err)
    dist.destroy_process_group()
    print(rank, "initialized after destroy:", dist.is_initialized())
"""


def test_eager_collectives_on_two_processes(tmp_path):
    (tmp_path / "collectives.py").write_text(textwrap.dedent(EAGER_COLLECTIVES))
    launch_two(tmp_path, "collectives.py")
    lines = sorted(line for rank in (0, 1)
                   for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines())
    assert lines == [
        "0 2 [3.0, 10.0] [1.5, 5.0] [3, 1] [1.0, 1.0, 1.0]",
        "0 initialized after destroy: False",
        "0 twice: trying to initialize the default process group twice!",
        "1 2 [3.0, 10.0] [1.5, 5.0] [3, 1] [1.0, 1.0, 1.0]",
        "1 initialized after destroy: False",
        "1 twice: trying to initialize the default process group twice!"]


@pytest.mark.parametrize("n, world, shuffle, drop_last", [
    (10, 2, True, False), (11, 3, True, False), (11, 3, True, True), (7, 4, False, False),
    (3, 5, True, False), (100, 4, True, True), (2000, 3, True, False)])
def test_distributed_sampler_gives_torchs_indices(n, world, shuffle, drop_last):
    from torch.utils.data.distributed import DistributedSampler as TorchSampler

    from stepgraph.utils.data import DistributedSampler

    for rank in range(world):
        ours = DistributedSampler(range(n), world, rank, shuffle, seed=5, drop_last=drop_last)
        theirs = TorchSampler(range(n), world, rank, shuffle, seed=5, drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs), (rank, epoch)
        assert len(ours) == len(theirs)


def test_torch_randperm_matches_torch():
    from stepgraph.utils.data.distributed import torch_randperm

    for n, seed in ((0, 0), (1, 3), (17, 0), (1000, 12345), (50, 2**40 + 3)):
        expected = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        assert torch_randperm(n, seed) == expected


def test_refusals_name_the_torch_name_and_the_alternative():
    import stepgraph
    from stepgraph import distributed as dist
    from stepgraph.errors import UnsupportedOpError
    from stepgraph.nn.parallel import DistributedDataParallel
    from stepgraph.utils.data import DistributedSampler

    dist.destroy()
    with pytest.raises(UnsupportedOpError, match=r"backend='mpi'.*use backend='nccl' or 'gloo'"):
        dist.init_process_group(backend="mpi")
    with pytest.raises(UnsupportedOpError, match=r"init_method='file:///x'.*env://"):
        dist.init_process_group(init_method="file:///x")
    with pytest.raises(UnsupportedOpError, match="torch.distributed.all_gather_object"):
        dist.all_gather_object
    with pytest.raises(ValueError, match="init_process_group"):
        DistributedDataParallel(stepgraph.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="init_process_group"):
        dist.all_reduce(stepgraph.tensor([1.0]))
    with pytest.raises(RuntimeError, match="distributed package"):
        DistributedSampler(range(4))
    with pytest.raises(UnsupportedOpError, match="torch.nn.parallel.DataParallel.*Distributed"):
        stepgraph.nn.parallel.DataParallel
    dist.init_process_group(backend="nccl", world_size=1, rank=0)     # a world of one
    try:
        with pytest.raises(UnsupportedOpError, match=r"mixed_precision=.*torch.autocast"):
            DistributedDataParallel(stepgraph.nn.Linear(2, 2), mixed_precision=object())
        with pytest.raises(UnsupportedOpError, match=r"op=.*ReduceOp.SUM"):
            dist.all_reduce(stepgraph.tensor([1.0]), op="sum")
        ddp = DistributedDataParallel(stepgraph.nn.Linear(2, 2), device_ids=[0])
        assert list(ddp.state_dict()) == ["module.weight", "module.bias"]
        assert ddp.data_parallel.broadcast_buffers and dist.get_world_size() == 1
        t = stepgraph.tensor([2.0, 3.0])
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert t.tolist() == [2.0, 3.0]
    finally:
        dist.destroy_process_group()
