"""cuda vs numpy for the index and reduce families: slice with a step and its gradient,
concat (every dtype, pieces of odd widths), step-1 slices and concats of channel runs,
gather and gather_grad (repeated and out-of-range indices), triangle, reduce_max and its
gradient (with ties), topk (largest and smallest, ties, k = n), cumsum both ways. Fresh
random inputs (never zeros), cuda outputs poisoned first; one traced model with indexing, cat,
max and topk trained 5 steps on both backends."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

import stepgraph  # noqa: E402,F401  (registers the op families)
from tests.cuda.helpers import assert_close, make_node, random, run_both, to_host  # noqa: E402
from tests.ops.test_index_ops import picker_losses  # noqa: E402


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("fp32")


FLOATS = pytest.mark.parametrize("dtype", ["float32", "float64"])


def values(rng, shape, dtype):
    """Random floats, or integers in [1, 100) for the integer dtypes (never all zeros)."""
    if np.dtype(dtype).kind == "f":
        return random(rng, *shape, dtype=dtype)
    return rng.integers(1, 100, shape).astype(dtype)
STEPS = [((4, 9, 5), 1, 1, 8, 3), ((7, 33), 1, 0, 33, 2), ((10,), 0, 3, 10, 4),
         ((2, 3, 8, 12), 3, 1, 12, 5), ((3, 9), 0, 2, 3, 7)]


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8"])
@pytest.mark.parametrize("shape,dim,start,stop,step", STEPS)
def test_slice_step(ctx, impls, shape, dim, start, stop, step, dtype):
    x = values(np.random.default_rng([3, *shape, step]), shape, dtype)
    ref, got = run_both(ctx, make_node("slice", [x], dim=dim, start=start, stop=stop,
                                       step=step), [x], impls)
    np.testing.assert_array_equal(got[0], ref[0])
    dy = random(np.random.default_rng([5, *shape]), *ref[0].shape)
    node = make_node("slice_grad", [dy], input_shape=shape, dim=dim, start=start, step=step)
    ref, got = run_both(ctx, node, [dy], impls)
    np.testing.assert_array_equal(got[0], ref[0])


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "uint8"])
@pytest.mark.parametrize("shapes,dim", [([(3, 4), (3, 1), (3, 7)], 1), ([(1, 5), (6, 5)], 0),
                                        ([(2, 3, 8), (2, 5, 8)], 1), ([(33,), (31,)], 0)])
def test_concat(ctx, impls, shapes, dim, dtype):
    rng = np.random.default_rng([len(shapes), dim, *shapes[0]])
    xs = [values(rng, s, dtype) for s in shapes]
    ref, got = run_both(ctx, make_node("concat", xs, dim=dim), xs, impls)
    np.testing.assert_array_equal(got[0], ref[0])


# Step-1 slices and concats move whole runs in the widest unit dividing them (shape.py
# runs_in_units): last-axis runs of 2-byte channels of 128, 16, 8, 4 and 2 bytes, offsets at odd
# multiples of each unit, a middle axis.
RUN_SLICES = [((4, 5, 128), 2, 64, 128), ((4, 5, 128), 2, 8, 72), ((4, 5, 128), 2, 3, 67),
              ((4, 5, 128), 2, 4, 8), ((6, 130), 1, 2, 66), ((4, 6, 3, 8), 1, 1, 4)]
RUN_CONCATS = [[(4, 5, 64), (4, 5, 64)], [(4, 5, 16), (4, 5, 48), (4, 5, 64)],
               [(4, 5, 3), (4, 5, 61)], [(4, 5, 4), (4, 5, 12)], [(2, 9, 1), (2, 9, 2)]]


def _poisoned(ctx, shape, dtype):
    """A device array of every bit set (NaN for the float types), made on the context's
    stream."""
    bits = np.full(int(np.prod(shape)) * np.dtype(dtype).itemsize, 0xFF, np.uint8)
    with ctx.stream:
        return cp.asarray(bits.view(dtype).reshape(shape))


# The launchers are called on CuPy arrays directly: 2-byte element types (bf16's and float16's
# bits) whatever the IR's dtypes, compared with NumPy's slicing and concatenation bit for bit.
@pytest.mark.parametrize("dtype", ["uint16", "float16", "float32"])
@pytest.mark.parametrize("shape,dim,start,stop", RUN_SLICES)
def test_slice_runs_of_channels(ctx, shape, dim, start, stop, dtype):
    from stepgraph.backends.cuda import shape as shape_ops

    x = values(np.random.default_rng([7, *shape, start]), shape, dtype)
    index = tuple(slice(start, stop) if a == dim else slice(None) for a in range(len(shape)))
    want = x[index]
    got = _poisoned(ctx, want.shape, dtype)
    with ctx.stream:
        dx = cp.asarray(x)
    shape_ops.slice_forward(ctx, dx, got, dim, start, stop)
    np.testing.assert_array_equal(to_host(ctx, [got])[0], want)
    back = _poisoned(ctx, shape, dtype)
    with ctx.stream:
        dy = cp.asarray(want)
    shape_ops.slice_backward(ctx, dy, back, dim, start)
    grad = np.zeros_like(x)
    grad[index] = want
    np.testing.assert_array_equal(to_host(ctx, [back])[0], grad)


@pytest.mark.parametrize("dtype", ["uint16", "float16", "float32"])
@pytest.mark.parametrize("shapes", RUN_CONCATS)
def test_concat_runs_of_channels(ctx, shapes, dtype):
    from stepgraph.backends.cuda import index

    rng = np.random.default_rng([9, len(shapes), *shapes[0]])
    xs = [values(rng, s, dtype) for s in shapes]
    want = np.concatenate(xs, axis=-1)
    got = _poisoned(ctx, want.shape, dtype)
    with ctx.stream:
        dxs = [cp.asarray(x) for x in xs]
    index.concat_forward(ctx, dxs, got, want.ndim - 1)
    np.testing.assert_array_equal(to_host(ctx, [got])[0], want)


GATHERS = [((3, 5, 4), 1, 7), ((6, 9), 0, 2), ((4, 1000), 1, 3), ((2, 3, 2, 5), 3, 5)]


@FLOATS
@pytest.mark.parametrize("idx_dtype", ["int32", "int64"])
@pytest.mark.parametrize("shape,dim,k", GATHERS)
def test_gather_and_grad(ctx, impls, shape, dim, k, dtype, idx_dtype):
    rng = np.random.default_rng([11, *shape, k])
    x = random(rng, *shape, dtype=dtype)
    ishape = shape[:dim] + (k,) + shape[dim + 1:]
    # repeats, and a few indices out of range (read 0, scatter nothing) on both sides
    index = rng.integers(-1, shape[dim] + 1, ishape).astype(idx_dtype)
    ref, got = run_both(ctx, make_node("gather", [x, index], dim=dim), [x, index], impls)
    np.testing.assert_array_equal(got[0], ref[0])
    dy = random(rng, *ishape, dtype=dtype)
    node = make_node("gather_grad", [dy, index], input_shape=shape, dim=dim)
    ref, got = run_both(ctx, node, [dy, index], impls)
    assert_close(got[0], ref[0], rtol=1e-6, what=f"gather_grad {shape} {dim}")


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "uint8"])
@pytest.mark.parametrize("shape,diagonal,upper", [((5, 5), 0, False), ((2, 4, 7), 2, True),
                                                  ((3, 6, 2), -1, False), ((1, 9), -3, True)])
def test_triangle(ctx, impls, shape, diagonal, upper, dtype):
    x = values(np.random.default_rng([13, *shape]), shape, dtype)
    node = make_node("triangle", [x], diagonal=diagonal, upper=upper)
    ref, got = run_both(ctx, node, [x], impls)
    np.testing.assert_array_equal(got[0], ref[0])


REDUCE = [((3, 5, 4), 1), ((7, 33), 1), ((64, 3), 0), ((1, 1029), 1), ((2, 3, 5, 7), 0)]


@FLOATS
@pytest.mark.parametrize("kind", ["max", "min"])
@pytest.mark.parametrize("shape,dim", REDUCE)
def test_reduce_max_and_grad(ctx, impls, shape, dim, kind, dtype):
    rng = np.random.default_rng([17, *shape, dim])
    x = np.round(random(rng, *shape, dtype=dtype) * 2) / 2   # a coarse grid: ties
    ref, got = run_both(ctx, make_node("reduce_max", [x], dim=dim, kind=kind), [x], impls)
    np.testing.assert_array_equal(got[0], ref[0])
    y, dy = ref[0], random(rng, *ref[0].shape, dtype=dtype)
    node = make_node("reduce_max_grad", [dy, x, y], dim=dim)
    ref, got = run_both(ctx, node, [dy, x, y], impls)
    assert_close(got[0], ref[0], rtol=1e-6, what=f"reduce_max_grad {shape} {dim}")


@FLOATS
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("shape,dim,k", [((3, 5, 4), 1, 2), ((7, 33), 1, 33), ((64, 3), 0, 5),
                                         ((2, 1029), 1, 1), ((4, 6), 1, 0)])
def test_topk(ctx, impls, shape, dim, k, largest, dtype):
    x = np.round(random(np.random.default_rng([19, *shape, k]), *shape, dtype=dtype) * 2) / 2
    node = make_node("topk", [x], dim=dim, k=k, largest=largest)
    ref, got = run_both(ctx, node, [x], impls)
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])          # ties in index order on both


@FLOATS
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("shape,dim", REDUCE)
def test_cumsum(ctx, impls, shape, dim, reverse, dtype):
    x = random(np.random.default_rng([23, *shape, dim]), *shape, dtype=dtype)
    node = make_node("cumsum", [x], dim=dim, reverse=reverse)
    ref, got = run_both(ctx, node, [x], impls)
    assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5, what=f"cumsum {shape} {dim}")


def test_model_trains_the_same_on_both_backends():
    """Indexing, cat, max, topk, cumsum, tril and var in one model: 5 steps, cpu vs cuda."""
    losses = {device: picker_losses(device, steps=5) for device in ("cpu", "cuda")}
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=1e-4)
