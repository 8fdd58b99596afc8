"""A training script written the way fast CIFAR-10 speedrun scripts (airbench) are: a small
conv net of conv-BatchNorm-GELU blocks, the whole net in float16 with `net.half()` and its
BatchNorms turned back to float, SGD with Nesterov momentum and two parameter groups, a
label-smoothing cross-entropy summed over the batch, and an evaluation pass under no_grad.
--dtype autocast trains float32 weights under torch.autocast(float16) with a GradScaler
instead; --dtype default keeps the default dtype (the float64 reference run). Images come
from an .npz file (x: N x 3 x H x W, y: N int64); --seed seeds the initial weights."""
import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


class ConvGroup(nn.Module):
    def __init__(self, channels_in, channels_out):
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels_out, momentum=0.4)
        self.pool = nn.MaxPool2d(2)
        self.activ = nn.GELU()

    def forward(self, x):
        return self.activ(self.norm(self.pool(self.conv(x))))


class Net(nn.Module):
    def __init__(self, widths=(16, 32), classes=10, scale=1 / 9):
        super().__init__()
        self.groups = nn.Sequential(ConvGroup(3, widths[0]), ConvGroup(widths[0], widths[1]))
        self.head = nn.Linear(widths[1], classes, bias=False)
        self.scale = scale

    def forward(self, x):
        x = self.groups(x)
        x = F.adaptive_max_pool2d(x, 1).flatten(1)
        return self.head(x) * self.scale


def make_net(args, dtype):
    net = Net()
    if os.path.exists(args.init):
        net.load_state_dict(torch.load(args.init, weights_only=True))
    else:
        torch.save(net.state_dict(), args.init)
    if args.dtype == "half":
        net.half()
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.float()
    return net


def evaluate(net, x, y, input_dtype):
    net.eval()
    with torch.no_grad():
        logits = net(x.to(input_dtype)).float()
        loss = F.cross_entropy(logits, y).item()
        correct = (logits.argmax(1) == y).sum().item()
    net.train()
    return loss, correct


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--dtype", choices=["half", "autocast", "default"], default="half")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--label-smoothing", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    data = np.load(args.data)
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    input_dtype = torch.float16 if args.dtype == "half" else x.dtype
    net = make_net(args, input_dtype)

    norm_params = [p for name, p in net.named_parameters() if "norm" in name]
    other_params = [p for name, p in net.named_parameters() if "norm" not in name]
    optimizer = torch.optim.SGD([dict(params=norm_params, lr=args.lr, weight_decay=0.0),
                                 dict(params=other_params, lr=args.lr / 4, weight_decay=5e-4)],
                                momentum=0.85, nesterov=True)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing, reduction="none")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10,
                                  enabled=args.dtype == "autocast")

    step = 0
    for epoch in range(args.epochs):
        for i in range(0, len(x), args.batch_size):
            inputs = x[i:i + args.batch_size].to(input_dtype)
            labels = y[i:i + args.batch_size]
            with torch.autocast("cpu", dtype=torch.float16,
                                enabled=args.dtype == "autocast"):
                outputs = net(inputs)
                loss = criterion(outputs, labels).sum()
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            print(f"step {step} loss {loss.item() / len(labels):.6f}")
            step += 1
        test_loss, correct = evaluate(net, x, y, input_dtype)
        print(f"epoch {epoch} test loss {test_loss:.6f} correct {correct}")
    print(f"scale {scaler.get_scale()}")


if __name__ == "__main__":
    main()
