"""cuda vs numpy for the transformer ops: embedding and embedding_grad (both gradient paths,
repeated indices, int32/int64, vocabularies of 5, 65 and 50257 rows), layer_norm and its
gradient (with and without weight/bias, rows from 1 to 4096 columns and the wide-row loop
kernels), bmm (every flag combination, fp32 and tf32), softmax with scale and the causal mask,
slice / slice_grad, arange, cross-entropy with ignore_index, optimizer parameter groups over 3
steps. Fresh random inputs (never zeros), cuda outputs poisoned first; captured graphs of
embedding_grad and layer_norm_grad replay bit for bit what eager runs compute."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu("nvmath")

import stepgraph  # noqa: E402,F401  (registers the op families)
from stepgraph.backends.cuda import embedding  # noqa: E402
from stepgraph.backends.cuda.runtime import launch  # noqa: E402
from stepgraph.backends.cuda.runtime.context import CudaContext  # noqa: E402
from stepgraph.errors import CaptureError  # noqa: E402
from tests.cuda.helpers import (  # noqa: E402
    PARAM_SHAPES, assert_close, capture, make_node, poisoned, random, reference, rel_err,
    run_both, run_cuda, run_update_steps, to_device, to_host)


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("fp32")


@pytest.fixture
def embedding_path():
    """Set embedding.PATH for one test, restored afterwards."""
    old = embedding.PATH
    yield lambda path: setattr(embedding, "PATH", path)
    embedding.PATH = old


# ---- embedding -----------------------------------------------------------------------------

def indices(rng, v, shape, dtype):
    """Random indices of shape with many repeats: a third of them are the first one."""
    idx = rng.integers(0, v, size=shape).astype(dtype)
    flat = idx.reshape(-1)
    flat[::3] = flat[0]
    if flat.size > 4:
        flat[-1] = v - 1                 # the last row is hit too
    return idx


EMBED_CASES = [(5, 3, (7,)), (5, 768, (2, 33)), (65, 64, (4, 37)), (65, 1, (1,)),
               (50257, 32, (3, 5)), (50257, 6, (2, 700))]


@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
@pytest.mark.parametrize("v,c,shape", EMBED_CASES)
def test_embedding(ctx, impls, v, c, shape, idx_dtype):
    rng = np.random.default_rng([211, v, c, *shape])
    weight, idx = random(rng, v, c), indices(rng, v, shape, idx_dtype)
    node = make_node("embedding", [weight, idx])
    ref, got = run_both(ctx, node, [weight, idx], impls)
    np.testing.assert_array_equal(got[0], ref[0])


def test_embedding_misaligned_and_invalid(ctx, impls):
    """A weight view off 16-byte alignment takes the scalar copy; an index outside [0, V)
    gives a NaN row (no fault)."""
    rng = np.random.default_rng(213)
    v, c = 9, 8
    flat = random(rng, 1 + v * c)
    idx = np.array([[0, 8, 3], [3, 9, -1]], np.int64)
    (dev_flat,) = to_device(ctx, [flat])
    weight = dev_flat[1:].reshape(v, c)
    assert not launch._aligned(weight)
    (dev_idx,) = to_device(ctx, [idx])
    with ctx.stream:
        out = cp.full((2, 3, c), np.nan, np.float32)
    embedding.embedding_forward(ctx, weight, dev_idx, out)
    got = to_host(ctx, [out])[0]
    want = flat[1:].reshape(v, c)
    np.testing.assert_array_equal(got[0], want[[0, 8, 3]])
    np.testing.assert_array_equal(got[1, 0], want[3])
    assert np.isnan(got[1, 1:]).all()


@pytest.mark.parametrize("path", ["scan", "sorted"])
@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
@pytest.mark.parametrize("v,c,shape", EMBED_CASES + [(300, 12, (3000,)), (7, 20, (2, 1500))])
def test_embedding_grad(ctx, impls, embedding_path, v, c, shape, idx_dtype, path):
    if path == "scan" and v * int(np.prod(shape)) > 1 << 24:
        pytest.skip("the scan path reads every index once per vocabulary row")
    embedding_path(path)
    rng = np.random.default_rng([223, v, c, *shape])
    idx = indices(rng, v, shape, idx_dtype)
    dy = random(rng, *shape, c)
    node = make_node("embedding_grad", [dy, idx], num_embeddings=v)
    ref, got = run_both(ctx, node, [dy, idx], impls)
    # Per row, dy rows summed: sorted sums in position order (numpy's); scan in 8 interleaved
    # partial sums. Tolerance from the largest count of one index.
    count = np.bincount(idx.reshape(-1).astype(np.int64), minlength=v).max()
    assert_close(got[0], ref[0], rtol=1e-5, atol=2e-7 * count, what=f"embedding_grad {path}")


@pytest.mark.parametrize("path", ["scan", "sorted"])
def test_embedding_grad_drops_invalid_indices(ctx, impls, embedding_path, path):
    """Rows of dy whose index lies outside [0, V) are dropped, as numpy's reference does."""
    embedding_path(path)
    rng = np.random.default_rng(225)
    idx = indices(rng, 40, (3, 50), np.int32)
    idx[0, :4] = [-1, 40, 41, -100]
    dy = random(rng, 3, 50, 8)
    node = make_node("embedding_grad", [dy, idx], num_embeddings=40)
    ref, got = run_both(ctx, node, [dy, idx], impls)
    assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5, what=f"embedding_grad {path} invalid")


