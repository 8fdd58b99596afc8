"""K steps per launch on the numpy backend: `step.run(batches, steps=K)` trains exactly as the
step called on each slice in turn, bit for bit (losses, parameters, BatchNorm statistics,
optimizer state, LR schedule, dropout masks), and refuses feeds that do not stack whole steps
(api.py TrainStep.run, compile/executable.py StepsReplay, compile/feed.py check_steps_feed)."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import losses, models, nn, optim
from stepgraph.errors import LabelError, NonFiniteError, ShapeError
from tests.ops.helpers import seeded

BATCH = 8


def mlp_case():
    return (models.mlp(in_features=16, hidden=32, classes=5, dropout=0.25), (16,),
            losses.cross_entropy, lambda: optim.Adam(lr=1e-2, schedule=optim.WarmupCosine(2, 9)))


def bn_case():
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4),
                          nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 5))
    return (model, (2, 5, 5), losses.cross_entropy,
            lambda: optim.SGD(lr=0.05, momentum=0.9, schedule=optim.StepDecay(2, 0.5)))


CASES = {"mlp-adam-warmup-cosine": mlp_case, "batchnorm-sgd-step-decay": bn_case}


def stacked(name: str, steps: int, shape) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of `steps` batches stacked along a leading axis."""
    gen = seeded(name)
    return (gen.standard_normal((steps, BATCH, *shape)).astype(np.float32),
            gen.integers(0, 5, (steps, BATCH)))


def twins(case: str, **options):
    """Two train steps over identically initialised copies of the case's model; `options`
    go to compile_train_step (tests/cuda/test_kstep_cuda.py passes device, graph, precision)."""
    make = CASES[case]
    first, shape, loss, make_opt = make()
    second = make()[0]
    second.load_state_dict(first.state_dict())
    x, y = stacked("example", 1, shape)
    return [sg.compile_train_step(m, loss, make_opt(), example_inputs=(x[0], y[0]), seed=3,
                                  **options) for m in (first, second)], shape


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and np.array_equal(sa[k], sb[k]), k


@pytest.mark.parametrize("case", list(CASES))
def test_run_equals_single_steps_bitwise(case):
    (kstep, single), shape = twins(case)
    x, y = stacked(case, 9, shape)
    plan = [(slice(0, 6), 3), (slice(6, 7), None), (slice(7, 9), 2)]   # None: one plain call
    got, want = [], []
    for part, steps in plan:
        if steps is None:
            got.append(kstep(x[part][0], y[part][0]))
        else:
            got += kstep.run((x[part], y[part]), steps=steps)
        want += [single(xi, yi) for xi, yi in zip(x[part], y[part])]
        kstep.optimizer.lr = single.optimizer.lr = kstep.optimizer.lr * 0.5   # read per launch
    assert [h.step for h in got] == [h.step for h in want] == list(range(1, 10))
    assert [float(h) for h in got] == [float(h) for h in want]
    assert len(set(float(h) for h in got)) > 1           # every step trained on its own batch
    assert_same_state(kstep, single)
    assert int(kstep.state_dict()["optimizer.step"]) == 9


def test_run_on_ragged_last_batch_uses_its_own_plan():
    (kstep, single), shape = twins("mlp-adam-warmup-cosine")
    x, y = stacked("ragged", 2, shape)
    x, y = x[:, :5], y[:, :5]                          # batch 5: another signature than 8
    got = kstep.run((x, y), steps=np.int64(2))         # any integer type counts steps
    want = [single(xi, yi) for xi, yi in zip(x, y)]
    assert [float(h) for h in got] == [float(h) for h in want]
    assert_same_state(kstep, single)
    assert len(kstep.executables) == 2


def test_run_under_raise_stops_at_the_bad_step():
    """A NaN batch in the middle: its update and every later one are held, and reading a loss
    raises the error naming the step, leaving the state of the steps before it."""
    (kstep, single), shape = twins("mlp-adam-warmup-cosine")
    x, y = stacked("bad", 4, shape)
    x[2, 1, 3] = np.nan
    got = kstep.run((x, y), steps=4)
    for xi, yi in zip(x[:2], y[:2]):
        single(xi, yi)
    with pytest.raises(NonFiniteError, match="step 3") as err:
        float(got[-1])
    assert err.value.step == 3
    assert_same_state(kstep, single)


def test_run_checks_every_steps_labels_before_running():
    (kstep, _), shape = twins("mlp-adam-warmup-cosine")
    x, y = stacked("labels", 4, shape)
    y[3, 0] = 5
    before = kstep.state_dict()
    with pytest.raises(LabelError, match=r"\[0, 5\)"):
        kstep.run((x, y), steps=2)
    after = kstep.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("feed, steps, error, message", [
    (lambda x, y: (x[0], y[0]), 2, ShapeError, r"'x': expected shape \(2, batch, 16\)"),
    (lambda x, y: (x[..., :15], y), 2, ShapeError, r"'x': expected shape \(2, batch, 16\)"),
    (lambda x, y: (x, y[..., None]), 2, ShapeError, r"'y': expected shape \(2, batch\)"),
    (lambda x, y: (x, y[:4]), 2, ShapeError, r"'y': leading \(steps\) axis 4 does not match"),
    (lambda x, y: (x, y), 4, ShapeError, r"leading axis 6 is not a positive multiple of steps=4"),
    (lambda x, y: (x[:, :3], y), 2, ShapeError, r"'y': batch size 8 does not match 'x' batch"),
    (lambda x, y: (x.astype(np.float64), y), 2, ShapeError, r"'x': expected dtype float32"),
    (lambda x, y: (x,), 2, ShapeError, r"expected 2 inputs \(x, y\), got 1"),
    (lambda x, y: (x, y), 0, ValueError, r"steps must be a positive int, got 0"),
    (lambda x, y: (x, y), 1.5, ValueError, r"steps must be a positive int, got 1.5"),
], ids=["no-steps-axis", "feature", "target-rank", "leading-mismatch", "not-multiple",
        "batch-mismatch", "dtype", "count", "zero-steps", "float-steps"])
def test_run_rejects_feeds_that_do_not_stack_whole_steps(feed, steps, error, message):
    (kstep, _), shape = twins("mlp-adam-warmup-cosine")
    x, y = stacked("shapes", 6, shape)
    with pytest.raises(error, match=message):
        kstep.run(feed(x, y), steps=steps)
    assert int(kstep.state_dict()["optimizer.step"]) == 0
