"""cuda vs numpy for the bf16 kernels of the dense steps (precision="bf16"): dropout,
dropout_grad, act_bias_grad, reduce_sum, matmul and linear (cuBLASLt bf16, fused and unfused
epilogues, and the small-GEMM kernels), the optimizer updates' bf16 weight copies; whole mlp- and
big-shaped bf16 steps against the numpy backend, and graph replay against eager, bit for bit.

Every op runs on fresh random inputs into poisoned outputs. The reference is the numpy
backend's run_node (float32 compute, each bf16 output rounded once). Where the arithmetic is
the same (dropout, relu derivatives, weight copies) the bits must agree. Sums in another order
(GEMMs; reduce_sum's and act_bias_grad's float64 column sums vs numpy's float32 pairwise sums)
and float32 gelu (normcdff) vs numpy's float64 erf differ from the reference in the last
float32 bits, which can move a bf16 rounding by one step: those compare within 1 bf16 ulp of
the numpy value, or within a small absolute tolerance where a float32 sum cancels to near 0
(there an ulp of the tiny result is far below the sum's float32 rounding error)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

import stepgraph as sg  # noqa: E402
from stepgraph import losses, models, optim  # noqa: E402
from stepgraph.backends.cuda.matmul import small_matmul  # noqa: E402
from stepgraph.backends.numpy import NumpyBackend, bf16  # noqa: E402
from stepgraph.ir.graph import BF16, Node, Value  # noqa: E402
from stepgraph.ir.ops import OPS, infer_outputs  # noqa: E402
from tests.cuda.helpers import (MIDDLE_SUM_CASES, ROW_SUM_CASES,  # noqa: E402
                                update_hyperparameters)
from tests.ops.helpers import relative_error as rel, seeded  # noqa: E402

POISON = {"float32": np.float32(np.nan), "uint8": np.uint8(7), "int64": np.int64(-7),
          BF16: np.uint16(0x7FA1)}                # a NaN the rounding never writes (0x7FC0)
STORAGE = {BF16: np.uint16}


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("bf16")


def bits(rng, *shape, scale=1.0) -> np.ndarray:
    """Random bf16 values (raw bits), normal, shifted off zero."""
    return bf16.to_bits((rng.standard_normal(shape) * scale + 0.1).astype(np.float32))


def node_of(op, arrays, dtypes, **attrs) -> Node:
    ins = [Value(a.shape, d) for a, d in zip(arrays, dtypes)]
    outs = [Value(s, d) for s, d in infer_outputs(op, ins, attrs)]
    return Node(op, ins, outs, attrs, mutates=OPS[op].mutates(attrs))


def _poisoned(values, xp):
    return [xp.full(v.shape, POISON[v.dtype], STORAGE.get(v.dtype, v.dtype)) for v in values]


def run_both(backend, ctx, node, arrays):
    """(numpy outputs, cuda outputs, numpy inputs after, cuda inputs after) of one node."""
    ref_ins = [a.copy() for a in arrays]
    ref = _poisoned(node.outputs, np)
    NumpyBackend().run_node(node, ref_ins, ref)
    with ctx.stream:
        dev_ins = [cp.asarray(a) for a in arrays]
        dev = _poisoned(node.outputs, cp)
    backend.impls[node.op](node, dev_ins, dev, ctx)
    ctx.stream.synchronize()
    return ref, [cp.asnumpy(a) for a in dev], ref_ins, [cp.asnumpy(a) for a in dev_ins]


def ordered(b: np.ndarray) -> np.ndarray:
    """bf16 bits as integers that count ulps monotonically across zero."""
    b = b.astype(np.int32)
    return np.where(b & 0x8000, -(b & 0x7FFF), b)


def assert_bf16_within(got, want, ulps=1, atol=0.0, what=""):
    assert got.dtype == np.uint16 and got.shape == want.shape, what
    assert not np.any(got == POISON[BF16]), f"{what}: elements left unwritten"
    far = np.abs(ordered(got) - ordered(want)) > ulps
    if atol:
        far &= np.abs(bf16.from_bits(got) - bf16.from_bits(want)) > atol
    assert not far.any(), (f"{what}: {far.sum()} of {far.size} differ by more than {ulps} ulp; "
                           f"first got {bf16.from_bits(got)[far][:4]} want "
                           f"{bf16.from_bits(want)[far][:4]}")


# ---- elementwise and reductions ------------------------------------------------------------

@pytest.mark.parametrize("shape", [(64, 48), (7, 13), (1,)])
@pytest.mark.parametrize("per_channel", [False, True])
def test_dropout_and_its_grad_match_the_numpy_bits(backend, ctx, shape, per_channel, request):
    if per_channel and len(shape) < 2:
        pytest.skip("per_channel needs (N, C, ...)")
    rng = seeded(request.node.name)
    shape = shape + (3, 5) if per_channel else shape
    x, step = bits(rng, *shape), np.array(11, np.int64)
    node = node_of("dropout", [x, step], [BF16, "int64"], p=0.3, seed=5, site=2,
                   per_channel=per_channel)
    (y_ref, m_ref), (y, m), _, _ = run_both(backend, ctx, node, [x, step])
    np.testing.assert_array_equal(m, m_ref)
    np.testing.assert_array_equal(y, y_ref)
    dy = bits(rng, *shape)
    grad = node_of("dropout_grad", [dy, m_ref], [BF16, "uint8"], p=0.3, per_channel=per_channel)
    (dx_ref,), (dx,), _, _ = run_both(backend, ctx, grad, [dy, m_ref])
    np.testing.assert_array_equal(dx, dx_ref)


@pytest.mark.parametrize("kind", ["relu", "gelu", "gelu_tanh", "none"])
@pytest.mark.parametrize("rows,cols", [(64, 40), (3000, 24), (5, 1), (1024, 1536), (300, 30)])
def test_act_bias_grad(backend, ctx, kind, rows, cols, request):
    """Four columns a thread where cols % 4 == 0 (the GPT's (B * T, 1536) among them, its rows
    split over blocks), one where not."""
    rng = seeded(request.node.name)
    dy, saved = bits(rng, rows, cols), bits(rng, rows, cols, scale=2.0)
    node = node_of("act_bias_grad", [dy, saved], [BF16, BF16], kind=kind, slope=0.01)
    (dz_ref, db_ref), (dz, db), _, _ = run_both(backend, ctx, node, [dy, saved])
    if kind == "gelu":     # float32 normcdff vs the reference's float64 erf: within one ulp
        # but in the far tails (|dz| ~ 1e-16 and below, 16 of 1.5M elements measured on an
        # H200), where float32's exp carries a larger relative error
        assert_bf16_within(dz, dz_ref, atol=1e-12, what="dz")
    elif kind == "gelu_tanh":   # the hardware's tanh (2^-10.9 relative): within one ulp, or
        # a small absolute error where the derivative crosses zero (near z = -0.75)
        assert_bf16_within(dz, dz_ref, atol=2e-3, what="dz")
    else:                  # one float32 product, rounded once: the same bits
        np.testing.assert_array_equal(dz, dz_ref)
    # db: float64 column sums of the float32 dz vs numpy's float32 pairwise sums.
    assert_bf16_within(db, db_ref, atol=1e-4 * np.sqrt(rows), what="db")


@pytest.mark.parametrize("shape,axes", [((64, 40), (0,)), ((3000, 24), (0,)),
                                        ((6, 5, 4, 3), (0, 2, 3)), ((6, 5, 4), (1,)),
                                        ((4, 5, 6), (0, 2))])
def test_reduce_sum(backend, ctx, shape, axes, request):
    rng = seeded(request.node.name)
    x = bits(rng, *shape)
    node = node_of("reduce_sum", [x], [BF16], axes=axes)
    (want,), (got,), _, _ = run_both(backend, ctx, node, [x])
    n = np.prod(shape) // got.size
    assert_bf16_within(got, want, atol=1e-4 * np.sqrt(n), what="reduce_sum")


@pytest.mark.parametrize("shape,axes", ROW_SUM_CASES + MIDDLE_SUM_CASES)
def test_reduce_sum_rows(backend, ctx, shape, axes, request):
    """The last axes summed (a warp per row for many rows), or a middle run of them (batched
    column sums): within test_reduce_sum's bounds of the numpy emulation, and the same bits on a
    second run."""
    rng = seeded(request.node.name)
    x = bits(rng, *shape)
    node = node_of("reduce_sum", [x], [BF16], axes=axes)
    (want,), (got,), _, _ = run_both(backend, ctx, node, [x])
    n = np.prod(shape) // got.size
    assert_bf16_within(got, want, atol=1e-4 * np.sqrt(n), what=f"reduce_sum {shape} {axes}")
    _, (again,), _, _ = run_both(backend, ctx, node, [x])
    np.testing.assert_array_equal(again, got)


# ---- GEMMs ---------------------------------------------------------------------------------

def gemm_tolerance(k: int) -> float:
    """Absolute slack for a float32 sum of k unit-scale products summed in another order."""
    return 4e-6 * k


@pytest.fixture(params=["small", "cublaslt"])
def gemm_path(request, monkeypatch):
    """The kernels of the bf16 products below (each of at most SMALL_MACS multiply-adds):
    small_matmul's, as linear.py routes them, or cuBLASLt's (SMALL_MACS 0)."""
    if request.param == "cublaslt":
        monkeypatch.setattr(small_matmul, "SMALL_MACS", 0)
    return request.param


@pytest.mark.parametrize("trans_a,shape_a,shape_b", [(False, (64, 40), (40, 48)),
                                                     (True, (40, 64), (40, 48)),
                                                     (False, (33, 17), (17, 10))])
def test_matmul(backend, ctx, gemm_path, trans_a, shape_a, shape_b, request):
    rng = seeded(request.node.name)
    a, b = bits(rng, *shape_a), bits(rng, *shape_b)
    node = node_of("matmul", [a, b], [BF16, BF16], **({"trans_a": True} if trans_a else {}))
    (want,), (got,), _, _ = run_both(backend, ctx, node, [a, b])
    assert_bf16_within(got, want, atol=gemm_tolerance(shape_b[0]), what="matmul")


@pytest.mark.parametrize("path", ["auto", "cublaslt", "cublaslt:bgrad"])
# Not deep and narrow: there cuBLASLt's bf16 heuristic may add split-K parts in bf16 (at
# 1024 x 13 x 24, dw up to 56 ulps off; docs/TESTING.md, "bf16 GEMMs with split-K parts").
@pytest.mark.parametrize("rows,m,n", [(40, 64, 48), (2048, 384, 96), (192, 13, 24)])
def test_matmul_with_bias_grad(backend, ctx, gemm_path, path, rows, m, n, monkeypatch, request):
    """A Linear's weight and bias gradients from one bf16 matmul node (dz^T @ x, dz.sum(0)) on
    each path: autotuned, the GEMM (small or cuBLASLt's) then reduce.cu's column sums, or
    cuBLASLt's BGRADB epilogue; each output rounded once, within the summation-order slack."""
    from stepgraph.backends.cuda.matmul import linear

    rng = seeded(request.node.name)
    dz, x = bits(rng, rows, m), bits(rng, rows, n)
    node = node_of("matmul", [dz, x], [BF16, BF16], trans_a=True, bias_grad=True)
    if path != "auto":
        monkeypatch.setattr(linear, "_run_fastest",
                            lambda node, ctx, operands, paths: paths[path]())
    (want_w, want_b), (got_w, got_b), _, _ = run_both(backend, ctx, node, [dz, x])
    assert_bf16_within(got_w, want_w, atol=gemm_tolerance(rows), what="matmul dw")
    assert_bf16_within(got_b, want_b, atol=1e-4 * np.sqrt(rows), what="matmul db")


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("b,m,k,n", [(2, 16, 32, 16), (3, 65, 65, 32), (2, 7, 5, 9)])
def test_bmm(backend, ctx, b, m, k, n, trans_a, trans_b, request):
    """bf16 bmm (attention written out by hand: q @ k^T, att @ v; (65, 65): a ViT's odd
    token count, 2-byte aligned rows) against the numpy emulation."""
    rng = seeded(request.node.name)
    a = bits(rng, b, k, m) if trans_a else bits(rng, b, m, k)
    w = bits(rng, b, n, k) if trans_b else bits(rng, b, k, n)
    node = node_of("bmm", [a, w], [BF16, BF16], trans_a=trans_a, trans_b=trans_b)
    (want,), (got,), _, _ = run_both(backend, ctx, node, [a, w])
    assert got.shape == (b, m, n)
    assert_bf16_within(got, want, atol=gemm_tolerance(k), what=f"bmm {(b, m, k, n)}")


@pytest.mark.parametrize("act,save_preact", [(None, False), ("relu", False), ("relu", True),
                                             ("gelu", True), ("gelu", False)])
@pytest.mark.parametrize("n,k,m", [(64, 96, 48), (32, 64, 10)])
def test_linear(backend, ctx, gemm_path, act, save_preact, n, k, m, request):
    rng = seeded(request.node.name)
    x, w, b = bits(rng, n, k), bits(rng, m, k, scale=0.3), bits(rng, m)
    attrs = {"act": act}
    if act is not None:
        attrs.update(slope=0.01, save_preact=save_preact)
    node = node_of("linear", [x, w, b], [BF16] * 3, **attrs)
    ref, got, _, _ = run_both(backend, ctx, node, [x, w, b])
    assert len(got) == 1 + save_preact
    for name, g, r in zip(("y", "z"), got, ref):
        assert_bf16_within(g, r, atol=gemm_tolerance(k), what=f"linear {act} {name}")


# ---- the small-GEMM kernels (linear.py: bf16 products of at most SMALL_MACS) ----------------

SMALL_ACTS = tuple(small_matmul.ACT_CODES)        # None and each activation the kernels apply
F32_UNIT_ROUNDOFF = 2.0 ** -24
STEEPEST_ACT = 1.13           # the largest slope of those activations (gelu's; the others' <= 1)
DIFFER_FRACTION = 0.01


def centred(rng, *shape, scale=1.0) -> np.ndarray:
    """Random bf16 values (raw bits), normal with mean 0: with w scaled by 1 / sqrt(k), the
    pre-activations are about unit normal, where sigmoid, tanh and gelu are not flat (and a
    second rounding of y would show)."""
    return bf16.to_bits((rng.standard_normal(shape) * scale).astype(np.float32))


def small_kernels_launched(monkeypatch) -> list[str]:
    """The small-GEMM kernels launched from now on, by name."""
    launched = []
    kernel = small_matmul.compiler.kernel

    def recording(filename, name):
        if name.startswith("small_matmul"):
            launched.append(name)
        return kernel(filename, name)

    monkeypatch.setattr(small_matmul.compiler, "kernel", recording)
    return launched


def assert_small_gemm_close(got, want, a, b, bias=None, what=""):
    """got (the small kernel's) against want (the numpy emulation's), bf16 bits, of
    act(a @ b + bias) with a (m, k), b (k, n) and bias float32 values. Products of bf16 values
    are exact in float32, so the two float32 results differ only by their sums' orders: by at
    most 2 gamma_{k+1} sum |terms| (each order's error is within gamma_{k+1} of the exact
    sum, the bias add included), times the activation's slope, plus a few float32 ulps for the
    activation's own float32 evaluation; rounding each once to bf16 adds at most one bf16 ulp.
    Such differences rarely straddle a bf16 rounding boundary, so the bits differ at all in at
    most DIFFER_FRACTION of the elements (a NumPy emulation of the kernels' sum orders on these
    shapes: at most 0.06%), where an unrounded (truncated) output differs in about half and a
    twice-rounded one (y from the rounded z, or the bias added to a rounded product) in 5 to
    30% (sigmoid, tanh, gelu; relu's y is the same either way)."""
    assert got.dtype == np.uint16 and got.shape == want.shape, what
    assert not np.any(got == POISON[BF16]), f"{what}: elements left unwritten"
    k = a.shape[1]
    terms = np.abs(a).astype(np.float64) @ np.abs(b) + (0 if bias is None else np.abs(bias))
    gamma = (k + 1) * F32_UNIT_ROUNDOFF / (1 - (k + 1) * F32_UNIT_ROUNDOFF)
    g, w = bf16.from_bits(got).astype(np.float64), bf16.from_bits(want).astype(np.float64)
    bf16_ulp = np.spacing(np.maximum(np.abs(g), np.abs(w)).astype(np.float32)) * 2.0 ** 16
    slack = STEEPEST_ACT * 2 * gamma * terms + 8 * F32_UNIT_ROUNDOFF * np.abs(w) + bf16_ulp
    far = np.abs(g - w) > slack
    assert not far.any(), (f"{what}: {far.sum()} of {far.size} beyond the bound; first got "
                           f"{g[far][:4]} want {w[far][:4]}")
    differ = int(np.count_nonzero(got != want))
    assert differ <= max(1, DIFFER_FRACTION * got.size), (
        f"{what}: {differ} of {got.size} differ from the emulation's bits")


@pytest.mark.parametrize("act,save_preact", [(None, False)] + [
    (act, save) for act in SMALL_ACTS if act is not None for save in (False, True)])
@pytest.mark.parametrize("n,k,m", [(64, 320, 50), (64, 50, 10), (7, 33, 5)],
                         ids=["cnn-fc1", "cnn-fc2", "odd"])
def test_small_linear(backend, ctx, monkeypatch, act, save_preact, n, k, m, request):
    """The cnn's Linear(320, 50) and Linear(50, 10) at batch 64 (the warp kernel: k > 48) and
    an odd shape (the thread kernel), with bias: y, and z when saved, each rounded once."""
    rng = seeded(request.node.name)
    x, w, b = centred(rng, n, k), centred(rng, m, k, scale=k ** -0.5), centred(rng, m)
    attrs = {"act": act}
    if act is not None:
        attrs.update(slope=0.2, save_preact=save_preact)
    node = node_of("linear", [x, w, b], [BF16] * 3, **attrs)
    launched = small_kernels_launched(monkeypatch)
    ref, got, _, _ = run_both(backend, ctx, node, [x, w, b])
    kind = "thread" if k <= small_matmul.THREAD_K else "warp"
    assert launched == [f"small_matmul_{kind}_kernel<unsigned short, unsigned short>"]
    assert len(got) == 1 + save_preact
    xf, wf, bf = (bf16.from_bits(v) for v in (x, w, b))
    for name, g, r in zip(("y", "z"), got, ref):
        assert_small_gemm_close(g, r, xf, wf.T, bf, what=f"linear {act} {name}")


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)], ids=["ab", "aTb", "abT", "aTbT"])
@pytest.mark.parametrize("m,k,n", [(64, 50, 320), (50, 64, 320), (64, 10, 50), (10, 64, 50),
                                   (7, 33, 5)],
                         ids=["cnn-dx1", "cnn-dw1", "cnn-dx2", "cnn-dw2", "odd"])
