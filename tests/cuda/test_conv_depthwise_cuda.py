"""The depthwise kernels (conv.PATH forced to "depthwise", conv_depthwise.cu) vs the NumPy
backend on fresh random inputs, outputs poisoned first: forward (bias, fused ReLU),
grad_input, grad_weight with db, NCHW and NHWC, over the pencil 1x3 conv that cuDNN ran slowly,
MobileNet's 3x3 (stride 1 and 2), ConvNeXt's 7x7 and an odd dilated one.

float32: the tolerance policy (tests/reference.py): the NumPy backend in float64 is the
reference, the bound 4x torch float32's own error on the same problem plus the floor; each op
runs twice, bit-identical (one owner per output, fixed sum order).
bfloat16: as the tiled kernels are judged (test_bf16_conv_cuda.py): the emulation's arithmetic
in another order, so within one bf16 ulp or the float32 summation bound, on at most
TILED_FRACTION of the elements differing at all.
float16: one float16 rounding of the float64 value plus the float32 summation bound.
Last, a small model of depthwise convs trains on the path, its graph replay bit-identical to
eager, NCHW and channels-last.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

import stepgraph as sg  # noqa: E402
from stepgraph import losses, nn, optim  # noqa: E402
from stepgraph.backends.cuda.conv import conv, conv_depthwise  # noqa: E402
from stepgraph.backends.numpy.backend import NumpyBackend  # noqa: E402
from stepgraph.ir.graph import Node, Value  # noqa: E402
from stepgraph.ir.ops import OPS, infer_outputs  # noqa: E402
from tests.cuda.test_bf16_conv_cuda import (TILED_DB_FRACTION, TILED_FRACTION,  # noqa: E402
                                            abs_bound, assert_near_bits, bf16_random, emulate,
                                            node_of, on_cuda, relu_bits)
from tests.ops.helpers import seeded  # noqa: E402
from tests.reference import assert_close_to_reference  # noqa: E402

torch = pytest.importorskip("torch")

# (x NCHW, (kh, kw), stride, padding, dilation)
CASES = [((32, 256, 1, 130), (1, 3), 1, (0, 0), 1),         # the pencil conv cuDNN ran slowly
         ((8, 64, 32, 32), (3, 3), 1, (1, 1), 1),           # MobileNet
         ((8, 64, 32, 32), (3, 3), 2, (1, 1), 1),           # MobileNet, stride 2
         ((4, 96, 16, 16), (7, 7), 1, (3, 3), 1),           # ConvNeXt
         ((3, 5, 7, 9), (3, 3), 1, (2, 2), 2)]              # odd sizes, dilation 2
IDS = [f"{'x'.join(map(str, x))}-k{k[0]}{k[1]}s{s}p{p[0]}{p[1]}d{d}" for x, k, s, p, d in CASES]
LAYOUTS = ["NCHW", "NHWC"]


@pytest.fixture
def launched(monkeypatch):
    """conv.PATH forced to "depthwise"; the conv_depthwise kernels launched meanwhile."""
    monkeypatch.setattr(conv, "PATH", "depthwise")
    names, real = [], conv_depthwise._launch

    def record(ctx, filename, name, grid, block, args, *shared):
        names.append(name)
        real(ctx, filename, name, grid, block, args, *shared)

    monkeypatch.setattr(conv_depthwise, "_launch", record)
    return names


def attrs_of(case, layout: str, **more) -> dict:
    x, k, s, p, d = case
    attrs = dict(stride=(s, s), padding=p, dilation=(d, d), groups=x[1], **more)
    return attrs | ({"layout": "NHWC"} if layout == "NHWC" else {})


def to_layout(a: np.ndarray, layout: str) -> np.ndarray:
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)) if layout == "NHWC" else a


def from_layout(a: np.ndarray, layout: str) -> np.ndarray:
    return np.ascontiguousarray(a.transpose(0, 3, 1, 2)) if layout == "NHWC" and a.ndim == 4 \
        else a


def node_typed(op: str, arrays: list, dtype: str, **attrs) -> Node:
    ins = [Value(a.shape, dtype) for a in arrays]
    outs = [Value(s, d) for s, d in infer_outputs(op, ins, attrs)]
    return Node(op, ins, outs, attrs, mutates=OPS[op].mutates(attrs))


def numpy64(op: str, arrays: list, **attrs) -> list[np.ndarray]:
    """The NumPy backend's outputs in float64: the reference."""
    wide = [a.astype(np.float64) for a in arrays]
    node = node_typed(op, wide, "float64", **attrs)
    outs = [np.full(v.shape, np.nan) for v in node.outputs]
    NumpyBackend().run_node(node, wide, outs)
    return outs


