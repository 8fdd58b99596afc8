"""Bad inputs raise typed errors that name the input and say expected vs got, before anything
changes: parameters, optimizer state and the step counter stay as they were, and training
then continues exactly as if the bad call had never happened."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import losses, nn, optim
from stepgraph.errors import LabelError, ShapeError

BATCH, FEATURES, CLASSES = 8, 6, 4


def make_step(loss=losses.cross_entropy, dropout=0.3):
    nn.manual_seed(0)
    layers = [nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, CLASSES)]
    if loss is losses.nll_loss:
        layers.append(nn.LogSoftmax(dim=1))
    model = nn.Sequential(*layers)
    x, y = batch(0)
    return sg.compile_train_step(model, loss, optim.AdamW(lr=0.01), example_inputs=(x, y))


def batch(i: int, size: int = BATCH):
    gen = np.random.default_rng(i)
    return gen.standard_normal((size, FEATURES)).astype(np.float32), gen.integers(0, CLASSES, size)


def snapshot(step) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in step.state_dict().items()}


def assert_unchanged(before, step):
    after = step.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


x0, y0 = batch(0)
BAD_FEEDS = {   # name -> (arrays, exception, what the message must say)
    "features": ((np.zeros((BATCH, FEATURES + 1), np.float32), y0), ShapeError,
                 ["'x'", f"(batch, {FEATURES})", f"({BATCH}, {FEATURES + 1})"]),
    "rank": ((x0.reshape(BATCH, 2, 3), y0), ShapeError, ["'x'", "rank 2", "rank 3"]),
    "dtype": ((x0.astype(np.float64), y0), ShapeError, ["'x'", "float32", "float64"]),
    "label-dtype": ((x0, y0.astype(np.int32)), ShapeError, ["'y'", "int64", "int32"]),
    "label-rank": ((x0, y0.reshape(BATCH, 1)), ShapeError, ["'y'", "rank 1", "rank 2"]),
    "batch-mismatch": ((x0, y0[:BATCH - 1]), ShapeError, ["'y'", str(BATCH - 1), str(BATCH)]),
    "empty-batch": ((x0[:0], y0[:0]), ShapeError, ["batch size 0"]),
    "too-few": ((x0,), ShapeError, ["expected 2 inputs", "got 1"]),
    "too-many": ((x0, y0, y0), ShapeError, ["expected 2 inputs", "got 3"]),
    "not-an-array": ((x0.tolist(), y0), ShapeError, ["list"]),
    "label-too-large": ((x0, np.where(np.arange(BATCH) == 3, CLASSES, y0)), LabelError,
                        ["'y'", f"[0, {CLASSES})", f"{CLASSES}]"]),
    "label-negative": ((x0, np.where(np.arange(BATCH) == 3, -1, y0)), LabelError,
                       ["'y'", f"[0, {CLASSES})", "[-1,"]),
}


@pytest.mark.parametrize("loss", [losses.cross_entropy, losses.nll_loss],
                         ids=["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("case", BAD_FEEDS)
def test_bad_feed_raises_before_any_state_changes(case, loss):
    arrays, error, words = BAD_FEEDS[case]
    step = make_step(loss)
    step(*batch(1))
    before, n_exes = snapshot(step), len(step.executables)
    with pytest.raises(error) as info:
        step(*arrays)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"
    assert_unchanged(before, step)
    assert len(step.executables) == n_exes


def test_training_after_a_rejected_call_is_unaffected():
    losses_seen = []
    for interrupt in (False, True):
        step = make_step()
        run = []
        for i in range(1, 5):
            if interrupt and i == 3:
                with pytest.raises(LabelError):
                    step(batch(i)[0], np.full(BATCH, CLASSES))
            loss = step(*batch(i))
            run.append(float(loss))
            assert loss.step == i
        losses_seen.append((run, step.state_dict()))
    (a, sd_a), (b, sd_b) = losses_seen
    assert a == b
    for k in sd_a:
        np.testing.assert_array_equal(sd_a[k], sd_b[k], err_msg=k)


def test_mse_targets_are_not_checked_as_labels():
    nn.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 3))
    x = batch(0)[0]
    target = np.full((BATCH, 3), 100.0, np.float32)   # far outside any "class range"
    step = sg.compile_train_step(model, losses.mse, optim.SGD(lr=0.01), (x, target))
    assert np.isfinite(float(step(x, target)))
    with pytest.raises(ShapeError, match="'y'"):
        step(x, target[:, :2])


def test_predict_checks_its_input():
    nn.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, CLASSES))
    predict = sg.compile_predict(model, (x0,))
    assert predict(x0[:3]).shape == (3, CLASSES)
    with pytest.raises(ShapeError, match="'x'"):
        predict(x0[:, :2])
    with pytest.raises(ShapeError, match="float64"):
        predict(x0.astype(np.float64))


def test_dlpack_inputs_train_like_numpy_and_their_labels_are_checked():
    """DESIGN.md: inputs are NumPy arrays, CuPy arrays, or anything that speaks DLPack."""
    a, b = make_step(), make_step()
    for i in range(1, 4):
        x, y = batch(i)
        assert float(a(x, y)) == float(b(torch.from_numpy(x), torch.from_numpy(y)))
    before = snapshot(b)
    with pytest.raises(LabelError, match="'y'"):
        b(torch.from_numpy(x0), torch.full((BATCH,), CLASSES))
    with pytest.raises(ShapeError, match="float64"):
        b(torch.from_numpy(x0).double(), torch.from_numpy(y0))
    assert_unchanged(before, b)


def test_strided_and_single_sample_batches_train_like_contiguous_ones():
    a, b = make_step(dropout=0.0), make_step(dropout=0.0)
    x, y = batch(1)
    wide = np.zeros((BATCH, 2 * FEATURES), np.float32)
    wide[:, ::2] = x                                   # a strided view, not contiguous
    assert float(a(x, y)) == float(b(wide[:, ::2], y))
    assert float(a(np.asfortranarray(x), y)) == float(b(x, y))
    assert float(a(x[:1], y[:1])) == float(b(x[:1].copy(), y[:1].copy()))
    for k, v in a.state_dict().items():
        np.testing.assert_array_equal(v, b.state_dict()[k], err_msg=k)


def test_host_labels_are_checked_around_the_ignore_index():
    """check_labels: every label in [0, classes) or the loss's ignore_index (the all-valid
    batch is decided without masking; the others are masked first)."""
    from stepgraph.compile.feed import check_labels

    check_labels("y", np.array([0, 3, 1]), CLASSES, -100)
    check_labels("y", np.array([0, -100, 3]), CLASSES, -100)
    check_labels("y", np.array([-100, -100]), CLASSES, -100)
    check_labels("y", np.array([], np.int64), CLASSES, None)
    for bad, ignore in (([0, -100, 4], -100), ([-1, 2], -100), ([-100, 1], None), ([4], None),
                        ([5, CLASSES], CLASSES)):
        with pytest.raises(LabelError, match=r"'y'.*\[0, 4\)"):
            check_labels("y", np.array(bad), CLASSES, ignore)
