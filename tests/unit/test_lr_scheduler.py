"""stepgraph.optim.lr_scheduler against torch.optim.lr_scheduler, side by side.

torch's scheduler runs on a torch optimizer (SGD with momentum, AdamW) with three parameter
groups of different lr; stepgraph's on a stub optimizer whose param_groups are copies of
torch's group dicts (momentum / betas included) and whose defaults are torch's. Both are
Python float64 arithmetic, so every group's lr (and momentum / beta1 where a scheduler cycles
it) must agree to 1e-12 relative after every step.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import stepgraph
from stepgraph.optim import lr_scheduler as ours

TL = torch.optim.lr_scheduler
STEPS = 30
REL = 1e-12


class StubOptimizer:
    """What a scheduler may use of an optimizer: param_groups, defaults and step()."""

    def __init__(self, groups: list[dict], defaults: dict):
        self.param_groups = groups
        self.defaults = defaults
        self.steps = 0

    def step(self):
        self.steps += 1


def torch_optimizer(kind: str):
    params = [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)) for _ in range(3)]
    if kind == "sgd":
        groups = [{"params": [params[0]]}, {"params": [params[1]], "lr": 0.05},
                  {"params": [params[2]], "lr": 0.2, "momentum": 0.5}]
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    groups = [{"params": [params[0]]}, {"params": [params[1]], "lr": 3e-3},
              {"params": [params[2]], "lr": 5e-4, "betas": (0.8, 0.99)}]
    return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01)


def stub_like(topt) -> StubOptimizer:
    groups = [{key: copy.copy(value) for key, value in group.items() if key != "params"}
              for group in topt.param_groups]
    for group in groups:
        group["params"] = []
    return StubOptimizer(groups, dict(topt.defaults))


def momentum_of(group: dict) -> float:
    return group["betas"][0] if "betas" in group else group["momentum"]


def assert_same(tsched, topt, sched, opt, where: str) -> None:
    theirs = [group["lr"] for group in topt.param_groups]
    mine = [group["lr"] for group in opt.param_groups]
    assert mine == pytest.approx(theirs, rel=REL, abs=0), f"lr {where}"
    assert sched.get_last_lr() == pytest.approx(tsched.get_last_lr(), rel=REL, abs=0), \
        f"get_last_lr {where}"
    for tgroup, group in zip(topt.param_groups, opt.param_groups):
        assert momentum_of(group) == pytest.approx(momentum_of(tgroup), rel=REL, abs=0), \
            f"momentum {where}"
        if "betas" in tgroup:
            assert group["betas"][1] == tgroup["betas"][1]


# Each case builds a scheduler from a module (torch's or stepgraph's) and an optimizer.
CASES = {
    "StepLR": lambda L, o: L.StepLR(o, step_size=4, gamma=0.5),
    "MultiStepLR": lambda L, o: L.MultiStepLR(o, milestones=[3, 7, 7, 15], gamma=0.3),
    "ExponentialLR": lambda L, o: L.ExponentialLR(o, gamma=0.9),
    "CosineAnnealingLR": lambda L, o: L.CosineAnnealingLR(o, T_max=10, eta_min=1e-4),
    "CosineAnnealingLR-eta0": lambda L, o: L.CosineAnnealingLR(o, T_max=7),
    "LambdaLR": lambda L, o: L.LambdaLR(o, lambda e: 0.95 ** e),
    "LambdaLR-list": lambda L, o: L.LambdaLR(
        o, [lambda e: 1.0 / (e + 1), lambda e: 0.9 ** e, lambda e: min(1.0, (e + 1) / 5)]),
    "MultiplicativeLR": lambda L, o: L.MultiplicativeLR(o, lambda e: 0.97 if e % 2 else 0.9),
    "LinearLR": lambda L, o: L.LinearLR(o, start_factor=0.25, end_factor=0.9, total_iters=8),
    "LinearLR-down": lambda L, o: L.LinearLR(o, start_factor=1.0, end_factor=0.1,
                                             total_iters=12),
    "ConstantLR": lambda L, o: L.ConstantLR(o, factor=0.5, total_iters=6),
    "PolynomialLR": lambda L, o: L.PolynomialLR(o, total_iters=20, power=2.0),
    "OneCycleLR-cos": lambda L, o: L.OneCycleLR(o, max_lr=[0.4, 0.2, 0.8], total_steps=STEPS),
    "OneCycleLR-linear": lambda L, o: L.OneCycleLR(
        o, max_lr=0.3, epochs=5, steps_per_epoch=6, anneal_strategy="linear",
        pct_start=0.25, div_factor=10.0, final_div_factor=100.0),
    "OneCycleLR-three-phase": lambda L, o: L.OneCycleLR(
        o, max_lr=0.5, total_steps=STEPS + 2, three_phase=True, base_momentum=[0.8, 0.7, 0.6],
        max_momentum=0.97),
    "OneCycleLR-no-momentum": lambda L, o: L.OneCycleLR(o, max_lr=0.5, total_steps=STEPS,
                                                        cycle_momentum=False),
    "CyclicLR-triangular2": lambda L, o: L.CyclicLR(o, base_lr=[1e-3, 2e-3, 5e-4], max_lr=0.1,
                                                    step_size_up=4, step_size_down=3,
                                                    mode="triangular2"),
    "CyclicLR-exp-range": lambda L, o: L.CyclicLR(o, base_lr=1e-3, max_lr=0.1, step_size_up=5,
                                                  mode="exp_range", gamma=0.97),
    "SequentialLR": lambda L, o: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.1, total_iters=5), L.CosineAnnealingLR(o, T_max=20)],
        milestones=[5]),
    "SequentialLR-three": lambda L, o: L.SequentialLR(
        o, [L.ConstantLR(o, factor=0.2, total_iters=10), L.ExponentialLR(o, gamma=0.9),
            L.StepLR(o, step_size=3, gamma=0.5)], milestones=[4, 12]),
    "ChainedScheduler": lambda L, o: L.ChainedScheduler(
        [L.ConstantLR(o, factor=0.1, total_iters=4), L.ExponentialLR(o, gamma=0.9)]),
    "ChainedScheduler-nested": lambda L, o: L.ChainedScheduler(
        [L.LinearLR(o, start_factor=0.5, total_iters=6), L.MultiStepLR(o, [8, 16])],
        optimizer=o),
    "CosineAnnealingWarmRestarts": lambda L, o: L.CosineAnnealingWarmRestarts(
        o, T_0=4, T_mult=2, eta_min=1e-4),
    "CosineAnnealingWarmRestarts-mult1": lambda L, o: L.CosineAnnealingWarmRestarts(o, T_0=7),
}
KINDS = ["sgd", "adamw"]


def pair(name: str, kind: str):
    topt = torch_optimizer(kind)
    opt = stub_like(topt)
    return CASES[name](TL, topt), topt, CASES[name](ours, opt), opt


def advance(tsched, topt, sched, opt, steps: int, first: int = 0) -> None:
    for i in range(first, first + steps):
        topt.step()
        opt.step()
        tsched.step()
        sched.step()
        assert_same(tsched, topt, sched, opt, f"after step {i + 1}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_torch_every_step(name, kind):
    tsched, topt, sched, opt = pair(name, kind)
    assert_same(tsched, topt, sched, opt, "after construction")
    advance(tsched, topt, sched, opt, STEPS)


@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_layout_is_torchs(name):
    tsched, topt, sched, opt = pair(name, "sgd")
    advance(tsched, topt, sched, opt, 3)
    assert list(sched.state_dict()) == list(tsched.state_dict())
    assert "optimizer" not in sched.state_dict()


def restore(name: str, kind: str, saved_groups: list[dict], state: dict):
    """A fresh scheduler as a resumed script makes it: on a fresh optimizer, then the
    optimizer's saved groups loaded into it (the same dicts), then the scheduler's state."""
    opt = stub_like(torch_optimizer(kind))
    sched = CASES[name](ours, opt)
    for group, saved in zip(opt.param_groups, saved_groups):
        group.update(copy.deepcopy(saved))
    opt.step()                                   # the optimizer has stepped before the save
    sched.load_state_dict(copy.deepcopy(state))
    return sched, opt


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_round_trip(name, kind):
    tsched, topt, sched, opt = pair(name, kind)
    advance(tsched, topt, sched, opt, 12)
    resumed, ropt = restore(name, kind, opt.param_groups, sched.state_dict())
    assert_same(tsched, topt, resumed, ropt, "after loading")
    advance(tsched, topt, resumed, ropt, STEPS - 12, first=12)


@pytest.mark.parametrize("name", list(CASES))
def test_loads_torchs_state_dict(name):
    tsched, topt, sched, opt = pair(name, "adamw")
    advance(tsched, topt, sched, opt, 9)
    saved_groups = [{key: value for key, value in group.items() if key != "params"}
                    for group in topt.param_groups]
    resumed, ropt = restore(name, "adamw", saved_groups, tsched.state_dict())
    assert_same(tsched, topt, resumed, ropt, "after loading torch's state")
    advance(tsched, topt, resumed, ropt, 10, first=9)


RESUMED = {
    "StepLR": lambda L, o, k: L.StepLR(o, step_size=4, gamma=0.5, last_epoch=k),
    "MultiStepLR": lambda L, o, k: L.MultiStepLR(o, [3, 7, 7, 15], gamma=0.3, last_epoch=k),
    "ExponentialLR": lambda L, o, k: L.ExponentialLR(o, gamma=0.9, last_epoch=k),
    "CosineAnnealingLR": lambda L, o, k: L.CosineAnnealingLR(o, T_max=10, eta_min=1e-4,
                                                             last_epoch=k),
    "LinearLR": lambda L, o, k: L.LinearLR(o, start_factor=0.25, total_iters=8, last_epoch=k),
    "ConstantLR": lambda L, o, k: L.ConstantLR(o, factor=0.5, total_iters=6, last_epoch=k),
    "PolynomialLR": lambda L, o, k: L.PolynomialLR(o, total_iters=20, power=2.0, last_epoch=k),
    "LambdaLR": lambda L, o, k: L.LambdaLR(o, lambda e: 0.95 ** e, last_epoch=k),
    "WarmRestarts": lambda L, o, k: L.CosineAnnealingWarmRestarts(o, T_0=4, T_mult=2,
                                                                   last_epoch=k),
    "OneCycleLR": lambda L, o, k: L.OneCycleLR(o, max_lr=0.4, total_steps=STEPS, last_epoch=k),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(RESUMED))
def test_last_epoch_resumes_as_torch(name, kind):
    """last_epoch=k on groups that hold initial_lr (and OneCycleLR's keys) from a saved run,
    with an lr that is not the schedule's: torch's first values of a resumed scheduler."""
    topt = torch_optimizer(kind)
    RESUMED[name](TL, topt, -1)                  # writes initial_lr (OneCycleLR: its keys)
    for group in topt.param_groups:
        group["lr"] *= 0.5
    opt = stub_like(topt)
    tsched, sched = RESUMED[name](TL, topt, 5), RESUMED[name](ours, opt, 5)
    assert_same(tsched, topt, sched, opt, "after construction")
    advance(tsched, topt, sched, opt, 12)


@pytest.mark.parametrize("name", ["StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR",
                                  "LinearLR", "ConstantLR", "PolynomialLR", "LambdaLR",
                                  "CosineAnnealingWarmRestarts"])
def test_step_with_epoch_as_torch(name):
    """The deprecated step(epoch): torch's closed forms, and its deprecation warning."""
    tsched, topt, sched, opt = pair(name, "sgd")
    for epoch in [1, 2, 5, 4, 9, 13, 13, 20, 3, 25]:
        topt.step()
        opt.step()
        with warnings.catch_warnings(record=True) as theirs:
            warnings.simplefilter("always")
            tsched.step(epoch)
        with warnings.catch_warnings(record=True) as mine:
            warnings.simplefilter("always")
            sched.step(epoch)
        assert_same(tsched, topt, sched, opt, f"at epoch {epoch}")
        assert [str(w.message)[:40] for w in mine] == [str(w.message)[:40] for w in theirs]


PLATEAU = {
    "min-rel": dict(patience=2),
    "min-abs-cooldown": dict(threshold=0.05, threshold_mode="abs", cooldown=2, patience=1,
                             factor=0.5),
    "max-rel-min-lr": dict(mode="max", patience=0, factor=0.3, min_lr=[1e-3, 0.0, 0.02]),
    "max-abs-eps": dict(mode="max", threshold_mode="abs", patience=1, factor=0.5, eps=0.01),
}
METRICS = [1.0, 0.9, 0.95, 0.95, 0.96, 0.89, 0.9, 0.9, 0.9, 0.7, 0.71, 0.72, 0.73, 0.74, 0.5,
           0.5, 0.5, 0.5, 0.8, 0.8, 0.3, 0.31, 0.32, 0.33, 0.34, 0.35, 0.1, 0.1, 0.2, 0.2]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(PLATEAU))
