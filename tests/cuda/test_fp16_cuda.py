"""float16 on the GPU: each family's float16 kernels against the NumPy backend's float16
(float32 compute, one rounding per store), judged by the tolerance policy: both against a
float64 run of the same node, the cuda error within a small multiple of the NumPy backend's
own float16 error (float16's unit roundoff is 2^-11); conversions and moves bit for bit.
Then the half_convnet model (tests/compat/scripts/half_convnet.py) trained on cuda in one
CUDA graph with model.half(), and with float16 autocast and a GradScaler, each against the
same loop on the NumPy backend and torch float64.

Every op runs on fresh random inputs into poisoned outputs (a float16 NaN no kernel writes)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

import stepgraph as sg  # noqa: E402
from stepgraph.backends.numpy import NumpyBackend  # noqa: E402
from stepgraph.ir.graph import Node, Value  # noqa: E402
from stepgraph.ir.ops import OPS, infer_outputs  # noqa: E402
from stepgraph.ops.optim import hyperparameter_table  # noqa: E402
from tests import half_convnet_model as hc  # noqa: E402
from tests.reference import assert_close_to_reference  # noqa: E402

F16 = "float16"
POISON = {F16: np.uint16(0x7E55).view(np.float16), "float32": np.float32(np.nan),
          "float64": np.float64(np.nan),
          "uint8": np.uint8(7), "int32": np.int32(-7), "int64": np.int64(-7)}
FACTOR = 4.0          # the bound: this times the NumPy backend's float16 error, plus the floor


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("fp16")


def half(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale + 0.1).astype(np.float16)


def node_of(op, arrays, dtypes=None, **attrs) -> Node:
    dtypes = dtypes or [str(a.dtype) for a in arrays]
    ins = [Value(a.shape, d) for a, d in zip(arrays, dtypes)]
    outs = [Value(s, d) for s, d in infer_outputs(op, ins, attrs)]
    return Node(op, ins, outs, attrs, mutates=OPS[op].mutates(attrs))


def _poisoned(values, xp):
    return [xp.full(v.shape, POISON[v.dtype], v.dtype) for v in values]


def _numpy(node, arrays):
    ins = [a.copy() for a in arrays]
    outs = _poisoned(node.outputs, np)
    NumpyBackend().run_node(node, ins, outs)
    return outs, ins


def _float64(node, arrays):
    """The same node with every float16 value in float64 (the reference)."""
    wide = [a.astype(np.float64) if a.dtype == np.float16 else a for a in arrays]
    ins = [Value(v.shape, "float64" if v.dtype == F16 else v.dtype) for v in node.inputs]
    outs = [Value(s, d) for s, d in infer_outputs(node.op, ins, node.attrs)]
    return _numpy(Node(node.op, ins, outs, node.attrs, mutates=node.mutates), wide)


def run_three(backend, ctx, node, arrays):
    """(cuda, numpy float16, float64) outputs and mutated inputs of one node."""
    with ctx.stream:
        dev_ins = [cp.asarray(a) for a in arrays]
        dev = _poisoned(node.outputs, cp)
    backend.impls[node.op](node, dev_ins, dev, ctx)
    ctx.stream.synchronize()
    got = ([cp.asnumpy(a) for a in dev], [cp.asnumpy(a) for a in dev_ins])
    return got, _numpy(node, arrays), _float64(node, arrays)


def judge(got, ref16, ref64, what, factor=FACTOR):
    assert got.dtype == ref16.dtype, f"{what}: {got.dtype} vs {ref16.dtype}"
    assert not np.isnan(got).any() or np.isnan(ref64).any(), f"{what}: an output not written"
    assert_close_to_reference(got.astype(np.float64), ref64, ref16.astype(np.float64), what,
                              factor=factor, precision=np.float16)


def check(backend, ctx, op, arrays, outputs=None, factor=FACTOR, **attrs):
    node = node_of(op, arrays, **attrs)
    (got, _), (ref16, _), (ref64, _) = run_three(backend, ctx, node, arrays)
    for i in (outputs if outputs is not None else range(len(got))):
        judge(got[i], ref16[i], ref64[i], f"{op} output {i}", factor)
    return got, ref16


# ---- the families -------------------------------------------------------------------------

def test_cast_rounds_as_numpy_astype(backend, ctx):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4099) * 3e4).astype(np.float32)       # overflows to inf too
    x[:4] = [np.nan, 65520.0, -65519.0, 2.0 ** -25 * 3]             # ties, subnormals
    (got, _), (ref, _), _ = run_three(backend, ctx, node_of("cast", [x], dtype=F16), [x])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    np.testing.assert_array_equal(got[0].view(np.uint16)[4:], want.view(np.uint16)[4:])
    assert np.isnan(got[0][0]) and np.array_equal(got[0][1:], want[1:]) and \
        np.array_equal(ref[0][1:], want[1:])
    back = want[4:]
    (got, _), _, _ = run_three(backend, ctx, node_of("cast", [back], dtype="float32"), [back])
    np.testing.assert_array_equal(got[0], back.astype(np.float32))


def test_fill_and_elementwise(backend, ctx):
    rng = np.random.default_rng(1)
    y = np.zeros((5, 7), np.float16)
    (got, _), (ref, _), _ = run_three(backend, ctx, node_of(
        "fill", [], shape=(5, 7), dtype=F16, value=0.1), [])
    np.testing.assert_array_equal(got[0], ref[0])
    del y
    x = half(rng, 33, 65)
    for kind in ("relu", "gelu", "sigmoid", "tanh"):
        check(backend, ctx, "act", [x], kind=kind, slope=None)
        check(backend, ctx, "act_grad", [half(rng, 33, 65), x], kind=kind, slope=None)
    check(backend, ctx, "add", [x, half(rng, 33, 65)])
    check(backend, ctx, "binary", [x, half(rng, 1, 65)], kind="mul")
    check(backend, ctx, "scalar", [x], kind="div", value=3.0)


def test_reduce_softmax_and_loss(backend, ctx):
    rng = np.random.default_rng(2)
    x = half(rng, 64, 48)
    check(backend, ctx, "reduce_sum", [x], axes=(0,), keepdims=False)
    check(backend, ctx, "log_softmax", [x], dim=-1)
    y = check(backend, ctx, "log_softmax", [x], dim=-1)[0][0]
    check(backend, ctx, "log_softmax_grad", [half(rng, 64, 48), y], dim=-1)
    labels = rng.integers(0, 48, 64).astype(np.int64)
    check(backend, ctx, "cross_entropy_train", [x, labels], label_smoothing=0.2)


def test_pool_and_batch_norm(backend, ctx):
    rng = np.random.default_rng(3)
    x = half(rng, 4, 6, 10, 10)
    got, _ = check(backend, ctx, "maxpool2d", [x], outputs=[0], kernel=(2, 2),
                   stride=(2, 2), padding=(0, 0))
    c = 6
    stats = [rng.standard_normal(c).astype(np.float32) for _ in range(2)] + \
        [np.zeros(c, np.float32), np.ones(c, np.float32), np.zeros((), np.int64)]
    check(backend, ctx, "batch_norm_train", [x, *stats], eps=1e-5, momentum=0.4,
          affine=True, track=True)


def test_linear_matmul_and_conv(backend, ctx):
    rng = np.random.default_rng(4)
    x, w, b = half(rng, 96, 200), half(rng, 72, 200, scale=0.1), half(rng, 72)
    check(backend, ctx, "linear", [x, w, b], act="gelu", slope=None)       # unfused epilogue
    check(backend, ctx, "linear", [x, w], act="relu", slope=None)          # cuBLASLt epilogue
    check(backend, ctx, "linear", [half(rng, 8, 20), half(rng, 10, 20)], act=None)   # small
    check(backend, ctx, "matmul", [half(rng, 96, 72), w], trans_a=False, trans_b=False)
    xi, wi = half(rng, 8, 16, 12, 12), half(rng, 24, 16, 3, 3, scale=0.1)
    conv = dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1)
    y = check(backend, ctx, "conv2d", [xi, wi], **conv)[0][0]
    dy = half(rng, *y.shape)
    check(backend, ctx, "conv2d_grad_input", [dy, wi], input_shape=xi.shape, **conv)
    check(backend, ctx, "conv2d_grad_weight", [dy, xi], weight_shape=wi.shape, **conv)


def test_attention_own_kernels(backend, ctx):
    rng = np.random.default_rng(5)
    q, k, v = (half(rng, 2, 3, 40, 64) for _ in range(3))
    check(backend, ctx, "sdpa", [q, k, v], outputs=[0], causal=True, scale=0.125,
          dropout_p=0.0, seed=0, site=0)


def test_sgd_update_of_float16_parameters(backend, ctx):
    """model.half(): float16 parameters, gradients and momentum updated in one launch, each
    widened, updated in float32 and rounded once, as the NumPy backend's update."""
    rng = np.random.default_rng(6)
    params = [half(rng, 33, 5), half(rng, 7)]
    grads = [half(rng, *p.shape) for p in params]
    bufs = [half(rng, *p.shape, scale=0.1) for p in params]
    attrs = dict(n_params=2, n_scalars=3, n_slots=1, nesterov=True)
    hyper = hyperparameter_table("sgd_update", dict(lr=1.0, weight_decay=5e-4, momentum=0.85,
                                                    dampening=0.0), 2)
    arrays = [np.float32(0.05), np.int64(3), hyper] + params + grads + bufs
    node = Node("sgd_update", [Value(np.shape(a), str(np.asarray(a).dtype)) for a in arrays],
                [], attrs, mutates=OPS["sgd_update"].mutates(attrs))
    arrays = [np.asarray(a) for a in arrays]
    (_, got), (_, ref16), (_, ref64) = run_three(backend, ctx, node, arrays)
    for i in list(range(3, 5)) + list(range(7, 9)):
        judge(got[i] - arrays[i], ref16[i] - arrays[i], ref64[i] - arrays[i].astype(np.float64),
              f"sgd_update input {i}")



