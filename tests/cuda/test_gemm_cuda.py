"""cuda vs numpy for the GEMM ops (matmul, linear, conv2d and its gradients), and GEMMs inside a
captured CUDA graph. Fresh random inputs, outputs poisoned with NaN first, awkward shapes."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu("nvmath")

from stepgraph.backends.cuda.conv import conv, conv_tiled  # noqa: E402
from stepgraph.backends.cuda.conv import geometry as conv_geometry  # noqa: E402
from stepgraph.backends.cuda.matmul import gemm, linear, small_matmul  # noqa: E402
from stepgraph.errors import PlanError, ShapeError  # noqa: E402
from stepgraph.ir.graph import Node, Value  # noqa: E402
from stepgraph.ir.ops import IMPLS as NUMPY_IMPLS  # noqa: E402
from stepgraph.ir.ops import infer_outputs  # noqa: E402
from tests.cuda import helpers  # noqa: E402
from tests.cuda.helpers import make_node, poisoned, random, rel_err, to_device  # noqa: E402

TOL = {"fp32": 1e-5, "tf32": 3e-3}
# cuBLASLt's GELU epilogue may evaluate tanh with a hardware approximation (~5e-4 relative).
GELU_TANH_EPILOGUE_TOL = 2e-3
ACTS = (None, "relu", "leaky_relu", "sigmoid", "tanh", "gelu", "gelu_tanh")


@pytest.fixture(scope="module", params=["fp32", "tf32"])
def ctx(request, backend):
    return backend.make_context(request.param)


@pytest.fixture(scope="module")
def ctx32(backend):
    return backend.make_context("fp32")


def run_both(backend, ctx, node: Node, arrays):
    """(numpy outputs, cuda outputs) of one node, the cuda side through the backend's table."""
    return helpers.run_both(ctx, node, arrays, backend.impls)


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


@pytest.mark.parametrize("path", ["auto", "cublaslt", "cublaslt:bgrad"])
@pytest.mark.parametrize("rows, m, n", [(37, 13, 20), (2048, 13, 8), (1024, 96, 64), (4096, 384, 40)])
def test_matmul_with_bias_grad_matches_numpy(backend, ctx, rows, m, n, path, monkeypatch):
    """dw = dz^T @ x and db = dz.sum(0) from one matmul node (compile/fuse.py
    fuse_matmul_bias_grad) on each path: the autotuned one, the GEMM then reduce.cu's column
    sums (one or four columns a thread, with row splits on the tall ones), and
    cuBLASLt's BGRADB epilogue."""
    rng = np.random.default_rng([rows, m, n])
    dz, x = random(rng, rows, m), random(rng, rows, n)
    node = make_node("matmul", [dz, x], trans_a=True, bias_grad=True)
    assert [v.shape for v in node.outputs] == [(m, n), (m,)]
    if path != "auto":      # the path itself, not the small-GEMM kernel small products take
        chosen = []
        monkeypatch.setattr(small_matmul, "SMALL_MACS", 0)
        monkeypatch.setattr(linear, "_run_fastest", lambda node, ctx, operands, paths:
                            chosen.append(path) or paths[path]())
    ref, got = run_both(backend, ctx, node, [dz, x])
    assert path == "auto" or chosen == [path]
    check(ref, got, TOL[ctx.precision], f"matmul bias_grad {rows}x{m}x{n} {path}")


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


@pytest.mark.parametrize("path", ["cublaslt", "cublaslt:unfused"])
@pytest.mark.parametrize("save_preact", [False, True])
def test_linear_gelu_tanh_each_cublaslt_path(backend, ctx32, monkeypatch, path, save_preact):
    """gelu_tanh offers the GEMM epilogue and the BIAS GEMM + activation kernel to the
    autotuner; each, run alone, matches numpy."""
    offered = []

    def run(ctx, key, paths, default):
        offered.append(set(paths))
        paths[path]()

    monkeypatch.setattr(linear.autotune, "run_fastest", run)
    rng = np.random.default_rng(51)
    x, w, b = random(rng, 512, 128), random(rng, 256, 128), random(rng, 256)
    node = make_node("linear", [x, w, b], act="gelu_tanh", save_preact=save_preact)
    ref, got = run_both(backend, ctx32, node, [x, w, b])
    assert offered and {"cublaslt", "cublaslt:unfused"} <= offered[0]
    fused = path == "cublaslt" and linear.GELU_TANH_IN_EPILOGUE
    check(ref[:1], got[:1], GELU_TANH_EPILOGUE_TOL if fused else TOL["fp32"], path)
    check(ref[1:], got[1:], TOL["fp32"], f"{path} preact")


