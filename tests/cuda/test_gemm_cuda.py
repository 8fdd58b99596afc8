"""cuda vs numpy for the GEMM ops (matmul, linear, conv2d and its gradients), and GEMMs inside a
captured CUDA graph. Fresh random inputs, outputs poisoned with NaN first, awkward shapes."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

cp = pytest.importorskip("cupy")
pytest.importorskip("nvmath")

from stepgraph.backends import cuda_available  # noqa: E402

if not cuda_available():
    pytest.skip("no GPU visible to CuPy", allow_module_level=True)

from stepgraph.backends.cuda import conv, gemm, linear  # noqa: E402
from stepgraph.backends.cuda.backend import CudaBackend  # noqa: E402
from stepgraph.backends.numpy.kernels import IMPLS as NUMPY_IMPLS  # noqa: E402
from stepgraph.errors import BackendUnavailableError, PlanError, ShapeError  # noqa: E402
from stepgraph.ir.graph import Node, Value  # noqa: E402
from stepgraph.ir.ops import infer_outputs  # noqa: E402

TOL = {"fp32": 1e-5, "tf32": 3e-3}
# cuBLASLt's GELU epilogue may evaluate tanh with a hardware approximation (~5e-4 relative).
GELU_TANH_EPILOGUE_TOL = 2e-3
ACTS = (None, "relu", "leaky_relu", "sigmoid", "tanh", "gelu", "gelu_tanh")


@pytest.fixture(scope="module")
def backend():
    try:
        return CudaBackend()
    except BackendUnavailableError as err:    # e.g. nvmath without its cuBLASLt library
        pytest.skip(str(err))


@pytest.fixture(scope="module", params=["fp32", "tf32"])
def ctx(request, backend):
    return backend.make_context(request.param)


@pytest.fixture(scope="module")
def ctx32(backend):
    return backend.make_context("fp32")


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def random(rng, *shape, dtype="float32"):
    # Offset away from zero so that no input is all zeros, even at batch 1 / K = 1.
    return (rng.standard_normal(shape) + 0.1).astype(dtype)


def make_node(op, arrays, **attrs) -> Node:
    ins = [Value(a.shape, str(a.dtype)) for a in arrays]
    outs = [Value(s, d) for s, d in infer_outputs(op, ins, attrs)]
    return Node(op, ins, outs, attrs)


def run_both(backend, ctx, node: Node, arrays):
    """(numpy outputs, cuda outputs as numpy) of one node on the same inputs."""
    ref = [np.full(v.shape, np.nan, v.dtype) for v in node.outputs]
    NUMPY_IMPLS[node.op](node, list(arrays), ref, None)
    with ctx.stream:   # inputs and poisoned outputs made in the stream's order
        dev_in = [cp.asarray(a) for a in arrays]
        dev_out = [cp.full(v.shape, np.nan, v.dtype) for v in node.outputs]
    backend.run_node(node, dev_in, dev_out, ctx)
    return ref, [backend.to_numpy(o) for o in dev_out]


def check(ref, got, tol, what=""):
    for i, (r, g) in enumerate(zip(ref, got)):
        assert g.shape == r.shape, f"{what} output {i}: shape {g.shape} != {r.shape}"
        assert np.isfinite(g).all(), f"{what} output {i}: not every element was written"
        err = rel_err(g, r)
        assert err < tol, f"{what} output {i}: rel err {err:.2e} >= {tol}"


# ---- matmul --------------------------------------------------------------------------------

MATMUL_SHAPES = [(1, 1, 1), (7, 1, 5), (1, 130, 3), (33, 17, 9), (64, 64, 64), (5, 300, 1)]


@pytest.mark.parametrize("m,k,n", MATMUL_SHAPES)
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_matmul_matches_numpy(backend, ctx, m, k, n, trans_a, trans_b):
    rng = np.random.default_rng([m, k, n, int(trans_a), int(trans_b)])
    a = random(rng, *((k, m) if trans_a else (m, k)))
    b = random(rng, *((n, k) if trans_b else (k, n)))
    node = make_node("matmul", [a, b], trans_a=trans_a, trans_b=trans_b)
    ref, got = run_both(backend, ctx, node, [a, b])
    check(ref, got, TOL[ctx.precision], f"matmul {m}x{k}x{n} ta={trans_a} tb={trans_b}")


def test_matmul_float64(backend, ctx32):
    rng = np.random.default_rng(64)
    a, b = random(rng, 9, 13, dtype="float64"), random(rng, 11, 13, dtype="float64")
    node = make_node("matmul", [a, b], trans_b=True)
    ref, got = run_both(backend, ctx32, node, [a, b])
    check(ref, got, 1e-12, "matmul float64")


# ---- linear --------------------------------------------------------------------------------

LINEAR_SHAPES = [(1, 5, 3), (13, 7, 17), (64, 32, 24), (6, 1, 8)]   # (N, K, M)


@pytest.mark.parametrize("n,k,m", LINEAR_SHAPES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("save_preact", [False, True])
def test_linear_matches_numpy(backend, ctx32, n, k, m, act, with_bias, save_preact):
    rng = np.random.default_rng([n, k, m, ACTS.index(act), int(with_bias), int(save_preact)])
    x, w, b = random(rng, n, k), random(rng, m, k), random(rng, m)
    arrays = [x, w, b] if with_bias else [x, w]
    node = make_node("linear", arrays, act=act, slope=0.07, save_preact=save_preact)
    ref, got = run_both(backend, ctx32, node, arrays)
    tol = TOL["fp32"]
    if act == "gelu_tanh" and linear.GELU_TANH_IN_EPILOGUE:
        check(ref[:1], got[:1], GELU_TANH_EPILOGUE_TOL, f"linear {act}")
        check(ref[1:], got[1:], tol, f"linear {act} preact")
    else:
        check(ref, got, tol, f"linear {act} bias={with_bias} save_preact={save_preact}")


@pytest.mark.parametrize("act", [None, "relu", "gelu"])
def test_linear_tf32(backend, act):
    ctx = backend.make_context("tf32")
    rng = np.random.default_rng(32)
    x, w, b = random(rng, 50, 96), random(rng, 40, 96), random(rng, 40)
    node = make_node("linear", [x, w, b], act=act)
    ref, got = run_both(backend, ctx, node, [x, w, b])
    check(ref, got, TOL["tf32"], f"linear tf32 {act}")


def test_bgradb_epilogue_gives_weight_and_bias_grads(backend, ctx32):
    """dw = dz^T @ x with db = dz.sum(0) from the same GEMM (cuBLASLt BGRADB)."""
    rng = np.random.default_rng(7)
    dz, x = random(rng, 37, 12), random(rng, 37, 20)
    with ctx32.stream:
        d_dz, d_x = cp.asarray(dz), cp.asarray(x)
        dw, db = cp.full((12, 20), np.nan, np.float32), cp.full((12,), np.nan, np.float32)
    try:
        gemm.matmul(ctx32, d_dz, d_x, dw, trans_a=True, epilogue="BGRADB", bias=db)
    except gemm.GemmUnsupportedError as err:
        pytest.xfail(f"cuBLASLt has no BGRADB kernel here: {err}")
    check([dz.T @ x, dz.sum(0)], [backend.to_numpy(dw), backend.to_numpy(db)], 1e-5, "bgradb")


# ---- conv2d --------------------------------------------------------------------------------

# (N, C, H, W, O, kh, kw, stride, padding, bias)
CONVS = [
    (2, 3, 9, 7, 5, 3, 3, (1, 1), (1, 1), True),
    (1, 1, 5, 5, 1, 2, 3, (2, 1), (0, 0), False),
    (3, 4, 8, 10, 6, 3, 3, (2, 2), (1, 2), True),
    (2, 5, 4, 3, 7, 1, 1, (1, 1), (0, 0), True),      # pointwise: no im2col
    (2, 5, 4, 3, 7, 1, 1, (1, 1), (0, 0), False),
    (2, 2, 4, 4, 3, 4, 4, (1, 1), (0, 0), True),      # kernel covers the image: P = 1
    (2, 2, 9, 9, 3, 2, 2, (3, 3), (0, 0), False),     # stride > kernel: unread pixels
    (1, 3, 6, 5, 2, 5, 5, (1, 1), (2, 2), True),      # padding larger than half
]


def conv_arrays(cfg, seed):
    n, c, h, w, o, kh, kw, stride, padding, bias = cfg
    rng = np.random.default_rng(seed)
    x, wt, b = random(rng, n, c, h, w), random(rng, o, c, kh, kw), random(rng, o)
    attrs = {"stride": stride, "padding": padding}
    return x, wt, (b if bias else None), attrs


@pytest.mark.parametrize("cfg", CONVS)
def test_conv2d_forward_matches_numpy(backend, ctx, cfg):
    x, w, b, attrs = conv_arrays(cfg, 1)
    arrays = [x, w] if b is None else [x, w, b]
    ref, got = run_both(backend, ctx, make_node("conv2d", arrays, **attrs), arrays)
    check(ref, got, TOL[ctx.precision], f"conv2d {cfg}")


@pytest.mark.parametrize("cfg", CONVS)
def test_conv2d_grad_input_matches_numpy(backend, ctx, cfg):
    x, w, _, attrs = conv_arrays(cfg, 2)
    y_shape = infer_outputs("conv2d", [Value(x.shape, "float32"), Value(w.shape, "float32")],
                            attrs)[0][0]
    dy = random(np.random.default_rng(3), *y_shape)
    node = make_node("conv2d_grad_input", [dy, w], input_shape=x.shape, **attrs)
    ref, got = run_both(backend, ctx, node, [dy, w])
    check(ref, got, TOL[ctx.precision], f"conv2d_grad_input {cfg}")


@pytest.mark.parametrize("cfg", CONVS)
def test_conv2d_grad_weight_matches_numpy(backend, ctx, cfg):
    x, w, _, attrs = conv_arrays(cfg, 4)
    y_shape = infer_outputs("conv2d", [Value(x.shape, "float32"), Value(w.shape, "float32")],
                            attrs)[0][0]
    dy = random(np.random.default_rng(5), *y_shape)
    node = make_node("conv2d_grad_weight", [dy, x], weight_shape=w.shape, **attrs)
    ref, got = run_both(backend, ctx, node, [dy, x])
    check(ref, got, TOL[ctx.precision], f"conv2d_grad_weight {cfg}")


def test_conv2d_in_chunks(backend, monkeypatch):
    """A batch larger than the scratch limit runs in chunks (short last chunk included)."""
    ctx = backend.make_context("fp32")      # fresh scratch pool
    cfg = (5, 3, 7, 6, 4, 3, 3, (1, 1), (1, 1), True)
    x, w, b, attrs = conv_arrays(cfg, 6)
    per_sample = (3 * 9 + 4) * 7 * 6 * 4    # the largest (grad_weight) need, 2 samples a chunk
    monkeypatch.setattr(conv, "SCRATCH_CHUNK_BYTES", 2 * per_sample)
    ref, got = run_both(backend, ctx, make_node("conv2d", [x, w, b], **attrs), [x, w, b])
    check(ref, got, 1e-5, "conv2d chunked")
    dy = random(np.random.default_rng(8), *ref[0].shape)
    node = make_node("conv2d_grad_input", [dy, w], input_shape=x.shape, **attrs)
    check(*run_both(backend, ctx, node, [dy, w]), 1e-5, "conv2d_grad_input chunked")
    node = make_node("conv2d_grad_weight", [dy, x], weight_shape=w.shape, **attrs)
    check(*run_both(backend, ctx, node, [dy, x]), 1e-5, "conv2d_grad_weight chunked")


@pytest.mark.parametrize("op", ["conv2d", "conv2d_grad_input", "conv2d_grad_weight"])
def test_conv_prepare_takes_all_scratch(backend, op):
    """After PREPARE, running the node allocates nothing more (so it could be captured)."""
    ctx = backend.make_context("fp32")
    x, w, b, attrs = conv_arrays(CONVS[0], 9)
    dy = random(np.random.default_rng(10), 2, 5, 9, 7)
    arrays = {"conv2d": [x, w, b], "conv2d_grad_input": [dy, w],
              "conv2d_grad_weight": [dy, x]}[op]
    extra = {"conv2d": {}, "conv2d_grad_input": {"input_shape": x.shape},
             "conv2d_grad_weight": {"weight_shape": w.shape}}[op]
    node = make_node(op, arrays, **attrs, **extra)
    with ctx.stream:
        ins = [cp.asarray(a) for a in arrays]
        outs = [cp.full(v.shape, np.nan, v.dtype) for v in node.outputs]
    conv.PREPARE[op](node, ins, outs, ctx)
    pool = ctx.extras["conv_scratch"]
    before = [buf.data.ptr for buf in pool.buffers]
    backend.run_node(node, ins, outs, ctx)
    assert [buf.data.ptr for buf in pool.buffers] == before


# ---- backend memory ------------------------------------------------------------------------

def test_backend_views_and_copies(backend):
    rng = np.random.default_rng(21)
    arena = backend.empty((4096,), "uint8")
    v = backend.view(arena, 256, (3, 5), "float32")
    assert backend.owns(v) and not backend.owns(np.zeros(3))
    for _ in range(2):                       # the second copy reuses the pinned staging buffer
        host = random(rng, 3, 5)
        backend.copy_into(v, host)
        np.testing.assert_array_equal(backend.to_numpy(v), host)
    dev = cp.asarray(random(rng, 3, 5))      # written on CuPy's current stream
    backend.copy_into(v, dev)
    np.testing.assert_array_equal(backend.to_numpy(v), cp.asnumpy(dev))
    strided = cp.asarray(random(rng, 5, 3)).T
    backend.copy_into(v, strided)
    np.testing.assert_array_equal(backend.to_numpy(v), cp.asnumpy(strided))
    kept = backend.copy_result(v)
    backend.copy_into(v, random(rng, 3, 5))
    np.testing.assert_array_equal(backend.to_numpy(kept), cp.asnumpy(strided))
    with pytest.raises(ShapeError):
        backend.copy_into(v, np.zeros((5, 3), np.float32))
    with pytest.raises(ShapeError):
        backend.copy_into(v, np.zeros((3, 5), np.float64))
    with pytest.raises(PlanError):
        backend.view(arena, 4000, (100,), "float32")


# ---- capture -------------------------------------------------------------------------------

def test_gemms_replay_inside_cuda_graph(backend):
    """Linear (fused epilogue), a transposed matmul and a conv are captured after one eager
    warm-up, and every replay sees the new input data copied into the same buffers."""
    ctx = backend.make_context("fp32")
    rng = np.random.default_rng(11)
    x, w, b = random(rng, 10, 24), random(rng, 16, 24), random(rng, 16)
    xi, wc, bc = random(rng, 2, 3, 8, 8), random(rng, 4, 3, 3, 3), random(rng, 4)
    lin = make_node("linear", [x, w, b], act="relu")
    mm = make_node("matmul", [x, x], trans_a=True)
    cv = make_node("conv2d", [xi, wc, bc], stride=(1, 1), padding=(1, 1))
    calls = [(lin, [x, w, b]), (mm, [x, x]), (cv, [xi, wc, bc])]
    with ctx.stream:
        dev = {id(a): cp.asarray(a) for _, arrays in calls for a in arrays}
        outs = {n: [cp.full(v.shape, np.nan, v.dtype) for v in n.outputs] for n, _ in calls}

    def step():
        for node, arrays in calls:
            backend.run_node(node, [dev[id(a)] for a in arrays], outs[node], ctx)

    step()                                   # eager warm-up: plans GEMMs, takes scratch
    s = ctx.stream
    ctx.capturing = True
    s.begin_capture()
    try:
        step()
    finally:
        graph = s.end_capture()
        ctx.capturing = False
    graph.upload(s)
    for replay in range(5):
        new_x, new_xi = random(rng, *x.shape), random(rng, *xi.shape)
        backend.copy_into(dev[id(x)], new_x)
        backend.copy_into(dev[id(xi)], new_xi)
        graph.launch(s)
        for node, arrays in calls:
            host = [new_x if a is x else new_xi if a is xi else a for a in arrays]
            ref = [np.full(v.shape, np.nan, v.dtype) for v in node.outputs]
            NUMPY_IMPLS[node.op](node, host, ref, None)
            got = [backend.to_numpy(o) for o in outs[node]]
            check(ref, got, 1e-5, f"replay {replay} {node.op}")