@pytest.mark.parametrize("c", [48, 384, 6000])
def test_layer_norm_of_a_half_model(backend, ctx, c):
    """model.half(): x, weight, bias float16; float32 statistics; dx, dweight, dbias float16
    (the finalize rounds each sum once); and a float32 x with a fused float16 y."""
    rng = np.random.default_rng(7)
    x, w, b = half(rng, 2, 9, c), half(rng, c), half(rng, c)
    got, _ = check(backend, ctx, "layer_norm", [x, w, b], eps=1e-5, weight=True, bias=True)
    mean, rstd = got[1], got[2]
    check(backend, ctx, "layer_norm_grad", [half(rng, *x.shape), x, w, mean, rstd],
          weight=True, bias=True)
    x32 = x.astype(np.float32)
    node = node_of("layer_norm", [x32], eps=1e-5)
    node.outputs[0] = Value(x.shape, F16)            # fuse_layer_norm_casts' float16 y
    (dev, _), (ref16, _), (ref64, _) = run_three(backend, ctx, node, [x32])
    judge(dev[0], ref16[0], ref64[0].astype(np.float64), "layer_norm float16 y")



def test_softmax_plain_and_scaled(backend, ctx):
    rng = np.random.default_rng(8)
    x = half(rng, 2, 3, 40, 40, scale=3.0)
    y = check(backend, ctx, "softmax", [x], dim=-1)[0][0]
    check(backend, ctx, "softmax_grad", [half(rng, *x.shape), y], dim=-1)
    ys = check(backend, ctx, "softmax", [x], dim=-1, scale=0.125, causal=True)[0][0]
    check(backend, ctx, "softmax_grad", [half(rng, *x.shape), ys], dim=-1, scale=0.125,
          causal=True)


