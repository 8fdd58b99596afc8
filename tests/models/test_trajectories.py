"""Whole training trajectories against PyTorch: the `mlp` and `cnn` workloads of BENCHMARKS.md
(batch 32 to keep CI fast) start from the PyTorch twin's weights, train on the same fresh
batches with the same optimizer, and are judged by the tolerance policy (docs/TESTING.md)
against the twin run in float64: every loss, and every parameter's change over the run, within
4x the error the twin makes in float32 (tests/reference.py).

The batches carry signal (labels come from a random linear teacher), so the gradients are
not noise around zero. Each batch is drawn, before its step, away from ReLU and max-pool kinks
of torch's current forward (samples_near_a_kink). At a kink both one-sided gradients are right,
and float32 rounding (~1e-7) decides which one an implementation takes; with Adam, which turns
small gradient differences into updates of up to lr, one such flip makes two correct float32
runs drift apart chaotically. Measured on 20 random mlp+AdamW setups with unconstrained
batches: stepgraph and torch float32 each left torch float64's loss trajectory by more than
1e-5 in 2-3 of them, with equally accurate gradients; with kink-free batches, none did.

Adam has a kink of its own: its first update is lr * d / (|d| + eps) for the direction d
(gradient plus weight decay), a sign function smoothed over eps, with slope lr / eps at d = 0.
At torch's default eps (1e-8) that slope is 1e5; among the 262,144 elements of a 512 x 512
weight, an L2-decayed d = g + wd * p lands within 1e-9 of zero by chance (measured:
mlp-adam-weight-decay's 3.weight[172, 382]), where float32's rounding of d (~1e-11) decides
the update, and the error spreads to the tensors that element feeds. One such element then
holds both runs' largest error, and the ratio of two roundings has a heavy tail: over the mlp
and cnn runs with Adam and AdamW, stepgraph's largest error was up to 4.5x torch float32's with
the CPU libraries' AVX-512 kernels, 3.7x with their AVX2 kernels (OPENBLAS_CORETYPE=Haswell,
DNNL_MAX_CPU_ISA=AVX2, ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2), and still 3.6x
at eps 1e-6. So the Adam runs here use eps = ADAM_EPS = 1e-4 (slope 10), where the bulk of the
elements, not one, sets the largest error: at most 1.6x torch's, with either kind of kernel.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch import nn as tnn

import stepgraph as sg
from stepgraph import losses, models, optim, rng
from tests.ops.helpers import seeded
from tests.reference import assert_close_to_reference, assert_state_changes_close

STEPS, BATCH = 20, 32
LOSS_RTOL = 1e-5       # the lockstep test's loss, against torch float32 from the same state
LOCKSTEP_RTOL = 1e-4   # one step's update and new optimizer state
KINK_MARGIN = 1e-5     # 100x float32 rounding of a pre-activation here
ADAM_EPS = 1e-4        # Adam's eps in the trajectory runs: its first step's slope lr/eps is 10

class MaskedDropout(tnn.Module):
    """torch twin of stepgraph's dropout: the same Philox mask (stepgraph.rng), so a dropout
    model's trajectory can be compared too. `clock` holds the step counter value the step
    reads (steps completed so far)."""

    def __init__(self, p: float, site: int, seed: int, clock: list[int], per_channel=False):
        super().__init__()
        self.p, self.site, self.seed, self.clock = p, site, seed, clock
        self.per_channel = per_channel

    def forward(self, x):
        if self.p == 0:
            return x
        shape = x.shape[:2] if self.per_channel else x.shape
        mask = rng.dropout_keep_mask(math.prod(shape), self.p, self.seed, self.site,
                                     self.clock[0]).reshape(shape)
        mask = torch.tensor(mask, dtype=x.dtype)
        if self.per_channel:
            mask = mask[:, :, None, None]
        return x * mask * (1.0 / (1.0 - self.p))


@dataclass
class Workload:
    name: str
    sg_model: Callable[[float], sg.nn.Module]
    torch_model: Callable[[float, int, list[int]], tnn.Module]
    loss: Callable
    torch_loss: Callable
    x_shape: tuple[int, ...]


def torch_mlp(p: float, seed: int, clock: list[int]) -> tnn.Module:
    return tnn.Sequential(tnn.Linear(784, 512), tnn.ReLU(), MaskedDropout(p, 0, seed, clock),
                          tnn.Linear(512, 512), tnn.ReLU(), MaskedDropout(p, 1, seed, clock),
                          tnn.Linear(512, 10))


def torch_cnn(p: float, seed: int, clock: list[int]) -> tnn.Module:
    return tnn.Sequential(tnn.Conv2d(1, 10, 5), tnn.MaxPool2d(2), tnn.ReLU(),
                          tnn.Conv2d(10, 20, 5), MaskedDropout(p, 0, seed, clock, True),
                          tnn.MaxPool2d(2), tnn.ReLU(), tnn.Flatten(), tnn.Linear(320, 50),
                          tnn.ReLU(), MaskedDropout(p, 1, seed, clock), tnn.Linear(50, 10),
                          tnn.LogSoftmax(dim=1))


WORKLOADS = {
    "mlp": Workload("mlp", lambda p: models.mlp(dropout=p), torch_mlp, losses.cross_entropy,
                    TF.cross_entropy, (784,)),
    "cnn": Workload("cnn", lambda p: models.cnn(dropout=p), torch_cnn, losses.nll_loss,
                    TF.nll_loss, (1, 28, 28)),
}


class Batches:
    """Fresh random batches with teacher labels, each drawn away from the kinks of the torch
    model's forward at the moment it is drawn (samples near a kink are drawn again)."""

    def __init__(self, name: str, x_shape: tuple[int, ...]):
        self.gen, self.x_shape = seeded(name), x_shape
        self.teacher = self.gen.standard_normal((math.prod(x_shape), 10)).astype(np.float32)

    def draw(self, size: int = BATCH, away_from: tnn.Module | None = None):
        x = self.gen.standard_normal((size, *self.x_shape)).astype(np.float32)
        while away_from is not None and (near := samples_near_a_kink(away_from, x)).any():
            x[near] = self.gen.standard_normal((int(near.sum()), *self.x_shape))
        return x, (x.reshape(size, -1) @ self.teacher).argmax(axis=1).astype(np.int64)