@pytest.mark.parametrize("v,n", [(5, 17), (300, 2500), (50257, 5000), (1 << 16, 3000)])
def test_embedding_sort_is_stable(ctx, v, n):
    """sort_indices: keys ascending, positions ascending within a key (numpy's stable
    argsort), invalid indices last as key V; several passes and sort blocks."""
    rng = np.random.default_rng([227, v, n])
    idx = indices(rng, v, (n,), np.int64)
    idx[5] = -3
    idx[n // 2] = v + 4
    node = make_node("embedding_grad", [random(rng, n, 2), idx], num_embeddings=v)
    (dev_idx,) = to_device(ctx, [idx])
    keys, positions = embedding.sort_indices(ctx, node, dev_idx, v)
    keys, positions = to_host(ctx, [keys, positions])
    want_keys = np.where((idx >= 0) & (idx < v), idx, v)
    order = np.argsort(want_keys, kind="stable")
    np.testing.assert_array_equal(positions, order)
    np.testing.assert_array_equal(keys, want_keys[order])


@pytest.mark.parametrize("path", ["scan", "sorted"])
def test_embedding_grad_is_deterministic(ctx, impls, embedding_path, path):
    embedding_path(path)
    rng = np.random.default_rng(229)
    v, shape, c = 65, (8, 512), 96
    idx, dy = indices(rng, v, shape, np.int64), random(rng, *shape, c)
    node = make_node("embedding_grad", [dy, idx], num_embeddings=v)
    ins = to_device(ctx, [dy, idx])
    runs = []
    for _ in range(3):
        out = poisoned(ctx, node)
        impls[node.op](node, ins, out, ctx)
        runs.append(to_host(ctx, out)[0])
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])


def test_embedding_grad_sort_needs_its_scratch_before_capture(ctx, impls, embedding_path):
    embedding_path("sorted")
    rng = np.random.default_rng(233)
    idx, dy = indices(rng, 100, (50,), np.int64), random(rng, 50, 4)
    node = make_node("embedding_grad", [dy, idx], num_embeddings=100)
    dev = to_device(ctx, [dy, idx])
    cold = CudaContext(stream=ctx.stream, capturing=True, gemm=ctx.gemm)
    with pytest.raises(CaptureError):
        impls[node.op](node, dev, poisoned(ctx, node), cold)


# ---- layer_norm ----------------------------------------------------------------------------

LN_WIDTHS = [1, 33, 37, 64, 384, 768, 1000, 2304, 4096, 2049, 8196]   # 8196: the loop kernels
LN_LEADING = [(1,), (13,), (2, 3)]
LN_AFFINE = [(False, False), (True, False), (True, True), (False, True)]


def ln_inputs(rng, lead, c, has_w, has_b):
    x = random(rng, *lead, c, scale=2.0, shift=1.5)       # rows far from mean 0
    ins = [x]
    if has_w:
        ins.append(random(rng, c, shift=1.0))
    if has_b:
        ins.append(random(rng, c))
    return ins


def ln_node(ins, has_w, has_b):
    return make_node("layer_norm", ins, eps=1e-5, weight=has_w, bias=has_b)


