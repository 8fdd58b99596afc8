"""torchvision's SqueezeNet 1.0 (tests/compat/models/squeezenet.py, imports changed only) at a
64x64 input: one SGD step against torch float64, and the cause of the one-step discrepancy
that used to appear at some input sizes and batches, measured.

The cause: its three MaxPool2d(3, 2, ceil_mode=True) sit on ReLU outputs, and now and then the
two largest elements of a window are closer in float64 than float32 resolves (about one batch
in three here: some 10^6 pairs of window elements). Each float32 computation then decides the
window by its own rounding: float64 sends the window's gradient to the larger element, torch
float32 to whichever its rounding makes larger (the first in window order where they round
equal), and stepgraph, while ceil_mode took a composed max of selections, split it evenly
where its float32 values rounded equal. The update then differs from float64's by all or half
of that window's gradient (here torch float32 by all, 5e-3 of expand3x3's change, where
stepgraph was at half; in the issue's report the other way round, 100x torch's error). Neither
is wrong by float32's standard, but stepgraph now pools ceil_mode windows with the maxpool2d
op (the partial windows padded with -inf), whose gradient goes to the first maximum as
torch's: measured here, the same update as torch float32."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as TF

import stepgraph as sg
from stepgraph import optim
from tests.compat import loader

SIZE, BATCH, CLASSES, LR, SEED = 64, 4, 10, 1.0, 3   # a batch with a float32 tie (below)


def _batch():
    gen = np.random.default_rng(SIZE + 1000 * SEED)
    x = gen.standard_normal((BATCH, 3, SIZE, SIZE)).astype(np.float32)
    return x, gen.integers(0, CLASSES, BATCH)


def _pool_inputs(model, x):
    """The input of each MaxPool2d in one forward."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
             for m in model.features if isinstance(m, torch.nn.MaxPool2d)]
    model(x)
    for h in hooks:
        h.remove()
    return seen


def _window_tops(x):
    """The two largest values of every ceil_mode 3x3 / 2 window, and where the windows are."""
    extra = [(-(-(n - 3) // 2)) * 2 + 3 - n for n in x.shape[2:]]
    padded = TF.pad(x, (0, extra[1], 0, extra[0]), value=-float("inf"))
    windows = padded.unfold(2, 3, 2).unfold(3, 3, 2).flatten(-2)
    return windows.topk(2, dim=-1)


def test_near_ties_in_max_pool_windows_are_the_cause():
    tv = loader.load("squeezenet", "torch")
    torch.manual_seed(0)
    model = tv.SqueezeNet("1_0", CLASSES, dropout=0.0)
    x, _ = _batch()
    f32 = _pool_inputs(model, torch.tensor(x))
    f64 = _pool_inputs(model.double(), torch.tensor(x, dtype=torch.float64))
    flipped = []
    for a, b in zip(f32, f64):
        (top, where), (top64, where64) = _window_tops(a), _window_tops(b)
        moved = (where[..., 0] != where64[..., 0]) & (top64[..., 0] > 0)
        # the windows float32 decides otherwise: their two largest float64 values closer
        # than float32 resolves
        gap = (top64[..., 0] - top64[..., 1])[moved] / top64[..., 0][moved]
        flipped += gap.tolist()
    assert len(flipped) >= 1 and max(flipped) < 1e-6, flipped


def test_one_sgd_step_as_torch_float32_against_float64():
    tv, ours = loader.load("squeezenet", "torch"), loader.load("squeezenet", "stepgraph")
    torch.manual_seed(0)
    start = {k: v.detach().clone() for k, v in
             tv.SqueezeNet("1_0", CLASSES, dropout=0.0).state_dict().items()}
    x, y = _batch()
    change = {}
    for dtype in (torch.float64, torch.float32):
        model = tv.SqueezeNet("1_0", CLASSES, dropout=0.0).to(dtype)
        model.load_state_dict(start)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        TF.cross_entropy(model(torch.tensor(x, dtype=dtype)), torch.tensor(y)).backward()
        opt.step()
        change[dtype] = {k: v.detach().double().numpy() - start[k].double().numpy()
                         for k, v in model.state_dict().items()}
    model = ours.SqueezeNet("1_0", CLASSES, dropout=0.0)
    model.load_state_dict({k: v.numpy() for k, v in start.items()})
    before = {k: v.astype(np.float64) for k, v in model.state_dict().items()}
    step = sg.compile_train_step(model, sg.nn.functional.cross_entropy,
                                 optim.SGD(model.parameters(), lr=LR), (x, y))
    step(x, y)
    for k, want in change[torch.float64].items():
        got = model.state_dict()[k].astype(np.float64) - before[k]
        ours_err = np.linalg.norm(got - want) / np.linalg.norm(want)
        torch_err = np.linalg.norm(change[torch.float32][k] - want) / np.linalg.norm(want)
        # torch float32's own error (up to 5e-3 here, at the near-tie) within 10%, or a
        # rounding; and the window decided as torch float32 decides it (the split gradient
        # of the composed max was 2.7e-3 from torch's update in expand3x3.weight)
        assert ours_err <= 1.1 * torch_err + 2e-6, (k, ours_err, torch_err)
        apart = np.linalg.norm(got - change[torch.float32][k]) / np.linalg.norm(want)
        assert apart <= 1e-4, (k, apart)