def samples_near_a_kink(tmodel: tnn.Module, x: np.ndarray,
                        margin: float = KINK_MARGIN) -> np.ndarray:
    """Which samples put some ReLU input of torch's forward within `margin` of zero, or the
    two largest values of some max-pool window within `margin` of each other. Exact zeros and
    exact ties (dropped channels) are not ambiguous: both implementations agree on them."""
    near = torch.zeros(len(x), dtype=torch.bool)

    def ambiguous(d):   # per sample: any 0 < d < margin
        return ((d < margin) & (d > 0)).flatten(1).any(dim=1)

    def relu(module, inputs, output):
        near.logical_or_(ambiguous(inputs[0].abs()))

    def pool(module, inputs, output):
        k, s = module.kernel_size, module.stride
        windows = inputs[0].unfold(2, k, s).unfold(3, k, s).flatten(-2)
        top2 = windows.topk(2, dim=-1).values
        near.logical_or_(ambiguous(top2[..., 0] - top2[..., 1]))

    hooks = [m.register_forward_hook(relu if isinstance(m, tnn.ReLU) else pool)
             for m in tmodel.modules() if isinstance(m, (tnn.ReLU, tnn.MaxPool2d))]
    with torch.no_grad():
        tmodel(torch.tensor(x))
    for h in hooks:
        h.remove()
    return near.numpy()


@dataclass
class Result:
    losses: list[float]
    torch_losses: list[float]        # the twin in float32
    torch64_losses: list[float]      # the twin in float64, from the same weights
    params: dict[str, np.ndarray]
    torch_params: dict[str, np.ndarray]
    torch64_params: dict[str, np.ndarray]
    initial: dict[str, np.ndarray]
    step: sg.TrainStep
    grad_norms: list[float]          # torch's total gradient norm per step, when clipping