def test_small_matmul(backend, ctx, monkeypatch, trans_a, trans_b, m, k, n, request):
    """The cnn's gradient products, (m, k) @ (k, n): dx = dy @ w (64x50 @ 50x320, 64x10 @
    10x50), dw = dy^T @ x (50x64 @ 64x320, 10x64 @ 64x50; the VJP's trans_a=True), and an odd
    shape, each operand stored either way."""
    rng = seeded(request.node.name)
    a = centred(rng, *((k, m) if trans_a else (m, k)))
    b = centred(rng, *((n, k) if trans_b else (k, n)))
    node = node_of("matmul", [a, b], [BF16, BF16], trans_a=trans_a, trans_b=trans_b)
    launched = small_kernels_launched(monkeypatch)
    (want,), (got,), _, _ = run_both(backend, ctx, node, [a, b])
    assert len(launched) == 1 and launched[0].endswith("<unsigned short, unsigned short>")
    af, bf = bf16.from_bits(a), bf16.from_bits(b)
    assert_small_gemm_close(got, want, af.T if trans_a else af, bf.T if trans_b else bf,
                            what=f"matmul {trans_a} {trans_b}")


# ---- optimizer weight copies ---------------------------------------------------------------

def update_node(op, params, n_slots, copies, copy_dims=None, **attrs):
    attrs, hyper = update_hyperparameters(op, attrs, len(params))
    arrays = [np.array(1e-2, np.float32), np.array(1, np.int64), hyper]
    dtypes = ["float32", "int64", "float64"]
    rng = seeded(f"{op}-{n_slots}-{copy_dims}")
    for group in range(2 + n_slots):
        for p in params:
            arrays.append(p.copy() if group == 0 else
                          (rng.standard_normal(p.shape).astype(np.float32) *
                           (1.0 if group == 1 else 0.0)))
            dtypes.append("float32")
    dims_of = copy_dims or (None,) * len(copies)
    for i, dims in zip(copies, dims_of):
        shape = params[i].shape if dims is None else tuple(params[i].shape[d] for d in dims)
        arrays.append(np.full(shape, 0x1234, np.uint16))
        dtypes.append(BF16)
    full = dict(n_params=len(params), n_scalars=3, n_slots=n_slots, max_norm=None,
                copies=tuple(copies), **attrs)
    if copy_dims:
        full["copy_dims"] = tuple(copy_dims)
    return node_of(op, arrays, dtypes, **full), arrays


