"""The 3-D family on the GPU vs the numpy references, on fresh random inputs with the cuda
outputs poisoned first: conv3d and its gradients through cuDNN (every path the autotuner may
pick: bias in the graph or by the epilogue; stride, padding, dilation, groups, odd sizes;
fp32 and tf32), maxpool3d / avgpool3d and their gradients (pool3d.cu: ceil_mode, dilation,
count_include_pad, divisor_override; float32 bit for bit where the reference is exact, and
bfloat16), batch_norm_train over 5-D input; and the 3-D CNN of tests/ops/test_3d_ops.py
trained three steps by cuda eager and graph replay against the numpy backend."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import nn, optim
from stepgraph.nn import functional as F

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu("nvmath")

from stepgraph.backends.cuda import norm, pool3d  # noqa: E402
from stepgraph.backends.cuda.conv import conv3d, conv_cudnn  # noqa: E402
from stepgraph.backends.numpy import bf16  # noqa: E402
from stepgraph.backends.numpy.backend import NumpyBackend  # noqa: E402
from stepgraph.ir.graph import BF16, Node, Value, storage_dtype  # noqa: E402
from stepgraph.ir.ops import infer_outputs  # noqa: E402
from tests.cuda import helpers  # noqa: E402
from tests.cuda.helpers import assert_close, make_node, random, rel_err  # noqa: E402
from tests.ops.test_3d_ops import AVG_CASES, MAX_CASES, _op_attrs, make_cnn  # noqa: E402

TOL = {"fp32": 1e-5, "tf32": 3e-3}

# x shape, w shape, stride, padding, dilation, groups
CONVS = [
    ((2, 3, 5, 6, 7), (4, 3, 3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1),
    ((2, 2, 7, 5, 9), (3, 2, 2, 3, 3), (2, 1, 3), (1, 0, 2), (1, 1, 1), 1),
    ((2, 4, 7, 6, 7), (6, 2, 3, 2, 3), (1, 2, 1), (2, 1, 0), (2, 1, 3), 2),
    ((1, 3, 6, 7, 5), (3, 1, 3, 3, 1), (2, 2, 2), (1, 1, 1), (1, 1, 1), 3),
    ((3, 5, 2, 3, 4), (2, 5, 1, 1, 1), (1, 1, 1), (0, 0, 0), (1, 1, 1), 1),
    ((2, 16, 8, 8, 8), (32, 16, 3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1), 1),
]


@pytest.fixture(scope="module", params=["fp32", "tf32"])
def ctx(request, backend):
    if not conv_cudnn.available():
        pytest.skip(f"cuDNN is not usable: {conv_cudnn.unavailable_reason()}")
    return backend.make_context(request.param)


@pytest.fixture(scope="module")
def plain_ctx(backend):
    """A float32 context for the kernels that need no cuDNN."""
    return backend.make_context("fp32")


def _conv_nodes(cfg, rng, bias: bool):
    xs, ws, stride, padding, dilation, groups = cfg
    attrs = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    x, w = random(rng, *xs), random(rng, *ws, scale=0.3)
    ins = [x, w] + ([random(rng, ws[0])] if bias else [])
    fwd = make_node("conv3d", ins, **attrs)
    dy = random(rng, *fwd.outputs[0].shape)
    gi = make_node("conv3d_grad_input", [dy, w], input_shape=xs, **attrs)
    gw = make_node("conv3d_grad_weight", [dy, x], weight_shape=ws, **attrs)
    return [(fwd, ins), (gi, [dy, w]), (gw, [dy, x])]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("cfg", CONVS, ids=[str(i) for i in range(len(CONVS))])
def test_conv3d_matches_numpy(cfg, bias, ctx):
    """Forward, input and weight gradient through the launchers (the autotuner's pick)."""
    rng = np.random.default_rng(len(cfg[0]) * 7 + bias)
    for node, arrays in _conv_nodes(cfg, rng, bias):
        want = helpers.reference(node, arrays)
        got = helpers.run_cuda(ctx, node, arrays, conv3d.IMPLS)
        assert rel_err(got[0], want[0]) <= TOL[ctx.precision], node.op


def test_conv3d_candidates_each_match_numpy(backend):
    """Every cuDNN plan of one forward with bias (fused and +epilogue), dgrad and wgrad."""
    if not conv_cudnn.available():
        pytest.skip(conv_cudnn.unavailable_reason())
    ctx = backend.make_context("fp32")
    rng = np.random.default_rng(3)
    cfg = CONVS[2]
    (fwd, ins), (gi, gi_ins), (gw, gw_ins) = _conv_nodes(cfg, rng, True)
    g = conv3d.geometry(cfg[0], cfg[1], fwd.attrs)
    x, w, b = helpers.to_device(ctx, ins)
    want = helpers.reference(fwd, ins)[0]
    y = cp.full(fwd.outputs[0].shape, np.nan, np.float32)
    paths = conv3d._forward_paths(ctx, g, x, w, y, b, None)
    assert paths, conv_cudnn.reason(ctx, "conv3d", g, x.dtype)
    for name, run in paths.items():
        y.fill(np.nan)
        run()
        assert rel_err(helpers.to_host(ctx, [y])[0], want) <= 1e-5, name
    for node, arrays, make in [
            (gi, gi_ins, conv_cudnn.grad_input_paths), (gw, gw_ins, conv_cudnn.grad_weight_paths)]:
        a, c = helpers.to_device(ctx, arrays)
        want = helpers.reference(node, arrays)[0]
        out = cp.full(node.outputs[0].shape, np.nan, np.float32)
        paths = make(ctx, g, a, c, out, op=node.op)
        assert paths, node.op
        for name, run in paths.items():
            out.fill(np.nan)
            run()
            assert rel_err(helpers.to_host(ctx, [out])[0], want) <= 1e-5, (node.op, name)


# ---- pooling -------------------------------------------------------------------------------

POOL_SHAPES = [(2, 3, 7, 6, 5), (1, 4, 9, 8, 11)]
POISON = {"uint16": 0x7FA1, "float32": np.nan, "int32": -7}


def _pool_node(op: str, arrays: list, **attrs) -> Node:
    """A node over host arrays: uint16 arrays are bf16 values, others their dtype."""
    ins = [Value(a.shape, BF16 if a.dtype == np.uint16 else str(a.dtype)) for a in arrays]
    outs = [Value(s, d) for s, d in infer_outputs(op, ins, attrs)]
    return Node(op, ins, outs, attrs)


def _pool_both(ctx, node: Node, arrays: list) -> tuple[list, list]:
    """(the NumPy backend's outputs (bf16: its emulation), the cuda launcher's), each
    output poisoned first."""
    kinds = [storage_dtype(v.dtype) for v in node.outputs]
    want = [np.full(v.shape, POISON[k], k) for v, k in zip(node.outputs, kinds)]
    NumpyBackend().run_node(node, [a.copy() for a in arrays], want)
    with ctx.stream:
        ins = [cp.asarray(a) for a in arrays]
        outs = [cp.full(v.shape, POISON[k], k) for v, k in zip(node.outputs, kinds)]
    pool3d.IMPLS[node.op](node, ins, outs, ctx)
    return want, helpers.to_host(ctx, outs)


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """bf16 bits' distance in representable values."""
    def ordinal(b):
        b = b.astype(np.int64)
        return np.where(b & 0x8000, 0x8000 - b, b)
    return np.abs(ordinal(got) - ordinal(want))


def _pool_cases():
    return [("maxpool3d", c) for c in MAX_CASES] + [("avgpool3d", c) for c in AVG_CASES]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", POOL_SHAPES, ids=["7x6x5", "9x8x11"])
@pytest.mark.parametrize("op,case", _pool_cases())
def test_pool3d_matches_numpy(op, case, shape, dtype, plain_ctx):
    """Max pooling and its gradient bit for bit (a maximum is an input; the gather adds in
    np.add.at's window order), in both dtypes; inputs on a coarse grid, so windows hold
    ties and the first maximum must win. Average pooling: float32 to rounding, bfloat16
    within one ulp (float32 sums in another order, then one rounding) in a few elements, or
    within the float32 summation bound where the terms cancel."""
    attrs = _op_attrs((MAX_CASES if op == "maxpool3d" else AVG_CASES)[case], op)
    rng = np.random.default_rng(abs(hash((op, case, shape, dtype))) % 2**32)
    x = (np.round(rng.standard_normal(shape) * 2) / 2 if op == "maxpool3d" else
         random(rng, *shape, scale=2.0)).astype(np.float32)
    bits = dtype == "bfloat16"
    x = bf16.to_bits(x) if bits else x
    fwd = _pool_node(op, [x], **attrs)
    want, got = _pool_both(plain_ctx, fwd, [x])
    dy = random(rng, *want[0].shape)
    dy = bf16.to_bits(dy) if bits else dy
    if op == "maxpool3d":
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        bwd = _pool_node("maxpool3d_grad", [dy, want[1]], input_shape=shape, **attrs)
        want, got = _pool_both(plain_ctx, bwd, [dy, want[1]])
        np.testing.assert_array_equal(got[0], want[0])
        return
    bwd = _pool_node("avgpool3d_grad", [dy], input_shape=shape, **attrs)
    g_want, g_got = _pool_both(plain_ctx, bwd, [dy])
    for what, a, b, src in [("y", got[0], want[0], x), ("dx", g_got[0], g_want[0], dy)]:
        if bits:
            # An element whose terms cancel to near zero can round to bf16 values far apart
            # in ulps (even of opposite signs) after float32 sums in two orders; such an
            # element passes within the float32 summation bound: at most 27 terms of at
            # most max|term| (dx: at most 8 windows, each 1/count of one dy).
            d = _ulps(a, b)
            g, r = (bf16.from_bits(v).astype(np.float64) for v in (a, b))
            slack = 27 * 2.0**-23 * np.abs(bf16.from_bits(src)).max()
            off = (d > 1) & (np.abs(g - r) > slack)
            assert not off.any() and (d > 0).mean() <= 2e-2, (what, d[off], (d > 0).mean())
        else:
            assert_close(a, b, 1e-6, 1e-6, f"{op} {what}", all_finite=True)


def test_batch_norm_train_5d_matches_numpy(plain_ctx):
    rng = np.random.default_rng(5)
    c = 6
    x = random(rng, 3, c, 4, 5, 7, scale=2.0, shift=3.0)
    ins = [x, random(rng, c), random(rng, c), random(rng, c), np.abs(random(rng, c)) + 0.5,
           np.array(4, np.int64)]
    node = make_node("batch_norm_train", ins, eps=1e-5, momentum=0.1, affine=True,
                     track=True, act="relu")
    want, got = helpers.run_both(plain_ctx, node, ins, norm.IMPLS)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-6


# ---- training ------------------------------------------------------------------------------

def _train(device, graph, data):
    nn.manual_seed(0)
    model = make_cnn(nn)
    step = sg.compile_train_step(model, loss=F.cross_entropy,
                                 optimizer=optim.SGD(lr=0.1, momentum=0.9),
                                 example_inputs=data[0], device=device, graph=graph)
    before = {k: v.numpy() for k, v in model.state_dict().items()}
    losses = [float(step(x, y)) for x, y in data]
    after = {k: v.numpy() for k, v in model.state_dict().items()}
    return losses, {k: after[k] - before[k] for k in before if "num_batches" not in k}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_3d_cnn_trains_on_cuda_as_on_numpy(graph):
    if not conv_cudnn.available():
        pytest.skip(conv_cudnn.unavailable_reason())
    rng = np.random.default_rng(1)
    data = [(rng.standard_normal((4, 2, 6, 7, 7)).astype(np.float32),
             rng.integers(0, 4, 4).astype(np.int64)) for _ in range(5)]
    want_losses, want = _train("cpu", False, data)
    got_losses, got = _train("cuda", graph, data)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-4)
    for k in want:
        if k == "4.bias":
            # The second conv's bias feeds BatchNorm, which subtracts its mean: its true
            # gradient is 0 and either backend's change is rounding noise (an H200 run gave
            # 0 on CUDA, 3.7e-9 in one element on the CPU).
            assert max(np.abs(got[k]).max(), np.abs(want[k]).max()) < 1e-6, k
            continue
        assert np.abs(want[k]).max() > 0, k
        assert rel_err(got[k], want[k]) < 1e-3, (k, rel_err(got[k], want[k]))
