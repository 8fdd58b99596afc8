"""Values of a training pass read before optimizer.step() (stepgraph/loop/early.py): the loss
read after each backward() of a gradient accumulation, or before backward(), an accuracy from
the output, under a GradScaler and under bf16 autocast. Each loop is run on torch (float32 and
float64: the losses and the state changes judged by the tolerance policy) and on stepgraph
twice, with the early reads and with every value read after the step: losses, accuracies and
the state_dict (BatchNorm's running statistics and counters included) equal bit for bit."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph.loop.passes import ValueNotReadyError
from tests.reference import assert_close_to_reference, assert_state_changes_close, state_float64
from tests.unit.test_loop_capture import counting_forward

CLASSES, BATCH = 5, 8
BEFORE, AFTER_BACKWARD, AFTER_STEP = "before backward", "after backward", "after step"


def bn_net(fw, dropout=0.0):
    """A conv net with both BatchNorms: momentum 0.1, and None (the cumulative average, which
    reads num_batches_tracked)."""
    nn = fw.nn
    layers = [nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
              nn.Linear(4 * 36, 16), nn.BatchNorm1d(16, momentum=None), nn.ReLU()]
    layers += [nn.Dropout(dropout)] if dropout else []
    return nn.Sequential(*layers, nn.Linear(16, CLASSES))


def batches(n, seed=0):
    gen = np.random.default_rng(seed)
    return [(gen.standard_normal((BATCH, 3, 6, 6)).astype(np.float32),
             gen.integers(0, CLASSES, BATCH).astype(np.int64)) for _ in range(n)]


def models(count=2, dropout=0.0):
    """torch float32 and float64 twins and `count` stepgraph ones, all with the same state."""
    torch.manual_seed(0)
    t32 = bn_net(torch, dropout)
    t64 = bn_net(torch, dropout).double()
    t64.load_state_dict({k: v.double() if v.is_floating_point() else v
                         for k, v in t32.state_dict().items()})
    ours = []
    for _ in range(count):
        m = bn_net(sg, dropout)
        m.load_state_dict({k: v.numpy() for k, v in t32.state_dict().items()})
        ours.append(m)
    return t32, t64, ours


def state(model) -> dict[str, np.ndarray]:
    """A copy of the state_dict's values in their dtypes (a stepgraph entry, array or tensor,
    as np.array reads it)."""
    return {k: v.detach().numpy().copy() if isinstance(v, torch.Tensor) else np.array(v)
            for k, v in model.state_dict().items()}


def accuracy(fw, out, y):
    return (out.argmax(1) == fw.from_numpy(y)).float().mean()


def loop(fw, model, data, read, accumulate=1, dtype=np.float32, scaler=False, bf16=False,
         on_read=None):
    """torch's gradient-accumulation loop, its loss divided by `accumulate`; each pass's loss
    and accuracy read `read` (before backward(), after it, or after the step that ran the
    pass). on_read(model) runs around each read. Returns the losses and accuracies."""
    F = fw.nn.functional
    opt = fw.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scale = (fw.amp.GradScaler("cpu", init_scale=1024.0) if fw is torch
             else sg.amp.GradScaler(init_scale=1024.0)) if scaler else None
    losses, accs, waiting = [], [], []

    def take(loss, acc):
        hook = on_read(model) if on_read is not None else contextlib.nullcontext()
        with hook:
            losses.append(loss.item())
            accs.append(acc.item())
    for i, (x, y) in enumerate(data):
        autocast = fw.autocast("cpu", dtype=fw.bfloat16) if bf16 else contextlib.nullcontext()
        with autocast:
            out = model(fw.from_numpy(x.astype(dtype)))
            loss = F.cross_entropy(out, fw.from_numpy(y)) / accumulate
        if read == BEFORE:
            take(loss, accuracy(fw, out, y))
        (scale.scale(loss) if scale else loss).backward()
        if read == AFTER_BACKWARD:
            take(loss, accuracy(fw, out, y))     # ops after backward() on the pass's output
        waiting.append((loss, out, y))
        if (i + 1) % accumulate == 0:
            if scale:
                scale.step(opt)
                scale.update()
            else:
                opt.step()
            opt.zero_grad()
            if read == AFTER_STEP:
                for held in waiting:
                    take(held[0], accuracy(fw, held[1], held[2]))
            waiting.clear()
    return losses, accs


def judged(read, data, **options):
    """The loop on torch float32 / float64 (reading after backward(), as torch scripts do) and
    on stepgraph reading `read` and reading after the step: stepgraph's losses within the
    policy's bound of float64's and its state changes too; the two stepgraph runs bit for bit
    equal. Returns stepgraph's losses."""
    t32, t64, (ours, plain) = models()
    start = state_float64(t32)
    l32, _ = loop(torch, t32, data, AFTER_BACKWARD, **options)
    l64, a64 = loop(torch, t64, data, AFTER_BACKWARD, dtype=np.float64, **options)
    lsg, asg = loop(sg, ours, data, read, **options)
    lref, aref = loop(sg, plain, data, AFTER_STEP, **options)
    assert lsg == lref and asg == aref
    got, want = state(ours), state(plain)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    assert asg == a64
    assert_close_to_reference(lsg, l64, l32, "losses")
    assert_state_changes_close(start, got, state_float64(t64), state_float64(t32),
                               counters=len(data))
    return lsg


def test_loss_read_after_each_backward_of_an_accumulation():
    """`running += loss.item()` after each backward(), three per step: torch's losses."""
    judged(AFTER_BACKWARD, batches(6), accumulate=3)


def test_loss_read_after_backward_in_a_plain_loop():
    judged(AFTER_BACKWARD, batches(4))