@pytest.mark.parametrize("op", ["adam_update", "sgd_update"])
def test_update_writes_bf16_copies_of_the_updated_parameters(backend, ctx, op):
    rng = seeded(op)
    # Sizes that take the four-a-thread path, one that does not, and an uncopied parameter.
    params = [rng.standard_normal(s).astype(np.float32) for s in [(64, 32), (10,), (7, 3),
                                                                   (16,)]]
    attrs = (dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
             if op == "adam_update" else
             dict(momentum=0.5, dampening=0.0, weight_decay=0.0, nesterov=False))
    node, arrays = update_node(op, params, 2 if op == "adam_update" else 1, copies=(0, 1, 2),
                               **attrs)
    _, _, ref_ins, dev_ins = run_both(backend, ctx, node, arrays)
    first = 3 + (2 + node.attrs["n_slots"]) * len(params)
    for j, i in enumerate((0, 1, 2)):
        p_dev, p_ref = dev_ins[3 + i], ref_ins[3 + i]
        np.testing.assert_allclose(p_dev, p_ref, rtol=1e-6, atol=1e-7)
        # The copy is the device's own updated parameter rounded once: bit for bit.
        np.testing.assert_array_equal(dev_ins[first + j], bf16.to_bits(p_dev))
        assert_bf16_within(dev_ins[first + j], ref_ins[first + j], what=f"copy {j}")


