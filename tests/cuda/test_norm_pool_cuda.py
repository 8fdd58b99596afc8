"""cuda vs numpy for the norm and pool families and the extended older ops: batch_norm_train
(affine, running statistics over 3 calls, cumulative momentum, fused ReLU; (N, C), (N, C, L),
(N, C, H, W), both kernel layouts and the float4 path), batch_norm_grad, avgpool2d and its
gradient, maxpool2d with padding, cross-entropy with label smoothing. Fresh random inputs
(never zeros), cuda outputs poisoned first; one captured graph replayed."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

require_gpu()

import stepgraph  # noqa: E402,F401  (registers the op families)
from stepgraph.backends.cuda import elementwise, loss, norm, optim, pool, reduce  # noqa: E402
from stepgraph.backends.cuda.runtime import launch  # noqa: E402
from stepgraph.backends.cuda.runtime.context import CudaContext  # noqa: E402
from stepgraph.errors import CaptureError  # noqa: E402
from stepgraph.ir.ops import IMPLS as NUMPY_IMPLS  # noqa: E402
from tests.cuda import helpers  # noqa: E402
from tests.cuda.helpers import (  # noqa: E402
    assert_close, capture, logits_and_labels, make_node, poisoned, pool_input, random,
    to_device, to_host)

CUDA_IMPLS = {**elementwise.IMPLS, **reduce.IMPLS, **loss.IMPLS, **optim.IMPLS,
              **norm.IMPLS, **pool.IMPLS}
run_both = functools.partial(helpers.run_both, impls=CUDA_IMPLS)


# ---- batch_norm_train ----------------------------------------------------------------------

# (N, C) over both layouts (columns from 8 channels; a last block of channels part-filled for
# C = 10, 40 and 264; C = 9 and 10 walk a channel a thread where others take 2 or 4 (norm.py
# COLUMN_WALKS); up to 1024 channels, a warp of the finalize kernels per channel),
# (N, C, L), (N, C, H, W): odd sizes, C = 1, inner % 4 == 0 (float4 packs), and sizes that
# split a channel over several blocks.
BN_SHAPES = [(6, 5), (7, 1), (16, 40), (5000, 16), (300, 10), (900, 9), (2000, 64), (700, 264),
             (3001, 128), (61, 1024),
             (4, 3, 7), (3, 1, 9), (2, 6, 8),
             (2, 3, 5, 5), (8, 16, 4, 4), (1, 2, 50, 50), (4, 2, 64, 64), (64, 3, 33, 33)]
# (affine, track, momentum, act)
BN_VARIANTS = [(True, True, 0.1, "none"), (False, True, 0.1, "none"), (True, False, 0.1, "none"),
               (False, False, 0.1, "relu"), (True, True, None, "relu"),
               (False, True, None, "none")]


def bn_inputs(rng, shape, affine, track):
    c = shape[1]
    x = random(rng, *shape, scale=2.0, shift=3.0)       # mean far from 0: a real shift
    ins = [x]
    if affine:
        ins += [random(rng, c), random(rng, c)]
    if track:
        ins += [random(rng, c, scale=0.1), np.abs(random(rng, c)) + 0.5,
                np.array(3, np.int64)]
    return ins


def bn_node(ins, affine, track, momentum, act):
    return make_node("batch_norm_train", ins, eps=1e-5, momentum=momentum, affine=affine,
                     track=track, act=act)


def check_bn_statistics(got, want, what):
    """save_mean, save_invstd."""
    assert_close(got[0], want[0], rtol=1e-6, atol=1e-6, what=f"{what} save_mean")
    assert_close(got[1], want[1], rtol=1e-6, atol=0, what=f"{what} save_invstd")


def check_bn_outputs(got, want, what):
    """y, save_mean, save_invstd."""
    assert_close(got[0], want[0], rtol=1e-5, atol=1e-5, what=f"{what} y")
    check_bn_statistics(got[1:], want[1:], what)


def check_three_calls(ctx, rng, node, ref_ins, what, check):
    """Three calls on fresh x each (ref_ins[0]): check(outputs, reference, what) every call,
    the running statistics (mutated inputs) and num_batches_tracked after each."""
    dev_ins = to_device(ctx, ref_ins)
    shape = ref_ins[0].shape
    for call in range(3):
        x = random(rng, *shape, scale=2.0, shift=3.0 - call)
        ref_ins[0][...] = x
        dev_ins[0].set(x, stream=ctx.stream)
        want = [np.full(v.shape, np.nan, v.dtype) for v in node.outputs]
        NUMPY_IMPLS[node.op](node, ref_ins, want, None)
        got = poisoned(ctx, node)
        CUDA_IMPLS[node.op](node, dev_ins, got, ctx)
        check(to_host(ctx, got), want, f"{what} call {call}")
        state = to_host(ctx, dev_ins)
        for i in node.mutates:
            if ref_ins[i].dtype == np.int64:
                assert int(state[i]) == int(ref_ins[i]) == 4 + call
            else:
                assert_close(state[i], ref_ins[i], rtol=2e-6, atol=1e-7,
                             what=f"{what} call {call} running input {i}")


@pytest.mark.parametrize("affine,track,momentum,act", BN_VARIANTS)
@pytest.mark.parametrize("shape", BN_SHAPES)
def test_batch_norm_train(ctx, shape, affine, track, momentum, act):
    """Three calls on fresh x each: outputs every call, running statistics (mutated inputs)
    and num_batches_tracked after each."""
    rng = np.random.default_rng([101, *shape, affine, track])
    ref_ins = bn_inputs(rng, shape, affine, track)
    node = bn_node(ref_ins, affine, track, momentum, act)
    check_three_calls(ctx, rng, node, ref_ins,
                      f"batch_norm_train {shape} affine={affine} track={track} m={momentum} "
                      f"{act}", check_bn_outputs)


@pytest.mark.parametrize("norm_r", [None, "affine", "plain"])
@pytest.mark.parametrize("act", ["relu", "none"])
@pytest.mark.parametrize("shape", [(2000, 64), (300, 10), (900, 9), (8, 16, 4, 4),
                                   (2, 3, 5, 5)])
def test_batch_norm_train_with_residual(ctx, shape, act, norm_r):
    """The fused residual (compile/fuse.py fuse_batch_norm_residual): y = act(bn(x) + r), in
    the columns layout, float4 planes and scalar planes; with norm_r, r is a shortcut's raw
    value and its BatchNorm (statistics from batch_norm_stats; affine or not) is applied on
    the way in."""
    rng = np.random.default_rng([127, *shape])
    ins = bn_inputs(rng, shape, True, True) + [random(rng, *shape, scale=1.5, shift=-1.0)]
    attrs = {}
    if norm_r:
        affine_r = norm_r == "affine"
        c = shape[1]
        w_r, b_r = (random(rng, c), random(rng, c)) if affine_r else (None, None)
        _, r_mean, r_invstd = bn_forward_numpy(ins[-1], w_r, b_r, "none")
        ins += [r_mean, r_invstd] + ([w_r, b_r] if affine_r else [])
        attrs = dict(residual_norm=True, residual_affine=affine_r, residual_eps=1e-5)
    node = make_node("batch_norm_train", ins, eps=1e-5, momentum=0.1, affine=True, track=True,
                     act=act, residual=True, **attrs)
    ref_ins, dev_ins = [a.copy() for a in ins], to_device(ctx, ins)
    want = [np.full(v.shape, np.nan, v.dtype) for v in node.outputs]
    NUMPY_IMPLS[node.op](node, ref_ins, want, None)
    got = poisoned(ctx, node)
    CUDA_IMPLS[node.op](node, dev_ins, got, ctx)
    check_bn_outputs(to_host(ctx, got), want,
                     f"batch_norm_train residual {shape} {act} {norm_r}")
    if act == "relu":
        assert (want[0] == 0).any() and (want[0] > 0).any()


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape", [(2000, 64), (900, 9), (8, 16, 4, 4), (2, 3, 5, 5)])
def test_batch_norm_stats(ctx, shape, momentum):
    """batch_norm_stats (a shortcut BatchNorm's statistics, compile/fuse.py): save_mean,
    save_invstd and the running statistics as batch_norm_train's, three calls."""
    rng = np.random.default_rng([137, *shape])
    ref_ins = bn_inputs(rng, shape, False, True)
    node = make_node("batch_norm_stats", ref_ins, eps=1e-5, momentum=momentum, track=True)
    assert node.mutates == (1, 2, 3)       # the running statistics and num_batches_tracked
    check_three_calls(ctx, rng, node, ref_ins, f"batch_norm_stats {shape} m={momentum}",
                      check_bn_statistics)


def test_batch_norm_train_is_deterministic(ctx):
    shape = (64, 3, 33, 33)                     # several splits per channel
    x = random(np.random.default_rng(103), *shape)
    node = bn_node([x], False, False, 0.1, "none")
    (dev,) = to_device(ctx, [x])
    runs = []
    for _ in range(3):
        out = poisoned(ctx, node)
        CUDA_IMPLS[node.op](node, [dev], out, ctx)
        runs.append(to_host(ctx, out))
    for a, b in zip(runs[0], runs[1] + runs[2]):
        np.testing.assert_array_equal(a, b)


def test_batch_norm_needs_its_scratch_before_capture(ctx):
    x = random(np.random.default_rng(107), 4, 3, 5, 5)
    node = bn_node([x], False, False, 0.1, "none")
    dev = to_device(ctx, [x])
    cold = CudaContext(stream=ctx.stream, capturing=True)
    with pytest.raises(CaptureError):
        CUDA_IMPLS[node.op](node, dev, poisoned(ctx, node), cold)
    CUDA_IMPLS[node.op](node, dev, poisoned(ctx, node), ctx)     # eager: builds the scratch
    out = poisoned(ctx, node)
    CUDA_IMPLS[node.op](node, dev, out, cold)                    # now found: no error
    assert np.isfinite(to_host(ctx, out)[0]).all()


def test_batch_norm_float4_and_scalar_paths_agree(ctx):
    """A misaligned view of the same data takes the scalar walk: same values."""
    shape = (3, 4, 8, 8)
    flat = random(np.random.default_rng(109), 1 + int(np.prod(shape)))
    x = flat[1:].reshape(shape)
    node = bn_node([x], False, False, 0.1, "none")
    (dev_flat,) = to_device(ctx, [flat])
    aligned = dev_flat[1:].copy().reshape(shape)
    misaligned = dev_flat[1:].reshape(shape)
    assert not launch._aligned(misaligned) and launch._aligned(aligned)
    outs = []
    for arr in (aligned, misaligned):
        out = poisoned(ctx, node)
        CUDA_IMPLS[node.op](node, [arr], out, ctx)
        outs.append(to_host(ctx, out))
    for a, b, name in zip(outs[0], outs[1], ("y", "save_mean", "save_invstd")):
        assert_close(b, a, rtol=1e-6, atol=1e-6, what=f"float4 vs scalar {name}")


# ---- batch_norm_grad -----------------------------------------------------------------------

def bn_forward_numpy(x, weight, bias, act):
    """(y, save_mean, save_invstd) of the numpy reference (no running statistics)."""
    ins = [x] + ([weight, bias] if weight is not None else [])
    node = bn_node(ins, weight is not None, False, 0.1, act)
    outs = [np.empty(v.shape, v.dtype) for v in node.outputs]
    NUMPY_IMPLS[node.op](node, ins, outs, None)
    return outs


@pytest.mark.parametrize("affine,act", [(True, "none"), (False, "none"), (True, "relu"),
                                        (False, "relu")])
@pytest.mark.parametrize("shape", BN_SHAPES)
def test_batch_norm_grad(ctx, shape, affine, act):
    rng = np.random.default_rng([113, *shape, affine])
    c = shape[1]
    x, dy = random(rng, *shape, scale=2.0, shift=3.0), random(rng, *shape)
    weight, bias = (random(rng, c), random(rng, c)) if affine else (None, None)
    _, mean, invstd = bn_forward_numpy(x, weight, bias, act)
    ins = [dy, x] + ([weight] if affine else []) + [mean, invstd] + (
        [bias] if affine and act == "relu" else [])
    node = make_node("batch_norm_grad", ins, affine=affine, act=act)
    ref, got = run_both(ctx, node, ins)
    what = f"batch_norm_grad {shape} affine={affine} {act}"
    k = np.abs(invstd * (weight if affine else 1.0)).max()
    assert_close(got[0], ref[0], rtol=1e-4, atol=2e-5 * k * np.abs(dy).max(), what=f"{what} dx")
    if affine:
        axes = (0,) + tuple(range(2, len(shape)))
        sums = np.abs(dy).astype(np.float64).sum(axis=axes).max()
        xhat = np.abs((x - mean.reshape((1, c) + (1,) * (len(shape) - 2)))
                      * invstd.reshape((1, c) + (1,) * (len(shape) - 2))).max()
        assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6 * sums * xhat, what=f"{what} dweight")
        assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6 * sums, what=f"{what} dbias")