@pytest.mark.parametrize("has_w,has_b", LN_AFFINE)
@pytest.mark.parametrize("lead", LN_LEADING)
@pytest.mark.parametrize("c", LN_WIDTHS)
def test_layer_norm(ctx, impls, c, lead, has_w, has_b):
    rng = np.random.default_rng([239, c, *lead, has_w, has_b])
    ins = ln_inputs(rng, lead, c, has_w, has_b)
    node = ln_node(ins, has_w, has_b)
    ref, got = run_both(ctx, node, ins, impls)
    what = f"layer_norm {lead} x {c} weight={has_w} bias={has_b}"
    assert_close(got[0], ref[0], rtol=1e-5, atol=2e-5, what=f"{what} y")
    assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6, what=f"{what} mean")
    assert_close(got[2], ref[2], rtol=2e-5, atol=0, what=f"{what} rstd")


def ln_grad_inputs(rng, lead, c, has_w):
    """(dy, x, [weight], mean, rstd), mean and rstd from the numpy forward."""
    ins = ln_inputs(rng, lead, c, has_w, False)
    fwd = reference(ln_node(ins, has_w, False), ins)
    return [random(rng, *lead, c), ins[0]] + ins[1:] + [fwd[1], fwd[2]]


@pytest.mark.parametrize("has_w,has_b", LN_AFFINE)
@pytest.mark.parametrize("lead", LN_LEADING + [(4096,)])
@pytest.mark.parametrize("c", LN_WIDTHS)
def test_layer_norm_grad(ctx, impls, c, lead, has_w, has_b):
    if lead == (4096,) and c > 1000:
        pytest.skip("kept small: many rows are covered at narrower widths")
    rng = np.random.default_rng([241, c, *lead, has_w, has_b])
    ins = ln_grad_inputs(rng, lead, c, has_w)
    node = make_node("layer_norm_grad", ins, eps=1e-5, weight=has_w, bias=has_b)
    ref, got = run_both(ctx, node, ins, impls)
    what = f"layer_norm_grad {lead} x {c} weight={has_w} bias={has_b}"
    rows = int(np.prod(lead))
    assert_close(got[0], ref[0], rtol=1e-4, atol=2e-5, what=f"{what} dx")
    for i in range(1, len(ref)):          # dweight, dbias: sums over the rows
        assert_close(got[i], ref[i], rtol=1e-4, atol=1e-5 * np.sqrt(rows),
                     what=f"{what} output {i}")


def test_layer_norm_float4_and_scalar_paths_agree(ctx, impls):
    """A misaligned view of the same rows takes the scalar walk: the same values."""
    rng = np.random.default_rng(251)
    rows, c = 9, 384
    flat = random(rng, 1 + rows * c)
    ins = [flat[1:].reshape(rows, c), random(rng, c), random(rng, c)]
    node = ln_node(ins, True, True)
    (dev_flat,) = to_device(ctx, [flat])
    rest = to_device(ctx, ins[1:])
    outs = []
    with ctx.stream:       # the aligned copy is made where the kernel will read it
        aligned = dev_flat[1:].copy().reshape(rows, c)
    for x in (aligned, dev_flat[1:].reshape(rows, c)):
        out = poisoned(ctx, node)
        impls[node.op](node, [x] + rest, out, ctx)
        outs.append(to_host(ctx, out))
    for a, b in zip(*outs):
        assert_close(b, a, rtol=1e-6, atol=1e-6, what="float4 vs scalar layer_norm")


