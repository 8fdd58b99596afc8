"""cross_entropy_train over classes-first logits (compile/logits_layout.py, loss.cu
cross_entropy_train_columns_kernel): on the same logits transposed it gives the row kernel's
loss and dlogits (the lanes add a row's exponentials in another order: an ulp of the log-sum,
so a float32 rounding apart) in every storage, with label smoothing and ignored rows, in one
block and over many, the same bits on every run; and the numpy reference's values. Whole
steps with a 65-token vocabulary (gpt) run it in test_gpt_train_cuda.py and
test_bf16_attention_cuda.py."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

from stepgraph.backends.cuda.loss import cross_entropy_train  # noqa: E402
from stepgraph.backends.numpy import bf16  # noqa: E402
from stepgraph.ir.graph import Node  # noqa: E402
from tests.ops.helpers import op_forward, seeded  # noqa: E402

# storage -> (array dtype, loss dtype, NaN poison of the dlogits)
STORAGES = {"float32": (np.float32, np.float32, np.float32(np.nan)),
            "bfloat16": (np.uint16, np.float32, np.uint16(0x7FA1)),
            "float16": (np.float16, np.float16, np.float16(np.nan))}
# (rows, classes): one block; one block with fewer classes than lanes; many blocks
SHAPES = [(40, 65), (300, 5), (4000, 65), (16384, 65), (1000, 1000)]


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("bf16")


def case(storage: str, n: int, c: int, ignore: int):
    rng = seeded(f"ce columns {storage} {n} {c} {ignore}")
    x = (3 * rng.standard_normal((n, c))).astype(np.float32)
    x = bf16.to_bits(x) if storage == "bfloat16" else x.astype(STORAGES[storage][0])
    labels = rng.integers(0, c, n).astype(np.int64)
    if ignore >= 0:
        labels[::7] = ignore
    return x, labels


def widened(x, storage: str) -> np.ndarray:
    return bf16.from_bits(x) if storage == "bfloat16" else x.astype(np.float32)


def run(ctx, x, labels, storage, smoothing, ignore, classes_first, node=None, capture=False):
    _, loss_dtype, poison = STORAGES[storage]
    node = node or Node("cross_entropy_train", [], [], {})
    with ctx.stream:
        xs, ys = cp.asarray(x), cp.asarray(labels)
        loss, dx = cp.full((), np.nan, loss_dtype), cp.full(x.shape, poison)
    run_ctx = type(ctx)(stream=ctx.stream, capturing=True) if capture else ctx
    cross_entropy_train(run_ctx, node, xs, ys, loss, dx, smoothing, ignore, classes_first)
    with ctx.stream:
        return loss.get(), dx.get()


@pytest.mark.parametrize("n, c", SHAPES)
@pytest.mark.parametrize("storage", list(STORAGES))
@pytest.mark.parametrize("smoothing, ignore", [(0.0, -100), (0.1, 3)])
def test_columns_kernel_gives_the_row_kernels_results(ctx, n, c, storage, smoothing, ignore):
    x, labels = case(storage, n, c, ignore)
    loss_r, dx_r = run(ctx, x, labels, storage, smoothing, ignore, False)
    loss_c, dx_c = run(ctx, np.ascontiguousarray(x.T), labels, storage, smoothing, ignore, True)
    assert dx_c.shape == (c, n) and np.isfinite(widened(dx_c, storage)).all()
    close = dict(rtol=1e-3, atol=0) if storage == "float16" else dict(rtol=2e-6, atol=0)
    np.testing.assert_allclose(np.float32(loss_c), np.float32(loss_r), **close)
    # An ulp of the log-sum l moves exp(x - l) by up to ulp(l) (|l| < 16: 2e-6) absolutely,
    # which at the label (p - 1, p near 1) is a large part of the gradient: so an absolute
    # bound of 2e-6 a row's scale 1 / n; a 16-bit gradient may round to the neighbouring
    # value (float16's below 2^-14 are 2^-24 apart).
    rtol = 2e-6 if storage == "float32" else 2.0 ** -7
    atol = 2e-6 / n + (2.0 ** -24 if storage == "float16" else 0.0)
    np.testing.assert_allclose(widened(dx_c, storage).T, widened(dx_r, storage), rtol=rtol,
                               atol=atol)
    if ignore >= 0:
        assert (widened(dx_c, storage)[:, ::7] == 0).all()


@pytest.mark.parametrize("n, c", SHAPES)
def test_columns_kernel_matches_the_numpy_reference(ctx, n, c):
    x, labels = case("float32", n, c, 3)
    xt = np.ascontiguousarray(x.T)
    want_loss, want_dx = op_forward("cross_entropy_train", {"x": xt, "y": labels},
                                    classes_first=True, label_smoothing=0.1, ignore_index=3)
    loss, dx = run(ctx, xt, labels, "float32", 0.1, 3, True)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-6)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6 / n)


def test_columns_kernel_is_deterministic_and_its_capture_fallback_matches(ctx):
    """Many blocks: the same bits every run; a capture-time call without scratch (no warm-up)
    runs one block: the same dlogits bits, the loss to its float64 sums' order."""
    x, labels = case("bfloat16", 16384, 65, -100)
    xt = np.ascontiguousarray(x.T)
    node = Node("cross_entropy_train", [], [], {})
    runs = [run(ctx, xt, labels, "bfloat16", 0.0, -100, True, node) for _ in range(3)]
    for loss, dx in runs[1:]:
        assert loss == runs[0][0]
        np.testing.assert_array_equal(dx, runs[0][1])
    loss, dx = run(ctx, xt, labels, "bfloat16", 0.0, -100, True, capture=True)
    np.testing.assert_array_equal(dx, runs[0][1])
    np.testing.assert_allclose(loss, runs[0][0], rtol=1e-6)


def test_bad_labels_give_a_nan_loss(ctx):
    """A label outside [0, C) picks NaN (the guard then skips the step), as the row kernel."""
    x, labels = case("float32", 4000, 65, -100)
    labels[5] = 65
    loss, _ = run(ctx, np.ascontiguousarray(x.T), labels, "float32", 0.0, -100, True)
    assert np.isnan(loss)
