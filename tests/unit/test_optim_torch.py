"""torch.optim in a training script: each optimizer built torch's way (model.parameters() or
groups with their own hyperparameters) and compiled into a step, against torch.optim over
several steps, judged on parameter changes against torch in float64 (bound: a small multiple
of torch float32's own error); param_groups written between steps (lr 0 stops the updates,
weight_decay, momentum, betas, eps, alpha, lr_decay take effect at the next step) with the
same compiled executables and graphs; state_dict round trips and state_dicts made by
torch.optim loading; the refusals."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import losses, nn, optim
from stepgraph.optim.optimizer import HYPERPARAMETERS_KEY, SCHEDULE_KEY
from stepgraph.optim.schedules import schedule_factor
from tests.ops.helpers import seeded

STEPS = 6
IN, HIDDEN, OUT, BATCH = 6, 5, 3, 8


def batches(n: int, seed: str = "optim-torch"):
    gen = seeded(seed)
    return [(gen.standard_normal((BATCH, IN)).astype(np.float32),
             gen.standard_normal((BATCH, OUT)).astype(np.float32)) for _ in range(n)]


def sg_model():
    """Smooth (tanh, MSE): no kink for float32 rounding to flip."""
    nn.manual_seed(3)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def torch_twin(model, dtype):
    twin = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUT)).to(dtype)
    twin.load_state_dict({k: torch.tensor(v.numpy(), dtype=dtype) for k, v in
                          model.state_dict().items()})
    return twin


def group_split(params):
    """Two groups: the first layer, the second layer."""
    params = list(params)
    return params[:2], params[2:]


# name -> (torch.optim class, defaults, group 0 overrides, group 1 overrides): every optimizer
# with two groups of different hyperparameters.
CASES = {
    "sgd-nesterov": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True),
                     dict(weight_decay=0.05), dict(lr=0.03, momentum=0.5)),
    "sgd-dampening-maximize": (torch.optim.SGD, dict(lr=0.05, momentum=0.8, dampening=0.3,
                                                     maximize=True),
                               dict(weight_decay=0.1), dict(lr=0.02, momentum=0.0)),
    "sgd-plain": (torch.optim.SGD, dict(lr=0.1), dict(weight_decay=0.01), dict(lr=0.2)),
    "adam": (torch.optim.Adam, dict(lr=0.01), dict(betas=(0.8, 0.99), weight_decay=0.1),
             dict(lr=0.003, eps=1e-4)),
    "adam-amsgrad-maximize": (torch.optim.Adam, dict(lr=0.01, amsgrad=True, maximize=True),
                              dict(weight_decay=0.05), dict(betas=(0.5, 0.9))),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1), dict(betas=(0.85, 0.95)),
              dict(lr=0.02, weight_decay=0.0)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=0.01), dict(alpha=0.9, weight_decay=0.05),
                dict(lr=0.003, eps=1e-6)),
    "rmsprop-centered-momentum": (torch.optim.RMSprop, dict(lr=0.005, centered=True,
                                                            momentum=0.9),
                                  dict(alpha=0.95), dict(momentum=0.0, weight_decay=0.1)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.05),
                dict(initial_accumulator_value=0.5, weight_decay=0.05),
                dict(lr=0.05, eps=1e-6)),
}
SG_CLASS = {torch.optim.SGD: optim.SGD, torch.optim.Adam: optim.Adam,
            torch.optim.AdamW: optim.AdamW, torch.optim.RMSprop: optim.RMSprop,
            torch.optim.Adagrad: optim.Adagrad}


def make_groups(params, case):
    first, second = group_split(params)
    _, _, g0, g1 = CASES[case]
    return [{"params": first, **g0}, {"params": second, **g1}]


def build(case, data):
    """(model, stepgraph optimizer, compiled step) of a case, torch's way."""
    cls, defaults, _, _ = CASES[case]
    model = sg_model()
    opt = SG_CLASS[cls](make_groups(model.parameters(), case), **defaults)
    step = sg.compile_train_step(model, losses.mse, opt, data[0])
    return model, opt, step