def cuda_twice(ctx, node: Node, arrays: list) -> list[np.ndarray]:
    """The node's outputs on cuda (poisoned with NaN first), run twice: the same bits."""
    runs = []
    for _ in range(2):
        with ctx.stream:
            ins = [cp.asarray(a) for a in arrays]
            outs = [cp.full(v.shape, np.nan, v.dtype) for v in node.outputs]
        conv.IMPLS[node.op](node, ins, outs, ctx)
        ctx.stream.synchronize()
        runs.append([cp.asnumpy(o) for o in outs])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b, err_msg=f"{node.op}: not deterministic")
    return runs[0]


def torch32(case, x, w, b, dy, relu: bool) -> dict[str, np.ndarray]:
    """torch float32's y, dx, dw, db (NCHW) of the problem: the error the bound scales."""
    _, _, s, p, d = case
    tx, tw, tb = (torch.from_numpy(a).requires_grad_() for a in (x, w, b))
    y = torch.nn.functional.conv2d(tx, tw, tb, stride=s, padding=p, dilation=d,
                                   groups=x.shape[1])
    if relu:
        y = torch.relu(y)
    y.backward(torch.from_numpy(dy))
    return {"y": y.detach().numpy(), "dx": tx.grad.numpy(), "dw": tw.grad.numpy(),
            "db": tb.grad.numpy()}


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale + 0.1).astype(np.float32)


