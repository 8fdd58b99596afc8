"""torchvision's SqueezeNet 1.0 (tests/compat/models/squeezenet.py, imports changed only) at a
64x64 input: one SGD step against torch float64, and the cause of the one-step discrepancy
that used to appear at some input sizes and batches, measured.

The cause: its three MaxPool2d(3, 2, ceil_mode=True) sit on ReLU outputs, and now and then the
two largest elements of a window are closer in float64 than float32 resolves. Each float32
computation then decides the window by its own rounding, and the window's whole gradient goes
to one element or the other: the update differs from float64's by all of it (measured: 5e-3
of expand3x3's change). Neither decision
is wrong by float32's standard, and which way a run goes depends on the CPU's kernels: of 12
batches, torch float32 decided a window otherwise than float64 in 2 with the CPU libraries'
AVX-512 kernels and in none with their AVX2 kernels, and stepgraph, whose convolutions round
otherwise, need not follow torch there. So the step test draws its batch away from near-ties,
as the trajectory tests draw theirs away from kinks, and the tie rule itself (the gradient to
the first maximum in window order, as torch's) is tested on exact ties, which every rounding
keeps. (stepgraph once split a tied window's gradient evenly, while ceil_mode took a composed
max of selections; it now pools ceil_mode windows with the maxpool2d op, the partial windows
padded with -inf.)"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as TF

import stepgraph as sg
from stepgraph import optim
from stepgraph.nn import functional as F
from tests.compat import loader
from tests.ops.test_norm_pool_ops import check_against_torch, with_target
from tests.reference import assert_state_changes_close

SIZE, BATCH, CLASSES, LR, SEED = 64, 4, 10, 1.0, 3
BATCHES = 12             # the cause test's batches
NEAR_TIE = 1e-5          # a window's two largest values this close, relative: 100x float32's
                         # resolution, so float32 and float64 may order them otherwise


def _batch(seed: int = SEED):
    gen = np.random.default_rng(SIZE + 1000 * seed)
    x = gen.standard_normal((BATCH, 3, SIZE, SIZE)).astype(np.float32)
    return x, gen.integers(0, CLASSES, BATCH), gen


def _model(tv, dtype=torch.float32):
    torch.manual_seed(0)
    return tv.SqueezeNet("1_0", CLASSES, dropout=0.0).to(dtype)


def _pool_inputs(model, x):
    """The input of each MaxPool2d in one forward."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
             for m in model.features if isinstance(m, torch.nn.MaxPool2d)]
    with torch.no_grad():
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


def _near_tie_windows(top) -> torch.Tensor:
    """Per sample, how many windows (of _window_tops' values `top`) hold two largest
    (positive) values within NEAR_TIE."""
    gap = (top[..., 0] - top[..., 1]) / top[..., 0]
    return ((top[..., 0] > 0) & (gap < NEAR_TIE)).flatten(1).sum(dim=1)


def _near_ties(pool_inputs) -> torch.Tensor:
    """Per sample, how many windows of all the pools hold a near-tie."""
    return sum(_near_tie_windows(_window_tops(x).values) for x in pool_inputs)


def test_near_ties_in_max_pool_windows_are_the_cause():
    """Over BATCHES batches: every window torch float32 decides otherwise than float64 has its
    two largest float64 values closer than float32 resolves, and windows that close, which a
    float32 rounding may decide either way, occur (how many decide otherwise depends on the
    CPU's kernels: module docstring)."""
    tv = loader.load("squeezenet", "torch")
    model, model64 = _model(tv), _model(tv, torch.float64)
    flipped, near = [], 0
    for seed in range(BATCHES):
        x, _, _ = _batch(seed)
        f32 = _pool_inputs(model, torch.tensor(x))
        f64 = _pool_inputs(model64, torch.tensor(x, dtype=torch.float64))
        for a, b in zip(f32, f64):
            (top, where), (top64, where64) = _window_tops(a), _window_tops(b)
            near += int(_near_tie_windows(top).sum())
            moved = (where[..., 0] != where64[..., 0]) & (top64[..., 0] > 0)
            gap = (top64[..., 0] - top64[..., 1])[moved] / top64[..., 0][moved]
            flipped += gap.tolist()
    assert near >= BATCHES, f"only {near} near-tie windows in {BATCHES} batches"
    assert all(gap < 1e-6 for gap in flipped), flipped


def test_one_sgd_step_as_torch_float32_against_float64():
    """One SGD step on a batch drawn away from near-ties (samples with a near-tie window in
    torch float32's forward are drawn again), judged by the tolerance policy."""
    tv, ours = loader.load("squeezenet", "torch"), loader.load("squeezenet", "stepgraph")
    start = {k: v.detach().clone() for k, v in _model(tv).state_dict().items()}
    x, y, gen = _batch()
    probe = _model(tv)
    while (near := _near_ties(_pool_inputs(probe, torch.tensor(x))) > 0).any():
        x[near.numpy()] = gen.standard_normal((int(near.sum()), 3, SIZE, SIZE))
    after = {}
    for dtype in (torch.float64, torch.float32):
        model = _model(tv, dtype)
        model.load_state_dict(start)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        TF.cross_entropy(model(torch.tensor(x, dtype=dtype)), torch.tensor(y)).backward()
        opt.step()
        after[dtype] = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    model = ours.SqueezeNet("1_0", CLASSES, dropout=0.0)
    model.load_state_dict({k: v.numpy() for k, v in start.items()})
    before = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}
    step = sg.compile_train_step(model, sg.nn.functional.cross_entropy,
                                 optim.SGD(model.parameters(), lr=LR), (x, y))
    step(x, y)
    assert_state_changes_close(before, model.state_dict(), after[torch.float64],
                               after[torch.float32])


def test_exact_ties_in_ceil_mode_windows_go_to_the_first_maximum():
    """SqueezeNet's ReLU + MaxPool2d(3, 2, ceil_mode=True) on values from a coarse grid:
    windows (the partial last ones too: 14 = 2 * 6 + 2) hold exact ties, which every rounding
    keeps, and the gradient must go to the first maximum in window order, as torch's."""
    gen = np.random.default_rng(0)
    x = (gen.integers(-2, 3, (2, 3, 14, 14)) / 2).astype(np.float32)

    def torch_fn(x):
        return TF.max_pool2d(TF.relu(x), 3, 2, ceil_mode=True)

    check_against_torch(lambda t, i: F.max_pool2d(F.relu(i["x"]), 3, 2, ceil_mode=True),
                        torch_fn, with_target({"x": x}, torch_fn, gen), ("x",), False, 1e-6)
