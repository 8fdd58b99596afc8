"""The 3-D family against PyTorch: conv3d (stride, padding, dilation, groups, "same"), max_pool3d
(padding, dilation, ceil_mode), avg_pool3d (ceil_mode, count_include_pad, divisor_override),
adaptive_avg_pool3d and batch_norm over 5-D input, forward and gradients. float32 results are
judged against torch in float64, the bound a small multiple of torch float32's own error there;
float64 results agree to rounding. Finite-difference VJP checks of the ops in float64; the
modules' constructors, parameters, init and state_dict keys against torch.nn's; a small 3-D CNN
trained three steps from one state_dict as torch trains it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch import nn as tnn

import stepgraph as sg
from stepgraph import nn, optim
from stepgraph.errors import ShapeError, UnsupportedOpError
from stepgraph.ir.trace import Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import (assert_close, forward_and_grads, randn, relative_error,
                               seeded, torch_forward_and_grads, trace_inputs)
from tests.ops.test_norm_pool_ops import fd_check
from tests.reference import assert_changes_close

FUSED = pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
# float32 vs torch float64: at most this many times torch float32's own error, with a floor of
# a few float32 roundings (max pooling is exact in both: error 0)
ERROR_FACTOR, ERROR_FLOOR = 4.0, 1e-6


@pytest.fixture
def gen(request) -> np.random.Generator:
    return seeded(request.node.name)


def check(body, torch_fn, arrays64, wrt, fused=False):
    """body on float32 and float64 copies of arrays64 (x, weights, target) vs torch_fn: float64
    to 1e-10; float32 judged against torch float64, the bound ERROR_FACTOR x torch float32's
    error (each output and gradient as a whole)."""
    arrays32 = {k: v.astype(np.float32) for k, v in arrays64.items()}
    want, want_grads = torch_forward_and_grads(torch_fn, arrays64, wrt)
    out64, grads64 = forward_and_grads(body, arrays64, wrt, fused)
    assert out64.dtype == np.float64
    assert_close(out64, want, 1e-10, "float64 forward")
    for name in wrt:
        assert_close(grads64[name], want_grads[name], 1e-10, f"float64 grad of {name}")
    out32, grads32 = forward_and_grads(body, arrays32, wrt, fused)
    t_out32, t_grads32 = torch_forward_and_grads(torch_fn, arrays32, wrt)
    pairs = [("forward", out32, t_out32, want)] + [
        (f"grad of {n}", grads32[n], t_grads32[n], want_grads[n]) for n in wrt]
    for what, got, torch32, exact in pairs:
        assert got.dtype == np.float32, what
        bound = ERROR_FACTOR * relative_error(torch32, exact) + ERROR_FLOOR
        assert relative_error(got, exact) <= bound, (what, relative_error(got, exact), bound)


def with_target(arrays, torch_fn, gen):
    out = torch_fn(**{k: torch.tensor(v) for k, v in arrays.items()})
    return {**arrays, "target": randn(gen, *out.shape, dtype=np.float64)}


# ---- conv3d --------------------------------------------------------------------------------

CONV_CASES = {   # x shape, w shape, stride, padding, dilation, groups
    "k3-pad1": ((2, 3, 5, 6, 7), (4, 3, 3, 3, 3), 1, 1, 1, 1),
    "odd-stride-pad": ((2, 2, 7, 5, 9), (3, 2, 2, 3, 3), (2, 1, 3), (1, 0, 2), 1, 1),
    "dilation-groups": ((2, 4, 7, 6, 7), (6, 2, 3, 2, 3), (1, 2, 1), (2, 1, 0), (2, 1, 3), 2),
    "depthwise-stride2": ((1, 3, 6, 7, 5), (3, 1, 3, 3, 1), 2, 1, 1, 3),
    "pointwise": ((3, 5, 2, 3, 4), (2, 5, 1, 1, 1), 1, 0, 1, 1),
}


@FUSED
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv3d(case, bias, fused, gen):
    xs, ws, stride, padding, dilation, groups = CONV_CASES[case]
    arrays = {"x": randn(gen, *xs, dtype=np.float64), "w": randn(gen, *ws, dtype=np.float64) / 3,
              "b": randn(gen, ws[0], dtype=np.float64)}
    if not bias:
        del arrays["b"]

    def torch_fn(x, w, b=None):
        return TF.conv3d(x, w, b, stride, padding, dilation, groups)

    check(lambda t, i: F.conv3d(i["x"], i["w"], i.get("b"), stride, padding, dilation, groups),
          torch_fn, with_target(arrays, torch_fn, gen), tuple(arrays), fused)


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv3d_finite_differences(case, gen):
    xs, ws, stride, padding, dilation, groups = CONV_CASES[case]
    triple = lambda v: (v,) * 3 if isinstance(v, int) else v      # noqa: E731
    arrays = {"x": randn(gen, *xs, dtype=np.float64), "w": randn(gen, *ws, dtype=np.float64),
              "b": randn(gen, ws[0], dtype=np.float64)}
    fd_check("conv3d", dict(stride=triple(stride), padding=triple(padding),
                            dilation=triple(dilation), groups=groups), arrays, ("x", "w", "b"),
             gen)


@pytest.mark.parametrize("padding", ["same", "valid"])
def test_conv3d_string_padding_and_unbatched_input(padding, gen):
    arrays = {"x": randn(gen, 2, 5, 6, 7, dtype=np.float64),
              "w": randn(gen, 3, 2, 3, 2, 3, dtype=np.float64)}

    def torch_fn(x, w):
        return TF.conv3d(x, w, padding=padding, dilation=(1, 2, 1))

    check(lambda t, i: F.conv3d(i["x"], i["w"], padding=padding, dilation=(1, 2, 1)),
          torch_fn, with_target(arrays, torch_fn, gen), ("x", "w"))


def test_conv3d_errors(gen):
    t = Tracer()
    i = trace_inputs(t, {"x": randn(gen, 1, 4, 4, 4, 4), "w": randn(gen, 2, 2, 3, 3, 3)})
    with pytest.raises(ShapeError, match="weight expects 2 x 1"):
        F.conv3d(i["x"], i["w"])
    with pytest.raises(UnsupportedOpError, match="conv3d padding='same'"):
        F.conv3d(i["x"], i["w"], stride=2, padding="same", groups=2)
    with pytest.raises(ShapeError, match="larger than padded"):
        F.conv3d(i["x"], i["w"], dilation=2, groups=2)
    with pytest.raises(ShapeError, match=r"\(N, C, D, H, W\)"):
        F.conv3d(i["x"].reshape(4, 4, 16), i["w"], groups=2)


# ---- pooling -------------------------------------------------------------------------------

MAX_CASES = {   # kwargs of max_pool3d over a (2, 3, 7, 6, 5) input
    "k2": dict(kernel_size=2),
    "k3s2-pad1-ceil": dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    "k232-s122-dil212-pad110": dict(kernel_size=(2, 3, 2), stride=(1, 2, 2),
                                     dilation=(2, 1, 2), padding=(1, 1, 0)),
    "k3s2-ceil-dil2": dict(kernel_size=(3, 2, 3), stride=2, dilation=2, ceil_mode=True,
                           padding=(1, 1, 0)),
    "k3s1-pad1": dict(kernel_size=3, stride=1, padding=1),
}


@FUSED
@pytest.mark.parametrize("case", MAX_CASES)
def test_max_pool3d(case, fused, gen):
    kw = MAX_CASES[case]

    def torch_fn(x):
        return TF.max_pool3d(x, **kw)

    arrays = with_target({"x": randn(gen, 2, 3, 7, 6, 5, dtype=np.float64)}, torch_fn, gen)
    check(lambda t, i: F.max_pool3d(i["x"], **kw), torch_fn, arrays, ("x",), fused)


AVG_CASES = {   # kwargs of avg_pool3d over a (2, 3, 7, 6, 5) input
    "k2": dict(kernel_size=2),
    "k3s2-pad1-ceil": dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    "k3s2-pad1-ceil-real-only": dict(kernel_size=3, stride=2, padding=1, ceil_mode=True,
                                     count_include_pad=False),
    "k232-s122-pad110-real-only": dict(kernel_size=(2, 3, 2), stride=(1, 2, 2),
                                        padding=(1, 1, 0), count_include_pad=False),
    "divisor-override": dict(kernel_size=(3, 2, 2), stride=(2, 1, 2), padding=(1, 0, 1),
                             ceil_mode=True, divisor_override=5),
}


@FUSED
@pytest.mark.parametrize("case", AVG_CASES)
def test_avg_pool3d(case, fused, gen):
    kw = AVG_CASES[case]

    def torch_fn(x):
        return TF.avg_pool3d(x, **kw)

    arrays = with_target({"x": randn(gen, 2, 3, 7, 6, 5, dtype=np.float64)}, torch_fn, gen)
    check(lambda t, i: F.avg_pool3d(i["x"], **kw), torch_fn, arrays, ("x",), fused)


def _op_attrs(kw: dict, op: str) -> dict:
    triple = lambda v: (v,) * 3 if isinstance(v, int) else tuple(v)      # noqa: E731
    kernel = triple(kw["kernel_size"])
    attrs = dict(kernel=kernel, stride=triple(kw.get("stride", kernel)),
                 padding=triple(kw.get("padding", 0)), ceil_mode=kw.get("ceil_mode", False))
    if op == "maxpool3d":
        return attrs | dict(dilation=triple(kw.get("dilation", 1)))
    return attrs | dict(count_include_pad=kw.get("count_include_pad", True),
                        divisor_override=kw.get("divisor_override"))


@pytest.mark.parametrize("op,case", [("maxpool3d", c) for c in MAX_CASES]
                         + [("avgpool3d", c) for c in AVG_CASES])
def test_pool3d_finite_differences(op, case, gen):
    kw = (MAX_CASES if op == "maxpool3d" else AVG_CASES)[case]
    fd_check(op, _op_attrs(kw, op), {"x": randn(gen, 2, 2, 7, 6, 5, dtype=np.float64)},
             ("x",), gen)


def test_max_pool3d_indices_are_first_maxima_in_their_volume():
    """Ties resolve to the first maximum in window order; idx is (d * H + h) * W + w."""
    x = np.zeros((1, 1, 3, 4, 4), np.float64)
    x[0, 0, 1, 2, 3] = x[0, 0, 2, 3, 3] = 5.0
    from tests.ops.helpers import op_forward

    y, idx = op_forward("maxpool3d", {"x": x}, **_op_attrs(dict(kernel_size=3, stride=2,
                                                                 padding=1, ceil_mode=True),
                                                            "maxpool3d"))
    want = TF.max_pool3d(torch.tensor(x), 3, 2, 1, ceil_mode=True, return_indices=True)
    np.testing.assert_array_equal(y, want[0].numpy())
    np.testing.assert_array_equal(idx, want[1].numpy())


@pytest.mark.parametrize("out_size,spatial", [(1, (5, 6, 7)), ((2, 3, 4), (4, 6, 8)),
                                              ((3, None, 2), (7, 5, 5)), (2, (3, 5, 4))])
def test_adaptive_avg_pool3d(out_size, spatial, gen):
    def torch_fn(x):
        return TF.adaptive_avg_pool3d(x, out_size)

    arrays = with_target({"x": randn(gen, 2, 3, *spatial, dtype=np.float64)}, torch_fn, gen)
    check(lambda t, i: F.adaptive_avg_pool3d(i["x"], out_size), torch_fn, arrays, ("x",), True)


def test_pool3d_errors(gen):
    t = Tracer()
    i = trace_inputs(t, {"x": randn(gen, 1, 2, 4, 4, 4)})
    with pytest.raises(ShapeError, match="at most half the kernel"):
        F.max_pool3d(i["x"], 2, padding=(0, 2, 0))
    with pytest.raises(ShapeError, match="larger than padded"):
        F.avg_pool3d(i["x"], 5)
    with pytest.raises(UnsupportedOpError, match="return_indices"):
        F.max_pool3d(i["x"], 2, return_indices=True)
    with pytest.raises(ShapeError, match=r"\(N, C, D, H, W\)"):
        F.avg_pool3d(i["x"].reshape(2, 64), 2)


def test_unbatched_pooling(gen):
    arrays = {"x": randn(gen, 2, 5, 6, 7, dtype=np.float64)}

    def torch_fn(x):
        return TF.max_pool3d(x, 2, ceil_mode=True) + TF.avg_pool3d(x, 2, ceil_mode=True)

    check(lambda t, i: F.max_pool3d(i["x"], 2, ceil_mode=True)
          + F.avg_pool3d(i["x"], 2, ceil_mode=True),
          torch_fn, with_target(arrays, torch_fn, gen), ("x",))


# ---- batch norm over 5-D input -------------------------------------------------------------

@FUSED
def test_batch_norm_5d_training_with_affine(fused, gen):
    c = 3
    arrays = {"x": randn(gen, 2, c, 3, 4, 5, dtype=np.float64) * 2 + 1,
              "w": randn(gen, c, dtype=np.float64), "b": randn(gen, c, dtype=np.float64)}

    def torch_fn(x, w, b):
        return TF.relu(TF.batch_norm(x, None, None, w, b, training=True))

    check(lambda t, i: F.relu(F.batch_norm(i["x"], None, None, i["w"], i["b"], training=True)),
          torch_fn, with_target(arrays, torch_fn, gen), ("x", "w", "b"), fused)


# ---- modules -------------------------------------------------------------------------------

def test_module_parameters_init_and_state_dicts_match_torch():
    pairs = [(nn.Conv3d(6, 9, (3, 2, 1), stride=2, padding=1, dilation=(1, 2, 1), groups=3),
              tnn.Conv3d(6, 9, (3, 2, 1), stride=2, padding=1, dilation=(1, 2, 1), groups=3)),
             (nn.Conv3d(2, 4, 3, bias=False, padding="same"),
              tnn.Conv3d(2, 4, 3, bias=False, padding="same")),
             (nn.BatchNorm3d(5, momentum=None), tnn.BatchNorm3d(5, momentum=None)),
             (nn.BatchNorm3d(5, affine=False), tnn.BatchNorm3d(5, affine=False))]
    for ours, theirs in pairs:
        sd, want = ours.state_dict(), theirs.state_dict()
        assert list(sd) == list(want)
        for k in want:
            assert sd[k].shape == tuple(want[k].shape), k
        assert repr(ours) == repr(theirs)
        ours.load_state_dict({k: v.numpy() for k, v in want.items()})
    bound = 1 / np.sqrt(2 * 3 * 2 * 1)      # fan_in = C/groups * kd * kh * kw
    w = nn.Conv3d(6, 9, (3, 2, 1), groups=3).weight
    assert bound / 2 < np.abs(np.asarray(w)).max() <= bound
    for ours, theirs in [(nn.MaxPool3d(3, 2, 1, ceil_mode=True),
                          tnn.MaxPool3d(3, 2, 1, ceil_mode=True)),
                         (nn.AvgPool3d(2), tnn.AvgPool3d(2)),
                         (nn.AdaptiveAvgPool3d((1, 2, 3)), tnn.AdaptiveAvgPool3d((1, 2, 3)))]:
        assert repr(ours) == repr(theirs)


def test_torch_namespace_has_the_3d_names():
    """torchvision's ops/misc.py names torch.nn.BatchNorm3d in a default argument at import."""
    for name in ("Conv3d", "BatchNorm3d", "MaxPool3d", "AvgPool3d", "AdaptiveAvgPool3d"):
        assert getattr(sg.nn, name) is getattr(nn, name)
    for name in ("conv3d", "max_pool3d", "avg_pool3d", "adaptive_avg_pool3d"):
        assert callable(getattr(sg.nn.functional, name))


