"""cuda vs numpy for every non-GEMM op (backends/cuda/elementwise.py, reduce.py, loss.py, optim.py against
the NumPy references of stepgraph/ops/): fresh random inputs (never zeros), cuda outputs poisoned first,
awkward shapes (batch 1, sizes not multiples of 4 or 8, odd channel counts), dropout masks
identical bit for bit, optimizer updates over 3 steps, and one captured graph replayed."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

from stepgraph.backends.cuda import elementwise, loss, optim, pool, reduce  # noqa: E402
from stepgraph.backends.cuda.runtime.context import CudaContext  # noqa: E402
from stepgraph.errors import CaptureError  # noqa: E402
from stepgraph.ir.ops import IMPLS as NUMPY_IMPLS  # noqa: E402
from stepgraph.ops.activation import ACTIVATIONS, GRAD_FROM_OUTPUT  # noqa: E402
from stepgraph.ops.optim import hyperparameter_table  # noqa: E402
from stepgraph.optim import schedules  # noqa: E402
from tests.cuda import helpers  # noqa: E402
from tests.cuda.helpers import (  # noqa: E402
    assert_close, capture, logits_and_labels, make_node, poisoned, pool_input, random,
    run_update_steps, to_device, to_host)

# max pooling's launchers live in pool.py (with average pooling and the channels-last kernels)
# the ops of the elementwise, reduce, loss and optim families
CORE_IMPLS = {**elementwise.IMPLS, **reduce.IMPLS, **loss.IMPLS, **optim.IMPLS}
run_both = functools.partial(helpers.run_both, impls={**CORE_IMPLS, **pool.IMPLS})


SHAPES = [(1,), (1, 1), (3, 5), (7, 33), (2, 3, 5, 7), (1, 1029), (64, 128)]
# gelu_tanh's derivative cancels terms of size ~1 (1 - tanh^2 at large |z|): a 1-ulp difference
# between numpy's and CUDA's float32 tanh shows up as ~1e-6 absolute.
GRAD_ATOL = {"gelu_tanh": 5e-6}


# ---- elementwise ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_act(ctx, kind, shape):
    x = random(np.random.default_rng([len(shape), *shape]), *shape) * 3
    node = make_node("act", [x], kind=kind, slope=0.07)
    ref, got = run_both(ctx, node, [x])
    assert_close(got[0], ref[0], what=f"act {kind} {shape}")


@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_act_grad(ctx, kind, shape):
    rng = np.random.default_rng([7, *shape])
    z, dy = random(rng, *shape) * 3, random(rng, *shape)
    saved = z
    if kind in GRAD_FROM_OUTPUT:
        saved = np.empty_like(z)
        NUMPY_IMPLS["act"](make_node("act", [z], kind=kind), [z], [saved], None)
    node = make_node("act_grad", [dy, saved], kind=kind, slope=0.07)
    ref, got = run_both(ctx, node, [dy, saved])
    assert_close(got[0], ref[0], atol=GRAD_ATOL.get(kind, 1e-6), what=f"act_grad {kind} {shape}")


@pytest.mark.parametrize("kind", ["relu", "gelu", "sigmoid"])
def test_act_in_place_and_misaligned(ctx, kind):
    """y aliasing x (linear epilogues), and views off 16-byte alignment (scalar path)."""
    x = random(np.random.default_rng(3), 1 + 4 * 37 + 3)
    want = np.empty_like(x[1:])
    NUMPY_IMPLS["act"](make_node("act", [x[1:]], kind=kind), [x[1:]], [want], None)
    (dev,) = to_device(ctx, [x])
    view = dev[1:]
    elementwise.act_forward(ctx, view, view, kind, 0.01)
    assert_close(to_host(ctx, [view])[0], want, what=f"act {kind} in place, misaligned")


@pytest.mark.parametrize("shape", SHAPES)
def test_add(ctx, shape):
    rng = np.random.default_rng([11, *shape])
    a, b = random(rng, *shape), random(rng, *shape)
    ref, got = run_both(ctx, make_node("add", [a, b]), [a, b])
    assert_close(got[0], ref[0], rtol=0, atol=0, what=f"add {shape}")


@pytest.mark.parametrize("dtype,value", [("float32", 1.0), ("float32", -2.5), ("float64", 0.3),
                                         ("int32", 5), ("int64", 2**40 + 3), ("uint8", 1)])
@pytest.mark.parametrize("shape", [(), (1,), (5, 3), (2, 3, 4, 5)])
def test_fill(ctx, dtype, value, shape):
    node = make_node("fill", [], value=value, shape=shape, dtype=dtype)
    ref, got = run_both(ctx, node, [])
    np.testing.assert_array_equal(got[0], ref[0])


# ---- dropout -------------------------------------------------------------------------------

DROPOUT_CASES = [((1,), False), ((1, 1), False), ((3, 7), False), ((16, 33), False),
                 ((1025,), False), ((4, 3, 5, 5), True), ((2, 5, 3, 3), False), ((3, 7), True),
                 ((1, 1, 1, 1), True)]


@pytest.mark.parametrize("shape,per_channel", DROPOUT_CASES)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("step", [1, 6, 2**32 + 5])
def test_dropout_masks_identical(ctx, shape, per_channel, p, step):
    x = random(np.random.default_rng([5, *shape]), *shape)
    step_arr = np.array(step, dtype=np.int64)
    node = make_node("dropout", [x, step_arr], p=p, seed=2**40 + 123, site=3,
                     per_channel=per_channel)
    ref, got = run_both(ctx, node, [x, step_arr])
    np.testing.assert_array_equal(got[1], ref[1], err_msg=f"dropout mask {shape} p={p}")
    assert_close(got[0], ref[0], rtol=0, atol=0, what=f"dropout y {shape} p={p}")


@pytest.mark.parametrize("shape,per_channel", DROPOUT_CASES)
def test_dropout_grad(ctx, shape, per_channel):
    rng = np.random.default_rng([6, *shape])
    dy = random(rng, *shape)
    mshape = shape[:2] if per_channel else shape
    mask = (rng.random(mshape) > 0.3).astype(np.uint8)
    node = make_node("dropout_grad", [dy, mask], p=0.3, per_channel=per_channel)
    ref, got = run_both(ctx, node, [dy, mask])
    assert_close(got[0], ref[0], rtol=0, atol=0, what=f"dropout_grad {shape}")


# ---- reductions ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape,axes", [((1, 1), (0,)), ((5, 33), (0,)), ((130, 7), (0,)),
                                        ((3, 5, 4, 3), (0, 2, 3)), ((1, 7, 1, 1), (0, 2, 3)),
                                        ((64, 3, 9, 9), (0, 2, 3)), ((9, 13), (1,)),
                                        ((6, 5, 3), (0, 1, 2)), ((1000,), (0,)),
                                        ((2000, 45), (0,)),
                                        # hundreds of row splits (reduce_sum_splits_kernel's
                                        # warps over them, a last round part-filled)
                                        ((70000, 67), (0,)), ((40000, 64), (0,)),
                                        ((600, 5, 4, 4), (0, 2, 3))])
def test_reduce_sum(ctx, shape, axes):
    x = random(np.random.default_rng([13, *shape]), *shape)
    ref, got = run_both(ctx, make_node("reduce_sum", [x], axes=axes), [x])
    scale = float(np.abs(x).sum(axis=axes).max())
    assert_close(got[0], ref[0], rtol=1e-5, atol=2e-6 * scale, what=f"reduce_sum {shape} {axes}")


@pytest.mark.parametrize("shape,axes", helpers.ROW_SUM_CASES + helpers.MIDDLE_SUM_CASES)
def test_reduce_sum_rows(ctx, shape, axes):
    """The last axes summed (a warp per row for many rows), or a middle run of them (batched
    column sums): within test_reduce_sum's bounds of the numpy sum, and the same bits on a
    second run."""
    x = random(np.random.default_rng([19, *shape]), *shape)
    node = make_node("reduce_sum", [x], axes=axes)
    ref, got = run_both(ctx, node, [x])
    scale = float(np.abs(x).sum(axis=axes).max())
    assert_close(got[0], ref[0], rtol=1e-5, atol=2e-6 * scale, what=f"reduce_sum {shape} {axes}")
    again = helpers.run_cuda(ctx, node, [x], CORE_IMPLS)
    np.testing.assert_array_equal(again[0].view(np.uint32), got[0].view(np.uint32))


@pytest.mark.parametrize("kind", ("none",) + ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 1), (5, 33), (130, 7), (64, 100), (3, 1), (1000, 40),
                                   (2048, 512)])
def test_act_bias_grad(ctx, kind, shape):
    rng = np.random.default_rng([17, *shape])
    dy, saved = random(rng, *shape), random(rng, *shape)
    if kind in GRAD_FROM_OUTPUT:
        saved = np.abs(saved) / (1 + np.abs(saved))     # a plausible y in (0, 1)
    node = make_node("act_bias_grad", [dy, saved], kind=kind, slope=0.07)
    ref, got = run_both(ctx, node, [dy, saved])
    assert_close(got[0], ref[0], atol=GRAD_ATOL.get(kind, 1e-6), what=f"act_bias_grad {kind} dz")
    scale = float(np.abs(ref[0]).sum(axis=0).max())
    assert_close(got[1], ref[1], atol=2e-6 * scale, what=f"act_bias_grad {kind} db")


@pytest.mark.parametrize("sizes", [[(1,)], [(3, 7), (5,)], [(5000,), (4097,), (1,), (33, 17)]])
def test_global_norm(ctx, sizes):
    rng = np.random.default_rng(len(sizes))
    tensors = [random(rng, *s) for s in sizes]
    node = make_node("global_norm", tensors)
    ref, got = run_both(ctx, node, tensors)
    assert_close(got[0], ref[0], rtol=1e-6, atol=0, what=f"global_norm {sizes}")


def test_global_norm_is_deterministic(ctx):
    tensors = to_device(ctx, [random(np.random.default_rng(1), 70001), random(
        np.random.default_rng(2), 513)])
    node = make_node("global_norm", tensors)
    outs = []
    for _ in range(3):
        out = poisoned(ctx, node)
        CORE_IMPLS["global_norm"](node, tensors, out, ctx)
        outs.append(to_host(ctx, out)[0])
    assert outs[0] == outs[1] == outs[2]


# ---- pooling -------------------------------------------------------------------------------

POOLS = [((1, 1, 2, 2), (2, 2), (2, 2)), ((2, 3, 7, 9), (3, 3), (2, 2)),
         ((2, 2, 5, 5), (2, 3), (1, 2)), ((1, 3, 8, 8), (2, 2), (2, 2)),
         ((3, 5, 9, 6), (3, 2), (3, 1)), ((2, 1, 6, 6), (2, 2), (3, 3)),
         ((2, 2, 9, 6), (3, 2), (3, 2)), ((2, 10, 24, 24), (2, 2), (2, 2))]   # exact tilings


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape,kernel,stride", POOLS)
def test_maxpool2d(ctx, shape, kernel, stride, relu):
    x = pool_input(shape, 19)
    node = make_node("maxpool2d", [x], kernel=kernel, stride=stride, relu=relu)
    ref, got = run_both(ctx, node, [x])
    np.testing.assert_array_equal(got[1], ref[1], err_msg=f"maxpool2d idx {shape}")
    np.testing.assert_array_equal(got[0], ref[0], err_msg=f"maxpool2d y {shape}")


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape,kernel,stride", POOLS)
def test_maxpool2d_grad(ctx, shape, kernel, stride, relu):
    x = pool_input(shape, 19)
    fwd = make_node("maxpool2d", [x], kernel=kernel, stride=stride, relu=relu)
    y_shape = fwd.outputs[0].shape
    y, idx = np.empty(y_shape, np.float32), np.empty(y_shape, np.int32)
    NUMPY_IMPLS["maxpool2d"](fwd, [x], [y, idx], None)
    dy = random(np.random.default_rng(23), *y_shape)
    ins = [dy, idx] + ([y] if relu else [])
    node = make_node("maxpool2d_grad", ins, kernel=kernel, stride=stride, input_shape=shape,
                     relu=relu)
    ref, got = run_both(ctx, node, ins)
    assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6, what=f"maxpool2d_grad {shape}")


# ---- softmax and losses --------------------------------------------------------------------

# Rows of one warp, of 128 threads (C > 1024) and 256 threads (C > 8192); one block and many;
# log_softmax's narrow rows (C <= 16: 1 to 16 lanes, several rows a warp), a segmentation
# head's two classes over many blocks among them.
ROWS = [(1, 1), (1, 10), (7, 3), (128, 10), (8, 2000), (3, 20000), (33, 1025), (5, 9000),
        (4000, 10), (40, 1500), (5000, 2), (999, 16), (77, 5)]


@pytest.mark.parametrize("n,c", ROWS)
def test_log_softmax(ctx, n, c):
    x = random(np.random.default_rng([29, n, c]), n, c) * 4
    ref, got = run_both(ctx, make_node("log_softmax", [x]), [x])
    assert_close(got[0], ref[0], rtol=1e-5, atol=2e-6, what=f"log_softmax {n}x{c}")


@pytest.mark.parametrize("n,c", ROWS)
def test_log_softmax_grad(ctx, n, c):
    rng = np.random.default_rng([31, n, c])
    x, dy = random(rng, n, c), random(rng, n, c)
    y = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    ref, got = run_both(ctx, make_node("log_softmax_grad", [dy, y]), [dy, y])
    scale = float(np.abs(dy).sum(axis=1).max())
    assert_close(got[0], ref[0], rtol=1e-5, atol=2e-6 * scale, what=f"log_softmax_grad {n}x{c}")


@pytest.mark.parametrize("n,c", [(5000, 2), (999, 16), (77, 5), (7, 3), (1, 1)])
def test_narrow_log_softmax_rows_give_the_warp_rows_bits(ctx, n, c, monkeypatch):
    """Rows of at most 16 columns on 1-16 lanes each, several a warp, compute what one warp a
    row computes, bit for bit, both ways (include/reduce.cuh lanes_sum, lanes_max)."""
    rng = np.random.default_rng([53, n, c])
    x, dy = random(rng, n, c) * 4, random(rng, n, c)
    y = (x - np.log(np.exp(x).sum(axis=1, keepdims=True))).astype(np.float32)
    cases = [("log_softmax", [x]), ("log_softmax_grad", [dy, y])]
    narrow = [run_both(ctx, make_node(op, ins), ins)[1][0] for op, ins in cases]
    wide = loss._row_block
    monkeypatch.setattr(loss, "_row_block", lambda cols, threads, narrow=False:
                        wide(cols, threads))
    warp = [run_both(ctx, make_node(op, ins), ins)[1][0] for op, ins in cases]
    for (op, _), a, b in zip(cases, narrow, warp):
        np.testing.assert_array_equal(a, b, err_msg=op)


@pytest.mark.parametrize("label_dtype", ["int32", "int64"])
@pytest.mark.parametrize("n,c", ROWS)
def test_cross_entropy(ctx, n, c, label_dtype):
    x, labels = logits_and_labels(n, c, label_dtype, 37)
    ref, got = run_both(ctx, make_node("cross_entropy", [x, labels]), [x, labels])
    assert_close(got[0], ref[0], rtol=2e-6, atol=0, what=f"cross_entropy loss {n}x{c}")
    assert_close(got[1], ref[1], rtol=1e-6, atol=1e-6, what=f"cross_entropy lse {n}x{c}")


@pytest.mark.parametrize("label_dtype", ["int32", "int64"])
@pytest.mark.parametrize("n,c", ROWS)
def test_cross_entropy_grad(ctx, n, c, label_dtype):
    x, labels = logits_and_labels(n, c, label_dtype, 41)
    lse = (x.max(1) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1))).astype(np.float32)
    dloss = np.array(1.7, np.float32)
    node = make_node("cross_entropy_grad", [dloss, x, lse, labels])
    ref, got = run_both(ctx, node, [dloss, x, lse, labels])
    assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6 / n, what=f"cross_entropy_grad {n}x{c}")


@pytest.mark.parametrize("label_dtype", ["int32", "int64"])
@pytest.mark.parametrize("n,c", ROWS)
def test_cross_entropy_train(ctx, n, c, label_dtype):
    x, labels = logits_and_labels(n, c, label_dtype, 43)
    ref, got = run_both(ctx, make_node("cross_entropy_train", [x, labels]), [x, labels])
    assert_close(got[0], ref[0], rtol=2e-6, atol=0, what=f"cross_entropy_train loss {n}x{c}")
    assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6 / n, what=f"cross_entropy_train dx {n}x{c}")


@pytest.mark.parametrize("n,c", [(4000, 10), (40, 1500)])
def test_cross_entropy_train_deterministic_and_capture_fallback(ctx, n, c):
    """Many blocks: the same bits every run; a capture-time call without scratch (no warm-up)
    takes the one-block path and still matches."""
    x, labels = logits_and_labels(n, c, "int64", 47)
    node = make_node("cross_entropy_train", [x, labels])
    ins = to_device(ctx, [x, labels])
    runs = []
    for _ in range(3):
        outs = poisoned(ctx, node)
        CORE_IMPLS[node.op](node, ins, outs, ctx)
        runs.append(to_host(ctx, outs))
    assert runs[0][0] == runs[1][0] == runs[2][0]
    fresh = make_node("cross_entropy_train", [x, labels])
    cold = CudaContext(stream=ctx.stream, capturing=True)
    outs = poisoned(ctx, fresh)
    CORE_IMPLS[fresh.op](fresh, ins, outs, cold)
    loss, dx = to_host(ctx, outs)
    assert_close(loss, runs[0][0], rtol=2e-6, atol=0, what="one-block fallback loss")
    assert_close(dx, runs[0][1], rtol=0, atol=0, what="one-block fallback dlogits")


@pytest.mark.parametrize("label_dtype", ["int32", "int64"])
@pytest.mark.parametrize("n,c", [(1, 1), (1, 10), (7, 3), (128, 10), (3000, 7)])
def test_nll_loss_and_grad(ctx, n, c, label_dtype):
    x, labels = logits_and_labels(n, c, label_dtype, 53)
    ref, got = run_both(ctx, make_node("nll_loss", [x, labels]), [x, labels])
    assert_close(got[0], ref[0], rtol=2e-6, atol=0, what=f"nll_loss {n}x{c}")
    dloss = np.array(0.7, np.float32)
    node = make_node("nll_loss_grad", [dloss, labels], classes=c)
    ref, got = run_both(ctx, node, [dloss, labels])
    assert_close(got[0], ref[0], rtol=0, atol=0, what=f"nll_loss_grad {n}x{c}")


# (8, 2, 128, 128): 64 blocks; (1_100_000,): the 264-block cap, threads striding
@pytest.mark.parametrize("shape", [(1,), (7, 3), (100, 33), (5, 1), (8, 2, 128, 128),
                                   (1_100_000,)])
def test_mse_and_grad(ctx, shape):
    rng = np.random.default_rng([59, *shape])
    pred, target = random(rng, *shape), random(rng, *shape)
    ref, got = run_both(ctx, make_node("mse", [pred, target]), [pred, target])
    assert_close(got[0], ref[0], rtol=2e-6, atol=0, what=f"mse {shape}")
    dloss = np.array(1.3, np.float32)
    node = make_node("mse_grad", [dloss, pred, target])
    ref, got = run_both(ctx, node, [dloss, pred, target])
    assert_close(got[0], ref[0], rtol=0, atol=0, what=f"mse_grad {shape}")


# ---- optimizer -----------------------------------------------------------------------------

def test_step_increment(ctx):
    step = np.array(41, dtype=np.int64)
    (dev,) = to_device(ctx, [step])
    CORE_IMPLS["step_increment"](make_node("step_increment", [step]), [dev], [], ctx)
    assert int(to_host(ctx, [dev])[0]) == 42


def test_record_loss_writes_the_steps_slot(ctx):
    length = 8
    history_loss = np.full(length, -1.0, np.float32)
    history_step = np.full(length, -1, np.int64)
    dev = to_device(ctx, [history_loss, history_step])
    for t, value in [(3, 1.5), (11, 2.25)]:          # step 11 lands in slot 3 again
        loss, step = np.array(value, np.float32), np.array(t, np.int64)
        ins = to_device(ctx, [loss, step]) + dev
        CORE_IMPLS["record_loss"](make_node("record_loss", [loss, step, history_loss,
                                                                 history_step]), ins, [], ctx)
    got_loss, got_step = to_host(ctx, dev)
    assert got_loss[3] == np.float32(2.25) and got_step[3] == 11
    assert (np.delete(got_step, 3) == -1).all()


def test_advance_step_matches_its_three_ops(ctx):
    length = 8
    step, vector = np.array(10, np.int64), schedules.WarmupCosine(3, 20, 1e-4).vector(0.05)
    loss = np.array(1.75, np.float32)
    hist_loss, hist_step = np.full(length, -1.0, np.float32), np.full(length, -1, np.int64)
    ins = [step, vector, loss, hist_loss, hist_step]
    node = make_node("advance_step", ins)
    want = [np.empty((), np.float32)]
    host = [a.copy() for a in ins]
    NUMPY_IMPLS["advance_step"](node, host, want, None)
    dev = to_device(ctx, ins)
    with ctx.stream:
        lr = cp.full((), np.nan, np.float32)
    CORE_IMPLS["advance_step"](node, dev, [lr], ctx)
    got = to_host(ctx, dev + [lr])
    assert int(got[0]) == 11 and int(host[0]) == 11
    assert_close(got[5], want[0], rtol=2.5e-7, atol=0, what="advance_step lr")
    np.testing.assert_array_equal(got[3], host[3])
    np.testing.assert_array_equal(got[4], host[4])
    assert got[4][11 % length] == 11 and got[3][11 % length] == np.float32(1.75)


SCHEDULES = [schedules.Constant(), schedules.StepDecay(3, 0.5), schedules.Cosine(10, 1e-4),
             schedules.WarmupCosine(3, 10, 1e-5)]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: type(s).__name__)
def test_lr_schedule(ctx, schedule):
    vector = schedule.vector(0.05)
    for t in range(0, 14):
        step = np.array(t, dtype=np.int64)
        ref, got = run_both(ctx, make_node("lr_schedule", [step, vector]), [step, vector])
        assert_close(got[0], ref[0], rtol=2.5e-7, atol=0, what=f"lr {schedule} step {t}")


@pytest.mark.parametrize("momentum,dampening,weight_decay,nesterov",
                         [(0.0, 0.0, 0.0, False), (0.9, 0.0, 0.0, False), (0.9, 0.1, 0.01, False),
                          (0.9, 0.0, 0.01, True), (0.0, 0.0, 0.05, False)])
@pytest.mark.parametrize("clip", [False, True])
def test_sgd_update(ctx, momentum, dampening, weight_decay, nesterov, clip):
    attrs = dict(momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                 nesterov=nesterov)
    n_slots = 1 if momentum else 0
    run_update_steps(ctx, CORE_IMPLS, "sgd_update", attrs, n_slots, [61, n_slots, int(clip)],
                     clip)


@pytest.mark.parametrize("decoupled,weight_decay", [(False, 0.0), (False, 0.01), (True, 0.01),
                                                    (True, 0.0)])
@pytest.mark.parametrize("clip", [False, True])
def test_adam_update(ctx, decoupled, weight_decay, clip):
    attrs = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay,
                 decoupled=decoupled)
    run_update_steps(ctx, CORE_IMPLS, "adam_update", attrs, 2, [61, 2, int(clip)], clip)


@pytest.mark.parametrize("amsgrad,maximize", [(True, False), (False, True), (True, True)])
def test_adam_update_amsgrad_maximize(ctx, amsgrad, maximize):
    attrs = dict(beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.01, decoupled=False,
                 amsgrad=amsgrad, maximize=maximize)
    run_update_steps(ctx, CORE_IMPLS, "adam_update", attrs, 2 + amsgrad,
                     [63, int(amsgrad), int(maximize)], steps=4)


@pytest.mark.parametrize("centered,momentum", [(False, 0.0), (True, 0.0), (False, 0.9),
                                               (True, 0.5)])
@pytest.mark.parametrize("clip", [False, True])
def test_rmsprop_update(ctx, centered, momentum, clip):
    """Slots: square_avg[, grad_avg][, momentum_buffer] (the kernel's s0, s1, s2)."""
    attrs = dict(alpha=0.9, eps=1e-6, weight_decay=0.02, momentum=momentum, centered=centered,
                 maximize=clip)
    n_slots = 1 + centered + (momentum > 0)
    run_update_steps(ctx, CORE_IMPLS, "rmsprop_update", attrs, n_slots,
                     [65, n_slots, int(clip)], clip, steps=4)


def test_rmsprop_update_momentum_switched_off_per_row(ctx):
    """A step built with momentum buffers whose rows say momentum 0: plain RMSprop there,
    the buffer left as it is."""
    per = lambda values: tuple(values[g] for g in GROUPS_OF_PARAMS)   # noqa: E731
    attrs = dict(alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=per([0.9, 0.0]))
    run_update_steps(ctx, CORE_IMPLS, "rmsprop_update", attrs, 2, [66], steps=3)


@pytest.mark.parametrize("lr_decay,weight_decay,maximize", [(0.0, 0.0, False),
                                                            (0.1, 0.01, False),
                                                            (0.05, 0.0, True)])
@pytest.mark.parametrize("clip", [False, True])
def test_adagrad_update(ctx, lr_decay, weight_decay, maximize, clip):
    attrs = dict(lr_decay=lr_decay, weight_decay=weight_decay, eps=1e-10, maximize=maximize)
    run_update_steps(ctx, CORE_IMPLS, "adagrad_update", attrs, 1, [67, int(clip)], clip,
                     steps=4)


def test_sgd_update_reads_hyperparameter_rows_of_a_bucket(ctx):
    """attrs hyper_rows (an overlapped bucket): parameter i reads the given row of a longer
    table, not row i."""
    per = lambda values: tuple(values[g] for g in GROUPS_OF_PARAMS)   # noqa: E731
    attrs = dict(lr_scale=per([1.0, 0.25]), momentum=per([0.9, 0.0]), dampening=0.1,
                 weight_decay=per([0.0, 0.05]), nesterov=False)
    run_update_steps(ctx, CORE_IMPLS, "sgd_update", attrs, 1, [69], rows_reversed=True)


GROUPS_OF_PARAMS = [0, 1, 0, 1, 1, 0]      # parameter -> group, for per-parameter values


def test_update_tables_must_exist_before_capture(ctx):
    p, g = random(np.random.default_rng(67), 5), random(np.random.default_rng(68), 5)
    hyper = hyperparameter_table("sgd_update", {"lr": 1.0}, 1)
    ins = [np.array(0.1, np.float32), np.array(1, np.int64), hyper, p, g]
    node = make_node("sgd_update", ins, n_params=1, n_scalars=3, n_slots=0, nesterov=False,
                     max_norm=None)
    cold = CudaContext(stream=ctx.stream, capturing=True)
    with pytest.raises(CaptureError):
        CORE_IMPLS["sgd_update"](node, to_device(ctx, ins), [], cold)
    dev = to_device(ctx, ins)
    CORE_IMPLS["sgd_update"](node, dev, [], ctx)        # eager: builds the tables
    CORE_IMPLS["sgd_update"](node, dev, [], cold)       # now found: no error


# ---- a captured graph ----------------------------------------------------------------------

def test_captured_step_replays(ctx):
    """step_increment, lr_schedule, dropout, cross_entropy_train, global_norm and adam_update
    captured once after an eager warm-up, replayed with the device counter advancing."""
    rng = np.random.default_rng(71)
    n, c = 4000, 10       # many-block cross-entropy: needs its scratch from the warm-up
    x, labels = random(rng, n, c), rng.integers(0, c, size=n).astype(np.int64)
    w = random(rng, c)
    step, vector = np.array(0, np.int64), schedules.WarmupCosine(2, 8, 1e-4).vector(0.01)
    nodes = [make_node("step_increment", [step]),
             make_node("lr_schedule", [step, vector])]
    lr = np.zeros((), np.float32)
    drop = make_node("dropout", [x, step], p=0.25, seed=9, site=1)
    xd, mask = np.zeros_like(x), np.zeros(x.shape, np.uint8)
    ce = make_node("cross_entropy_train", [xd, labels])
    loss, dx = np.zeros((), np.float32), np.zeros_like(x)
    gsum = random(rng, c)      # the parameter's gradient: fixed, the schedule still moves
    norm = np.zeros((), np.float32)
    m, v = np.zeros_like(w), np.zeros_like(w)
    hyper = hyperparameter_table("adam_update", dict(lr=1.0, beta1=0.9, beta2=0.999, eps=1e-8,
                                                     weight_decay=0.01), 1)
    upd_ins = [lr, step, hyper, norm, w, gsum, m, v]
    upd = make_node("adam_update", upd_ins, n_params=1, n_scalars=4, n_slots=2, decoupled=True,
                    max_norm=1.0)
    gn = make_node("global_norm", [gsum])

    def program(impls, arrays, ctx_):
        s, vec, lr_, x_, xd_, mask_, lab, loss_, dx_, gs, norm_, w_, m_, v_, h_ = arrays
        impls["step_increment"](nodes[0], [s], [], ctx_)
        impls["lr_schedule"](nodes[1], [s, vec], [lr_], ctx_)
        impls["dropout"](drop, [x_, s], [xd_, mask_], ctx_)
        impls["cross_entropy_train"](ce, [xd_, lab], [loss_, dx_], ctx_)
        impls["global_norm"](gn, [gs], [norm_], ctx_)
        impls["adam_update"](upd, [lr_, s, h_, norm_, w_, gs, m_, v_], [], ctx_)

    host = [step, vector, lr, x, xd, mask, labels, loss, dx, gsum, norm, w, m, v, hyper]
    dev = to_device(ctx, [a.copy() for a in host])
    program(NUMPY_IMPLS, host, None)
    program(CORE_IMPLS, dev, ctx)                     # eager warm-up
    graph = capture(ctx, lambda: program(CORE_IMPLS, dev, ctx))
    for _ in range(5):
        program(NUMPY_IMPLS, host, None)
        graph.launch(ctx.stream)
    got = to_host(ctx, dev)
    assert int(got[0]) == int(step) == 6
    np.testing.assert_array_equal(got[5], mask)
    for name, i in (("lr", 2), ("loss", 7), ("dlogits", 8), ("norm", 10), ("w", 11),
                    ("exp_avg_sq", 13)):
        assert_close(got[i], host[i], rtol=1e-5, atol=1e-7, what=f"replayed {name}")