def test_sgd_update_writes_transposed_copies(backend, ctx):
    """Every transposed copy in one gather launch after the update: conv weights' KRSC copies
    (one over many blocks of the gather), a matrix's transpose, beside an in-order copy."""
    rng = seeded("transposed copies")
    shapes = [(6, 3, 5, 5), (6,), (64, 32, 3, 3), (20, 7)]
    dims = ((0, 2, 3, 1), None, (0, 2, 3, 1), (1, 0))
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    node, arrays = update_node("sgd_update", params, 1, copies=(0, 1, 2, 3), copy_dims=dims,
                               momentum=0.9, dampening=0.0, weight_decay=5e-4, nesterov=True)
    _, _, ref_ins, dev_ins = run_both(backend, ctx, node, arrays)
    first = 3 + 3 * len(params)
    for j, order in enumerate(dims):
        updated = dev_ins[3 + j] if order is None else dev_ins[3 + j].transpose(order)
        np.testing.assert_array_equal(dev_ins[first + j], bf16.to_bits(updated))
        assert_bf16_within(dev_ins[first + j], ref_ins[first + j], what=f"copy {j}")


# ---- whole steps ---------------------------------------------------------------------------

def dense_model(name: str):
    if name == "mlp":                 # the mlp workload's structure, smaller
        return models.mlp(in_features=96, hidden=64, classes=10, dropout=0.1), 96
    return models.big(width=128, depth=3, classes=10), 128   # big's, smaller width


