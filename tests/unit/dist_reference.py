"""The single-process reference of a data-parallel run of dist_worker.py, in PyTorch: the
worker's model (its torch twin, from rank 0's initialisation, which the ranks broadcast), fed
the union of the ranks' batches, at float64 (the tolerance policy's reference) or float32 (the
measure of what rounding alone does).

Each rank's shard runs its own forward, as on its rank: BatchNorm normalises by the shard's
statistics; the running statistics every rank keeps are rank 0's, from rank 0's shards alone
(DDP's broadcast_buffers, and stepgraph's: distributed/__init__.py), and the gradient is
the mean of the shards' mean-loss gradients, which is the global batch's when nothing couples
the samples (mlp, cnn). `torch_sync_reference` is the --sync-bn run's: BatchNorm over the
concatenated global batch. Data-parallel tests judge every rank's parameter
changes against it (tests/reference.py): a missing or partial all-reduce leaves a rank with
its own shard's gradient, far past the bound."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn as tnn

import dist_worker
from stepgraph.data import BatchLoader


@dataclass
class Reference:
    """initial: the state every rank starts from (float64); states[r], losses[r]: rank r's
    state_dict (parameters and running statistics, rank 0's, shared) and per-step losses."""
    initial: dict[str, np.ndarray]
    states: list[dict[str, np.ndarray]]
    losses: list[list[float]]


def torch_twin(name: str, size: int) -> tnn.Module:
    """dist_worker.make_model(name, size) written in torch, with the same state_dict keys."""
    classes = dist_worker.CLASSES
    if name == "mlp":
        return tnn.Sequential(tnn.Linear(size * size, 64), tnn.ReLU(), tnn.Dropout(0.0),
                              tnn.Linear(64, 64), tnn.ReLU(), tnn.Dropout(0.0),
                              tnn.Linear(64, classes))
    if name == "cnn":
        return tnn.Sequential(tnn.Conv2d(1, 16, 3, padding=1), tnn.ReLU(), tnn.MaxPool2d(2),
                              tnn.Conv2d(16, 32, 3, padding=1), tnn.ReLU(), tnn.MaxPool2d(2),
                              tnn.Flatten(), tnn.Linear(32 * 2 * 2, 64), tnn.ReLU(),
                              tnn.Linear(64, classes))
    if name == "bncnn":
        return tnn.Sequential(tnn.Conv2d(1, 8, 3, padding=1, bias=False), tnn.BatchNorm2d(8),
                              tnn.ReLU(), tnn.MaxPool2d(2), tnn.Flatten(),
                              tnn.Linear(8 * (size // 2) ** 2, 16), tnn.BatchNorm1d(16),
                              tnn.ReLU(), tnn.Linear(16, classes))
    if name == "resnet":
        from tests.models.test_resnet import TorchResNet

        return TorchResNet((8, 16, 32), 1, classes, in_channels=1)
    raise ValueError(name)


def rank_batches(name: str, steps: int, global_batch: int, size: int, world: int) -> list:
    """Per step, the (x, y) batch of each of `world` ranks, as dist_worker.train draws them."""
    _, layout = dist_worker.make_model(name, size)
    x, y = dist_worker.make_data(steps * global_batch, size, layout)
    loaders = [BatchLoader(x, y, global_batch // world, seed=3, rank=r, world_size=world)
               if world > 1 else BatchLoader(x, y, global_batch, seed=3) for r in range(world)]
    return list(zip(*(loader.epoch(0) for loader in loaders)))


def initial_state(name: str, size: int) -> dict[str, np.ndarray]:
    """Rank 0's initialisation (dist_worker.train's init_seed 0), which every rank trains."""
    dist_worker.nn_init.manual_seed(0)
    model, _ = dist_worker.make_model(name, size)
    return {k: np.array(v, copy=True) for k, v in model.state_dict().items()}


def torch_reference(name: str, steps: int, global_batch: int, dtype, size: int = 8,
                    world: int = 2, optimizer: str = "sgd",
                    max_grad_norm: float | None = None) -> Reference:
    """dist_worker.train's run on `world` ranks, done by one torch process at `dtype`."""
    initial = initial_state(name, size)
    twin = torch_twin(name, size).to(dtype)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    opt = (torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.01))
    buffers = [{k: b.clone() for k, b in twin.named_buffers()} for _ in range(world)]
    losses: list[list[float]] = [[] for _ in range(world)]
    for shards in rank_batches(name, steps, global_batch, size, world):
        opt.zero_grad()
        for r, (x, y) in enumerate(shards):
            held = dict(twin.named_buffers())
            with torch.no_grad():
                for k, b in buffers[r].items():
                    held[k].copy_(b)
            loss = tnn.functional.cross_entropy(twin(torch.from_numpy(x).to(dtype)),
                                                torch.from_numpy(y))
            (loss / world).backward()
            buffers[r] = {k: b.clone() for k, b in twin.named_buffers()}
            losses[r].append(loss.item())
        if max_grad_norm is not None:
            tnn.utils.clip_grad_norm_(twin.parameters(), max_grad_norm)
        opt.step()
    params = {k: p.detach().double().numpy() for k, p in twin.named_parameters()}
    states = []
    rank0 = {k: (b.double() if b.is_floating_point() else b).numpy()
             for k, b in buffers[0].items()}
    for r in range(world):
        states.append({k: params[k] if k in params else rank0[k] for k in initial})
    return Reference({k: v.astype(np.float64) if v.dtype.kind == "f" else v
                      for k, v in initial.items()}, states, losses)


def torch_sync_reference(name: str, steps: int, global_batch: int, dtype, size: int = 8,
                         world: int = 2) -> Reference:
    """dist_worker.train's run on `world` ranks with --sync-bn, done by one torch process at
    `dtype` with plain BatchNorm over the concatenated global batch (the ranks' shards in
    rank order): rank r's loss is the mean loss of its rows of the global output, the loss
    trained is the mean of the ranks' (the global batch's mean loss: equal shards), and every
    rank holds the same state."""
    initial = initial_state(name, size)
    twin = torch_twin(name, size).to(dtype)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    losses: list[list[float]] = [[] for _ in range(world)]
    for shards in rank_batches(name, steps, global_batch, size, world):
        opt.zero_grad()
        out = twin(torch.from_numpy(np.concatenate([x for x, _ in shards])).to(dtype))
        per_rank, at = [], 0
        for r, (x, y) in enumerate(shards):
            per_rank.append(tnn.functional.cross_entropy(out[at:at + len(x)],
                                                         torch.from_numpy(y)))
            losses[r].append(per_rank[-1].item())
            at += len(x)
        (sum(per_rank) / world).backward()
        opt.step()
    state = {k: (v.detach().double() if v.is_floating_point() else v.detach()).numpy()
             for k, v in twin.state_dict().items()}
    return Reference({k: v.astype(np.float64) if v.dtype.kind == "f" else v
                      for k, v in initial.items()}, [state] * world, losses)
