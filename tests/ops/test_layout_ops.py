"""The image ops with attrs layout "NHWC" (channels-last, compile/layout.py) on the numpy
backend: each equals its NCHW self on transposed operands (forward and every gradient), and
their VJP rules pass finite-difference checks, in float64."""
from __future__ import annotations

import numpy as np
import pytest

from tests.ops.helpers import op_forward, op_vjp, seeded
from tests.ops.test_ops_fd import RTOL, directional_fd, f64

NHWC, NCHW = (0, 2, 3, 1), (0, 3, 1, 2)
BN = dict(eps=1e-5, momentum=0.1, affine=True, track=False)

# name -> (op, attrs, inputs(gen) in NCHW, differentiable inputs); 4-D inputs are stored
# NHWC for the channels-last run (a conv weight (O, C, kh, kw) as (O, kh, kw, C)).
CASES = {
    "conv2d-bias-stride": ("conv2d", dict(stride=(2, 1), padding=(1, 2)),
                           lambda g: {"x": f64(g, 2, 3, 7, 6), "w": f64(g, 4, 3, 3, 2),
                                      "b": f64(g, 4)}, ("x", "w", "b")),
    "conv2d-groups-dilation": ("conv2d", dict(stride=(1, 1), padding=(2, 1), dilation=(2, 1),
                                              groups=2),
                               lambda g: {"x": f64(g, 2, 4, 6, 5), "w": f64(g, 6, 2, 3, 3)},
                               ("x", "w")),
    "conv2d-1x1": ("conv2d", dict(stride=(2, 2), padding=(0, 0)),
                   lambda g: {"x": f64(g, 2, 3, 5, 5), "w": f64(g, 4, 3, 1, 1)}, ("x", "w")),
    "maxpool2d": ("maxpool2d", dict(kernel=(3, 3), stride=(2, 2), padding=(1, 1)),
                  lambda g: {"x": f64(g, 2, 3, 7, 6)}, ("x",)),
    "avgpool2d": ("avgpool2d", dict(kernel=(3, 2), stride=(2, 2), padding=(1, 1),
                                    count_include_pad=False),
                  lambda g: {"x": f64(g, 2, 3, 7, 6)}, ("x",)),
    "avgpool2d-global": ("avgpool2d", dict(kernel=(4, 4), stride=(4, 4), padding=(0, 0),
                                           count_include_pad=True),
                         lambda g: {"x": f64(g, 3, 5, 4, 4)}, ("x",)),
    "batch_norm_train": ("batch_norm_train", dict(BN, act="none"),
                         lambda g: {"x": f64(g, 4, 3, 2, 3), "w": f64(g, 3), "b": f64(g, 3)},
                         ("x", "w", "b")),
    "batch_norm_train-relu-plain": ("batch_norm_train", dict(BN, affine=False, act="relu"),
                                    lambda g: {"x": f64(g, 3, 5, 3, 2)}, ("x",)),
}


def channels_last(arrays: dict) -> dict:
    return {k: np.ascontiguousarray(a.transpose(NHWC)) if a.ndim == 4 else a
            for k, a in arrays.items()}


def back(a: np.ndarray) -> np.ndarray:
    return a.transpose(NCHW) if a.ndim == 4 else a


@pytest.mark.parametrize("case", CASES)
def test_nhwc_equals_nchw(case):
    op, attrs, make_inputs, wrt = CASES[case]
    gen = seeded(f"nhwc{case}")
    arrays = make_inputs(gen)
    want = op_forward(op, arrays, **attrs)
    got = op_forward(op, channels_last(arrays), **attrs, layout="NHWC")
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(back(g), w, rtol=1e-12, atol=1e-12)
    v = f64(gen, *want[0].shape)
    grads = op_vjp(op, arrays, v, wrt, **attrs)
    grads_nhwc = op_vjp(op, channels_last(arrays), np.ascontiguousarray(v.transpose(NHWC)),
                        wrt, **attrs, layout="NHWC")
    for name in wrt:
        np.testing.assert_allclose(back(grads_nhwc[name]), grads[name], rtol=1e-12,
                                   atol=1e-12, err_msg=f"{case} d/d{name}")


@pytest.mark.parametrize("case", CASES)
def test_nhwc_vjp_matches_finite_differences(case):
    op, attrs, make_inputs, wrt = CASES[case]
    attrs = dict(attrs, layout="NHWC")
    gen = seeded(f"nhwcfd{case}")
    arrays = channels_last(make_inputs(gen))
    y = op_forward(op, arrays, **attrs)[0]
    v = f64(gen, *y.shape)
    grads = op_vjp(op, arrays, v, wrt, **attrs)
    for name in wrt:
        u = f64(gen, *arrays[name].shape)
        analytic = float(np.sum(grads[name] * u))
        numeric = directional_fd(op, attrs, arrays, name, u, v)
        assert abs(analytic - numeric) <= RTOL * max(abs(numeric), 1.0), \
            f"{case} d/d{name}: <J^T v, u> = {analytic!r}, finite difference {numeric!r}"