@pytest.mark.parametrize("act", ["none", "relu"])
@pytest.mark.parametrize("shape", [(2000, 64), (900, 9), (700, 264), (8, 16, 4, 4),
                                   (2, 3, 5, 5)])
def test_batch_norm_grad_with_gradient_sum(ctx, shape, act):
    """The fused gradient sum (compile/fuse.py fuse_batch_norm_grad_sum): g = dy + dy2, in the
    columns layout (vector and scalar walks), float4 planes and scalar planes."""
    rng = np.random.default_rng([131, *shape])
    c = shape[1]
    x, dy, dy2 = random(rng, *shape, scale=2.0, shift=3.0), random(rng, *shape), \
        random(rng, *shape)
    weight, bias = random(rng, c), random(rng, c)
    _, mean, invstd = bn_forward_numpy(x, weight, bias, act)
    ins = [dy, x, weight, mean, invstd] + ([bias] if act == "relu" else []) + [dy2]
    node = make_node("batch_norm_grad", ins, affine=True, act=act, dy_sum=True)
    ref, got = run_both(ctx, node, ins)
    # the reference with the sum made first, as the unfused graph stores it
    plain = make_node("batch_norm_grad", ins[:-1], affine=True, act=act)
    want = [np.empty(v.shape, v.dtype) for v in plain.outputs]
    NUMPY_IMPLS[plain.op](plain, [dy + dy2] + ins[1:-1], want, None)
    for a, b in zip(ref, want):
        np.testing.assert_array_equal(a, b)
    what = f"batch_norm_grad dy_sum {shape} {act}"
    k = np.abs(invstd * weight).max()
    g = np.abs(dy + dy2)
    assert_close(got[0], ref[0], rtol=1e-4, atol=2e-5 * k * g.max(), what=f"{what} dx")
    sums = g.astype(np.float64).sum(axis=(0,) + tuple(range(2, len(shape)))).max()
    assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6 * sums, what=f"{what} dbias")


