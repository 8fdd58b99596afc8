"""The model, data and loop of tests/compat/scripts/half_convnet.py, written once for torch
and stepgraph (`fw`): conv-BatchNorm-GELU groups with max pooling, a bias-free head, SGD with
Nesterov momentum over two groups and a label-smoothing cross-entropy summed over the batch;
`net.half()` with the BatchNorms back in float, or float32 weights under float16 autocast with
a GradScaler. The float16 tests of both backends import it."""
from __future__ import annotations

import numpy as np

CLASSES = 10


def convnet(fw, half: bool, widths=(8, 16), seed: int = 0):
    nn, F = fw.nn, fw.nn.functional

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
        def __init__(self):
            super().__init__()
            self.groups = nn.Sequential(ConvGroup(3, widths[0]), ConvGroup(*widths))
            self.head = nn.Linear(widths[1], CLASSES, bias=False)

        def forward(self, x):
            x = F.adaptive_max_pool2d(self.groups(x), 1).flatten(1)
            return self.head(x) * (1 / 9)

    fw.manual_seed(seed)
    net = Net()
    if half:
        net.half()
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.float()
    return net


def load_from(net, torch_net) -> None:
    """net's state from a torch model's (dtypes kept: float16 where net holds float16)."""
    net.load_state_dict({k: v.detach().numpy() for k, v in torch_net.state_dict().items()})


def batches(n: int, dtype=np.float32, batch: int = 16, seed: int = 0):
    gen = np.random.default_rng(seed)
    return [(gen.standard_normal((batch, 3, 8, 8)).astype(dtype),
             gen.integers(0, CLASSES, batch).astype(np.int64)) for _ in range(n)]


def optimizer(fw, net, lr: float = 0.2):
    norm = [p for name, p in net.named_parameters() if "norm" in name]
    other = [p for name, p in net.named_parameters() if "norm" not in name]
    return fw.optim.SGD([dict(params=norm, lr=lr, weight_decay=0.0),
                         dict(params=other, lr=lr / 4, weight_decay=5e-4)],
                        momentum=0.85, nesterov=True)


def loss_fn(fw):
    criterion = fw.nn.CrossEntropyLoss(label_smoothing=0.2, reduction="none")
    return lambda out, y: criterion(out, y).sum()


def train(fw, net, data, autocast: bool, scale: float | None = None):
    """The script's loop; returns the GradScaler's scale after each step (autocast)."""
    opt, criterion = optimizer(fw, net), loss_fn(fw)
    scaler = fw.amp.GradScaler("cpu", init_scale=scale or 2.0 ** 10, enabled=autocast)
    scales = []
    for x, y in data:
        with fw.autocast("cpu", dtype=fw.float16, enabled=autocast):
            loss = criterion(net(fw.from_numpy(x)), fw.from_numpy(y))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def state(net) -> dict[str, np.ndarray]:
    return {k: np.asarray(v.detach().numpy() if hasattr(v, "detach") else v, np.float64)
            for k, v in net.state_dict().items()}