def make_cnn(nn):
    """A small 3-D CNN over the namespace `nn` (torch.nn or stepgraph.nn): (N, 2, 6, 7, 7) ->
    (N, 4)."""
    return nn.Sequential(
        nn.Conv3d(2, 6, 3, padding=1, bias=False), nn.BatchNorm3d(6), nn.ReLU(),
        nn.MaxPool3d(2, ceil_mode=True),
        nn.Conv3d(6, 8, (3, 2, 2), stride=(1, 2, 1), padding=(1, 0, 1), groups=2),
        nn.BatchNorm3d(8), nn.ReLU(), nn.AvgPool3d(2, padding=1, count_include_pad=False),
        nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(8, 4))


def test_3d_cnn_trains_three_steps_like_torch():
    """Three SGD (momentum) steps from one state_dict, on fresh batches. The parameter changes
    and running statistics of stepgraph (float32) are judged against torch in float64, bound
    ERROR_FACTOR x the error of torch float32 from there; the losses likewise."""
    torch.manual_seed(0)
    ref = make_cnn(torch.nn)
    model = make_cnn(nn)
    start = {k: v.numpy().copy() for k, v in ref.state_dict().items()}
    model.load_state_dict(start)
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((4, 2, 6, 7, 7)).astype(np.float32),
             rng.integers(0, 4, 4).astype(np.int64)) for _ in range(3)]
    step = sg.compile_train_step(model, loss=F.cross_entropy,
                                 optimizer=optim.SGD(lr=0.1, momentum=0.9),
                                 example_inputs=data[0], device="cpu")
    got_losses = [float(step(x, y)) for x, y in data]
    runs = {}
    for dtype in (torch.float64, torch.float32):
        net = make_cnn(torch.nn).to(dtype)
        net.load_state_dict({k: torch.tensor(v) for k, v in start.items()})
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for x, y in data:
            opt.zero_grad()
            loss = TF.cross_entropy(net(torch.tensor(x, dtype=dtype)), torch.tensor(y))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs[dtype] = (losses, {k: v.double().numpy() for k, v in net.state_dict().items()})
    (exact_losses, exact), (f32_losses, f32) = runs[torch.float64], runs[torch.float32]
    for got, torch32, want in zip(got_losses, f32_losses, exact_losses):
        assert abs(got - want) <= ERROR_FACTOR * abs(torch32 - want) + ERROR_FLOOR * abs(want)
    after = {k: v.numpy() for k, v in model.state_dict().items()}
    for k, before in start.items():
        if k.endswith("num_batches_tracked"):
            assert int(after[k]) == int(exact[k]) == 3
            continue
        if k == "4.bias":
            # a convolution's bias before a training-mode BatchNorm: its true gradient is 0,
            # so its change is float32 rounding alone (one ulp of the value or none; torch
            # float32's is 0 or one ulp with the CPU's kernels), judged at one rounding of
            # its values by the tolerance policy's judge
            assert_changes_close(before, after[k], exact[k], f32[k], k, moves=None,
                                 value_floor=True)
            continue
        change, want = after[k] - before, exact[k] - before
        assert np.abs(want).max() > 0, k
        bound = ERROR_FACTOR * relative_error(f32[k] - before, want) + ERROR_FLOOR
        assert relative_error(change, want) <= bound, (k, relative_error(change, want), bound)
