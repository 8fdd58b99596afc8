"""ops/erf.py: the NumPy references' erf. A float64 result is math.erf's, bit for bit; a
narrower one comes from piecewise polynomials that must stay within 4e-15 of math.erf relative,
keep erf's sign, zeros, limits and NaN, and round to float32 as math.erf does."""
from __future__ import annotations

import math

import numpy as np

from stepgraph.ops.activation import act_derivative, act_forward
from stepgraph.ops.erf import END, erf

SPECIAL = np.array([0.0, -0.0, 1e-300, -1e-30, 3e-8, END - 1e-12, END, -END, 7.5, np.inf,
                    -np.inf])


def exact(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def test_float64_results_are_math_erf():
    x = np.random.default_rng(0).standard_normal(1000) * 3
    assert np.array_equal(erf(x, np.float64), exact(x))


def test_narrow_results_are_within_a_few_float64_roundings():
    x = np.concatenate([np.linspace(-7, 7, 400_001), SPECIAL])
    got, want = erf(x, np.float32), exact(x)
    rel = np.abs(got - want) / np.maximum(np.abs(want), np.finfo(np.float64).tiny)
    assert rel.max() <= 4e-15, (rel.max(), x[rel.argmax()])
    assert np.array_equal(np.signbit(got), np.signbit(want))       # erf(-0) = -0
    assert got[x == np.inf].tolist() == [1.0] and got[x == -np.inf].tolist() == [-1.0]
    assert np.isnan(erf(np.array([np.nan]), np.float32)).all()


def test_narrow_results_round_to_float32_as_math_erf():
    x = np.random.default_rng(1).standard_normal(200_000).astype(np.float32)
    differ = erf(x, np.float32).astype(np.float32) != exact(x.astype(np.float64)).astype(np.float32)
    assert differ.sum() <= 2, differ.sum()          # a float32 near-tie at most, 1 ulp


def test_gelu_keeps_its_shape_and_dtype():
    z = np.random.default_rng(2).standard_normal((3, 5, 7)).astype(np.float32)
    for y in (act_forward(z, "gelu"), act_derivative(z, "gelu")):
        assert y.shape == z.shape and y.dtype == np.float32
    want = 0.5 * z * (1 + exact((z / math.sqrt(2.0)).astype(np.float64)))
    np.testing.assert_allclose(act_forward(z, "gelu"), want.astype(np.float32), rtol=2e-7,
                               atol=0)