@pytest.mark.parametrize("c", [384, 37, 768, 2304, 8196])
def test_layer_norm_many_rows_and_bit_identical_reruns(ctx, impls, c):
    """GPT-sized row counts (each block of the backward visits many rows; 16383 is no multiple
    of a block's rows): forward and gradient against numpy, then the gradient run again on
    the same inputs into fresh poisoned outputs gives the same bits."""
    rows = 16384 if c <= 768 else 2047
    rng = np.random.default_rng([271, c])
    for lead, has_w, has_b in (((rows - 1,), True, True), ((rows,), True, False),
                               ((2, rows // 2), False, False)):
        ins = ln_inputs(rng, lead, c, has_w, has_b)
        node = ln_node(ins, has_w, has_b)
        ref, got = run_both(ctx, node, ins, impls)
        what = f"layer_norm {lead} x {c} weight={has_w} bias={has_b}"
        assert_close(got[0], ref[0], rtol=1e-5, atol=2e-5, what=f"{what} y")
        assert_close(got[2], ref[2], rtol=2e-5, atol=0, what=f"{what} rstd")
        g_ins = [random(rng, *lead, c), ins[0]] + ins[1:2 if has_w else 1] + ref[1:]
        g_node = make_node("layer_norm_grad", g_ins, eps=1e-5, weight=has_w, bias=has_b)
        g_ref, first = run_both(ctx, g_node, g_ins, impls)
        n = int(np.prod(lead))
        assert_close(first[0], g_ref[0], rtol=1e-4, atol=2e-5, what=f"{what} dx")
        for i in range(1, len(g_ref)):
            assert_close(first[i], g_ref[i], rtol=1e-4, atol=1e-5 * np.sqrt(n),
                         what=f"{what} grad output {i}")
            assert rel_err(first[i], g_ref[i]) < 1e-5, f"{what} grad output {i}"
        dev = to_device(ctx, g_ins)
        for rerun in range(2):
            out = poisoned(ctx, g_node)
            impls[g_node.op](g_node, dev, out, ctx)
            for i, (a, b) in enumerate(zip(first, to_host(ctx, out))):
                np.testing.assert_array_equal(b, a, err_msg=f"{what} rerun {rerun} output {i}")


# ---- graphs: embedding_grad and layer_norm_grad replay their eager bits ---------------------

@pytest.mark.parametrize("path", ["scan", "sorted"])
def test_captured_embedding_grad_matches_eager(ctx, impls, embedding_path, path):
    embedding_path(path)
    rng = np.random.default_rng(257)
    v, shape, c = 700, (4, 300), 40
    idx, dy = indices(rng, v, shape, np.int64), random(rng, *shape, c)
    node = make_node("embedding_grad", [dy, idx], num_embeddings=v)
    ins, out = to_device(ctx, [dy, idx]), poisoned(ctx, node)
    impls[node.op](node, ins, out, ctx)                       # eager warm-up: scratch
    graph = capture(ctx, lambda: impls[node.op](node, ins, out, ctx))
    for step in range(5):
        fresh_idx, fresh_dy = indices(rng, v, shape, np.int64), random(rng, *shape, c)
        ins[0].set(fresh_dy, stream=ctx.stream)
        ins[1].set(fresh_idx, stream=ctx.stream)
        eager = poisoned(ctx, node)
        impls[node.op](node, ins, eager, ctx)
        with ctx.stream:
            out[0].fill(np.nan)
        graph.launch(ctx.stream)
        want, got = to_host(ctx, eager + out)
        np.testing.assert_array_equal(got, want, err_msg=f"replay {step}")
        ref = reference(node, [fresh_dy, fresh_idx])
        assert_close(got, ref[0], rtol=1e-5, atol=1e-4, what=f"replay {step} vs numpy")


@pytest.mark.parametrize("c", [384, 2049])
def test_captured_layer_norm_grad_matches_eager(ctx, impls, c):
    rng = np.random.default_rng([263, c])
    lead = (3, 50)
    ins = ln_grad_inputs(rng, lead, c, True)
    node = make_node("layer_norm_grad", ins, eps=1e-5, weight=True, bias=True)
    dev, out = to_device(ctx, ins), poisoned(ctx, node)
    cold = CudaContext(stream=ctx.stream, capturing=True, gemm=ctx.gemm)
    with pytest.raises(CaptureError):                         # partial sums: warm up first
        impls[node.op](node, dev, poisoned(ctx, node), cold)
    impls[node.op](node, dev, out, ctx)
    graph = capture(ctx, lambda: impls[node.op](node, dev, out, ctx))
    for step in range(5):
        fresh = ln_grad_inputs(rng, lead, c, True)
        for d, h in zip(dev, fresh):
            d.set(h, stream=ctx.stream)
        eager = poisoned(ctx, node)
        impls[node.op](node, dev, eager, ctx)
        with ctx.stream:
            for o in out:
                o.fill(np.nan)
        graph.launch(ctx.stream)
        got, want = to_host(ctx, out), to_host(ctx, eager)
        for i, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_array_equal(g, w, err_msg=f"replay {step} output {i}")


# ---- bmm -----------------------------------------------------------------------------------

BMM_SHAPES = [(1, 1, 1, 1), (3, 7, 5, 9), (2, 33, 64, 17), (5, 64, 128, 64), (2, 3, 0, 4)]


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("tf32", 3e-3)])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("b,m,k,n", BMM_SHAPES)
def test_bmm(backend, impls, b, m, k, n, trans_a, trans_b, precision, tol):
    ctx = backend.make_context(precision)
    rng = np.random.default_rng([269, b, m, k, n, trans_a, trans_b])
    a = random(rng, b, k, m) if trans_a else random(rng, b, m, k)
    w = random(rng, b, n, k) if trans_b else random(rng, b, k, n)
    node = make_node("bmm", [a, w], trans_a=trans_a, trans_b=trans_b)
    ref, got = run_both(ctx, node, [a, w], impls)
    assert got[0].shape == (b, m, n) and np.isfinite(got[0]).all()
    assert rel_err(got[0], ref[0]) <= tol, f"bmm {precision} {(b, m, k, n)} {trans_a} {trans_b}"


# ---- softmax: scale and causal -------------------------------------------------------------

SOFTMAX_SHAPES = [(7, 7), (2, 3, 9, 9), (3, 5, 9), (1, 1), (2, 4, 33), (2, 5, 1500),
                  (3, 40, 40)]


def causal_mask(shape):
    rows, cols = shape[-2:]
    r, c = np.arange(rows)[:, None], np.arange(cols)[None, :]
    return np.broadcast_to(c > r + (cols - rows), shape)


@pytest.mark.parametrize("scale,causal", [(0.125, True), (1.0, True), (0.37, False)])
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES)
def test_softmax_scaled(ctx, impls, shape, scale, causal):
    rng = np.random.default_rng([271, *shape, causal])
    x = random(rng, *shape, scale=3.0)
    node = make_node("softmax", [x], scale=scale, causal=causal)
    ref, got = run_both(ctx, node, [x], impls)
    what = f"softmax {shape} scale={scale} causal={causal}"
    assert_close(got[0], ref[0], rtol=1e-5, atol=1e-7, what=what)
    if causal:
        assert (got[0][causal_mask(shape)] == 0).all(), f"{what}: masked entries not 0"
    np.testing.assert_allclose(got[0].sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("scale,causal", [(0.125, True), (1.0, True), (0.37, False)])
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES)
def test_softmax_grad_scaled(ctx, impls, shape, scale, causal):
    rng = np.random.default_rng([277, *shape, causal])
    x, dy = random(rng, *shape, scale=3.0), random(rng, *shape)
    (y,) = reference(make_node("softmax", [x], scale=scale, causal=causal), [x])
    node = make_node("softmax_grad", [dy, y], scale=scale, causal=causal)
    ref, got = run_both(ctx, node, [dy, y], impls)
    bound = float(np.abs(dy * y).sum(axis=-1).max()) + float(np.abs(dy).max())
    assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6 * bound,
                 what=f"softmax_grad {shape} scale={scale} causal={causal}")
    if causal:
        assert (got[0][causal_mask(shape)] == 0).all()