def test_loss_and_accuracy_read_before_backward():
    """print(loss.item()) between the loss and backward(): a prefix of the pass, evaluated."""
    judged(BEFORE, batches(4))
    judged(BEFORE, batches(4), accumulate=2)


def test_loss_read_before_a_grad_scalers_step():
    """scaler.scale(loss).backward(); loss.item(): the unscaled loss."""
    judged(AFTER_BACKWARD, batches(4), accumulate=2, scaler=True)


def test_early_reads_leave_the_state_as_it_was():
    """At each early read the state_dict (running statistics, num_batches_tracked) is what it
    was before the read; only the step changes it (judged() compares the end state too)."""
    seen = []

    @contextlib.contextmanager
    def unchanged(model):
        before = state(model)
        yield
        after = state(model)
        seen.append(all(np.array_equal(before[k], after[k]) for k in before))
    _, _, (ours,) = models(1)
    loop(sg, ours, batches(4), AFTER_BACKWARD, accumulate=2, on_read=unchanged)
    assert seen == [True] * 4


def test_bf16_autocast_loss_read_before_the_step():
    """Under bf16 autocast the early losses are the step's bit for bit, and judged by the
    tolerance policy against torch float64, bound by torch's own bf16 autocast error."""
    data = batches(4)
    t32, t64, (ours, plain) = models()
    want64, _ = loop(torch, t64, data, AFTER_BACKWARD, accumulate=2, dtype=np.float64)
    want_bf16, _ = loop(torch, t32, data, AFTER_BACKWARD, accumulate=2, bf16=True)
    got, accs = loop(sg, ours, data, AFTER_BACKWARD, accumulate=2, bf16=True)
    ref, ref_accs = loop(sg, plain, data, AFTER_STEP, accumulate=2, bf16=True)
    assert got == ref and accs == ref_accs
    a, b = state(ours), state(plain)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert_close_to_reference(got, want64, want_bf16, "bf16 losses read early")


def test_replayed_passes_reuse_one_compiled_forward():
    """Six iterations, each reading its loss after backward(): one compiled forward of the
    loss, run six times (and one of the output, for the accuracy); the model's Python runs at
    the recording, in the step's trace of its two passes and in each compiled forward's."""
    _, _, (ours,) = models(1)
    calls = counting_forward(ours)
    losses, _ = loop(sg, ours, batches(6), AFTER_BACKWARD, accumulate=2)
    from stepgraph.loop.hooks import SESSION
    assert len(set(losses)) == 6
    forwards = [f for _, f in SESSION.early.values()]
    loss_forward = [f for f in forwards if len(f.wanted) == 1]
    assert len(loss_forward) == 1
    (exe,) = loss_forward[0].executables.values()
    assert exe.runs == 6
    assert len(forwards) == 2 and len(calls) == 1 + 2 + 2


def test_a_pass_drawing_random_numbers_refuses_an_early_read():
    """Dropout: an evaluation ahead of the step would draw other masks, so the read says to
    read after optimizer.step(); the refused read changes nothing, and after the step the
    value is the step's."""
    x, y = batches(1)[0]
    got = []
    for attempt in (True, False):
        _, _, (ours,) = models(1, dropout=0.5)
        opt = sg.optim.SGD(ours.parameters(), lr=0.1)
        loss = sg.nn.functional.cross_entropy(ours(sg.from_numpy(x)), sg.from_numpy(y))
        loss.backward()
        if attempt:
            with pytest.raises(ValueNotReadyError, match="random numbers.*after optimizer.step"):
                loss.item()
        opt.step()
        got.append((loss.item(), state(ours)))
    assert got[0][0] == got[1][0]
    assert all(np.array_equal(got[0][1][k], got[1][1][k]) for k in got[0][1])


def test_gradients_and_the_clipped_norm_still_wait_for_the_step():
    """p.grad, an op on it after backward() and clip_grad_norm_'s norm need the backward: not
    ready before the step (the message says when), readable after it."""
    _, _, (ours,) = models(1)
    opt = sg.optim.SGD(ours.parameters(), lr=0.1)
    x, y = batches(1)[0]
    out = ours(sg.from_numpy(x))
    loss = sg.nn.functional.cross_entropy(out, sg.from_numpy(y))
    loss.backward()
    grad = ours[0].weight.grad
    norm = sg.nn.utils.clip_grad_norm_(ours.parameters(), 1.0)
    for value in (grad, grad.abs().sum(), norm, loss * norm):
        with pytest.raises(ValueNotReadyError, match="after that"):
            value.numpy()
    assert np.isfinite(loss.item()) and out.numpy().shape == (BATCH, CLASSES)
    opt.step()
    assert np.isfinite(norm.item()) and grad.numpy().shape == (4, 3, 3, 3)


def test_the_output_read_early_is_torchs_and_the_steps():
    """The model's output read whole between backward() and step(): torch's forward, and the
    values the step computes (read after it by the twin), bit for bit."""
    t32, t64, (ours, plain) = models()
    x, y = batches(1)[0]
    want = {}
    for fw, model, dtype in ((torch, t32, np.float32), (torch, t64, np.float64)):
        out = model(fw.from_numpy(x.astype(dtype)))
        fw.nn.functional.cross_entropy(out, fw.from_numpy(y)).backward()
        want[dtype] = out.detach().numpy()
    got = []
    for model, early in ((ours, True), (plain, False)):
        opt = sg.optim.SGD(model.parameters(), lr=0.1)
        out = model(sg.from_numpy(x))
        sg.nn.functional.cross_entropy(out, sg.from_numpy(y)).backward()
        if early:
            got.append(out.numpy())
        opt.step()
        got.append(out.numpy())
    np.testing.assert_array_equal(got[0], got[2])
    assert_close_to_reference(got[0], want[np.float64], want[np.float32], "output")
