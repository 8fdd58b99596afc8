"""isnan, isinf, isposinf, isneginf, isfinite, isclose, all, any, allclose and equal on the
values OpInfo's random samples never hold (NaN, +-inf, equal infinities, ties at the
tolerance), against torch's, as Tensor methods and torch.* functions, eager and traced."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import stepgraph as sg
from tests.reference import assert_close_to_reference

NAN, INF = float("nan"), float("inf")
X = np.array([[1.0, NAN, INF, -INF, 0.0, -2.5], [1e-9, 3.0, NAN, INF, 1.0, -0.0]], np.float32)
Y = np.array([[1.0 + 1e-6, NAN, INF, INF, 1e-9, -2.5 - 1e-3], [0.0, 3.0, 1.0, INF, 1.0 + 2e-5,
                                                                0.0]], np.float32)


@pytest.mark.parametrize("name", ["isnan", "isinf", "isposinf", "isneginf", "isfinite"])
@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_the_tests_of_special_values_are_torchs(name, dtype):
    x = X if dtype == "float32" else np.array([[1, -3, 0]], np.int64)
    want = getattr(torch, name)(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(getattr(sg, name)(sg.from_numpy(x)).numpy(), want)
    np.testing.assert_array_equal(getattr(sg.from_numpy(x), name)().numpy(), want)


@pytest.mark.parametrize("equal_nan", [False, True])
@pytest.mark.parametrize("other", ["tensor", 1.0, NAN, INF])
def test_isclose_is_torchs(equal_nan, other):
    kw = dict(rtol=1e-5, atol=1e-8, equal_nan=equal_nan)
    t_other = torch.from_numpy(Y) if other == "tensor" else other
    s_other = sg.from_numpy(Y) if other == "tensor" else other
    want = torch.isclose(torch.from_numpy(X), t_other if other == "tensor" else
                         torch.full_like(torch.from_numpy(X), other), **kw).numpy()
    np.testing.assert_array_equal(sg.isclose(sg.from_numpy(X), s_other, **kw).numpy(), want)
    assert sg.allclose(sg.from_numpy(X), s_other, **kw) == bool(want.all())


@pytest.mark.parametrize("dim", [None, 0, 1, (0, 1)])
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("name", ["all", "any"])
def test_all_and_any_are_torchs(name, dim, keepdim):
    x = np.array([[0.0, NAN, 2.0], [0.0, 0.0, 0.0]], np.float32)   # NaN counts as true
    t = torch.from_numpy(x)
    want = getattr(t, name)() if dim is None else getattr(t, name)(dim=dim, keepdim=keepdim)
    got = getattr(sg.from_numpy(x), name)(dim, keepdim) if dim is not None else \
        getattr(sg, name)(sg.from_numpy(x))
    assert got.dtype == "bool"
    np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_allclose_and_equal_answer_with_python_bools_as_torch():
    a, b = sg.tensor([1.0, 2.0]), sg.tensor([1.0, 2.0 + 1e-6])     # 4 float32 ulps apart
    assert sg.allclose(a, b) is True and sg.equal(a, b) is False
    assert sg.equal(a, sg.tensor([1.0, 2.0])) is True
    assert sg.equal(a, sg.tensor([[1.0, 2.0]])) is False             # shapes differ
    assert sg.equal(sg.tensor([NAN]), sg.tensor([NAN])) is False
    with pytest.raises(RuntimeError, match="did not match"):
        sg.allclose(sg.tensor([1]), sg.tensor([1.0]))


def finite_mean(ns, x, scale):
    """The mean of the entries that are finite and not close to 0, written once for torch
    and stepgraph (`ns`)."""
    ok = x.isfinite() & ~ns.isclose(x, ns.zeros_like(x))
    kept = ns.where(ok, x, 0.0) * scale
    return kept.sum() / ok.float().sum() + 0.0 * ok.any().float()


def test_the_tests_trace_into_a_step():
    """In a traced forward they are ops of the step, judged by the tolerance policy against
    torch float64 of the same expression, bound by torch float32's error."""

    class Finite(sg.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = sg.nn.Parameter(np.ones(1, np.float32))

        def forward(self, x):
            return finite_mean(sg, x, self.scale)

    predict = sg.compile_predict(Finite(), (sg.from_numpy(X),), device="cpu")
    got = float(predict(sg.from_numpy(X)))
    ref64, ref32 = (float(finite_mean(torch, torch.from_numpy(X).to(dtype),
                                      torch.ones(1, dtype=dtype)))
                    for dtype in (torch.float64, torch.float32))
    assert_close_to_reference(got, ref64, ref32, "masked mean")