def test_softmax_without_attrs_is_the_plain_kernel(ctx, impls):
    """scale 1.0 and causal False run the attr-less kernels: the same bits as no attrs."""
    rng = np.random.default_rng(281)
    x, dy = random(rng, 6, 300, scale=3.0), random(rng, 6, 300)
    for op, ins in (("softmax", [x]), ("softmax_grad", [dy, x])):
        plain = run_cuda(ctx, make_node(op, ins), ins, impls)
        same = run_cuda(ctx, make_node(op, ins, scale=1.0, causal=False), ins, impls)
        np.testing.assert_array_equal(plain[0], same[0])


# ---- slice, slice_grad, arange -------------------------------------------------------------

SLICES = [((4, 6, 5), 1, 2, 5), ((4, 6, 5), 2, 0, 3), ((7, 3), 0, 1, 6), ((10,), 0, 3, 10),
          ((2, 3, 8, 12), 3, 4, 12), ((2, 3, 8, 12), 2, 0, 8), ((5, 1, 4), 1, 0, 1),
          ((3, 9), 1, 4, 4)]


@pytest.mark.parametrize("dtype", ["float32", "int64", "int32"])
@pytest.mark.parametrize("shape,dim,start,stop", SLICES)
def test_slice(ctx, impls, shape, dim, start, stop, dtype):
    rng = np.random.default_rng([283, *shape, dim, start])
    x = (random(rng, *shape) * 100).astype(dtype)
    node = make_node("slice", [x], dim=dim, start=start, stop=stop)
    ref, got = run_both(ctx, node, [x], impls)
    np.testing.assert_array_equal(got[0], ref[0])