def run_torch(model0_state, case, data, dtype, between=None):
    """torch's parameters after each step (float64 arrays), from the initial state."""
    cls, defaults, _, _ = CASES[case]
    twin = torch_twin_from(model0_state, dtype)
    topt = cls(make_groups(twin.parameters(), case), **defaults)
    out = []
    for t, (x, y) in enumerate(data):
        if between is not None:
            between(t, topt.param_groups)
        topt.zero_grad()
        loss = torch.nn.functional.mse_loss(twin(torch.tensor(x, dtype=dtype)),
                                            torch.tensor(y, dtype=dtype))
        loss.backward()
        topt.step()
        out.append({k: v.detach().double().numpy().copy() for k, v in
                    twin.state_dict().items()})
    return out, topt


def torch_twin_from(state, dtype):
    twin = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUT)).to(dtype)
    twin.load_state_dict({k: torch.tensor(v, dtype=dtype) for k, v in state.items()})
    return twin


def run_sg(model, step, opt, data, between=None):
    out = []
    for t, (x, y) in enumerate(data):
        if between is not None:
            between(t, opt.param_groups)
        step(x, y)
        out.append({k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()})
    return out


def assert_changes_match(init, got, want64, want32, what=""):
    """Per step and tensor: |stepgraph's change - torch float64's| <= 4 x torch float32's
    own error (+ 1e-6 of the change, for steps where float32 happens to be exact)."""
    for t, (g, w64, w32) in enumerate(zip(got, want64, want32)):
        for k in w64:
            d64 = w64[k] - init[k]
            err = np.abs((g[k] - init[k]) - d64).max()
            torch_err = np.abs((w32[k] - init[k]) - d64).max()
            bound = 4 * torch_err + 1e-6 * np.abs(d64).max() + 1e-9
            assert err <= bound, f"{what} step {t + 1} {k}: {err:.3e} > {bound:.3e} " \
                                 f"(torch float32 {torch_err:.3e})"


@pytest.mark.parametrize("case", CASES)
def test_optimizer_with_groups_matches_torch(case):
    data = batches(STEPS)
    model, opt, step = build(case, data)
    init = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}
    got = run_sg(model, step, opt, data)
    want64, _ = run_torch(init, case, data, torch.float64)
    want32, _ = run_torch(init, case, data, torch.float32)
    assert np.abs(want64[-1]["0.weight"] - init["0.weight"]).max() > 1e-3   # it moved
    assert_changes_match(init, got, want64, want32, case)


# ---- param_groups written between steps ----------------------------------------------------

# name -> (case, writes at step t: [(group, key, value)])
WRITES = {
    "sgd": ("sgd-nesterov", {2: [(0, "weight_decay", 0.3), (1, "momentum", 0.95)],
                             4: [(0, "lr", 0.02), (1, "dampening", 0.0)]}),
    "adam": ("adam", {2: [(0, "betas", (0.6, 0.9)), (1, "eps", 1e-2)],
                      3: [(1, "weight_decay", 0.2), (0, "lr", 0.05)]}),
    "rmsprop": ("rmsprop-centered-momentum", {2: [(0, "alpha", 0.5), (0, "momentum", 0.7)],
                                              4: [(0, "eps", 1e-3), (0, "momentum", 0.0)]}),
    "adagrad": ("adagrad", {2: [(0, "lr_decay", 0.5), (1, "weight_decay", 0.1)],
                            3: [(1, "eps", 0.1)]}),
}


def writer(writes):
    def between(t, groups):
        for g, key, value in writes.get(t, ()):
            groups[g][key] = value
            groups[g]["initial_lr"] = 1.0          # a scheduler's key: stored, ignored
    return between


@pytest.mark.parametrize("name", WRITES)
def test_param_group_writes_take_effect_at_the_next_step_without_a_new_trace(name):
    case, writes = WRITES[name]
    data = batches(STEPS, "writes")
    model, opt, step = build(case, data)
    executables = dict(step.executables)
    graphs = {k: e.plan.graph for k, e in executables.items()}
    groups = opt.param_groups
    init = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}
    got = run_sg(model, step, opt, data, writer(writes))
    want64, _ = run_torch(init, case, data, torch.float64, writer(writes))
    want32, _ = run_torch(init, case, data, torch.float32, writer(writes))
    assert_changes_match(init, got, want64, want32, name)
    # The same live dicts, executables and graphs: nothing was traced or captured again.
    assert opt.param_groups is groups and opt.param_groups[0] is groups[0]
    assert step.executables == executables
    assert all(step.executables[k] is e and e.plan.graph is graphs[k]
               for k, e in executables.items())


