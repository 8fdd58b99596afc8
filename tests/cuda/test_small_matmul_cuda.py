"""The small-GEMM kernel against the numpy reference, and cuBLASLt on the same shapes (both
paths of linear.py), fresh random inputs and NaN-poisoned outputs."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda
cp = require_gpu("nvmath")

from stepgraph.backends import get_backend  # noqa: E402
from stepgraph.backends.cuda.matmul import linear, small_matmul  # noqa: E402
from tests.cuda import helpers  # noqa: E402
from tests.cuda.helpers import make_node  # noqa: E402
from tests.ops.helpers import relative_error as rel  # noqa: E402

ACTS = (None, "relu", "leaky_relu", "sigmoid", "tanh", "gelu", "gelu_tanh")


@pytest.fixture(params=["small", "cublaslt", "tile"])
def path(request, monkeypatch):
    monkeypatch.setattr(small_matmul, "SMALL_MACS", 1 << 40 if request.param == "small" else 0)
    monkeypatch.setattr(linear, "PATH", "auto" if request.param == "small" else request.param)
    return request.param


@pytest.fixture(scope="module")
def ctx():
    return get_backend("cuda").make_context("fp32")


def run_both(ctx, op, arrays, **attrs):
    """(numpy outputs, cuda outputs) of one `op` node through linear.py's launchers."""
    return helpers.run_both(ctx, make_node(op, arrays, **attrs), arrays, linear.IMPLS)


@pytest.mark.parametrize("m,k,n", [(128, 512, 10), (1, 7, 3), (64, 50, 10), (33, 1, 17),
                                   (10, 128, 512)])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_matmul(ctx, path, m, k, n, trans_a, trans_b):
    rng = np.random.default_rng([m, k, n, trans_a, trans_b])
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    (want,), (got,) = run_both(ctx, "matmul", [a, b], trans_a=trans_a, trans_b=trans_b)
    assert np.isfinite(got).all() and rel(got, want) < 1e-5


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("save_preact", [False, True])
def test_linear(ctx, path, act, bias, save_preact):
    rng = np.random.default_rng([len(str(act)), bias, save_preact])
    x = rng.standard_normal((37, 50)).astype(np.float32)
    w = rng.standard_normal((10, 50)).astype(np.float32)
    ins = [x, w] + ([rng.standard_normal(10).astype(np.float32)] if bias else [])
    want, got = run_both(ctx, "linear", ins, act=act, slope=0.2, save_preact=save_preact)
    tol = 2e-3 if (act == "gelu_tanh" and path == "cublaslt") else 1e-5
    for g, w_ in zip(got, want):
        assert np.isfinite(g).all() and rel(g, w_) < tol


@pytest.mark.parametrize("splits", small_matmul.TILE_SPLITS)
@pytest.mark.parametrize("m,k,n", [(128, 784, 512), (65, 300, 130), (3, 40, 70), (200, 33, 64)])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_tile_matmul_every_split(ctx, monkeypatch, splits, m, k, n, trans_a, trans_b):
    """The tiled kernel with k split `splits` ways (where that split is a candidate), partial
    tiles at every edge, each operand layout; the tiled kernel is what ran."""
    monkeypatch.setattr(small_matmul, "SMALL_MACS", 0)
    monkeypatch.setattr(small_matmul, "TILE_SPLITS", (splits,))
    monkeypatch.setattr(linear, "PATH", "tile")
    launched = []
    kernel = small_matmul.compiler.kernel
    monkeypatch.setattr(small_matmul.compiler, "kernel",
                        lambda f, name: launched.append(name) or kernel(f, name))
    rng = np.random.default_rng([m, k, n, splits, trans_a, trans_b])
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    (want,), (got,) = run_both(ctx, "matmul", [a, b], trans_a=trans_a, trans_b=trans_b)
    assert np.isfinite(got).all() and rel(got, want) < 1e-5
    if splits in small_matmul.tile_splits(m, n, k):
        assert launched[0] == "tile_matmul_kernel"
        assert launched[1:] == (["tile_matmul_finish_kernel"] if splits > 1 else [])