@pytest.mark.parametrize("shape,dim,start,stop", SLICES)
def test_slice_grad(ctx, impls, shape, dim, start, stop):
    rng = np.random.default_rng([293, *shape, dim, start])
    dy_shape = list(shape)
    dy_shape[dim] = stop - start
    dy = random(rng, *dy_shape)
    node = make_node("slice_grad", [dy], input_shape=shape, dim=dim, start=start)
    ref, got = run_both(ctx, node, [dy], impls)
    np.testing.assert_array_equal(got[0], ref[0])


@pytest.mark.parametrize("n", [1, 7, 1000, 70000])
def test_arange(ctx, impls, n):
    node = make_node("arange", [], n=n, dtype="int64")
    ref, got = run_both(ctx, node, [], impls)
    np.testing.assert_array_equal(got[0], ref[0])


# ---- cross-entropy with ignore_index -------------------------------------------------------

CE_ROWS = [(1, 10), (7, 3), (64, 10), (130, 1500), (4000, 10), (40, 1500), (600, 40)]


def labels_with_ignored(rng, n, c, dtype, ignore_index):
    """Labels in [0, C) with about a quarter of the rows set to ignore_index (the last one
    when n > 1; never the first)."""
    labels = rng.integers(0, c, size=n)
    labels[labels == ignore_index] = (ignore_index + 1) % c     # no accidental ignores
    drop = rng.random(n) < 0.25
    drop[-1] = n > 1
    drop[0] = False
    labels[drop] = ignore_index
    return labels.astype(dtype)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [-100, 2])
@pytest.mark.parametrize("label_dtype", ["int32", "int64"])
@pytest.mark.parametrize("n,c", CE_ROWS)
def test_cross_entropy_ignore_index(ctx, impls, n, c, label_dtype, ignore_index, eps):
    if ignore_index >= c:
        pytest.skip("ignore_index must be a possible label here")
    rng = np.random.default_rng([307, n, c, abs(ignore_index)])
    x = random(rng, n, c, scale=3.0)
    labels = labels_with_ignored(rng, n, c, label_dtype, ignore_index)
    attrs = dict(ignore_index=ignore_index, label_smoothing=eps)
    what = f"{n}x{c} ignore={ignore_index} eps={eps}"
    ref, got = run_both(ctx, make_node("cross_entropy", [x, labels], **attrs),
                        [x, labels], impls)
    assert_close(got[0], ref[0], rtol=2e-6, atol=0, what=f"cross_entropy loss {what}")
    assert_close(got[1], ref[1], rtol=1e-6, atol=1e-6, what=f"cross_entropy lse {what}")
    # softmax - onehot cancels where p ~ 1: an ulp of lse (|lse| ~ 5) is ~5e-7 there, and the
    # gradient divides by the kept rows, not n.
    atol = 2e-6 / max(int((labels != ignore_index).sum()), 1)
    dloss = np.array(1.7, np.float32)
    node = make_node("cross_entropy_grad", [dloss, x, ref[1], labels], **attrs)
    gref, ggot = run_both(ctx, node, [dloss, x, ref[1], labels], impls)
    assert_close(ggot[0], gref[0], rtol=1e-5, atol=1.7 * atol, what=f"cross_entropy_grad {what}")
    tref, tgot = run_both(ctx, make_node("cross_entropy_train", [x, labels], **attrs),
                          [x, labels], impls)
    assert_close(tgot[0], tref[0], rtol=2e-6, atol=0, what=f"cross_entropy_train loss {what}")
    assert_close(tgot[1], tref[1], rtol=1e-5, atol=atol, what=f"cross_entropy_train dx {what}")
    ignored = labels == ignore_index
    assert (ggot[0][ignored] == 0).all() and (tgot[1][ignored] == 0).all()


