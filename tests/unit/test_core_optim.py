"""Optimizers (stepgraph/optim): the update ops they emit against torch.optim over several
steps with random gradients, the LR schedule formulas, and argument checks. Whole training
trajectories are in tests/models/test_trajectories.py; torch-style construction, param_groups
and state_dict in test_optim_torch.py."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stepgraph import losses, models, optim
from stepgraph.compile.build import build_train_graph
from stepgraph.compile.feed import signature_of
from stepgraph.ir.graph import PARAM, Value
from stepgraph.ir.trace import Tracer
from stepgraph.optim.schedules import schedule_lr
from tests.ops.helpers import assert_close, run_graph, seeded

SHAPES = [(5, 4), (5,), (3, 2, 2, 2)]
STEPS = 6

# name -> (stepgraph optimizer, torch optimizer factory, torch slot names)
OPTIMIZERS = {
    "sgd": (lambda: optim.SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1), ()),
    "sgd-momentum": (lambda: optim.SGD(lr=0.1, momentum=0.9),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), ("momentum_buffer",)),
    "sgd-dampening-wd": (
        lambda: optim.SGD(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.1),
        ("momentum_buffer",)),
    "sgd-nesterov-wd": (
        lambda: optim.SGD(lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.1),
        ("momentum_buffer",)),
    "adam": (lambda: optim.Adam(lr=0.01), lambda ps: torch.optim.Adam(ps, lr=0.01),
             ("exp_avg", "exp_avg_sq")),
    "adam-wd-betas-eps": (
        lambda: optim.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-3, weight_decay=0.1),
        lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-3, weight_decay=0.1),
        ("exp_avg", "exp_avg_sq")),
    "adamw": (lambda: optim.AdamW(lr=0.01, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
              ("exp_avg", "exp_avg_sq")),
    "adamw-amsgrad-maximize": (
        lambda: optim.AdamW(lr=0.01, weight_decay=0.1, amsgrad=True, maximize=True),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, amsgrad=True,
                                     maximize=True),
        ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    "sgd-maximize": (lambda: optim.SGD(lr=0.1, momentum=0.9, maximize=True),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, maximize=True),
                     ("momentum_buffer",)),
    "rmsprop": (lambda: optim.RMSprop(lr=0.01, weight_decay=0.1),
                lambda ps: torch.optim.RMSprop(ps, lr=0.01, weight_decay=0.1), ("square_avg",)),
    "rmsprop-centered-momentum-maximize": (
        lambda: optim.RMSprop(lr=0.01, alpha=0.9, eps=1e-6, momentum=0.8, centered=True,
                              maximize=True),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, alpha=0.9, eps=1e-6, momentum=0.8,
                                       centered=True, maximize=True),
        ("square_avg", "grad_avg", "momentum_buffer")),
    "adagrad": (lambda: optim.Adagrad(lr=0.1, lr_decay=0.1, weight_decay=0.05,
                                      initial_accumulator_value=0.2, eps=1e-6),
                lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.1, weight_decay=0.05,
                                               initial_accumulator_value=0.2, eps=1e-6),
                ("sum",)),
}


def update_graph(opt, shapes):
    """The update the optimizer appends to a step: params are graph params, the gradients are
    fed as inputs."""
    t = Tracer()
    params = []
    for i, shape in enumerate(shapes):
        v = Value(shape, "float32", PARAM, f"p{i}")
        t.graph.params.append(v)
        params.append(v)
    grads = [t.input(s, "float32", f"g{i}").value for i, s in enumerate(shapes)]
    opt.emit(t, params, grads)
    return t.graph


@pytest.mark.parametrize("clip", [None, 1.5], ids=["noclip", "clip"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_update_matches_torch_over_several_steps(name, clip):
    make, make_torch, slots = OPTIMIZERS[name]
    opt = make()
    opt.max_grad_norm = clip
    graph = update_graph(opt, SHAPES)
    gen = seeded(f"{name}{clip}")
    init = [gen.standard_normal(s).astype(np.float32) for s in SHAPES]
    bound = {f"p{i}": p.copy() for i, p in enumerate(init)}
    bound.update({v.name: np.array(opt.initial_state(v), v.dtype) for v in graph.state})
    tparams = [torch.nn.Parameter(torch.tensor(p)) for p in init]
    topt = make_torch(tparams)
    clipped = 0
    for _ in range(STEPS):
        grads = [gen.standard_normal(s).astype(np.float32) for s in SHAPES]
        run_graph(graph, {f"g{i}": g for i, g in enumerate(grads)}, bound)
        for tp, g in zip(tparams, grads):
            tp.grad = torch.tensor(g)
        if clip:
            clipped += float(torch.nn.utils.clip_grad_norm_(tparams, clip)) > clip
        topt.step()
    assert int(bound["optimizer.step"]) == STEPS
    assert clipped == (STEPS if clip else 0)   # random grads of norm ~4 always clip at 1.5
    for i, tp in enumerate(tparams):
        assert_close(bound[f"p{i}"], tp.detach().numpy(), 2e-6, f"p{i}")
        for slot in slots:
            assert_close(bound[f"optimizer.{slot}.p{i}"], topt.state[tp][slot].numpy(), 2e-6,
                         f"{slot} of p{i}")


def test_one_multi_tensor_update_for_every_parameter():
    x, y = np.ones((4, 784), np.float32), np.zeros(4, np.int64)
    model = models.mlp()
    graph = build_train_graph(model, losses.cross_entropy, optim.AdamW(),
                              signature_of(("x", "y"), (x, y)), seed=0)
    updates = [n for n in graph.nodes if n.op.endswith("_update")]
    assert len(updates) == 1
    (update,) = updates
    assert update.attrs["n_params"] == len(list(model.parameters())) == 6
    written = {update.inputs[i].name for i in update.mutates}
    assert written == {p.name for p in graph.params} | \
        {f"optimizer.{s}.{p.name}" for s in ("exp_avg", "exp_avg_sq") for p in graph.params}


# ---- schedules -----------------------------------------------------------------------------

def torch_lrs(make_scheduler, steps: int, base: float) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=base)
    sched = make_scheduler(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("kind", ["step", "cosine"])
def test_schedule_formulas_match_torch_schedulers(kind):
    base = 0.1
    if kind == "step":
        vec = optim.StepDecay(step_size=4, gamma=0.5).vector(base)
        want = torch_lrs(lambda o: torch.optim.lr_scheduler.StepLR(o, 4, 0.5), 20, base)
    else:
        vec = optim.Cosine(total_steps=20, min_lr=0.01).vector(base)
        want = torch_lrs(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 20, 0.01),
                         21, base)
    got = [schedule_lr(vec, t) for t in range(1, len(want) + 1)]
    np.testing.assert_allclose(got, want, rtol=1e-6)   # the vector is float32


def test_cosine_holds_min_lr_after_total_steps():
    vec = optim.Cosine(total_steps=10, min_lr=0.01).vector(0.1)
    assert [schedule_lr(vec, t) for t in (11, 12, 50)] == [schedule_lr(vec, 11)] * 3
    assert schedule_lr(vec, 11) == pytest.approx(0.01)


def test_warmup_cosine_formula():
    base, warmup, total, min_lr = 0.4, 4, 12, 0.02
    vec = optim.WarmupCosine(warmup, total, min_lr).vector(base)
    got = [schedule_lr(vec, t) for t in range(1, total + 3)]
    want = [base * t / warmup for t in range(1, warmup + 1)]
    want += [min_lr + (base - min_lr) * (1 + math.cos(math.pi * min(e, total - warmup) /
                                                      (total - warmup))) / 2
             for e in range(0, total - warmup + 2)]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[warmup - 1] == pytest.approx(base) and got[warmup] == pytest.approx(base)


def test_constant_schedule():
    assert schedule_lr(optim.Constant().vector(0.25), 1) == 0.25
    assert schedule_lr(optim.Constant().vector(0.25), 10_000) == 0.25


# ---- argument checks -----------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: optim.SGD(lr=-1.0),
    lambda: optim.SGD(lr=0.1, nesterov=True),
    lambda: optim.SGD(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
    lambda: optim.Adam(betas=(1.0, 0.999)),
    lambda: optim.AdamW(max_grad_norm=0.0),
    lambda: optim.WarmupCosine(warmup_steps=10, total_steps=10),
    lambda: optim.WarmupCosine(warmup_steps=0, total_steps=10),
], ids=["negative-lr", "nesterov-no-momentum", "nesterov-dampening", "beta-1", "clip-0",
        "warmup-not-below-total", "no-warmup"])
def test_invalid_arguments_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


def test_adamw_defaults_to_torch_defaults():
    opt = optim.AdamW()
    assert (opt.lr, opt.betas, opt.eps, opt.weight_decay) == (1e-3, (0.9, 0.999), 1e-8, 0.01)
    adam = optim.Adam()
    assert adam.weight_decay == 0.0 and not adam.decoupled and opt.decoupled
