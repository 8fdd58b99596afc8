"""GroupNorm, RMSNorm, LayerNorm without affine, Conv1d, ConvTranspose2d, interpolate and
adaptive pooling to any size: forward and input/parameter gradients against PyTorch (float32
and float64), and the modules' parameters, init and state_dict keys against torch.nn's."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch import nn as tnn

from stepgraph import nn
from stepgraph.nn import functional as F
from tests.ops.helpers import randn, seeded
from tests.ops.test_norm_pool_ops import check_against_torch

DTYPES = pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
RTOL = {np.float32: 2e-5, np.float64: 1e-10}


@pytest.fixture
def gen(request) -> np.random.Generator:
    return seeded(request.node.name)


def check(ours, theirs, arrays, wrt, dtype, gen):
    """ours(**traced) against theirs(**torch tensors): output, and gradients of the mse
    against a random target."""
    out = theirs(**{k: torch.tensor(v) for k, v in arrays.items()})
    arrays = {**arrays, "target": randn(gen, *out.shape, dtype=dtype)}
    check_against_torch(lambda t, i: ours(**{k: v for k, v in i.items() if k != "target"}),
                        theirs, arrays, wrt, False, RTOL[dtype])


@DTYPES
@pytest.mark.parametrize("shape,groups", [((2, 6, 5), 3), ((2, 4, 3, 3), 2), ((3, 4, 2, 2), 4)])
def test_group_norm(gen, dtype, shape, groups):
    c = shape[1]
    arrays = {"x": randn(gen, *shape, dtype=dtype), "w": randn(gen, c, dtype=dtype),
              "b": randn(gen, c, dtype=dtype)}
    check(lambda x, w, b: F.group_norm(x, groups, w, b, 1e-4),
          lambda x, w, b: TF.group_norm(x, groups, w, b, 1e-4), arrays, ("x", "w", "b"),
          dtype, gen)


@DTYPES
@pytest.mark.parametrize("normalized", [(5,), (3, 5)])
@pytest.mark.parametrize("eps", [None, 1e-3])
def test_rms_norm(gen, dtype, normalized, eps):
    arrays = {"x": randn(gen, 2, 3, 5, dtype=dtype), "w": randn(gen, *normalized, dtype=dtype)}
    check(lambda x, w: F.rms_norm(x, normalized, w, eps),
          lambda x, w: TF.rms_norm(x, normalized, w, eps), arrays, ("x", "w"), dtype, gen)


@DTYPES
def test_layer_norm_without_affine_and_without_bias(gen, dtype):
    arrays = {"x": randn(gen, 3, 4, 6, dtype=dtype), "w": randn(gen, 6, dtype=dtype)}
    check(lambda x, w: F.layer_norm(x, (6,)) + F.layer_norm(x, (6,), w),
          lambda x, w: TF.layer_norm(x, (6,)) + TF.layer_norm(x, (6,), w), arrays, ("x", "w"),
          dtype, gen)


CONV1D = {   # x shape, weight shape, stride, padding, dilation, groups
    "plain": ((2, 3, 9), (4, 3, 3), 1, 0, 1, 1),
    "strided-padded": ((2, 4, 10), (6, 2, 3), 2, 1, 1, 2),
    "dilated-same": ((1, 2, 8), (3, 2, 3), 1, "same", 2, 1),
}


@DTYPES
@pytest.mark.parametrize("case", list(CONV1D))
def test_conv1d(gen, dtype, case):
    xs, ws, stride, padding, dilation, groups = CONV1D[case]
    arrays = {"x": randn(gen, *xs, dtype=dtype), "w": randn(gen, *ws, dtype=dtype),
              "b": randn(gen, ws[0], dtype=dtype)}
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    check(lambda x, w, b: F.conv1d(x, w, b, **kw), lambda x, w, b: TF.conv1d(x, w, b, **kw),
          arrays, ("x", "w", "b"), dtype, gen)


CONVT = {   # x shape, weight shape, stride, padding, output_padding, groups, dilation
    "plain": ((2, 3, 4, 5), (3, 2, 3, 3), 1, 0, 0, 1, 1),
    "stride2": ((2, 3, 4, 4), (3, 4, 3, 3), 2, 1, 1, 1, 1),
    "asym": ((1, 2, 3, 5), (2, 3, 2, 4), (2, 3), (0, 1), (1, 0), 1, 1),
    "big-padding": ((1, 2, 5, 5), (2, 2, 3, 3), 1, 3, 0, 1, 1),
    "groups-dilation": ((2, 4, 4, 3), (4, 3, 3, 2), 2, 1, 1, 2, 2),
}


@DTYPES
@pytest.mark.parametrize("case", list(CONVT))
def test_conv_transpose2d(gen, dtype, case):
    xs, ws, stride, padding, out_pad, groups, dilation = CONVT[case]
    arrays = {"x": randn(gen, *xs, dtype=dtype), "w": randn(gen, *ws, dtype=dtype),
              "b": randn(gen, ws[1] * groups, dtype=dtype)}
    kw = dict(stride=stride, padding=padding, output_padding=out_pad, groups=groups,
              dilation=dilation)
    check(lambda x, w, b: F.conv_transpose2d(x, w, b, **kw),
          lambda x, w, b: TF.conv_transpose2d(x, w, b, **kw), arrays, ("x", "w", "b"), dtype,
          gen)


INTERP = {   # size, scale_factor, mode, align_corners
    "nearest-x2": (None, 2, "nearest", None),
    "nearest-size": ((7, 3), None, "nearest", None),
    "bilinear-x2": (None, 2, "bilinear", False),
    "bilinear-size": ((7, 3), None, "bilinear", False),
    "bilinear-corners": ((7, 9), None, "bilinear", True),
    "bilinear-down": (None, (0.5, 1.5), "bilinear", False),
}


@DTYPES
@pytest.mark.parametrize("case", list(INTERP))
def test_interpolate(gen, dtype, case):
    size, scale, mode, corners = INTERP[case]
    kw = dict(size=size, scale_factor=scale, mode=mode, align_corners=corners)
    check(lambda x: F.interpolate(x, **kw), lambda x: TF.interpolate(x, **kw),
          {"x": randn(gen, 2, 3, 5, 6, dtype=dtype)}, ("x",), dtype, gen)


@DTYPES
@pytest.mark.parametrize("out", [(3, 4), 5, (None, 2), (7, 1)])
def test_adaptive_avg_pool2d_any_size(gen, dtype, out):
    check(lambda x: F.adaptive_avg_pool2d(x, out), lambda x: TF.adaptive_avg_pool2d(x, out),
          {"x": randn(gen, 2, 3, 7, 10, dtype=dtype)}, ("x",), dtype, gen)


# ---- attention masks -------------------------------------------------------------------------

SDPA = {   # q, k shapes (v as k), mask shape and kind, is_causal
    "bool-LS": ((2, 3, 4, 8), (2, 3, 6, 8), (4, 6), "bool", False),
    "bool-broadcast-keys": ((2, 3, 4, 8), (2, 3, 6, 8), (2, 1, 1, 6), "bool", False),
    "float-full": ((2, 2, 5, 4), (2, 2, 5, 4), (2, 2, 5, 5), "float", False),
    "causal-L<S": ((2, 2, 3, 4), (2, 2, 6, 4), None, None, True),
    "causal-L>S": ((1, 2, 6, 4), (1, 2, 4, 4), None, None, True),
    "causal-L=S": ((1, 2, 5, 4), (1, 2, 5, 4), None, None, True),
}


def _mask(gen, shape, kind):
    if kind == "bool":
        m = gen.random(shape) < 0.7
        m[..., 0] = True                  # every query attends at least one key
        return m
    return randn(gen, *shape)


@DTYPES
@pytest.mark.parametrize("case", list(SDPA))
def test_sdpa_masks(gen, dtype, case):
    qs, ks, ms, kind, causal = SDPA[case]
    arrays = {"q": randn(gen, *qs, dtype=dtype), "k": randn(gen, *ks, dtype=dtype),
              "v": randn(gen, *ks, dtype=dtype)}
    if kind:
        m = _mask(gen, ms, kind)
        arrays["m"] = m if kind == "bool" else m.astype(dtype)
    check(lambda q, k, v, m=None: F.scaled_dot_product_attention(q, k, v, m, is_causal=causal),
          lambda q, k, v, m=None: TF.scaled_dot_product_attention(q, k, v, m,
                                                                   is_causal=causal),
          arrays, ("q", "k", "v"), dtype, gen)