def test_without_the_writes_the_trajectory_differs():
    """The writes test can fail: torch's trajectory with writes is not stepgraph's without."""
    case, writes = WRITES["adam"]
    data = batches(STEPS, "writes")
    model, opt, step = build(case, data)
    init = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}
    got = run_sg(model, step, opt, data)
    want64, _ = run_torch(init, case, data, torch.float64, writer(writes))
    want32, _ = run_torch(init, case, data, torch.float32, writer(writes))
    with pytest.raises(AssertionError):
        assert_changes_match(init, got, want64, want32)


@pytest.mark.parametrize("case", ["sgd-nesterov", "adam", "rmsprop", "adagrad"])
def test_lr_zero_stops_the_updates(case):
    data = batches(4, "lr zero")
    model, opt, step = build(case, data)
    step(*data[0])
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = model.state_dict()
    step(*data[1])
    step(*data[2])
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    opt.param_groups[1]["lr"] = 0.01         # one group on again: only its parameters move
    step(*data[3])
    after = model.state_dict()
    assert all(np.array_equal(after[k], before[k]) for k in ("0.weight", "0.bias"))
    assert not np.array_equal(after["2.weight"], before["2.weight"])


def test_compile_train_step_optimizer_has_one_group_of_every_parameter():
    """params=None (compile_train_step's style): one group, filled once a step is compiled;
    optimizer.lr and its writes both reach the step."""
    data = batches(3, "implicit")
    model = sg_model()
    opt = optim.SGD(lr=0.1, momentum=0.9)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == []
    step = sg.compile_train_step(model, losses.mse, opt, data[0])
    (group,) = opt.param_groups
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters()]
    assert group["lr"] == 0.1 and group["momentum"] == 0.9 and opt.defaults["lr"] == 0.1
    step(*data[0])
    opt.lr = 0.0                              # stepgraph's knob: the group follows
    assert group["lr"] == 0.0
    before = model.state_dict()
    step(*data[1])
    assert all(np.array_equal(v, before[k]) for k, v in model.state_dict().items())
    group["lr"] = 0.05                        # torch's knob
    step(*data[2])
    assert not np.array_equal(model.state_dict()["0.weight"], before["0.weight"])
    assert opt.compiled_steps() == [step]


def test_exact_group_lr_without_a_schedule():
    """Without a stepgraph schedule the update's lr is the group's lr bit for bit: the
    schedule's factor is exactly 1.0 and the float64 rows hold each group's lr as written."""
    data = batches(3, "exact")
    model = sg_model()
    lr = 0.123456789
    first, second = group_split(model.parameters())
    opt = optim.SGD([{"params": first, "lr": lr}, {"params": second}], lr=0.7)
    step = sg.compile_train_step(model, losses.mse, opt, data[0])
    step(*data[0])
    opt.param_groups[1]["lr"] = 1 / 3
    step(*data[1])
    vector = step.backend.to_numpy(step.state[SCHEDULE_KEY])
    assert [schedule_factor(vector, t) for t in (1, 2, 1000)] == [1.0] * 3
    table = step.backend.to_numpy(step.state[HYPERPARAMETERS_KEY])
    assert table.dtype == np.float64 and list(table[:, 0]) == [lr, lr, 1 / 3, 1 / 3]
    init = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}
    twin64, twin32 = torch_twin(model, torch.float64), torch_twin(model, torch.float32)
    results = []
    for twin in (twin64, twin32):
        topt = torch.optim.SGD([{"params": list(twin.parameters())[:2], "lr": lr},
                                {"params": list(twin.parameters())[2:], "lr": 1 / 3}])
        x, y = (torch.tensor(a, dtype=next(twin.parameters()).dtype) for a in data[2])
        torch.nn.functional.mse_loss(twin(x), y).backward()
        topt.step()
        results.append({k: v.double().numpy() for k, v in twin.state_dict().items()})
    step(*data[2])
    got = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}
    assert_changes_match(init, [got], [results[0]], [results[1]])