# ---- avgpool2d -----------------------------------------------------------------------------

# (shape, kernel, stride, padding): overlapping windows, padding, strides > kernel, one window
# per plane (global pooling: a warp per output from 64 window elements), 1-pixel planes.
AVG_POOLS = [((2, 3, 7, 9), (3, 3), (2, 2), (1, 1)), ((1, 1, 2, 2), (2, 2), (2, 2), (0, 0)),
             ((2, 2, 5, 5), (2, 3), (1, 2), (1, 1)), ((3, 5, 9, 6), (3, 2), (3, 1), (1, 0)),
             ((2, 1, 6, 6), (2, 2), (3, 3), (0, 0)), ((2, 4, 8, 8), (8, 8), (8, 8), (0, 0)),
             ((3, 7, 7, 7), (7, 7), (1, 1), (0, 0)), ((2, 3, 12, 10), (9, 9), (2, 1), (4, 3)),
             ((1, 2, 1, 1), (2, 2), (1, 1), (1, 1)), ((4, 16, 32, 32), (2, 2), (2, 2), (0, 0))]


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("shape,kernel,stride,padding", AVG_POOLS)
def test_avgpool2d(ctx, shape, kernel, stride, padding, count_include_pad):
    x = random(np.random.default_rng([127, *shape]), *shape)
    node = make_node("avgpool2d", [x], kernel=kernel, stride=stride, padding=padding,
                     count_include_pad=count_include_pad)
    ref, got = run_both(ctx, node, [x])
    assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6, what=f"avgpool2d {shape} {kernel}")


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("shape,kernel,stride,padding", AVG_POOLS)
def test_avgpool2d_grad(ctx, shape, kernel, stride, padding, count_include_pad):
    attrs = dict(kernel=kernel, stride=stride, padding=padding,
                 count_include_pad=count_include_pad)
    y_shape = make_node("avgpool2d", [np.empty(shape, np.float32)], **attrs).outputs[0].shape
    dy = random(np.random.default_rng([131, *shape]), *y_shape)
    node = make_node("avgpool2d_grad", [dy], input_shape=shape, **attrs)
    ref, got = run_both(ctx, node, [dy])
    assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6, what=f"avgpool2d_grad {shape} {kernel}")