@pytest.mark.parametrize("act", [None, "relu", "gelu"])
def test_linear_tf32(backend, act):
    ctx = backend.make_context("tf32")
    rng = np.random.default_rng(32)
    x, w, b = random(rng, 50, 96), random(rng, 40, 96), random(rng, 40)
    node = make_node("linear", [x, w, b], act=act)
    ref, got = run_both(backend, ctx, node, [x, w, b])
    check(ref, got, TOL["tf32"], f"linear tf32 {act}")


def test_bgradb_epilogue_gives_weight_and_bias_grads(backend, ctx32):
    """dw = dz^T @ x with db = dz.sum(0) from the same GEMM (cuBLASLt BGRADB). gemm.py offers
    the epilogue (EPILOGUES), so a cuBLASLt without a kernel for it fails here: no xfail (it ran
    on the H200 suites of docs/perf-notes.md, whose only xfail was another test)."""
    rng = np.random.default_rng(7)
    dz, x = random(rng, 37, 12), random(rng, 37, 20)
    with ctx32.stream:
        d_dz, d_x = cp.asarray(dz), cp.asarray(x)
        dw, db = cp.full((12, 20), np.nan, np.float32), cp.full((12,), np.nan, np.float32)
    gemm.matmul(ctx32, d_dz, d_x, dw, trans_a=True, epilogue="BGRADB", bias=db)
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
    (2, 4, 8, 6, 3, 2, 2, (2, 2), (0, 0), True),      # stride = kernel (a 2x2 transposed conv)
    (1, 3, 6, 5, 2, 5, 5, (1, 1), (2, 2), True),      # padding larger than half
    (1, 1, 13, 11, 3, 3, 2, (2, 2), (1, 0), True),    # batch 1, C = 1, odd sizes, 3x2 kernel
    (3, 6, 11, 9, 9, 2, 5, (2, 1), (1, 2), False),    # 9 channels: a partial group of 4
    (2, 3, 20, 15, 5, 3, 3, (1, 1), (1, 1), True),    # 300 output pixels: two uneven passes
    (2, 2, 7, 8, 3, 3, 3, (1, 1), (3, 3), True),      # windows wholly in the padding
    (64, 1, 28, 28, 10, 5, 5, (1, 1), (0, 0), True),  # the benchmark CNN's conv1
    (64, 10, 12, 12, 20, 5, 5, (1, 1), (0, 0), True),  # and its conv2
]
CONV_IDS = ["x".join(map(str, cfg[:7])) + f"-s{cfg[7][0]}{cfg[7][1]}p{cfg[8][0]}{cfg[8][1]}"
            + ("b" if cfg[9] else "") for cfg in CONVS]
BENCH_CONVS = CONVS[-2:]


@pytest.fixture(params=["gemm", "direct", "direct_narrow", "tiled"])
def conv_path(request, monkeypatch):
    """Every implementation of the conv ops: im2col + cuBLASLt, the direct kernels (4
    channels a thread, and 1: grad_weight has one direct kernel, which both names run) and the
    tiled kernels (stride 1; other convs fall back to direct when "tiled" is forced)."""
    monkeypatch.setattr(conv, "PATH", request.param)
    return request.param


def conv_arrays(cfg, seed):
    n, c, h, w, o, kh, kw, stride, padding, bias = cfg
    rng = np.random.default_rng(seed)
    x, wt, b = random(rng, n, c, h, w), random(rng, o, c, kh, kw), random(rng, o)
    attrs = {"stride": stride, "padding": padding}
    return x, wt, (b if bias else None), attrs


def conv_grad_inputs(cfg, seed):
    """x, w, dy (fresh, of the forward's output shape) and the attrs of one config."""
    x, w, _, attrs = conv_arrays(cfg, seed)
    y_shape = infer_outputs("conv2d", [Value(x.shape, "float32"), Value(w.shape, "float32")],
                            attrs)[0][0]
    return x, w, random(np.random.default_rng(seed + 1), *y_shape), attrs