@pytest.mark.parametrize("act", ACTS)
def test_tile_linear_epilogue_after_splits(ctx, monkeypatch, act):
    """Bias, activation and the saved pre-activation applied by the split-sum kernel."""
    monkeypatch.setattr(small_matmul, "SMALL_MACS", 0)
    monkeypatch.setattr(small_matmul, "TILE_SPLITS", (4,))
    monkeypatch.setattr(linear, "PATH", "tile")
    rng = np.random.default_rng([len(str(act)), 5])
    x = rng.standard_normal((70, 300)).astype(np.float32)
    w = rng.standard_normal((90, 300)).astype(np.float32)
    b = rng.standard_normal(90).astype(np.float32)
    want, got = run_both(ctx, "linear", [x, w, b], act=act, slope=0.2,
                         save_preact=act is not None)
    for g, w_ in zip(got, want):
        assert np.isfinite(g).all() and rel(g, w_) < 1e-5


def test_linear_path_is_timed_once_per_problem_and_shared(monkeypatch):
    """With PATH "auto" a mid-size fp32 linear times each candidate (cuBLASLt and the tiled
    kernel's splits) once, at the first call of its problem, and runs the fastest; another
    node with the same problem, in another context of the backend, reuses the choice and
    gives the same bits. The clock is a stand-in that makes the last candidate timed the
    fastest (a loaded GPU's timings would make any path win, the logic is what is tested
    here), and the disk cache is off (a choice stored by an earlier or a parallel process
    would skip the timing)."""
    monkeypatch.setattr(linear, "PATH", "auto")
    monkeypatch.setenv("STEPGRAPH_DISK_CACHE", "0")
    timed = []

    def clock(ctx, run, repeats: int = 5, give_up_above=None) -> float:
        run()                                   # as time_on_device: the candidate runs
        timed.append(run)
        return 1.0 / len(timed)                 # each later candidate "faster"

    monkeypatch.setattr(linear.autotune, "time_on_device", clock)
    backend = get_backend("cuda")
    ctx = backend.make_context("fp32")
    ctx.paths = {}                                    # no choice made by earlier tests
    rng = np.random.default_rng(9)
    x = rng.standard_normal((128, 784)).astype(np.float32)
    w = rng.standard_normal((512, 784)).astype(np.float32)
    b = rng.standard_normal(512).astype(np.float32)
    attrs = dict(act="relu", slope=0.01, save_preact=False)
    dev = [cp.asarray(a) for a in (x, w, b)]
    cp.cuda.Device().synchronize()     # uploaded before another stream's kernels read them
    outs, chosen = [], ctx.paths
    for _ in range(2):
        node = make_node("linear", [x, w, b], **attrs)
        with ctx.stream:
            outs.append(cp.full((128, 512), np.nan, np.float32))
        linear.IMPLS["linear"](node, dev, [outs[-1]], ctx)
        assert len(chosen) == 1
        monkeypatch.setattr(linear.autotune, "time_on_device",
                            lambda *a, **k: pytest.fail("timed twice"))
        twin_ctx = backend.make_context("fp32")
        twin_ctx.paths, ctx = ctx.paths, twin_ctx
    # every candidate timed once, distinct, and the fastest (the last) kept
    assert len(timed) >= 2 and len({id(run) for run in timed}) == len(timed)
    (name,) = chosen.values()
    assert name.startswith("tile:s"), name
    cp.cuda.Device().synchronize()     # both contexts' streams: the launches are not on CuPy's
    first, second = outs[0].get(), outs[1].get()
    np.testing.assert_array_equal(first, second)
    assert rel(first, np.maximum(x @ w.T + b, 0)) < 1e-5