# ---- maxpool2d with padding ----------------------------------------------------------------

MAX_POOLS = [((2, 3, 7, 9), (3, 3), (2, 2), (1, 1)), ((2, 2, 5, 5), (2, 3), (1, 2), (1, 1)),
             ((3, 5, 9, 6), (3, 2), (3, 1), (1, 0)), ((1, 3, 8, 8), (2, 2), (2, 2), (1, 1)),
             ((2, 4, 16, 16), (3, 3), (2, 2), (1, 1)), ((1, 2, 1, 1), (2, 2), (1, 1), (1, 1)),
             ((2, 3, 6, 6), (2, 2), (2, 2), (0, 0))]


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape,kernel,stride,padding", MAX_POOLS)
def test_maxpool2d_padding(ctx, shape, kernel, stride, padding, relu):
    x = pool_input(shape, 137)
    node = make_node("maxpool2d", [x], kernel=kernel, stride=stride, padding=padding, relu=relu)
    ref, got = run_both(ctx, node, [x])
    np.testing.assert_array_equal(got[1], ref[1], err_msg=f"maxpool2d idx {shape} {padding}")
    np.testing.assert_array_equal(got[0], ref[0], err_msg=f"maxpool2d y {shape} {padding}")


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape,kernel,stride,padding", MAX_POOLS)
def test_maxpool2d_grad_padding(ctx, shape, kernel, stride, padding, relu):
    x = pool_input(shape, 137)
    attrs = dict(kernel=kernel, stride=stride, padding=padding, relu=relu)
    fwd = make_node("maxpool2d", [x], **attrs)
    y_shape = fwd.outputs[0].shape
    y, idx = np.empty(y_shape, np.float32), np.empty(y_shape, np.int32)
    NUMPY_IMPLS["maxpool2d"](fwd, [x], [y, idx], None)
    dy = random(np.random.default_rng(139), *y_shape)
    ins = [dy, idx] + ([y] if relu else [])
    node = make_node("maxpool2d_grad", ins, input_shape=shape, **attrs)
    ref, got = run_both(ctx, node, ins)
    assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6, what=f"maxpool2d_grad {shape} {padding}")