def train_both(workload: Workload, sg_opt, torch_opt: Callable, *, dropout: float = 0.0,
               seed: int = 0, sizes: list[int] | None = None, max_norm: float | None = None,
               scheduler: Callable | None = None, before_step: Callable | None = None,
               test_name: str = "") -> Result:
    """Train the stepgraph model and its torch twin (in float32 and in float64) side by side
    on the same batches (of `sizes`, default 20 x 32). before_step(i, sg_opt, torch_opt) runs
    before step i, once per torch optimizer."""
    torch.manual_seed(len(test_name))
    clock = [0]
    tmodel = workload.torch_model(dropout, seed, clock)
    model = workload.sg_model(dropout)
    model.load_state_dict({k: v.detach().numpy() for k, v in tmodel.state_dict().items()})
    initial = model.state_dict()
    t64 = copy.deepcopy(tmodel).double()
    topt, topt64 = torch_opt(tmodel.parameters()), torch_opt(t64.parameters())
    scheds = [scheduler(o) for o in (topt, topt64)] if scheduler else []
    batches, sizes = Batches(test_name, workload.x_shape), sizes or [BATCH] * STEPS
    step = sg.compile_train_step(model, workload.loss, sg_opt,
                                 example_inputs=batches.draw(sizes[0]), seed=seed)
    got, want, want64, norms = [], [], [], []
    for i, size in enumerate(sizes):
        x, y = batches.draw(size, away_from=tmodel)
        if before_step:
            before_step(i, sg_opt, topt)
            before_step(i, sg_opt, topt64)
        got.append(float(step(x, y)))
        for twin, opt, out in ((tmodel, topt, want), (t64, topt64, want64)):
            opt.zero_grad()
            dtype = next(twin.parameters()).dtype
            loss = workload.torch_loss(twin(torch.tensor(x).to(dtype)), torch.tensor(y))
            loss.backward()
            if max_norm is not None:
                norm = float(tnn.utils.clip_grad_norm_(twin.parameters(), max_norm))
                norms += [norm] if twin is tmodel else []
            opt.step()
            out.append(loss.item())
        for sched in scheds:
            sched.step()
        clock[0] += 1
    return Result(got, want, want64, model.state_dict(),
                  {k: v.detach().numpy() for k, v in tmodel.state_dict().items()},
                  {k: v.detach().numpy() for k, v in t64.state_dict().items()}, initial, step,
                  norms)


def assert_same_trajectory(r: Result) -> None:
    """Losses per step and each parameter's change over the run, judged against the float64
    twin with the float32 twin's error as the measure (tests/reference.py)."""
    assert_close_to_reference(r.losses, r.torch64_losses, r.torch_losses,
                              f"losses\nstepgraph {r.losses}\ntorch     {r.torch_losses}")
    assert_state_changes_close(r.initial, r.params, r.torch64_params, r.torch_params)


# name -> (stepgraph optimizer, torch optimizer), each taking extra keyword arguments
OPTIMIZERS = {
    "sgd-momentum": (lambda **kw: optim.SGD(lr=0.01, momentum=0.5, **kw),
                     lambda ps, **kw: torch.optim.SGD(ps, lr=0.01, momentum=0.5, **kw)),
    "sgd-nesterov": (lambda **kw: optim.SGD(lr=0.01, momentum=0.5, nesterov=True, **kw),
                     lambda ps, **kw: torch.optim.SGD(ps, lr=0.01, momentum=0.5, nesterov=True,
                                                      **kw)),
    "sgd-weight-decay-dampening": (
        lambda **kw: optim.SGD(lr=0.01, momentum=0.5, dampening=0.1, weight_decay=0.05, **kw),
        lambda ps, **kw: torch.optim.SGD(ps, lr=0.01, momentum=0.5, dampening=0.1,
                                         weight_decay=0.05, **kw)),
    "adamw": (lambda **kw: optim.AdamW(lr=1e-3, weight_decay=0.01, **kw),
              lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **kw)),
    "adam-weight-decay": (lambda **kw: optim.Adam(lr=1e-3, weight_decay=0.01, **kw),
                          lambda ps, **kw: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01,
                                                            **kw)),
}


def trajectory_optimizers(name: str):
    """OPTIMIZERS[name] as the trajectory runs use it: Adam's eps at ADAM_EPS (module
    docstring). The lockstep test keeps torch's default eps: it compares one step at a time
    and leaves Adam's ill-conditioned elements out (assert_adam_update)."""
    sg_make, torch_make = OPTIMIZERS[name]
    kw = dict(eps=ADAM_EPS) if name.startswith("adam") else {}
    return (lambda: sg_make(**kw)), (lambda ps: torch_make(ps, **kw))


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_trajectory_matches_torch(workload, opt, request):
    sg_opt, torch_opt = trajectory_optimizers(opt)
    assert_same_trajectory(train_both(WORKLOADS[workload], sg_opt(), torch_opt,
                                      test_name=request.node.name))