def test_reduce_on_plateau(case, kind):
    topt = torch_optimizer(kind)
    opt = stub_like(topt)
    tsched = TL.ReduceLROnPlateau(topt, **PLATEAU[case])
    sched = ours.ReduceLROnPlateau(opt, **PLATEAU[case])
    assert_same(tsched, topt, sched, opt, "after construction")
    for i, metric in enumerate(METRICS):
        value = -metric if PLATEAU[case].get("mode") == "max" else metric
        topt.step()
        tsched.step(torch.tensor(value, dtype=torch.float64))
        sched.step(stepgraph.tensor(value, dtype=stepgraph.float64) if i % 2 else value)
        assert_same(tsched, topt, sched, opt, f"after metric {i}")
        assert (sched.best, sched.num_bad_epochs, sched.cooldown_counter) == (
            tsched.best, tsched.num_bad_epochs, tsched.cooldown_counter)
        if i == 14:                       # round trip half-way, into a fresh scheduler
            state = copy.deepcopy(sched.state_dict())
            assert list(state) == list(tsched.state_dict())
            sched = ours.ReduceLROnPlateau(opt)
            sched.load_state_dict(state)


class Warmup:
    """A callable object as lr_lambda: its attributes are scheduler state."""

    def __init__(self, steps: int):
        self.steps = steps

    def __call__(self, epoch: int) -> float:
        return min(1.0, (epoch + 1) / self.steps)