# ceil_mode's partial last windows (SqueezeNet's 3x3 / 2 pools over 14 x 14), with padding,
# and a 2x2 / 2 pool over odd sizes; NCHW x shapes
CEIL_POOLS = [((4, 16, 14, 14), (3, 3), (2, 2), (0, 0)), ((2, 5, 8, 9), (3, 3), (2, 2), (1, 1)),
              ((2, 40, 7, 9), (2, 2), (2, 2), (0, 0))]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape,kernel,stride,padding", CEIL_POOLS)
def test_maxpool2d_ceil_mode(ctx, shape, kernel, stride, padding, layout):
    """The op's own ceil_mode windows, clipped at the input's end: the same maxima and
    indices as the numpy reference, and the gradient to them."""
    x = pool_input(shape, 141)
    attrs = dict(kernel=kernel, stride=stride, padding=padding, ceil_mode=True)
    if layout == "NHWC":
        x, attrs = np.ascontiguousarray(x.transpose(0, 2, 3, 1)), dict(attrs, layout="NHWC")
    fwd = make_node("maxpool2d", [x], **attrs)
    ref, got = run_both(ctx, fwd, [x])
    np.testing.assert_array_equal(got[1], ref[1], err_msg=f"maxpool2d idx {shape} {layout}")
    np.testing.assert_array_equal(got[0], ref[0], err_msg=f"maxpool2d y {shape} {layout}")
    dy = random(np.random.default_rng(143), *ref[0].shape)
    bwd = make_node("maxpool2d_grad", [dy, ref[1]], input_shape=x.shape, **attrs)
    ref, got = run_both(ctx, bwd, [dy, ref[1]])
    assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6, what=f"maxpool2d_grad {shape} {layout}")