@pytest.mark.parametrize("relu", [False, True], ids=["bias", "bias_relu"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_depthwise_float32_matches_float64_within_torchs_error(ctx, launched, case, layout,
                                                               relu, request):
    check_float32(ctx, case, layout, relu, request.node.name)
    # the forward (and its ReLU), dx, dw + db: twice each, nothing but the depthwise kernels
    kinds = {name.split("_kernel")[0].removeprefix("conv2d_depthwise_") for name in launched}
    suffix = "_nhwc" if layout == "NHWC" else ""
    assert {f"forward{suffix}", f"grad_input{suffix}", f"grad_weight{suffix}"} <= kinds, kinds


PLANE_CASES = [i for i, (_, _, s, _, d) in enumerate(CASES) if s == 1 and d == 1]


@pytest.fixture
def launched_plane(launched, monkeypatch):
    """conv.PATH forced to the plane kernel ("depthwise_plane"; dw falls back to the flat
    depthwise kernel, the first path offered)."""
    monkeypatch.setattr(conv, "PATH", "depthwise_plane")
    return launched


@pytest.mark.parametrize("relu", [False, True], ids=["bias", "bias_relu"])
@pytest.mark.parametrize("i", PLANE_CASES, ids=[IDS[i] for i in PLANE_CASES])
def test_plane_kernels_float32_match_float64_within_torchs_error(ctx, launched_plane, i, relu,
                                                                 request):
    """The plane kernel (NCHW, stride 1, dilation 1: the forward and dx; dw stays on the flat
    kernel) judged as the flat ones are."""
    check_float32(ctx, CASES[i], "NCHW", relu, request.node.name)
    plane = conv_depthwise.plane_kernel_name("float32")
    assert launched_plane.count(plane) == 4, launched_plane      # y and dx, twice each


@pytest.mark.parametrize("i", PLANE_CASES, ids=[IDS[i] for i in PLANE_CASES])
def test_plane_kernels_bf16_are_within_the_summation_bound(ctx, launched_plane, i, request):
    check_bf16(ctx, CASES[i], "NCHW", request.node.name)
    # y, y with the ReLU, dx
    assert launched_plane.count(conv_depthwise.plane_kernel_name("uint16")) == 3, launched_plane


def check_float32(ctx, case, layout: str, relu: bool, name: str) -> None:
    """y, dx, dw and db of one problem on cuda (twice, the same bits) against the NumPy
    backend in float64, bound by torch float32's error (tests/reference.py)."""
    xs, (kh, kw) = case[0], case[1]
    rng = seeded(name)
    c = xs[1]
    x, w, b = f32(rng, *xs), f32(rng, c, 1, kh, kw, scale=0.3), f32(rng, c)
    y_shape = numpy64("conv2d", [x, w], **attrs_of(case, "NCHW"))[0].shape
    dy = f32(rng, *y_shape)
    ref32 = torch32(case, x, w, b, dy, relu)
    X, Wt, DY = to_layout(x, layout), to_layout(w, layout), to_layout(dy, layout)

    fwd_attrs = attrs_of(case, layout, **({"act": "relu"} if relu else {}))
    got = cuda_twice(ctx, node_typed("conv2d", [X, Wt, b], "float32", **fwd_attrs), [X, Wt, b])
    want = numpy64("conv2d", [X, Wt, b], **attrs_of(case, layout))[0]
    want = np.maximum(want, 0) if relu else want
    assert_close_to_reference(from_layout(got[0], layout), from_layout(want, layout),
                              ref32["y"], "depthwise conv2d y")

    attrs = attrs_of(case, layout)
    dgrad = node_typed("conv2d_grad_input", [DY, Wt], "float32", input_shape=X.shape, **attrs)
    got = cuda_twice(ctx, dgrad, [DY, Wt])
    want = numpy64("conv2d_grad_input", [DY, Wt], input_shape=X.shape, **attrs)[0]
    assert_close_to_reference(from_layout(got[0], layout), from_layout(want, layout),
                              ref32["dx"], "depthwise conv2d_grad_input dx")

    wgrad = node_typed("conv2d_grad_weight", [DY, X], "float32", weight_shape=Wt.shape,
                       bias=True, **attrs)
    got = cuda_twice(ctx, wgrad, [DY, X])
    want = numpy64("conv2d_grad_weight", [DY, X], weight_shape=Wt.shape, bias=True, **attrs)
    assert_close_to_reference(from_layout(got[0], layout), from_layout(want[0], layout),
                              ref32["dw"], "depthwise conv2d_grad_weight dw")
    assert_close_to_reference(got[1], want[1], ref32["db"], "depthwise conv2d_grad_weight db")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_depthwise_bf16_is_within_the_summation_bound(ctx, launched, case, layout, request):
    check_bf16(ctx, case, layout, request.node.name)
    assert launched and all("<unsigned short" in name for name in launched), launched


def check_bf16(ctx, case, layout: str, name: str) -> None:
    """y (bias and the fused ReLU before the one rounding), dx, dw and db against the
    emulation, as the tiled kernels are judged."""
    xs, (kh, kw) = case[0], case[1]
    rng = seeded(name)
    c = xs[1]
    x = to_layout(bf16_random(rng, *xs), layout)
    w = to_layout(bf16_random(rng, c, 1, kh, kw, scale=0.3), layout)
    ins = [x, w, bf16_random(rng, c)]
    attrs = attrs_of(case, layout)
    plain = node_of("conv2d", ins, **attrs)
    want = emulate(plain, ins)[0][0]
    slack = abs_bound(plain, ins)[0]
    got = on_cuda(ctx, plain, ins)[0][0]
    assert_near_bits(got, want, "depthwise conv2d y", max_fraction=TILED_FRACTION, slack=slack)
    got = on_cuda(ctx, node_of("conv2d", ins, **attrs, act="relu"), ins)[0][0]
    assert_near_bits(got, relu_bits(want), "depthwise conv2d y relu",
                     max_fraction=TILED_FRACTION, slack=slack)

    dy = bf16_random(rng, *want.shape)
    dgrad = node_of("conv2d_grad_input", [dy, w], input_shape=x.shape, **attrs)
    want_dx = emulate(dgrad, [dy, w])[0][0]
    assert_near_bits(on_cuda(ctx, dgrad, [dy, w])[0][0], want_dx, "depthwise dx",
                     max_fraction=TILED_FRACTION, slack=abs_bound(dgrad, [dy, w])[0])
    wgrad = node_of("conv2d_grad_weight", [dy, x], weight_shape=w.shape, bias=True, **attrs)
    want_w = emulate(wgrad, [dy, x])[0]
    got_w = on_cuda(ctx, wgrad, [dy, x])[0]
    bounds = abs_bound(wgrad, [dy, x])
    assert_near_bits(got_w[0], want_w[0], "depthwise dw", max_fraction=TILED_FRACTION,
                     slack=bounds[0])
    assert_near_bits(got_w[1], want_w[1], "depthwise db", max_fraction=TILED_DB_FRACTION,
                     slack=bounds[1])


def fp16_bound(ref64: np.ndarray, terms: np.ndarray, k: int) -> np.ndarray:
    """One float16 rounding of the value (half an ulp, relative 2^-11; 2^-25 below the
    normal range) plus 2 gamma_K of the terms' magnitudes (the float32 sum in any order)."""
    return np.maximum(np.abs(ref64) * 2.0 ** -11, 2.0 ** -25) + terms * 2 * k * 2.0 ** -24


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES[1:4], ids=IDS[1:4])
def test_depthwise_float16_rounds_once(ctx, launched, case, layout, request):
    """float16 storage (model.half()): float32 sums, each output rounded once."""
    xs, (kh, kw) = case[0], case[1]
    rng = seeded(request.node.name)
    c = xs[1]
    x = to_layout(f32(rng, *xs).astype(np.float16), layout)
    w = to_layout(f32(rng, c, 1, kh, kw, scale=0.3).astype(np.float16), layout)
    b = f32(rng, c).astype(np.float16)
    attrs = attrs_of(case, layout)
    y_shape = numpy64("conv2d", [x, w], **attrs)[0].shape
    dy = f32(rng, *y_shape).astype(np.float16)
    checks = [("conv2d", [x, w, b], {}, kh * kw + 1),
              ("conv2d_grad_input", [dy, w], {"input_shape": x.shape}, kh * kw),
              ("conv2d_grad_weight", [dy, x], {"weight_shape": w.shape, "bias": True},
               int(np.prod(y_shape)) // c)]
    for op, arrays, more, k in checks:
        got = cuda_twice(ctx, node_typed(op, arrays, "float16", **attrs, **more), arrays)
        want = numpy64(op, arrays, **attrs, **more)
        terms = numpy64(op, [np.abs(a) for a in arrays], **attrs, **more)
        for i, (g, r, t) in enumerate(zip(got, want, terms)):
            assert g.dtype == np.float16 and np.isfinite(g).all(), (op, i)
            err = np.abs(g.astype(np.float64) - r)
            assert (err <= fp16_bound(r, t, k)).all(), (op, i, float(err.max()))
    assert launched and all("<fp16_bits" in name for name in launched), launched


# ---- a model ---------------------------------------------------------------------------------

def depthwise_model():
    return nn.Sequential(nn.Conv2d(16, 16, 3, groups=16, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, groups=16, padding=1, bias=False))


@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
def test_a_depthwise_model_trains_and_replays_eager_bit_for_bit(launched, memory_format):
    """Two depthwise convs (ReLU between, fused into the first), mse loss to a target they
    can reach (0.5 relu(x)), SGD: graph replay and eager give the same losses and parameters
    bit for bit over 6 fresh batches (and the captured step holds exactly its ops' kernels),
    the step's convs ran on the depthwise kernels, and the loss falls on a repeated batch."""
    from tests.cuda.test_step_cuda import assert_replay_matches_eager

    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((8, 16, 12, 12), dtype=np.float32) for _ in range(6)]
    data = [(x, 0.5 * np.maximum(x, 0)) for x in xs]     # a target the model can learn
    base, steps = depthwise_model(), []
    for graph in (False, True):
        model = depthwise_model()
        model.load_state_dict(base.state_dict())
        steps.append(sg.compile_train_step(model, loss=losses.mse,
                                           optimizer=optim.SGD(lr=0.05, momentum=0.9),
                                           example_inputs=data[0], device="cuda", graph=graph,
                                           memory_format=memory_format))
    eager, replayed = steps
    ops = assert_replay_matches_eager(eager, replayed, data)
    assert "conv2d_grad_input" in ops and "conv2d_grad_weight" in ops, ops
    kinds = {name.split("_kernel")[0].removeprefix("conv2d_depthwise_").removesuffix("_nhwc")
             for name in launched}
    assert {"forward", "grad_input", "grad_weight"} <= kinds, kinds
    x, y = (cp.asarray(a) for a in data[0])
    losses_seen = [float(replayed(x, y)) for _ in range(20)]
    assert losses_seen[-1] < 0.9 * losses_seen[0], losses_seen