def conv_tol(ctx, path):
    return TOL["fp32"] if path != "gemm" else TOL[ctx.precision]   # direct is exact FP32


@pytest.mark.parametrize("act", ["none", "relu"])
@pytest.mark.parametrize("cfg", CONVS, ids=CONV_IDS)
def test_conv2d_forward_matches_numpy(backend, ctx, conv_path, cfg, act):
    """Each path, plain and with the ReLU fused (compile/fuse.py fuse_conv_relu): the gemm
    path in cuBLASLt's RELU epilogue, the others in place after their kernel."""
    x, w, b, attrs = conv_arrays(cfg, 1)
    arrays = [x, w] if b is None else [x, w, b]
    ref, got = run_both(backend, ctx, make_node("conv2d", arrays, **attrs, act=act), arrays)
    if act == "relu":
        assert (np.asarray(got[0]) >= 0).all() and (np.asarray(ref[0]) == 0).any()
    check(ref, got, conv_tol(ctx, conv_path), f"conv2d {conv_path} {cfg} {act}")


@pytest.mark.parametrize("cfg", CONVS, ids=CONV_IDS)
def test_conv2d_grad_input_matches_numpy(backend, ctx, conv_path, cfg):
    x, w, dy, attrs = conv_grad_inputs(cfg, 2)
    node = make_node("conv2d_grad_input", [dy, w], input_shape=x.shape, **attrs)
    ref, got = run_both(backend, ctx, node, [dy, w])
    check(ref, got, conv_tol(ctx, conv_path), f"conv2d_grad_input {conv_path} {cfg}")


@pytest.mark.parametrize("cfg", CONVS, ids=CONV_IDS)
@pytest.mark.parametrize("bias", [False, True], ids=["", "db"])
def test_conv2d_grad_weight_matches_numpy(backend, ctx, conv_path, cfg, bias):
    x, w, dy, attrs = conv_grad_inputs(cfg, 4)
    node = make_node("conv2d_grad_weight", [dy, x], weight_shape=w.shape, bias=bias, **attrs)
    ref, got = run_both(backend, ctx, node, [dy, x])
    check(ref, got, conv_tol(ctx, conv_path), f"conv2d_grad_weight {conv_path} {cfg}")


@pytest.fixture
def launched(monkeypatch):
    """The .cu file of every kernel fetched through compiler.kernel while the test runs."""
    files = []
    kernel = conv.compiler.kernel
    monkeypatch.setattr(conv.compiler, "kernel",
                        lambda f, name: files.append(f) or kernel(f, name))
    return files


STRIDE1_CONVS = [(cfg, i) for i, cfg in zip(CONV_IDS, CONVS) if cfg[7] == (1, 1)]


@pytest.mark.parametrize("variant", conv_tiled.CONV_VARIANTS,
                         ids=lambda v: f"{v[0][0]}x{v[0][1]}k{v[1]}")
@pytest.mark.parametrize("cfg", [c for c, _ in STRIDE1_CONVS], ids=[i for _, i in STRIDE1_CONVS])
def test_conv2d_tiled_every_tile(backend, ctx32, monkeypatch, launched, cfg, variant):
    """Each variant ((channels, pixels) tile, input-channel split) of conv2d_tiled_kernel,
    forward (also with a fused ReLU, applied in the store after the splits' sums) and
    grad_input, partial channel groups and row tiles included; where that kernel exists for
    the shape, it is what ran (the ReLU in the same launch)."""
    tile, ks = variant
    monkeypatch.setattr(conv, "PATH", "tiled")
    monkeypatch.setattr(conv_tiled, "CONV_VARIANTS", (variant,))
    x, w, dy, attrs = conv_grad_inputs(cfg, 18)
    b = random(np.random.default_rng(19), w.shape[0])
    g = conv._geometry(x.shape, w.shape, attrs)
    for op, arrays, extra in [("conv2d", [x, w, b], {}), ("conv2d", [x, w, b], {"act": "relu"}),
                              ("conv2d_grad_input", [dy, w], {"input_shape": x.shape})]:
        launched.clear()
        node = make_node(op, arrays, **attrs, **extra)
        check(*run_both(backend, ctx32, node, arrays), 1e-5, f"{op} tiled {tile} k{ks} {cfg}")
        flip = op == "conv2d_grad_input"
        if conv_tiled.unsupported(op, g, x.dtype) is None and \
                conv_tiled.plan_conv(g, flip, tile, ks, x.itemsize) is not None:
            assert launched == [conv_tiled.SOURCE], f"{op}: {launched}"


