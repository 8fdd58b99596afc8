"""torch.multinomial for sampling loops (eager tensors, the host generator): torch's shapes,
dtype and errors, the distribution of each draw with and without replacement (against the
exact probabilities), zero weights, seeding, and the refusal inside a traced forward."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph.errors import UnsupportedOpError

P = np.array([1.0, 2.0, 0.0, 7.0])            # unnormalised, one zero weight
DRAWS = 20000


def test_shapes_dtype_and_seeding():
    sg.manual_seed(3)
    a = sg.multinomial(sg.from_numpy(P), 2)
    assert a.dtype == "int64" and tuple(a.shape) == (2,)
    rows = sg.multinomial(sg.from_numpy(np.stack([P, P[::-1].copy()])), 3, replacement=True)
    assert tuple(rows.shape) == (2, 3)
    sg.manual_seed(3)
    np.testing.assert_array_equal(sg.multinomial(sg.from_numpy(P), 2).numpy(), a.numpy())
    g1, g2 = sg.Generator().manual_seed(5), sg.Generator().manual_seed(5)
    np.testing.assert_array_equal(sg.multinomial(sg.from_numpy(P), 3, generator=g1).numpy(),
                                  sg.multinomial(sg.from_numpy(P), 3, generator=g2).numpy())


@pytest.mark.parametrize("weights,n,replacement", [
    ([1.0, -1.0], 1, False), ([1.0, float("nan")], 1, True), ([0.0, 0.0], 1, True),
    ([1.0, 2.0], 3, False), ([1.0, 2.0], 0, True), ([[[1.0]]], 1, True)])
def test_mistakes_raise_torchs_errors(weights, n, replacement):
    with pytest.raises(RuntimeError) as want:
        torch.multinomial(torch.tensor(weights), n, replacement)
    with pytest.raises(RuntimeError) as got:
        sg.multinomial(sg.tensor(weights), n, replacement)
    assert str(got.value) == str(want.value)


def test_draws_follow_the_weights_with_and_without_replacement():
    """Frequencies of 20,000 draws within 0.015 of the exact probabilities: each draw with
    replacement, and the first and second draws without (P(second = j) = sum over i != j of
    p_i p_j / (1 - p_i)); a zero weight is never drawn with replacement, and comes after the
    positive ones without."""
    sg.manual_seed(0)
    p = P / P.sum()
    with_replacement = sg.multinomial(sg.from_numpy(P), DRAWS, replacement=True).numpy()
    assert np.abs(np.bincount(with_replacement, minlength=4) / DRAWS - p).max() < 0.015
    rows = sg.multinomial(sg.from_numpy(np.tile(P, (DRAWS, 1))), 4).numpy()
    second = np.array([sum(p[i] * p[j] / (1 - p[i]) for i in range(4) if i != j)
                       for j in range(4)])
    assert np.abs(np.bincount(rows[:, 0], minlength=4) / DRAWS - p).max() < 0.015
    assert np.abs(np.bincount(rows[:, 1], minlength=4) / DRAWS - second).max() < 0.015
    assert (rows[:, 3] == 2).all()                       # the zero weight, last
    assert (np.sort(rows, 1) == np.arange(4)).all()     # a permutation: no repeats


def test_inside_a_traced_forward_it_is_refused():
    class Sampler(sg.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = sg.nn.Linear(4, 3)

        def forward(self, x):
            return sg.multinomial(self.lin(x).softmax(-1), 1)

    with pytest.raises(UnsupportedOpError, match=r"torch\.multinomial .*called in .*outside "
                       r"the step"):
        sg.compile_predict(Sampler(), (np.zeros((2, 4), np.float32),), device="cpu")