@pytest.mark.parametrize("path", ["scan", "sorted"])
@pytest.mark.parametrize("c", [12, 13])                          # float4 groups or not
def test_embedding_of_a_float16_table(backend, ctx, monkeypatch, path, c):
    """The lookup moves float16 values bit for bit (NaN rows for indices out of range); the
    gradient's per-row sums in float32, each rounded once."""
    from stepgraph.backends.cuda import embedding

    monkeypatch.setattr(embedding, "PATH", path)
    rng = np.random.default_rng(9)
    w, idx = half(rng, 300, c), rng.integers(0, 300, (7, 40)).astype(np.int64)
    idx[0, :3] = [-1, 300, 299]
    (got, _), (ref, _), _ = run_three(backend, ctx, node_of("embedding", [w, idx]), [w, idx])
    np.testing.assert_array_equal(got[0].view(np.uint16)[1:], ref[0].view(np.uint16)[1:])
    assert np.isnan(got[0][0, :2]).all() and np.array_equal(got[0][0, 2], w[299])
    dy = half(rng, 7, 40, c)
    check(backend, ctx, "embedding_grad", [dy, idx], num_embeddings=300)


# ---- whole steps --------------------------------------------------------------------------

def _loop(device, mode, data, init):
    """The half_convnet loop on a fresh session of `device`; (state, scales, executable)."""
    from stepgraph.loop import hooks
    from stepgraph.loop import session as loop_session

    loop_session._SESSION, hooks.SESSION = None, None
    loop_session.session().device = device
    net = hc.convnet(sg, mode == "half")
    hc.load_from(net, init)
    scales = hc.train(sg, net, data, autocast=mode == "autocast")
    return hc.state(net), scales, hooks.SESSION.last_executable


@pytest.mark.parametrize("mode", ["half", "autocast"])
def test_half_convnet_trains_on_cuda_in_one_graph(mode):
    """model.half() with float BatchNorms (or float16 autocast with a GradScaler) trains on
    cuda in one CUDA graph a step: every parameter's change within the policy of the NumPy
    backend's float16 run against torch float64, the same loss scales."""
    import torch

    data = hc.batches(6, np.float16 if mode == "half" else np.float32)
    init = hc.convnet(torch, mode == "half")
    start = hc.state(init)
    t64 = hc.convnet(torch, False).double()
    t64.load_state_dict({k: v.double() if v.is_floating_point() else v
                         for k, v in init.state_dict().items()})
    hc.train(torch, t64, [(x.astype(np.float64), y) for x, y in data], autocast=False)
    ref64 = hc.state(t64)
    ours16, scales16, _ = _loop("cpu", mode, data, init)
    got, scales, exe = _loop("cuda", mode, data, init)
    assert exe.captured is not None
    assert scales == scales16
    for k in ref64:
        change64 = ref64[k] - start[k]
        if k.endswith("num_batches_tracked"):
            assert got[k] == ref64[k]
            continue
        assert np.abs(change64).max() > 1e-4, f"{k} did not train"
        assert_close_to_reference(got[k] - start[k], change64, ours16[k] - start[k],
                                  f"change of {k}", precision=np.float16)