def test_a_stepgraph_schedule_scales_every_group():
    data = batches(4, "schedule")
    model = sg_model()
    first, second = group_split(model.parameters())
    opt = optim.SGD([{"params": first}, {"params": second, "lr": 0.05}], lr=0.1,
                    schedule=optim.StepDecay(2, 0.5))
    step = sg.compile_train_step(model, losses.mse, opt, data[0])
    twin = torch_twin(model, torch.float64)
    tf, ts = group_split(twin.parameters())
    topt = torch.optim.SGD([{"params": tf}, {"params": ts, "lr": 0.05}], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(topt, 2, 0.5)
    for x, y in data:
        step(x, y)
        topt.zero_grad()
        torch.nn.functional.mse_loss(twin(torch.tensor(x, dtype=torch.float64)),
                                     torch.tensor(y, dtype=torch.float64)).backward()
        topt.step()
        sched.step()
    for k, v in twin.state_dict().items():
        np.testing.assert_allclose(model.state_dict()[k], v.numpy(), rtol=2e-5, atol=1e-6)


# ---- refusals and accepted flags -----------------------------------------------------------

def test_formula_switches_are_fixed_once_compiled():
    data = batches(1, "static")
    model, opt, step = build("sgd-nesterov", data)
    with pytest.raises(ValueError, match="nesterov selects the compiled update's formula"):
        opt.param_groups[0]["nesterov"] = False
    opt.param_groups[0]["nesterov"] = True          # the same value: fine
    model, opt, step = build("sgd-plain", data)
    with pytest.raises(ValueError, match="compiled with momentum 0"):
        opt.param_groups[1]["momentum"] = 0.9
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="amsgrad must be the same"):
        p = list(sg_model().parameters())
        optim.Adam([{"params": p[:1], "amsgrad": True}, {"params": p[1:]}])
    with pytest.raises(KeyError):
        del opt.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="add_param_group"):
        opt.add_param_group({"params": [nn.Parameter(np.zeros(2, np.float32))]})


def test_torch_constructors_and_defaults():
    p = list(sg_model().parameters())
    tp = [torch.nn.Parameter(torch.zeros(1))]
    for cls, tcls in SG_CLASS.items():
        ours, theirs = tcls(p), cls(tp)
        assert set(ours.defaults) == set(theirs.defaults), cls
        for k, v in theirs.defaults.items():
            assert ours.defaults[k] == v, (cls, k)
        keys = set(theirs.state_dict()["param_groups"][0])
        assert set(ours.state_dict()["param_groups"][0]) == keys
    opt = optim.Adam(p, lr=0.01, foreach=True, fused=True, capturable=True,
                     differentiable=False)
    assert opt.param_groups[0]["fused"] is True           # kept, unused
    assert optim.Adam(p, decoupled_weight_decay=True).decoupled
    named = optim.SGD(sg_model().named_parameters(), lr=0.1)
    assert named.param_groups[0]["param_names"][0] == "0.weight"
    with pytest.raises(ValueError, match="empty parameter list"):
        optim.SGD([], lr=0.1)
    with pytest.raises(TypeError, match="iterable"):
        optim.SGD(p[0], lr=0.1)


# ---- state_dict ----------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["sgd-nesterov", "adam-amsgrad-maximize", "adamw",
                                  "rmsprop-centered-momentum", "adagrad"])