# ---- cross-entropy with label smoothing ----------------------------------------------------

# One warp per row and wider rows; one block and many; the short-row train kernel.
CE_ROWS = [(1, 1), (1, 10), (7, 3), (128, 10), (8, 2000), (3, 20000), (33, 1025), (4000, 10),
           (40, 1500)]


@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("label_dtype", ["int32", "int64"])
@pytest.mark.parametrize("n,c", CE_ROWS)
def test_cross_entropy_smoothing(ctx, n, c, label_dtype, eps):
    x, labels = logits_and_labels(n, c, label_dtype, 149)
    node = make_node("cross_entropy", [x, labels], label_smoothing=eps)
    ref, got = run_both(ctx, node, [x, labels])
    assert_close(got[0], ref[0], rtol=2e-6, atol=0, what=f"cross_entropy eps={eps} {n}x{c}")
    assert_close(got[1], ref[1], rtol=1e-6, atol=1e-6, what=f"cross_entropy lse {n}x{c}")


@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("label_dtype", ["int32", "int64"])
@pytest.mark.parametrize("n,c", CE_ROWS)
def test_cross_entropy_grad_smoothing(ctx, n, c, label_dtype, eps):
    x, labels = logits_and_labels(n, c, label_dtype, 151)
    lse = (x.max(1) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1))).astype(np.float32)
    dloss = np.array(1.7, np.float32)
    node = make_node("cross_entropy_grad", [dloss, x, lse, labels], label_smoothing=eps)
    ref, got = run_both(ctx, node, [dloss, x, lse, labels])
    assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6 / n, what=f"ce_grad eps={eps} {n}x{c}")


@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("label_dtype", ["int32", "int64"])
@pytest.mark.parametrize("n,c", CE_ROWS)
def test_cross_entropy_train_smoothing(ctx, n, c, label_dtype, eps):
    x, labels = logits_and_labels(n, c, label_dtype, 157)
    node = make_node("cross_entropy_train", [x, labels], label_smoothing=eps)
    ref, got = run_both(ctx, node, [x, labels])
    assert_close(got[0], ref[0], rtol=2e-6, atol=0, what=f"ce_train loss eps={eps} {n}x{c}")
    assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6 / n, what=f"ce_train dx eps={eps} {n}x{c}")


