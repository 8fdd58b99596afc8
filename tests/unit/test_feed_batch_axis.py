"""The batch axis of each step input (compile/feed.py): decided once from the example inputs
(the first input's axis 0, and each other input's first axis of that size), the only axis
that may change between calls, and the same size in every input that has one."""
from __future__ import annotations

import numpy as np
import pytest

from stepgraph.compile.feed import check_feed, check_steps_feed, signature_of
from stepgraph.errors import ShapeError

NAMES = ("x", "h0", "mask", "y")


def arrays(batch: int, layers: int = 2, steps: tuple = ()):
    return (np.zeros((*steps, batch, 12), np.int64),
            np.zeros((*steps, layers, batch, 24), np.float32),
            np.zeros((*steps, 12, 12), np.float32),
            np.zeros((*steps, batch), np.int64))


def test_batch_axes_come_from_the_example():
    sig = signature_of(NAMES, arrays(4))
    assert [s.batch_axis for s in sig] == [0, 1, None, 0]
    assert sig[1].dims() == "(2, batch, 24)" and sig[2].dims() == "(12, 12)"


def test_a_partial_batch_shrinks_every_batch_axis_and_only_those():
    sig = signature_of(NAMES, arrays(4))
    got = check_feed(sig, arrays(3))
    assert [s.shape for s in got] == [(3, 12), (2, 3, 24), (12, 12), (3,)]
    assert [s.batch_axis for s in got] == [0, 1, None, 0]
    with pytest.raises(ShapeError, match=r"'h0': expected shape \(2, batch, 24\), got "
                       r"\(3, 3, 24\)"):
        check_feed(sig, arrays(3, layers=3))
    x, h0, mask, y = arrays(3)
    with pytest.raises(ShapeError, match=r"'mask': expected shape \(12, 12\)"):
        check_feed(sig, (x, h0, mask[:3], y))
    with pytest.raises(ShapeError, match=r"'h0': batch size 4 does not match 'x' batch size "
                       r"3 \(its batch axis is 1"):
        check_feed(sig, (x, arrays(4)[1], mask, y))


def test_the_first_axis_of_the_batch_size_wins_when_two_have_it():
    """With as many layers as sequences, h0's axis 0 is taken for the batch: a partial batch
    is then refused, by a message that names the shape the step expects."""
    sig = signature_of(NAMES, arrays(2))
    assert sig[1].batch_axis == 0
    with pytest.raises(ShapeError, match=r"'h0': expected shape \(batch, 2, 24\)"):
        check_feed(sig, arrays(1))


def test_steps_feeds_stack_steps_before_each_batch_axis():
    sig = signature_of(NAMES, arrays(4))
    one, launches = check_steps_feed(sig, arrays(3, steps=(4,)), steps=2)
    assert launches == 2 and one[1].shape == (2, 3, 24)
    with pytest.raises(ShapeError, match=r"'h0': expected shape \(2, 2, batch, 24\)"):
        check_steps_feed(sig, arrays(3, layers=1, steps=(4,)), steps=2)