@pytest.mark.parametrize("scheduler", ["LambdaLR", "MultiplicativeLR"])
def test_callable_lambda_state_round_trip(scheduler):
    topt = torch_optimizer("sgd")
    opt = stub_like(topt)
    tsched = getattr(TL, scheduler)(topt, [Warmup(4), lambda e: 0.9, Warmup(6)])
    sched = getattr(ours, scheduler)(opt, [Warmup(4), lambda e: 0.9, Warmup(6)])
    for s in (tsched, sched):
        s.lr_lambdas[0].steps = 10                   # changed during the run: saved
    advance(tsched, topt, sched, opt, 5)
    state = copy.deepcopy(sched.state_dict())
    assert state["lr_lambdas"] == tsched.state_dict()["lr_lambdas"] == [{"steps": 10}, None,
                                                                         {"steps": 6}]
    resumed = getattr(ours, scheduler)(opt, [Warmup(4), lambda e: 0.9, Warmup(6)])
    resumed.load_state_dict(state)
    assert resumed.lr_lambdas[0].steps == 10 and "lr_lambdas" in state
    advance(tsched, topt, resumed, opt, 10, first=5)


def test_one_cycle_raises_past_total_steps():
    tsched, topt, sched, opt = pair("OneCycleLR-cos", "sgd")
    advance(tsched, topt, sched, opt, STEPS)
    with pytest.raises(ValueError, match="Tried to step 31 times"):
        tsched.step()
    with pytest.raises(ValueError, match="Tried to step 31 times"):
        sched.step()