@pytest.mark.parametrize("n,c", [(5, 10), (4000, 10), (40, 1500)])
def test_cross_entropy_every_row_ignored(ctx, impls, n, c):
    """PyTorch: a NaN loss and zero gradients."""
    rng = np.random.default_rng([311, n, c])
    x, labels = random(rng, n, c), np.full(n, -100, np.int64)
    for op in ("cross_entropy", "cross_entropy_train"):
        got = run_cuda(ctx, make_node(op, [x, labels]), [x, labels], impls)
        assert np.isnan(got[0])
        if op == "cross_entropy_train":
            assert (got[1] == 0).all()
    lse = np.zeros(n, np.float32)
    dloss = np.array(1.0, np.float32)
    node = make_node("cross_entropy_grad", [dloss, x, lse, labels])
    assert (run_cuda(ctx, node, [dloss, x, lse, labels], impls)[0] == 0).all()


@pytest.mark.parametrize("n,c", [(4000, 10), (40, 1500)])
def test_cross_entropy_ignore_index_without_scratch(ctx, impls, n, c):
    """A capture-time call with no warm-up: the train kernel runs as one block counting the
    kept rows itself, the gradient kernel counts in every block; same results."""
    rng = np.random.default_rng([313, n, c])
    x, labels = random(rng, n, c), labels_with_ignored(rng, n, c, np.int64, -100)
    cold = CudaContext(stream=ctx.stream, capturing=True, gemm=ctx.gemm)
    for op, ins in (("cross_entropy_train", [x, labels]),
                    ("cross_entropy_grad", [np.array(0.5, np.float32), x,
                                            np.log(np.exp(x).sum(1)).astype(np.float32),
                                            labels])):
        warm, fresh = make_node(op, ins), make_node(op, ins)
        dev = to_device(ctx, ins)
        outs = [poisoned(ctx, warm), poisoned(ctx, fresh)]
        impls[op](warm, dev, outs[0], ctx)
        impls[op](fresh, dev, outs[1], cold)
        a, b = to_host(ctx, outs[0]), to_host(ctx, outs[1])
        assert_close(b[0], a[0], rtol=2e-6, atol=0, what=f"{op} without scratch")
        if len(a) > 1:
            np.testing.assert_array_equal(b[1], a[1])


# ---- optimizer parameter groups ------------------------------------------------------------

GROUPS = [0, 1, 0, 1, 1, 0]          # parameter -> group


def group_attrs(op):
    """Per-parameter attrs tuples of two groups (decay / no decay, a second lr)."""
    per = lambda values: tuple(values[g] for g in GROUPS)   # noqa: E731
    attrs = dict(lr_scale=per([1.0, 0.3]), weight_decay=per([0.1, 0.0]))
    if op == "adam_update":
        attrs.update(beta1=per([0.9, 0.8]), beta2=per([0.999, 0.99]), eps=1e-8,
                     decoupled=True)
    else:
        attrs.update(momentum=0.9, dampening=0.0, nesterov=False)
    return attrs


@pytest.mark.parametrize("op,n_slots", [("adam_update", 2), ("sgd_update", 1)])
def test_update_parameter_groups(ctx, impls, op, n_slots):
    run_update_steps(ctx, impls, op, group_attrs(op), n_slots, [317, n_slots])


@pytest.mark.parametrize("op,n_slots", [("adam_update", 2), ("sgd_update", 1)])
def test_update_groups_of_equal_values_are_the_scalar_update(ctx, impls, op, n_slots):
    """Tuples repeating the scalar attrs give the scalar update's bits."""
    n = len(PARAM_SHAPES)
    scalar = dict(weight_decay=0.01)
    if op == "adam_update":
        scalar.update(beta1=0.9, beta2=0.999, eps=1e-8, decoupled=True)
    else:
        scalar.update(momentum=0.9, dampening=0.0, nesterov=False)
    grouped = dict(scalar, lr_scale=(1.0,) * n, weight_decay=(0.01,) * n)
    if op == "adam_update":
        grouped.update(beta1=(0.9,) * n, beta2=(0.999,) * n)
    a = run_update_steps(ctx, impls, op, scalar, n_slots, [317, n_slots])
    b = run_update_steps(ctx, impls, op, grouped, n_slots, [317, n_slots])
    for step_a, step_b in zip(a, b):
        for x, y in zip(step_a, step_b):
            np.testing.assert_array_equal(x, y)