def test_state_dict_layout_matches_torch_and_round_trips(case):
    data = batches(6, "state dict")
    model, opt, step = build(case, data)
    init = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}
    # torch's before a step: none, except Adagrad's (made in its constructor: step 0, sum)
    fresh = run_torch(init, case, [], torch.float64)[1].state_dict()["state"]
    before = opt.state_dict()["state"]
    assert set(before) == set(fresh) == (set() if case != "adagrad" else {0, 1, 2, 3})
    for i, entry in fresh.items():
        assert set(before[i]) == set(entry)
        for k, v in entry.items():
            np.testing.assert_array_equal(before[i][k], v.numpy(), err_msg=f"{i} {k}")
    for x, y in data[:3]:
        step(x, y)
    ours = opt.state_dict()
    _, topt = run_torch(init, case, data[:3], torch.float64)
    theirs = topt.state_dict()
    assert ours["param_groups"] == [{k: v for k, v in g.items()} for g in
                                    theirs["param_groups"]]
    assert set(ours["state"]) == set(theirs["state"]) == {0, 1, 2, 3}
    for i, entry in theirs["state"].items():
        assert set(ours["state"][i]) == set(entry) | {"step"}, (i, entry.keys())
        for k, v in entry.items():
            np.testing.assert_allclose(ours["state"][i][k], v.numpy(), rtol=1e-4, atol=1e-6,
                                       err_msg=f"{case} state {i} {k}")
    by_param = opt.state
    assert set(map(id, by_param)) == set(map(id, model.parameters()))
    # Round trip: a fresh model and optimizer loading both go on as the original, bit for bit.
    saved, middle = copy.deepcopy(ours), {k: v.clone() for k, v in model.state_dict().items()}
    want = [float(step(x, y)) for x, y in data[3:]]
    cls, defaults, _, _ = CASES[case]
    model2 = sg_model()
    model2.load_state_dict(middle)
    opt2 = SG_CLASS[cls](make_groups(model2.parameters(), case), **defaults)
    opt2.load_state_dict(saved)                 # before any step is compiled: kept until then
    step2 = sg.compile_train_step(model2, losses.mse, opt2, data[0])
    assert [float(step2(x, y)) for x, y in data[3:]] == want
    final, final2 = model.state_dict(), model2.state_dict()
    for k in final:
        np.testing.assert_array_equal(final2[k], final[k], err_msg=k)


@pytest.mark.parametrize("case", ["sgd-dampening-maximize", "adam", "rmsprop",
                                  "rmsprop-centered-momentum", "adagrad"])
def test_a_torch_made_state_dict_loads_into_a_compiled_step(case):
    """torch trains 3 steps; stepgraph loads its parameters and optimizer state_dict into an
    already compiled step and both go on for 3 more: the changes agree with torch float64's."""
    data = batches(6, "torch made")
    model, opt, step = build(case, data)
    init = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}
    step(*data[5])                                # state to be overwritten
    cls, defaults, _, _ = CASES[case]
    results = {}
    for dtype in (torch.float64, torch.float32):
        twin = torch_twin_from(init, dtype)
        topt = cls(make_groups(twin.parameters(), case), **defaults)
        for t, (x, y) in enumerate(data):
            if t == 3 and dtype == torch.float32:
                state = copy.deepcopy(topt.state_dict())
                middle = {k: v.numpy().copy() for k, v in twin.state_dict().items()}
            topt.zero_grad()
            torch.nn.functional.mse_loss(twin(torch.tensor(x, dtype=dtype)),
                                         torch.tensor(y, dtype=dtype)).backward()
            topt.step()
        results[dtype] = {k: v.double().numpy() for k, v in twin.state_dict().items()}
    model.load_state_dict(middle)
    opt.load_state_dict(state)
    for x, y in data[3:]:
        step(x, y)
    got = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}
    start = {k: v.astype(np.float64) for k, v in middle.items()}
    assert_changes_match(start, [got], [results[torch.float64]], [results[torch.float32]],
                         case)


def test_load_state_dict_checks_before_writing():
    data = batches(2, "load checks")
    model, opt, step = build("adam", data)
    step(*data[0])
    good = opt.state_dict()
    bad = copy.deepcopy(good)
    bad["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(good)
    bad["state"][1]["step"] = np.array(7.0, np.float32)
    with pytest.raises(ValueError, match="one step counter"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(good)
    bad["param_groups"] = bad["param_groups"][:1]
    with pytest.raises(ValueError, match="number of parameter groups"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"] == good["param_groups"]
    for i in good["state"]:
        for k in good["state"][i]:
            np.testing.assert_array_equal(after["state"][i][k], good["state"][i][k])