def dense_batches(features: int, n: int, seed: int, batch: int = 32):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, features), dtype=np.float32),
             rng.integers(0, 10, batch)) for _ in range(n)]


def bf16_steps(name: str, devices, graph=False, seed=0):
    base, features = dense_model(name)
    data = dense_batches(features, 1, seed)
    steps = []
    for device in devices:
        model, _ = dense_model(name)
        model.load_state_dict(base.state_dict())
        steps.append(sg.compile_train_step(
            model, loss=losses.cross_entropy, optimizer=optim.AdamW(lr=1e-3, weight_decay=0.01),
            example_inputs=data[0], device=device, precision="bf16", seed=seed,
            graph=graph if device == "cuda" else False))
    return steps, features


@pytest.mark.parametrize("name", ["mlp", "big"])
def test_bf16_step_matches_the_numpy_emulation(name):
    """A few steps: the same masks (dropout) and the same roundings but for the order of the
    GEMMs' and bias gradients' sums, whose one-ulp differences the next steps carry on; the
    trajectories stay within bf16's resolution (2^-8 relative) of each other."""
    (cpu, gpu), features = bf16_steps(name, ["cpu", "cuda"])
    for x, y in dense_batches(features, 4, seed=1):
        lc, lg = float(cpu(x, y)), float(gpu(cp.asarray(x), cp.asarray(y)))
        assert np.isfinite(lg) and abs(lg - lc) <= 1e-2 * abs(lc) + 1e-3, (lc, lg)
    ref, got = cpu.model.state_dict(), gpu.model.state_dict()
    for k in ref:
        assert rel(got[k], ref[k]) < 1e-3, k


@pytest.mark.parametrize("name", ["mlp", "big"])
def test_bf16_graph_replay_is_bit_identical_to_eager(name):
    from tests.cuda.test_step_cuda import assert_replay_matches_eager

    (eager, graph), features = bf16_steps(name, ["cuda", "cuda"], seed=3)
    assert_replay_matches_eager(eager, graph, dense_batches(features, 10, seed=4))