class NoMomentum:
    """An optimizer without momentum or betas (torch's Adagrad)."""


def both_raise(build, error):
    """torch's builder on a torch SGD optimizer and ours on its stub raise the same type."""
    topt = torch_optimizer("sgd")
    opt = stub_like(topt)
    with pytest.raises(error) as theirs:
        build(TL, topt)
    with pytest.raises(error) as mine:
        build(ours, opt)
    return str(theirs.value), str(mine.value)


ERRORS = {
    "OneCycleLR-no-total": (lambda L, o: L.OneCycleLR(o, max_lr=0.1), ValueError),
    "OneCycleLR-epochs-only": (lambda L, o: L.OneCycleLR(o, 0.1, epochs=3), ValueError),
    "OneCycleLR-total-0": (lambda L, o: L.OneCycleLR(o, 0.1, total_steps=0), ValueError),
    "OneCycleLR-steps-per-epoch-0": (lambda L, o: L.OneCycleLR(o, 0.1, epochs=2,
                                                               steps_per_epoch=0), ValueError),
    "OneCycleLR-pct-int": (lambda L, o: L.OneCycleLR(o, 0.1, total_steps=9, pct_start=0),
                           ValueError),
    "OneCycleLR-pct-big": (lambda L, o: L.OneCycleLR(o, 0.1, total_steps=9, pct_start=1.5),
                           ValueError),
    "OneCycleLR-anneal": (lambda L, o: L.OneCycleLR(o, 0.1, total_steps=9,
                                                    anneal_strategy="exp"), ValueError),
    "OneCycleLR-max-lr-list": (lambda L, o: L.OneCycleLR(o, [0.1, 0.2], total_steps=9),
                               ValueError),
    "OneCycleLR-resume-without-keys": (lambda L, o: L.OneCycleLR(o, 0.1, total_steps=9,
                                                                 last_epoch=3), KeyError),
    "StepLR-resume-without-initial-lr": (lambda L, o: L.StepLR(o, 3, last_epoch=4), KeyError),
    "ConstantLR-factor": (lambda L, o: L.ConstantLR(o, factor=1.5), ValueError),
    "LinearLR-start": (lambda L, o: L.LinearLR(o, start_factor=0.0), ValueError),
    "LinearLR-end": (lambda L, o: L.LinearLR(o, end_factor=1.5), ValueError),
    "LambdaLR-list": (lambda L, o: L.LambdaLR(o, [lambda e: 1.0]), ValueError),
    "MultiplicativeLR-not-callable": (lambda L, o: L.MultiplicativeLR(o, 0.9), TypeError),
    "WarmRestarts-T0": (lambda L, o: L.CosineAnnealingWarmRestarts(o, T_0=0), ValueError),
    "WarmRestarts-Tmult": (lambda L, o: L.CosineAnnealingWarmRestarts(o, 3, T_mult=1.5),
                           ValueError),
    "WarmRestarts-eta": (lambda L, o: L.CosineAnnealingWarmRestarts(o, 3, eta_min="0"),
                         ValueError),
    "WarmRestarts-negative-epoch": (lambda L, o: L.CosineAnnealingWarmRestarts(o, 3).step(-1),
                                    ValueError),
    "Plateau-factor": (lambda L, o: L.ReduceLROnPlateau(o, factor=1.0), ValueError),
    "Plateau-mode": (lambda L, o: L.ReduceLROnPlateau(o, mode="up"), ValueError),
    "Plateau-threshold-mode": (lambda L, o: L.ReduceLROnPlateau(o, threshold_mode="x"),
                               ValueError),
    "Plateau-min-lr": (lambda L, o: L.ReduceLROnPlateau(o, min_lr=[0.0]), ValueError),
    "SequentialLR-empty": (lambda L, o: L.SequentialLR(o, [], []), ValueError),
    "SequentialLR-milestones": (lambda L, o: L.SequentialLR(o, [L.StepLR(o, 2)], [3]),
                                ValueError),
    "SequentialLR-plateau": (lambda L, o: L.SequentialLR(
        o, [L.StepLR(o, 2), L.ReduceLROnPlateau(o)], [3]), ValueError),
    "SequentialLR-not-scheduler": (lambda L, o: L.SequentialLR(o, [object()], []), TypeError),
    "ChainedScheduler-empty": (lambda L, o: L.ChainedScheduler([]), ValueError),
    "ChainedScheduler-plateau": (lambda L, o: L.ChainedScheduler([L.ReduceLROnPlateau(o)]),
                                 ValueError),
    "CyclicLR-mode": (lambda L, o: L.CyclicLR(o, 0.01, 0.1, mode="square"), ValueError),
    "not-an-optimizer": (lambda L, o: L.StepLR(NoMomentum(), 3), TypeError),
    "base-get-lr": (lambda L, o: L.LRScheduler(o), NotImplementedError),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_argument_errors_as_torch(case):
    build, error = ERRORS[case]
    theirs, mine = both_raise(build, error)
    if error is ValueError and "Tried" not in theirs:
        assert mine.split(",")[0] == theirs.split(",")[0]


def test_cycle_momentum_needs_momentum():
    topt = torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="momentum or beta1"):
        TL.OneCycleLR(topt, 0.1, total_steps=5)
    opt = stub_like(topt)
    with pytest.raises(ValueError, match="momentum or beta1"):
        ours.OneCycleLR(opt, 0.1, total_steps=5)
    with pytest.raises(ValueError, match="momentum or beta1"):
        ours.CyclicLR(opt, 0.01, 0.1)
    ours.OneCycleLR(opt, 0.1, total_steps=5, cycle_momentum=False)


