"""torch.amp.GradScaler in a captured training loop (amp.py, compile/loss_scale.py): the same
loop on torch's GradScaler (CPU, float32) and on stepgraph's. The scale and growth counter
must follow torch's step for step (overflows skip and back off, good steps grow it again),
and the parameters' changes are judged against a float64 run that applies the steps torch
did not skip, by the tolerance policy."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import stepgraph as sg
from tests.reference import assert_close_to_reference, state_float64

D_IN, HIDDEN, CLASSES = 12, 16, 5


def net(fw, norm: bool):
    layers = [fw.nn.Linear(D_IN, HIDDEN)] + ([fw.nn.BatchNorm1d(HIDDEN)] if norm else [])
    return fw.nn.Sequential(*layers, fw.nn.ReLU(), fw.nn.Linear(HIDDEN, CLASSES))


def twins(norm: bool):
    torch.manual_seed(0)
    t32 = net(torch, norm)
    t64 = net(torch, norm).double()
    t64.load_state_dict({k: v.double() if v.is_floating_point() else v
                         for k, v in t32.state_dict().items()})
    ours = net(sg, norm)
    ours.load_state_dict({k: v.numpy() for k, v in t32.state_dict().items()})
    return t32, t64, ours


def batches(n, seed=0):
    gen = np.random.default_rng(seed)
    return [(gen.standard_normal((8, D_IN)).astype(np.float32),
             gen.integers(0, CLASSES, 8).astype(np.int64)) for _ in range(n)]


def scaled_loop(fw, model, data, gain, clip=None, **scaler_args):
    """The loop as torch's AMP recipe writes it; returns (scale, growth tracker) after every
    update, and the scaler."""
    F = fw.nn.functional
    opt = fw.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = fw.amp.GradScaler("cpu", **scaler_args)
    history = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(fw.from_numpy(x)), fw.from_numpy(y)) * gain
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            fw.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        history.append((scaler.get_scale(), int(scaler._get_growth_tracker())))
    return history, scaler


def float64_reference(model, data, gain, applied, clip=None):
    """torch float64 without a scaler: every forward runs (BatchNorm's statistics move, as
    in torch's skipped steps), the update only where `applied`."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for (x, y), apply in zip(data, applied):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x).double()),
                                                 torch.from_numpy(y)) * gain
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if apply:
            opt.step()


def judge(start, t32, t64, ours, untrained=()):
    """Every state entry's change within the policy's bound; `untrained`: entries whose true
    change is zero (a bias before BatchNorm), judged but not required to move."""
    s32, s64, ssg = state_float64(t32), state_float64(t64), state_float64(ours)
    for k in s64:
        c64 = s64[k] - start[k]
        assert k in untrained or np.abs(c64).max() > 1e-4, f"{k} did not train"
        assert_close_to_reference(ssg[k] - start[k], c64, s32[k] - start[k], f"change of {k}")


def skipped(history, init_scale):
    scales = [init_scale] + [s for s, _ in history]
    return [after < before for before, after in zip(scales, scales[1:])]


@pytest.mark.parametrize("clip", [None, 1.0])
def test_overflow_skips_backs_off_and_grows_again_as_torch(clip):
    """A huge initial scale overflows the gradients: the step is skipped (parameters and
    momentum unchanged, BatchNorm's statistics still move, as in torch) and the scale backs
    off; growth_interval good steps grow it again, into overflow. The factors are far from
    torch's defaults so that every step overflows, or passes, by a wide margin: near the
    float32 limit whether an intermediate overflows depends on how each kernel orders its
    sums, in torch as here."""
    t32, t64, ours = twins(norm=True)
    start = state_float64(t32)
    data = batches(12)
    args = dict(init_scale=2.0 ** 127, growth_interval=3, growth_factor=2.0 ** 16,
                backoff_factor=2.0 ** -16)
    want, _ = scaled_loop(torch, t32, data, 64.0, clip, **args)
    got, scaler = scaled_loop(sg, ours, data, 64.0, clip, **args)
    assert got == want
    skips = skipped(want, args["init_scale"])
    assert 2 <= sum(skips) < len(skips) - 2, "the run must both skip and apply steps"
    assert any(after > before for (before, _), (after, _) in zip(want, want[1:])), \
        "the scale must grow again"
    float64_reference(t64, data, 64.0, [not s for s in skips], clip)
    judge(start, t32, t64, ours, untrained=("0.bias",))
    assert scaler.state_dict() == {"scale": want[-1][0], "growth_factor": 2.0 ** 16,
                                   "backoff_factor": 2.0 ** -16, "growth_interval": 3,
                                   "_growth_tracker": want[-1][1]}


def test_a_batch_with_inf_is_skipped_and_the_scale_backs_off():
    t32, t64, ours = twins(norm=False)
    start = state_float64(t32)
    data = batches(6)
    data[2] = (np.full_like(data[2][0], np.inf), data[2][1])
    args = dict(init_scale=1024.0, growth_interval=2)
    want, _ = scaled_loop(torch, t32, data, 1.0, **args)
    got, _ = scaled_loop(sg, ours, data, 1.0, **args)
    assert got == want
    assert skipped(want, 1024.0) == [False, False, True, False, False, False]
    float64_reference(t64, data, 1.0, [True, True, False, True, True, True])
    judge(start, t32, t64, ours)


def test_the_scale_is_step_state_not_a_constant_of_the_graph():
    """A loop whose scale moves every few steps compiles one step: no re-capture."""
    import warnings

    _, _, ours = twins(norm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        history, _ = scaled_loop(sg, ours, batches(6), 1.0, init_scale=8.0, growth_interval=1)
    assert [s for s, _ in history] == [16.0, 32.0, 64.0, 128.0, 256.0, 512.0]
    from stepgraph.loop.hooks import SESSION
    step = SESSION.last_step
    assert len(step.executables) == 1
    ops = [n.op for n in next(iter(step.executables.values())).plan.graph.nodes]
    assert ops.count("loss_scale_update") == 1 and "guard_restore" not in ops


def test_state_dict_round_trip_new_scale_and_disabled():
    _, _, ours = twins(norm=False)
    _, scaler = scaled_loop(sg, ours, batches(3), 1.0, init_scale=256.0, growth_interval=2)
    saved = scaler.state_dict()
    assert saved["scale"] == 512.0 and saved["_growth_tracker"] == 1
    other = sg.amp.GradScaler()
    other.load_state_dict(saved)
    assert other.state_dict() == saved
    other.update(new_scale=4.0)
    assert other.get_scale() == 4.0
    off = sg.cuda.amp.GradScaler(enabled=False)
    loss = sg.ones(())
    assert off.scale(loss) is loss and off.get_scale() == 1.0 and off.state_dict() == {}
    with pytest.raises(RuntimeError, match="empty"):
        other.load_state_dict({})


def test_disabled_scaler_trains_as_a_plain_loop():
    _, _, a = twins(norm=False)
    _, _, b = twins(norm=False)
    scaled_loop(sg, a, batches(3), 1.0, enabled=False)
    opt = sg.optim.SGD(b.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches(3):
        opt.zero_grad()
        sg.nn.functional.cross_entropy(b(sg.from_numpy(x)), sg.from_numpy(y)).backward()
        opt.step()
    for k, v in state_float64(a).items():
        np.testing.assert_array_equal(v, state_float64(b)[k])


def test_unscale_twice_is_refused_as_torch():
    _, _, ours = twins(norm=False)
    opt = sg.optim.SGD(ours.parameters(), lr=0.05)
    scaler = sg.amp.GradScaler()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
