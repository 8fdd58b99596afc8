"""A data-parallel training script written the way PyTorch's DDP tutorial ("multi-GPU training
with torchrun") writes one: init_process_group from the launcher's environment, the model's
BatchNorms converted to SyncBatchNorm and the model wrapped in DistributedDataParallel, a
DistributedSampler with set_epoch, the logged loss averaged over the ranks with all_reduce,
rank 0 printing, every rank saving its state, destroy_process_group. Started without a
launcher (no RANK in the environment) it trains alone on the global batch, as nanoGPT's
train.py does. Data: x (N x 1 x 8 x 8), y (N) from an .npz file."""
import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 2 * 2, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(torch.flatten(x, 1))


def ddp_setup():
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    return local_rank


class Trainer:
    def __init__(self, model, train_data, sampler, optimizer, rank, world_size, log_every):
        self.model, self.train_data, self.sampler = model, train_data, sampler
        self.optimizer, self.rank, self.world_size = optimizer, rank, world_size
        self.log_every = log_every

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()
        return loss

    def _run_epoch(self, epoch, device):
        self.sampler.set_epoch(epoch)
        for step, (source, targets) in enumerate(self.train_data):
            source, targets = source.to(device), targets.to(device)
            loss = self._run_batch(source, targets)
            if step % self.log_every == 0:
                mean = torch.tensor([loss.item()], device=device)
                if self.world_size > 1:
                    dist.all_reduce(mean, op=dist.ReduceOp.SUM)
                    mean /= self.world_size
                if self.rank == 0:
                    print(f"epoch {epoch} step {step} loss {mean.item():.6f}")

    def train(self, epochs, device):
        for epoch in range(epochs):
            self._run_epoch(epoch, device)


def evaluate(model, data, device):
    model.eval()
    with torch.no_grad():
        x, y = data.tensors
        return F.cross_entropy(model(x.to(device)), y.to(device)).item()


def main():
    parser = argparse.ArgumentParser(description="DDP training")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=2)
    parser.add_argument("--data", default="data.npz")
    parser.add_argument("--init", default=None, help="initial weights (written if missing)")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()

    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        local_rank = ddp_setup()
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        local_rank, rank, world_size = 0, 0, 1
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)

    arrays = np.load(args.data)
    x, y = torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])
    n_test = len(y) // 5
    train_set = TensorDataset(x[n_test:], y[n_test:])
    test_set = TensorDataset(x[:n_test], y[:n_test])
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=7)
    train_data = DataLoader(train_set, batch_size=args.batch_size // world_size, shuffle=False,
                            sampler=sampler)

    model = ConvNet()
    if args.init is not None:
        if os.path.exists(args.init):
            model.load_state_dict(torch.load(args.init))
        else:
            torch.save(model.state_dict(), args.init)
    model = model.to(device)
    if ddp:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = DDP(model, device_ids=[local_rank] if torch.cuda.is_available() else None)
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    Trainer(model, train_data, sampler, optimizer, rank, world_size,
            args.log_every).train(args.epochs, device)

    raw = model.module if ddp else model
    test_loss = evaluate(raw, test_set, device)
    if rank == 0:
        print(f"test loss {test_loss:.6f}")
    torch.save(raw.state_dict(), os.path.join(args.out, f"final_rank{rank}.pt"))
    torch.save(optimizer.state_dict(), os.path.join(args.out, f"optimizer_rank{rank}.pt"))
    if ddp:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