@pytest.mark.parametrize("split", conv_tiled.GRAD_WEIGHT_SPLITS, ids=lambda s: f"r{s[0]}o{s[1]}")
@pytest.mark.parametrize("cfg", [c for c, _ in STRIDE1_CONVS], ids=[i for _, i in STRIDE1_CONVS])
def test_conv2d_tiled_grad_weight_every_split(backend, ctx32, monkeypatch, launched, cfg,
                                               split):
    """conv2d_tiled_grad_weight_kernel with (row ranges, channel ranges) blocks per sample
    (where that split exists), with and without the bias gradient; the tiled kernels ran."""
    monkeypatch.setattr(conv, "PATH", "tiled")
    monkeypatch.setattr(conv_tiled, "GRAD_WEIGHT_SPLITS", (split,))
    x, w, dy, attrs = conv_grad_inputs(cfg, 24)
    g = conv._geometry(x.shape, w.shape, attrs)
    for bias in (False, True):
        launched.clear()
        node = make_node("conv2d_grad_weight", [dy, x], weight_shape=w.shape, bias=bias, **attrs)
        check(*run_both(backend, ctx32, node, [dy, x]), 1e-5, f"grad_weight {split} {cfg}")
        if conv_tiled.plan_grad_weight(g, split, bias, x.itemsize) is not None:
            assert launched == [conv_tiled.SOURCE] * 2, launched


@pytest.mark.parametrize("cfg", BENCH_CONVS, ids=CONV_IDS[-2:])
def test_conv_tiled_path_launches_only_tiled_kernels(backend, monkeypatch, launched, cfg):
    """On the tiled path each op of the benchmark CNN's convs launches conv_tiled.cu alone
    (grad_weight with db: the per-sample partials and their in-order sum), and is bitwise the
    same on a second run."""
    ctx = backend.make_context("fp32")                # fresh scratch pool
    monkeypatch.setattr(conv, "PATH", "tiled")
    monkeypatch.setattr(conv.reduce, "reduce_sum_forward",
                        lambda *a, **k: pytest.fail("separate bias reduction on tiled path"))
    x, w, dy, attrs = conv_grad_inputs(cfg, 22)
    b = random(np.random.default_rng(23), w.shape[0])
    calls = [("conv2d", [x, w, b], {}, 1),
             ("conv2d_grad_input", [dy, w], {"input_shape": x.shape}, 1),
             ("conv2d_grad_weight", [dy, x], {"weight_shape": w.shape, "bias": True}, 2)]
    for op, arrays, extra, launches in calls:
        node = make_node(op, arrays, **attrs, **extra)
        launched.clear()
        ref, first = run_both(backend, ctx, node, arrays)
        assert launched == [conv_tiled.SOURCE] * launches, f"{op}: {launched}"
        _, second = run_both(backend, ctx, node, arrays)
        check(ref, first, 1e-5, f"{op} tiled")
        for a, b2 in zip(first, second):
            np.testing.assert_array_equal(a, b2, err_msg=f"{op}: not deterministic")


