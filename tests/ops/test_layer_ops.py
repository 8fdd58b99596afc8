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
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import assert_close, randn, run_graph, seeded
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


@DTYPES
def test_layer_norm_over_several_trailing_dims(gen, dtype):
    arrays = {"x": randn(gen, 2, 3, 4, 5, dtype=dtype), "w": randn(gen, 4, 5, dtype=dtype),
              "b": randn(gen, 4, 5, dtype=dtype)}
    check(lambda x, w, b: F.layer_norm(x, (4, 5), w, b, 1e-3),
          lambda x, w, b: TF.layer_norm(x, (4, 5), w, b, 1e-3), arrays, ("x", "w", "b"),
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


INTERP = {   # size, scale_factor, mode, align_corners, recompute_scale_factor
    "nearest-x2": (None, 2, "nearest", None, None),
    "nearest-size": ((7, 3), None, "nearest", None, None),
    "bilinear-x2": (None, 2, "bilinear", False, None),
    "bilinear-size": ((7, 3), None, "bilinear", False, None),
    "bilinear-corners": ((7, 9), None, "bilinear", True, None),
    "bilinear-down": (None, (0.5, 1.5), "bilinear", False, None),
    "bilinear-recompute": (None, (1.7, 1.3), "bilinear", False, True),
}


@DTYPES
@pytest.mark.parametrize("case", list(INTERP))
def test_interpolate(gen, dtype, case):
    size, scale, mode, corners, recompute = INTERP[case]
    kw = dict(size=size, scale_factor=scale, mode=mode, align_corners=corners,
              recompute_scale_factor=recompute)
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


# ---- modules: parameters, init, state_dict keys, outputs -----------------------------------

def _run_module(m, *arrays):
    """m's output(s) on arrays through a one-call trace on numpy, parameters bound."""
    m.name_parameters()
    tr = Tracer(training=m.training)
    ins = [tr.input(a.shape, str(a.dtype), f"x{i}") for i, a in enumerate(arrays)]
    out = m(*ins)
    outs = out if isinstance(out, tuple) else (out,)
    tr.graph.outputs = {f"y{i}": o.value for i, o in enumerate(outs) if o is not None}
    got = run_graph(tr.graph, {f"x{i}": a for i, a in enumerate(arrays)},
                    {k: v for k, v in _bindings(m).items()})
    return [got.get(f"y{i}") for i in range(len(outs))]


def _bindings(m):
    return {name: p.storage for name, p in m._named_state()}


MODULE_CASES = {
    "GroupNorm": (lambda M: M.GroupNorm(2, 4), (2, 4, 3, 3)),
    "GroupNorm-no-affine": (lambda M: M.GroupNorm(4, 4, affine=False), (2, 4, 5)),
    "RMSNorm": (lambda M: M.RMSNorm([3, 4], eps=1e-5), (2, 3, 4)),
    "RMSNorm-no-affine": (lambda M: M.RMSNorm(4, elementwise_affine=False), (2, 4)),
    "LayerNorm-no-affine": (lambda M: M.LayerNorm(4, elementwise_affine=False), (2, 3, 4)),
    "LayerNorm-no-bias": (lambda M: M.LayerNorm(4, bias=False), (2, 4)),
    "LayerNorm-2d": (lambda M: M.LayerNorm([3, 4]), (2, 3, 4)),
    "Conv1d": (lambda M: M.Conv1d(4, 6, 3, stride=2, padding=1, groups=2), (2, 4, 9)),
    "ConvTranspose2d": (lambda M: M.ConvTranspose2d(4, 6, 3, stride=2, padding=1,
                                                    output_padding=1, groups=2), (2, 4, 5, 5)),
    "Upsample": (lambda M: M.Upsample(scale_factor=2, mode="bilinear"), (1, 2, 3, 4)),
    "UpsamplingNearest2d": (lambda M: M.UpsamplingNearest2d(size=(5, 7)), (1, 2, 3, 4)),
    "UpsamplingBilinear2d": (lambda M: M.UpsamplingBilinear2d(scale_factor=2), (1, 2, 3, 4)),
}


@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_modules_match_torch(case, gen):
    """Same state_dict keys and shapes; torch's weights loaded, the same output."""
    make, shape = MODULE_CASES[case]
    m, tm = make(nn), make(tnn)
    sd, want = m.state_dict(), tm.state_dict()
    assert [(k, v.shape) for k, v in sd.items()] == [(k, tuple(v.shape)) for k, v in want.items()]
    m.load_state_dict({k: v.numpy() for k, v in want.items()})
    x = randn(gen, *shape)
    (got,) = _run_module(m, x)
    assert_close(got, tm(torch.tensor(x)).detach().numpy(), 1e-5, case)


# Channel counts are large enough (>= 30 values per tensor) that the lower
# check fails by chance with odds below 1e-9: it catches a fan-in that is off
# by a factor of four, the upper one a fan-in that is too small.
@pytest.mark.parametrize("make,fan_in", [
    (lambda M: M.Conv1d(60, 30, 5, groups=3), 20 * 5),
    (lambda M: M.ConvTranspose2d(6, 40, (2, 3), groups=2), 20 * 2 * 3)])
def test_conv_init_bounds_like_torch(make, fan_in):
    m = make(nn)
    bound = 1 / np.sqrt(fan_in)
    for k, v in m.state_dict().items():
        assert v.numel() >= 30, k
        assert bound / 2 < np.abs(v).max() <= bound, k
    before = m.weight.numpy().copy()
    m.reset_parameters()
    assert not np.array_equal(before, m.weight.numpy())


MHA = {   # constructor kwargs, attn_mask kind, key_padding_mask kind, need_weights
    "self": (dict(), None, None, False),
    "batch-first-weights": (dict(batch_first=True), None, None, True),
    "cross-masks": (dict(), "bool", "bool", False),
    "float-mask-per-head-weights": (dict(bias=False, batch_first=True), "float3", None, True),
}


@pytest.mark.parametrize("case", list(MHA))
def test_multihead_attention_matches_torch(case, gen):
    kwargs, attn, padding, need_weights = MHA[case]
    batch_first = kwargs.get("batch_first", False)
    e, heads, n, length, s = 8, 2, 2, 3, 5
    m, tm = nn.MultiheadAttention(e, heads, **kwargs), tnn.MultiheadAttention(e, heads,
                                                                              **kwargs)
    assert [(k, v.shape) for k, v in m.state_dict().items()] == \
        [(k, tuple(v.shape)) for k, v in tm.state_dict().items()]
    bound = np.sqrt(6 / (4 * e))
    assert bound / 2 < np.abs(m.in_proj_weight.numpy()).max() <= bound
    m.load_state_dict({k: v.numpy() for k, v in tm.state_dict().items()})
    self_attn = case == "self"
    shape = lambda length: (n, length, e) if batch_first else (length, n, e)  # noqa: E731
    q = randn(gen, *shape(length))
    k, v = (q, q) if self_attn else (randn(gen, *shape(s)), randn(gen, *shape(s)))
    masks = {}
    if attn == "bool":
        masks["attn_mask"] = gen.random((length, s)) < 0.3
    elif attn == "float3":
        masks["attn_mask"] = randn(gen, n * heads, length, s)
    if padding == "bool":
        masks["key_padding_mask"] = np.zeros((n, s), bool)
        masks["key_padding_mask"][:, -2:] = True
    extra = dict(need_weights=need_weights, average_attn_weights=case != "float-mask-per-head-"
                 "weights")
    names = list(masks)

    class Call(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = m

        def forward(self, *xs):
            q_, k_, v_ = (xs[0], xs[0], xs[0]) if self_attn else xs[:3]
            rest = dict(zip(names, xs[1 if self_attn else 3:]))
            return self.attn(q_, k_, v_, **rest, **extra)

    got = _run_module(Call().eval(), *((q,) if self_attn else (q, k, v)), *masks.values())
    want = tm.eval()(torch.tensor(q), torch.tensor(k), torch.tensor(v),
                     **{a: torch.tensor(b) for a, b in masks.items()}, **extra)
    assert_close(got[0], want[0].detach().numpy(), 1e-5, "output")
    if need_weights:
        assert_close(got[1], want[1].detach().numpy(), 1e-5, "weights")
    else:
        assert got[1] is None and want[1] is None


# ---- max pooling: dilation, ceil_mode, adaptive ---------------------------------------------

MAXPOOL = {   # x shape, kernel, stride, padding, dilation, ceil_mode
    "ceil": ((2, 2, 7, 8), 2, 2, 0, 1, True),
    "ceil-pad": ((1, 2, 8, 9), 3, 2, 1, 1, True),
    "ceil-window-in-padding": ((1, 1, 6, 6), 3, 3, 1, 1, True),
    "dilated": ((2, 2, 9, 9), 3, 1, 1, 2, False),
    "dilated-ceil": ((1, 2, 10, 9), (2, 3), (3, 2), (1, 1), (2, 1), True),
}


@DTYPES
@pytest.mark.parametrize("case", list(MAXPOOL))
def test_max_pool2d_dilation_and_ceil_mode(gen, dtype, case):
    shape, k, s, p, d, ceil = MAXPOOL[case]
    kw = dict(kernel_size=k, stride=s, padding=p, dilation=d, ceil_mode=ceil)
    check(lambda x: F.max_pool2d(x, **kw), lambda x: TF.max_pool2d(x, **kw),
          {"x": randn(gen, *shape, dtype=dtype)}, ("x",), dtype, gen)


@DTYPES
@pytest.mark.parametrize("out", [(3, 4), 1, (None, 3), (7, 2), (5, 10)])
def test_adaptive_max_pool2d(gen, dtype, out):
    check(lambda x: F.adaptive_max_pool2d(x, out), lambda x: TF.adaptive_max_pool2d(x, out),
          {"x": randn(gen, 2, 3, 7, 10, dtype=dtype)}, ("x",), dtype, gen)


def test_max_pool_modules_match_torch(gen):
    x = randn(gen, 2, 3, 7, 9)
    for m, tm in [(nn.MaxPool2d(3, 2, 1, dilation=2, ceil_mode=True),
                   tnn.MaxPool2d(3, 2, 1, dilation=2, ceil_mode=True)),
                  (nn.AdaptiveMaxPool2d((4, 5)), tnn.AdaptiveMaxPool2d((4, 5))),
                  (nn.AdaptiveAvgPool2d((4, 5)), tnn.AdaptiveAvgPool2d((4, 5)))]:
        (got,) = _run_module(m, x)
        assert_close(got, tm(torch.tensor(x)).numpy(), 1e-6, repr(m))


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_dropout_trains_and_eval_is_deterministic(need_weights, gen):
    """Training draws dropout masks (its first loss is not the eval loss of the same
    weights); eval is the same every call; the attention's parameters get updates."""
    import stepgraph as sg
    from stepgraph import optim

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x, need_weights=need_weights)[0].mean(1)

    model = Net()
    x, y = randn(gen, 3, 5, 8), randn(gen, 3, 8)
    predict = sg.compile_predict(model.eval(), example_inputs=(x,))
    out = predict(x)
    np.testing.assert_array_equal(out, predict(x))
    eval_loss = float(np.mean((out - y) ** 2))
    model.train()
    step = sg.compile_train_step(model, loss=F.mse_loss, optimizer=optim.SGD(lr=0.1),
                                 example_inputs=(x, y), seed=3)
    before = model.state_dict()["attn.in_proj_weight"].clone()
    assert abs(float(step(x, y)) - eval_loss) > 1e-4 * eval_loss
    assert not np.array_equal(before, model.state_dict()["attn.in_proj_weight"])
