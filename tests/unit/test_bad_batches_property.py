"""Property: whatever batch a train step is fed (wrong shapes, ranks, dtypes, batch sizes,
empty, non-contiguous, on another device, not an array, labels out of range, NaN or Inf),
the only errors are typed ones, and a batch that is not trained on leaves every parameter,
the optimizer state and the step counter bit for bit as they were (numpy backend)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stepgraph as sg
from stepgraph import losses, nn, optim
from stepgraph.errors import LabelError, NonFiniteError, ShapeError

BATCH, FEATURES, CLASSES = 4, 3, 5
FLAWS = ("none", "features", "rank", "x-dtype", "y-dtype", "batch", "empty", "device", "list",
         "label", "nan", "inf")
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


class ForeignDeviceArray:
    """Speaks DLPack from a CUDA device (type 2): a step on the CPU must refuse it."""

    def __init__(self, array: np.ndarray):
        self.shape, self.dtype, self._array = array.shape, array.dtype, array

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        raise BufferError("device memory")


@st.composite
def feeds(draw, flaw: str):
    """(x, y, expectation) with `flaw`: expectation "shape" (a ShapeError at the call),
    "labels" (labels out of range), "non-finite" (a NaN or Inf input) or "good"."""
    n = draw(st.sampled_from([BATCH, 1, 7]))
    values = st.floats(-4, 4, allow_nan=False, width=32)
    x = np.array(draw(st.lists(values, min_size=n * FEATURES, max_size=n * FEATURES)),
                 np.float32).reshape(n, FEATURES)
    y = np.array(draw(st.lists(st.integers(0, CLASSES - 1), min_size=n, max_size=n)), np.int64)
    if flaw == "features":
        x = np.zeros((n, draw(st.sampled_from([FEATURES - 1, FEATURES + 2]))), np.float32)
    elif flaw == "rank":
        x = x.reshape(n, FEATURES, 1)
    elif flaw == "x-dtype":
        x = x.astype(draw(st.sampled_from([np.float64, np.float16, np.int32, np.bool_])))
    elif flaw == "y-dtype":
        y = y.astype(draw(st.sampled_from([np.int32, np.float32, np.uint8])))
    elif flaw == "batch":
        y = np.concatenate([y, y[:1]])
    elif flaw == "empty":
        x, y = x[:0], y[:0]
    elif flaw == "device":
        x = ForeignDeviceArray(x)
    elif flaw == "list":
        x = x.tolist()
    elif flaw == "label":
        y[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, CLASSES, 2**40, -2**40]))
    elif flaw in ("nan", "inf"):
        x[draw(st.integers(0, n - 1)), draw(st.integers(0, FEATURES - 1))] = \
            np.nan if flaw == "nan" else draw(st.sampled_from([np.inf, -np.inf]))
    expect = {"none": "good", "label": "labels", "nan": "non-finite",
              "inf": "non-finite"}.get(flaw, "shape")
    if isinstance(x, np.ndarray) and x.ndim == 2 and draw(st.booleans()):
        x = np.asfortranarray(x) if draw(st.booleans()) else np.repeat(x, 2, axis=1)[:, ::2]
    return x, y, expect


def make_step(policy: str):
    nn.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(8, CLASSES))
    gen = np.random.default_rng(0)
    example = (gen.standard_normal((BATCH, FEATURES)).astype(np.float32),
               gen.integers(0, CLASSES, BATCH))
    step = sg.compile_train_step(model, losses.cross_entropy, optim.AdamW(lr=0.01), example,
                                 on_bad_batch=policy)
    step(*example)
    return step, example


def state(step) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in step.state_dict().items()}


def unchanged(before: dict, step) -> bool:
    after = step.state_dict()
    return before.keys() == after.keys() and all(np.array_equal(before[k], after[k])
                                                  for k in before)


@pytest.mark.parametrize("flaw", FLAWS)
@SETTINGS
@given(data=st.data())
def test_raise_policy_only_typed_errors_and_untouched_state(flaw, data):
    x, y, expect = data.draw(feeds(flaw))
    step, good = make_step("raise")
    before = state(step)
    if expect in ("shape", "labels"):      # refused before anything runs
        with pytest.raises(ShapeError if expect == "shape" else LabelError):
            step(x, y)
        assert unchanged(before, step)
        return
    loss = step(x, y)
    if expect == "good":
        assert np.isfinite(float(loss)) and not unchanged(before, step)
        return
    assert unchanged(before, step)         # non-finite: not applied, reported next
    with pytest.raises(NonFiniteError) as info:
        step(*good)
    assert info.value.step == loss.step
    assert unchanged(before, step)
    assert np.isfinite(float(step(*good)))


@pytest.mark.parametrize("flaw", FLAWS)
@SETTINGS
@given(data=st.data())
def test_skip_policy_only_typed_errors_and_untouched_state(flaw, data):
    x, y, expect = data.draw(feeds(flaw))
    step, good = make_step("skip")
    before = state(step)
    if expect == "shape":
        with pytest.raises(ShapeError):
            step(x, y)
        assert unchanged(before, step) and step.skipped_steps == 0
        return
    loss = step(x, y)
    float(loss)                            # never raises under "skip"
    assert loss.skipped == (expect != "good")
    assert unchanged(before, step) == (expect != "good")
    assert step.skipped_steps == (expect != "good")
    assert np.isfinite(float(step(*good)))