@pytest.mark.parametrize("workload,p", [("mlp", 0.1), ("cnn", 0.5)])
def test_dropout_trajectory_matches_torch_with_philox_masks(workload, p, request):
    """The workloads as benchmarked (with dropout): the twin applies stepgraph.rng's masks,
    so this checks the mask bits per site and step, the scaling and the dropout gradient."""
    sg_opt, torch_opt = trajectory_optimizers("sgd-momentum" if workload == "cnn" else "adamw")
    assert_same_trajectory(train_both(WORKLOADS[workload], sg_opt(), torch_opt, dropout=p,
                                      seed=1234, test_name=request.node.name))


# ---- learning-rate schedules, clipping, LR changes: the mlp workload, 20 steps -------------

MLP = WORKLOADS["mlp"]


@pytest.mark.parametrize("kind", ["step", "cosine"])
def test_schedules_match_torch_schedulers_stepped_per_iteration(kind, request):
    if kind == "step":
        schedule = optim.StepDecay(step_size=6, gamma=0.3)
        torch_sched = lambda o: torch.optim.lr_scheduler.StepLR(o, 6, gamma=0.3)  # noqa: E731
    else:
        schedule = optim.Cosine(total_steps=STEPS, min_lr=0.002)
        torch_sched = lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(  # noqa: E731
            o, T_max=STEPS, eta_min=0.002)
    r = train_both(MLP, optim.SGD(lr=0.05, momentum=0.5, schedule=schedule),
                   lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5),
                   scheduler=torch_sched, test_name=request.node.name)
    assert_same_trajectory(r)


def warmup_cosine_lr(base, warmup, total, min_lr, t):
    """The WarmupCosine formula of optim/schedules.py, written out independently."""
    if t <= warmup:
        return base * t / warmup
    progress = min(t - 1 - warmup, total - warmup) / (total - warmup)
    return min_lr + (base - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def test_warmup_cosine_matches_its_formula(request):
    base, warmup, total, min_lr = 3e-3, 5, 15, 1e-4

    def set_torch_lr(i, sg_opt, topt):
        for group in topt.param_groups:
            group["lr"] = warmup_cosine_lr(base, warmup, total, min_lr, i + 1)

    r = train_both(MLP, optim.AdamW(lr=base, eps=ADAM_EPS,
                                    schedule=optim.WarmupCosine(warmup, total, min_lr)),
                   lambda ps: torch.optim.AdamW(ps, lr=base, eps=ADAM_EPS),
                   before_step=set_torch_lr,
                   test_name=request.node.name)
    assert_same_trajectory(r)


@pytest.mark.parametrize("opt", ["sgd-momentum", "adamw"])
def test_gradient_clipping_matches_clip_grad_norm(opt, request):
    max_norm = 0.5
    sg_make, torch_opt = trajectory_optimizers(opt)
    sg_opt = sg_make()
    sg_opt.max_grad_norm = max_norm
    r = train_both(MLP, sg_opt, torch_opt, max_norm=max_norm, test_name=request.node.name)
    assert_same_trajectory(r)
    clipped = sum(n > max_norm for n in r.grad_norms)
    assert 0 < clipped, f"no step clipped (norms {r.grad_norms}): the test would not fail"


def test_changing_lr_mid_training_takes_effect_at_the_next_step(request):
    def change(i, sg_opt, topt):
        if i in (8, 14):
            lr = 0.05 if i == 8 else 0.002
            sg_opt.lr = lr
            for group in topt.param_groups:
                group["lr"] = lr

    r = train_both(MLP, optim.SGD(lr=0.01, momentum=0.5),
                   lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.5), before_step=change,
                   test_name=request.node.name)
    assert_same_trajectory(r)
    assert r.step.optimizer.lr == 0.002