@pytest.mark.parametrize("tile", conv.GRAD_WEIGHT_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("cfg", [CONVS[2], CONVS[9], CONVS[10], CONVS[13]],
                         ids=[CONV_IDS[2], CONV_IDS[9], CONV_IDS[10], CONV_IDS[13]])
def test_conv2d_direct_grad_weight_every_tile(backend, ctx32, monkeypatch, cfg, tile):
    """Each (channels, taps) tile of the weight-gradient kernel, partial tiles included."""
    monkeypatch.setattr(conv, "PATH", "direct")
    monkeypatch.setattr(conv, "GRAD_WEIGHT_TILES", (tile,))
    x, w, dy, attrs = conv_grad_inputs(cfg, 12)
    node = make_node("conv2d_grad_weight", [dy, x], weight_shape=w.shape, **attrs)
    check(*run_both(backend, ctx32, node, [dy, x]), 1e-5, f"grad_weight tile {tile} {cfg}")


@pytest.mark.parametrize("path,cfg", [("direct", CONVS[2]), ("tiled", CONVS[0])],
                         ids=["direct", "tiled"])      # tiled: a stride-1 config
@pytest.mark.parametrize("op", ["conv2d", "conv2d_grad_input", "conv2d_grad_weight"])
def test_conv2d_kernels_float64(backend, ctx32, monkeypatch, op, path, cfg):
    """The direct and tiled kernels in float64 (the tiled weight gradient with its db)."""
    monkeypatch.setattr(conv, "PATH", path)
    x, w, dy, attrs = conv_grad_inputs(cfg, 14)
    x, w, dy = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    b = random(np.random.default_rng(15), w.shape[0], dtype="float64")
    arrays, extra = {"conv2d": ([x, w, b], {}),
                     "conv2d_grad_input": ([dy, w], {"input_shape": x.shape}),
                     "conv2d_grad_weight": ([dy, x], {"weight_shape": w.shape,
                                                      "bias": path == "tiled"})}[op]
    node = make_node(op, arrays, **attrs, **extra)
    check(*run_both(backend, ctx32, node, arrays), 1e-12, f"{op} float64 {path}")


@pytest.mark.parametrize("cfg", BENCH_CONVS, ids=CONV_IDS[-2:])
def test_conv_direct_path_launches_only_direct_kernels(backend, monkeypatch, launched, cfg):
    """On the direct path each op of the benchmark CNN's convs launches conv_direct.cu alone
    (grad_weight: the split sums and their in-order total), no GEMM, and is bitwise the same
    on a second run."""
    ctx = backend.make_context("fp32")                # fresh scratch pool
    monkeypatch.setattr(conv, "PATH", "direct")
    monkeypatch.setattr(conv.gemm, "matmul", lambda *a, **k: pytest.fail("GEMM on direct path"))
    x, w, dy, attrs = conv_grad_inputs(cfg, 16)
    b = random(np.random.default_rng(17), w.shape[0])
    calls = [("conv2d", [x, w, b], {}),
             ("conv2d_grad_input", [dy, w], {"input_shape": x.shape}),
             ("conv2d_grad_weight", [dy, x], {"weight_shape": w.shape})]
    for op, arrays, extra in calls:
        node = make_node(op, arrays, **attrs, **extra)
        assert conv.use_direct(op, conv._geometry(x.shape, w.shape, attrs), x.dtype)
        launched.clear()
        ref, first = run_both(backend, ctx, node, arrays)
        assert set(launched) == {conv.DIRECT_SOURCE}, f"{op}: {launched}"
        splits = conv.grad_weight_splits(conv._geometry(x.shape, w.shape, attrs))
        assert len(launched) == (2 if op == "conv2d_grad_weight" and splits > 1 else 1), \
            f"{op}: {launched}"
        _, second = run_both(backend, ctx, node, arrays)
        check(ref, first, 1e-5, f"{op} direct")
        np.testing.assert_array_equal(first[0], second[0], err_msg=f"{op}: not deterministic")


@pytest.mark.parametrize("cfg", BENCH_CONVS, ids=CONV_IDS[-2:])
def test_conv_path_is_timed_once_per_problem_and_shared(backend, monkeypatch, cfg):
    """With PATH "auto" the first call of a problem times every path once; later calls, of
    any node with the same problem in any context sharing the choices, reuse it and give the
    same bits; either way the result matches the reference."""
    ctx = backend.make_context("fp32")
    ctx.paths = {}                                    # no choice made by earlier tests
    x, w, dy, attrs = conv_grad_inputs(cfg, 16)
    node = make_node("conv2d_grad_input", [dy, w], **attrs, input_shape=x.shape)
    ref, first = run_both(backend, ctx, node, [dy, w])
    check(ref, first, 1e-5, "conv2d_grad_input timed path")
    assert len(ctx.paths) == 1
    monkeypatch.setattr(conv.autotune, "time_on_device",
                        lambda *a, **k: pytest.fail("timed twice"))
    twin_ctx = backend.make_context("fp32")
    twin_ctx.paths = ctx.paths
    twin = make_node("conv2d_grad_input", [dy, w], **attrs, input_shape=x.shape)
    _, second = run_both(backend, twin_ctx, twin, [dy, w])
    np.testing.assert_array_equal(first[0], second[0])


def test_conv_selection_rule():
    """Small convs go direct; big ones, or ones whose weights overflow shared memory, and
    weight gradients with very long sums stay on im2col + GEMM."""
    geom = conv.Geometry
    bench1, bench2 = geom(64, 1, 28, 28, 10, 5, 5, 1, 1, 0, 0), geom(64, 10, 12, 12, 20, 5, 5,
                                                                     1, 1, 0, 0)
    resnet = geom(128, 64, 32, 32, 64, 3, 3, 1, 1, 1, 1)            # 4.8 G multiply-adds
    wide = geom(1, 128, 8, 8, 4, 3, 3, 1, 1, 1, 1)                    # C*kh*kw = 1152
    tall = geom(1, 4, 8, 8, 200, 3, 3, 1, 1, 1, 1)                    # O*kh*kw = 1800
    long_sum = geom(512, 1, 32, 32, 1, 1, 1, 1, 1, 0, 0)              # N*Ho*Wo = 2^19
    for op in ("conv2d", "conv2d_grad_input", "conv2d_grad_weight"):
        assert conv.use_direct(op, bench1, "float32") and conv.use_direct(op, bench2, "float32")
        for g in (resnet, wide, tall):
            assert not conv.use_direct(op, g, "float32"), (op, g)
        assert not conv.use_direct(op, bench1, "float16")
    assert conv.use_direct("conv2d", long_sum, "float32")
    assert not conv.use_direct("conv2d_grad_weight", long_sum, "float32")
    assert conv.grad_weight_tile(bench2) == (4, 4) and conv.grad_weight_tile(bench1) == (1, 2)
    assert conv.grad_weight_block(bench1) == (192, 1) and conv.grad_weight_block(bench2) == (64, 4)


def test_conv2d_in_chunks(backend, monkeypatch):
    """A batch larger than the scratch limit runs in chunks (short last chunk included)."""
    monkeypatch.setattr(conv, "PATH", "gemm")
    ctx = backend.make_context("fp32")      # fresh scratch pool
    cfg = (5, 3, 7, 6, 4, 3, 3, (1, 1), (1, 1), True)
    x, w, b, attrs = conv_arrays(cfg, 6)
    per_sample = (3 * 9 + 4) * 7 * 6 * 4    # the largest (grad_weight) need, 2 samples a chunk
    monkeypatch.setattr(conv_geometry, "SCRATCH_CHUNK_BYTES", 2 * per_sample)
    ref, got = run_both(backend, ctx, make_node("conv2d", [x, w, b], **attrs), [x, w, b])
    check(ref, got, 1e-5, "conv2d chunked")
    dy = random(np.random.default_rng(8), *ref[0].shape)
    node = make_node("conv2d_grad_input", [dy, w], input_shape=x.shape, **attrs)
    check(*run_both(backend, ctx, node, [dy, w]), 1e-5, "conv2d_grad_input chunked")
    node = make_node("conv2d_grad_weight", [dy, x], weight_shape=w.shape, **attrs)
    check(*run_both(backend, ctx, node, [dy, x]), 1e-5, "conv2d_grad_weight chunked")


@pytest.mark.parametrize("op", ["conv2d", "conv2d_grad_input", "conv2d_grad_weight"])
def test_conv_second_run_allocates_no_scratch(backend, monkeypatch, op):
    """After one eager run, running the node again allocates nothing (so it can be captured)."""
    monkeypatch.setattr(conv, "PATH", "gemm")
    ctx = backend.make_context("fp32")
    x, w, b, attrs = conv_arrays(CONVS[0], 9)
    dy = random(np.random.default_rng(10), 2, 5, 9, 7)
    arrays = {"conv2d": [x, w, b], "conv2d_grad_input": [dy, w],
              "conv2d_grad_weight": [dy, x]}[op]
    extra = {"conv2d": {}, "conv2d_grad_input": {"input_shape": x.shape},
             "conv2d_grad_weight": {"weight_shape": w.shape}}[op]
    node = make_node(op, arrays, **attrs, **extra)
    ins, outs = to_device(ctx, arrays), poisoned(ctx, node)
    backend.run_node(node, ins, outs, ctx)
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

def test_gemms_replay_inside_cuda_graph(backend, conv_path):
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