@pytest.mark.parametrize("op", ["cross_entropy", "cross_entropy_train"])
@pytest.mark.parametrize("n,c", [(4000, 10), (40, 1500)])
def test_smoothed_cross_entropy_many_blocks_and_capture_fallback(ctx, op, n, c):
    """Many blocks park smoothed row losses: the same bits every run; a capture-time call
    without scratch takes the one-block path and still matches."""
    x, labels = logits_and_labels(n, c, "int64", 163)
    node = make_node(op, [x, labels], label_smoothing=0.2)
    ins = to_device(ctx, [x, labels])
    runs = []
    for _ in range(3):
        outs = poisoned(ctx, node)
        CUDA_IMPLS[op](node, ins, outs, ctx)
        runs.append(to_host(ctx, outs))
    assert runs[0][0] == runs[1][0] == runs[2][0]
    fresh = make_node(op, [x, labels], label_smoothing=0.2)
    outs = poisoned(ctx, fresh)
    CUDA_IMPLS[op](fresh, ins, outs, CudaContext(stream=ctx.stream, capturing=True))
    got = to_host(ctx, outs)
    assert_close(got[0], runs[0][0], rtol=2e-6, atol=0, what=f"{op} one-block fallback loss")
    assert_close(got[1], runs[0][1], rtol=0, atol=0, what=f"{op} one-block fallback output")


def test_zero_smoothing_is_the_unsmoothed_op(ctx):
    """label_smoothing 0.0 and no attr at all run the same arithmetic: identical bits."""
    x, labels = logits_and_labels(4000, 10, "int64", 167)
    ins = to_device(ctx, [x, labels])
    results = []
    for attrs in ({}, {"label_smoothing": 0.0}):
        node = make_node("cross_entropy_train", [x, labels], **attrs)
        outs = poisoned(ctx, node)
        CUDA_IMPLS[node.op](node, ins, outs, ctx)
        results.append(to_host(ctx, outs))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


# ---- a captured graph ----------------------------------------------------------------------

def test_captured_batch_norm_replays(ctx):
    """batch_norm_train (running statistics, cumulative momentum, ReLU) and batch_norm_grad
    captured once after an eager warm-up, replayed 5 times with fresh x and dy."""
    rng = np.random.default_rng(173)
    shape, c = (8, 6, 5, 5), 6
    x, dy = random(rng, *shape, shift=2.0), random(rng, *shape)
    w, b = random(rng, c), random(rng, c)
    rm, rv, count = np.zeros(c, np.float32), np.ones(c, np.float32), np.array(0, np.int64)
    fwd = bn_node([x, w, b, rm, rv, count], True, True, None, "relu")
    y, mean, invstd = (np.zeros(v.shape, np.float32) for v in fwd.outputs)
    grad_ins = [dy, x, w, mean, invstd, b]
    bwd = make_node("batch_norm_grad", grad_ins, affine=True, act="relu")
    dx, dw, db = (np.zeros(v.shape, np.float32) for v in bwd.outputs)

    def program(impls, a, ctx_):
        x_, dy_, w_, b_, rm_, rv_, n_, y_, m_, s_, dx_, dw_, db_ = a
        impls[fwd.op](fwd, [x_, w_, b_, rm_, rv_, n_], [y_, m_, s_], ctx_)
        impls[bwd.op](bwd, [dy_, x_, w_, m_, s_, b_], [dx_, dw_, db_], ctx_)

    host = [x, dy, w, b, rm, rv, count, y, mean, invstd, dx, dw, db]
    dev = to_device(ctx, [a.copy() for a in host])
    program(NUMPY_IMPLS, host, None)
    program(CUDA_IMPLS, dev, ctx)                          # eager warm-up: builds the scratch
    graph = capture(ctx, lambda: program(CUDA_IMPLS, dev, ctx))
    for step in range(5):
        fresh_x, fresh_dy = random(rng, *shape, shift=2.0 - step), random(rng, *shape)
        for i, value in ((0, fresh_x), (1, fresh_dy)):
            host[i][...] = value
            dev[i].set(value, stream=ctx.stream)
        program(NUMPY_IMPLS, host, None)
        graph.launch(ctx.stream)
    got = to_host(ctx, dev)
    assert int(got[6]) == int(host[6]) == 6
    for name, i, atol in (("running_mean", 4, 1e-6), ("running_var", 5, 1e-6), ("y", 7, 1e-5),
                          ("save_invstd", 9, 0), ("dx", 10, 1e-5), ("dweight", 11, 1e-4),
                          ("dbias", 12, 1e-4)):
        assert_close(got[i], host[i], rtol=1e-5, atol=atol, what=f"replayed {name}")
