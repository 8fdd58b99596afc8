"""Freezing and unfreezing layers in a captured training loop (loop/session.py): the optimizer
state of the parameters trained before and after a change of requires_grad carries over, a
frozen parameter keeps its state untouched (and its own step count, which Adam's bias
corrections read), and a parameter trained for the first time starts afresh, as in torch.
The same loop on torch float32 and float64 and on stepgraph, judged by the tolerance policy
(parameter changes against float64)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import stepgraph as sg
from tests.reference import assert_changes_close, assert_close_to_reference, state_float64
from tests.unit.test_loop_capture import twins

D_IN, HIDDEN, CLASSES = 12, 16, 5
STEPS, FREEZE_AT, UNFREEZE_AT = 9, 3, 6


def net(fw):
    return fw.nn.Sequential(fw.nn.Linear(D_IN, HIDDEN), fw.nn.Tanh(),
                            fw.nn.Linear(HIDDEN, HIDDEN), fw.nn.Tanh(),
                            fw.nn.Linear(HIDDEN, CLASSES))


def batches(seed=0, batch=8):
    gen = np.random.default_rng(seed)
    return [(gen.standard_normal((batch, D_IN)), gen.integers(0, CLASSES, batch))
            for _ in range(STEPS)]


OPTIMIZERS = {
    "sgd-momentum": lambda fw, params: fw.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda fw, params: fw.optim.AdamW(params, lr=0.01, weight_decay=0.05),
}


def loop(fw, model, make_opt, dtype, schedule):
    """STEPS steps; schedule(i) -> {layer index: requires_grad} set before step i."""
    opt = make_opt(fw, model.parameters())
    for i, (x, y) in enumerate(batches()):
        for layer, trainable in schedule(i).items():
            model[layer].requires_grad_(trainable)
        opt.zero_grad()
        out = model(fw.from_numpy(x.astype(dtype)))
        fw.nn.functional.cross_entropy(out, fw.from_numpy(y)).backward()
        opt.step()


def run_three(make_opt, schedule):
    t32, t64, ours = twins(net)
    start = state_float64(t32)
    loop(torch, t32, make_opt, np.float32, schedule)
    loop(torch, t64, make_opt, np.float64, schedule)
    loop(sg, ours, make_opt, np.float32, schedule)
    return start, state_float64(t32), state_float64(t64), state_float64(ours)


def judge(start, s32, s64, ours):
    for k in s64:
        assert_changes_close(start[k], ours[k], s64[k], s32[k], f"change of {k}")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_freeze_then_unfreeze_keeps_the_other_layers_state(name):
    """Layer 0 frozen before step 3 and trainable again before step 6: the other layers keep
    their momentum or Adam moments across both re-records, layer 0 resumes with the state it
    had (its Adam step count 3, not the loop's 6)."""
    def schedule(i):
        return {0: not FREEZE_AT <= i < UNFREEZE_AT}
    judge(*run_three(OPTIMIZERS[name], schedule))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_layer_trained_late_starts_afresh(name):
    """The head frozen from the start and trainable from step 3 (its first Adam step is t=1,
    its momentum buffer starts from its first gradient); layer 0 frozen from step 6."""
    def schedule(i):
        return {4: i >= FREEZE_AT, 0: i < UNFREEZE_AT}
    judge(*run_three(OPTIMIZERS[name], schedule))


def test_the_changes_are_measurable():
    """Without the carry (every layer's state reset at each re-record), AdamW's changes would
    be off: a run whose state restarts at step 3 is far from torch's, so the judge can fail."""
    start, s32, s64, _ = run_three(OPTIMIZERS["adamw"], lambda i: {0: not FREEZE_AT <= i <
                                                                   UNFREEZE_AT})
    t32, t64, _ = twins(net)
    reset = net(torch)
    reset.load_state_dict(t32.state_dict())
    data = batches()
    opt = OPTIMIZERS["adamw"](torch, reset.parameters())
    for i, (x, y) in enumerate(data):
        if i in (FREEZE_AT, UNFREEZE_AT):
            reset[0].requires_grad_(not FREEZE_AT <= i < UNFREEZE_AT)
            opt = OPTIMIZERS["adamw"](torch, reset.parameters())       # state reset
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reset(torch.from_numpy(x.astype(np.float32))),
                                          torch.from_numpy(y)).backward()
        opt.step()
    with pytest.raises(AssertionError, match="past the bound"):
        judge(start, s32, s64, state_float64(reset))


STATE_OPTIMIZERS = {
    **OPTIMIZERS,
    "rmsprop-momentum": lambda fw, params: fw.optim.RMSprop(params, lr=0.01, momentum=0.5),
    "adagrad": lambda fw, params: fw.optim.Adagrad(params, lr=0.1, lr_decay=0.01,
                                                   initial_accumulator_value=0.1),
}
# layers 0, 2, 4 trainable (True) or frozen before each step: frozen from the start, frozen
# mid-run and trained again, a step with one layer alone
STATE_SCHEDULE = [{0: False, 2: True, 4: True}, {0: True, 2: False, 4: True},
                  {0: True, 2: True, 4: True}, {0: False, 2: False, 4: True},
                  {0: True, 2: False, 4: False}, {0: False, 2: True, 4: True},
                  {0: True, 2: True, 4: True}]


def optimizer_states(fw, model, make_opt, dtype) -> list[dict]:
    """optimizer.state_dict()["state"] after each step of STATE_SCHEDULE, copied (torch's
    arrays are the live state)."""
    opt, out = make_opt(fw, model.parameters()), []
    for i, (x, y) in enumerate(batches()[:len(STATE_SCHEDULE)]):
        for layer, trainable in STATE_SCHEDULE[i].items():
            model[layer].requires_grad_(trainable)
        opt.zero_grad()
        logits = model(fw.from_numpy(x.astype(dtype)))
        fw.nn.functional.cross_entropy(logits, fw.from_numpy(y)).backward()
        opt.step()
        out.append({k: {s: np.array(v.numpy() if hasattr(v, "detach") else v, np.float64)
                        for s, v in entry.items()}
                    for k, entry in opt.state_dict()["state"].items()})
    return out


@pytest.mark.parametrize("name", STATE_OPTIMIZERS)
def test_state_dict_lists_frozen_parameters_state_as_torch(name):
    """optimizer.state_dict() after every step of a loop that freezes and unfreezes layers:
    the same parameter indices and keys as torch's (a frozen parameter's state still listed,
    Adagrad's made for every parameter from the start), each parameter's own step count, and
    the slots' values judged against torch float64 by the tolerance policy."""
    t32, t64, ours = twins(net)
    make_opt = STATE_OPTIMIZERS[name]
    s32 = optimizer_states(torch, t32, make_opt, np.float32)
    s64 = optimizer_states(torch, t64, make_opt, np.float64)
    got = optimizer_states(sg, ours, make_opt, np.float32)
    for i, (want, want32, have) in enumerate(zip(s64, s32, got)):
        assert set(have) == set(want), f"after step {i}: parameters with state"
        for k, entry in want.items():
            # stepgraph's SGD entries carry its step count too (torch's SGD keeps none)
            assert set(have[k]) - {"step"} == set(entry) - {"step"}, (i, k)
            for slot, value in entry.items():
                if slot == "step":
                    assert float(have[k]["step"]) == float(value), (i, k)
                else:
                    assert_close_to_reference(have[k][slot], value, want32[k][slot],
                                              f"step {i} parameter {k} {slot}")