def test_ragged_last_batch_trains_like_a_separate_step(request):
    sg_opt, torch_opt = trajectory_optimizers("adamw")
    r = train_both(MLP, sg_opt(), torch_opt,
                   sizes=[BATCH] * 6 + [20, BATCH, 20], test_name=request.node.name)
    assert_same_trajectory(r)
    exes = list(r.step.executables.values())
    assert sorted(e.plan.graph.inputs[0].shape[0] for e in exes) == [20, BATCH]
    weight = [[b for v, b in e.buffers.items() if v.name == "0.weight"][0] for e in exes]
    assert weight[0] is weight[1], "executables of one step must share parameter buffers"


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_lockstep_steps_match_torch(workload, opt, request):
    """Every step starts stepgraph from torch's exact parameters and optimizer state (through
    TrainStep.load_state_dict) and compares that one step: loss, parameter update and new
    optimizer state, so the optimizer recurrence is checked over 20 steps without drift."""
    w, (make_opt, torch_opt) = WORKLOADS[workload], OPTIMIZERS[opt]
    torch.manual_seed(len(request.node.name))
    tmodel, model = w.torch_model(0.0, 0, [0]), w.sg_model(0.0)
    topt = torch_opt(tmodel.parameters())
    batches = Batches(request.node.name, w.x_shape)
    step = sg.compile_train_step(model, w.loss, make_opt(), example_inputs=batches.draw())
    named = dict(tmodel.named_parameters())
    for k in range(STEPS):
        x, y = batches.draw(away_from=tmodel)
        before = {n: p.detach().numpy().copy() for n, p in named.items()}
        slots_before = torch_optimizer_state(topt, named)
        step.load_state_dict({**step.state_dict(), **before, **slots_before,
                              "optimizer.step": np.array(k, np.int64)})
        loss = float(step(x, y))
        topt.zero_grad()
        want = w.torch_loss(tmodel(torch.tensor(x)), torch.tensor(y))
        want.backward()
        topt.step()
        assert abs(loss - want.item()) <= LOSS_RTOL * abs(want.item()), f"step {k}"
        got = step.state_dict()
        assert int(got["optimizer.step"]) == k + 1
        for n, p in named.items():
            compare_step(f"step {k}, {n}", got, n, p, topt, before[n], slots_before)


def compare_step(what, got, name, p, topt, p_before, slots_before) -> None:
    """One parameter's update and new optimizer state, stepgraph (`got`) vs torch. Sums that
    nearly cancel (momentum against gradient, g + wd p) are judged against the size of their
    terms, not of their result: float32 rounds relative to the terms."""
    group = topt.param_groups[0]
    lr, g = group["lr"], p.grad.numpy()
    decay = group["weight_decay"] * p_before
    state = {slot: v for slot, v in topt.state[p].items() if slot != "step" and v is not None}
    for slot, value in state.items():
        key = f"optimizer.{slot}.{name}"
        old = slots_before.get(key, np.zeros_like(value.numpy()))
        terms = [old] if slot == "exp_avg_sq" else [old, g, decay]
        assert_close_to_terms(f"{what}: {slot}", got[key], value.numpy(), terms)
    update, want = got[name] - p_before, p.detach().numpy() - p_before
    if "exp_avg_sq" in state:
        assert_adam_update(f"{what}: update", update, want, adam_denominator(topt, p))
    else:
        terms = [lr * t for t in [g, decay, *[v.numpy() for v in state.values()]]]
        assert_close_to_terms(f"{what}: update", update, want, terms)


def assert_close_to_terms(what, got, want, terms) -> None:
    scale = np.linalg.norm(want) + sum(np.linalg.norm(t) for t in terms)
    err = np.linalg.norm(got - want)
    assert err <= LOCKSTEP_RTOL * scale, f"{what} differs by {err / scale:.1e} of its terms"


def adam_denominator(topt, p) -> np.ndarray:
    """sqrt(v_hat) of torch's Adam after its step."""
    state = topt.state[p]
    beta2 = topt.param_groups[0]["betas"][1]
    return np.sqrt(state["exp_avg_sq"].numpy() / (1 - beta2 ** float(state["step"])))


def assert_adam_update(what, got, want, denominator) -> None:
    """Adam divides by sqrt(v_hat) + eps: where sqrt(v_hat) < 1e-6 (an effective gradient
    that nearly cancels, or a unit active for one sample), rounding of 1e-10 in it moves the
    update by up to lr, so those elements are left out; exact zeros (dead units) are kept."""
    keep = (denominator > 1e-6) | (denominator == 0)
    assert keep.mean() > 0.9, f"{what}: only {keep.mean():.1%} of elements comparable"
    np.testing.assert_allclose(got[keep], want[keep], rtol=LOCKSTEP_RTOL,
                               atol=LOCKSTEP_RTOL * np.abs(want).max(), err_msg=what)


def torch_optimizer_state(topt, named) -> dict[str, np.ndarray]:
    """torch's per-parameter optimizer state under stepgraph's state_dict keys."""
    out = {}
    for n, p in named.items():
        for slot, value in topt.state.get(p, {}).items():
            if slot != "step" and value is not None:
                out[f"optimizer.{slot}.{n}"] = value.detach().numpy().copy()
    return out