def warnings_of(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message).split(".")[0] for w in caught]


@pytest.mark.parametrize("optimizer_first", [True, False])
def test_order_warning_as_torch(optimizer_first):
    tsched, topt, sched, opt = pair("StepLR", "sgd")

    def steps(sch, o):
        return lambda: ((o.step(), sch.step()) if optimizer_first else (sch.step(), o.step()))

    theirs, mine = warnings_of(steps(tsched, topt)), warnings_of(steps(sched, opt))
    assert mine == theirs
    assert bool(mine) == (not optimizer_first)
    assert opt.steps == 1                            # the wrapped step still steps
    assert warnings_of(steps(sched, opt)) == []      # only the first step warns
    assert_same(tsched, topt, sched, opt, "after two steps")


def test_get_lr_outside_step_warns():
    tsched, _, sched, _ = pair("ExponentialLR", "sgd")
    assert warnings_of(sched.get_lr) == warnings_of(tsched.get_lr) != []


def test_stepgraph_namespace():
    assert stepgraph.optim.lr_scheduler.StepLR is ours.StepLR
    assert issubclass(ours._LRScheduler, ours.LRScheduler)
    assert ours._LRScheduler.__name__ == "_LRScheduler"
    assert set(ours.__all__) == set(TL.__all__)
    assert all(isinstance(getattr(ours, n), type) for n in ours.__all__)
    with pytest.raises(AttributeError, match="torch.optim.lr_scheduler.Nope"):
        stepgraph.optim.lr_scheduler.Nope
