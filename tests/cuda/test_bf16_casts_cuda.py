"""The kernels that take over the casts compile/fuse.py drops at precision="bf16": the
updates, global_norm and guard_check reading bf16 gradients (fuse_gradient_casts),
cross_entropy_train reading bf16 logits and writing bf16 dlogits (fuse_loss_casts), and
layer_norm writing a bf16 y, layer_norm_grad reading a bf16 dy (fuse_layer_norm_casts).
Widening bf16 to float32 is exact and a cast rounds once, so each must give the bits of its
float32 kernel between the casts: what reads a bf16 input, the float32 kernel's results on the
widened input; what writes a bf16 output, the float32 kernel's output rounded to bf16. The
whole bf16 steps that run these are in test_bf16_cuda.py, test_bf16_conv_cuda.py and
test_bf16_attention_cuda.py (gpt)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

from stepgraph.backends.cuda import guards, layer_norm, optim, reduce  # noqa: E402
from stepgraph.backends.cuda.loss import cross_entropy_train  # noqa: E402
from stepgraph.backends.numpy import bf16  # noqa: E402
from stepgraph.ir.graph import Node  # noqa: E402
from stepgraph.ops.guard import GUARD_GRADS  # noqa: E402
from tests.cuda.helpers import update_hyperparameters  # noqa: E402
from tests.ops.helpers import seeded  # noqa: E402


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("bf16")


def _update(ctx, op, params, grads, n_slots, attrs):
    """Runs `op` over copies of params (float32) with `grads` (float32 or bf16 bits) and zero
    slots; returns the parameters and slots after."""
    attrs, hyper = update_hyperparameters(op, attrs, len(params))
    with ctx.stream:
        ins = [cp.asarray(np.float32(1e-2)), cp.asarray(np.int64(2)), cp.asarray(hyper)]
        ins += [cp.asarray(p) for p in params] + [cp.asarray(g) for g in grads]
        ins += [cp.zeros(p.shape, np.float32) + 0.25 for _ in range(n_slots) for p in params]
    node = Node(op, [], [], dict(n_params=len(params), n_scalars=3, n_slots=n_slots,
                                 max_norm=None, **attrs))
    getattr(optim, op)(ctx, node, ins)
    ctx.stream.synchronize()
    return [cp.asnumpy(a) for a in ins[3:3 + len(params)] + ins[3 + 2 * len(params):]]


@pytest.mark.parametrize("op", ["sgd_update", "adam_update"])
def test_update_with_bf16_gradients_equals_the_widened_float32_ones(ctx, op):
    rng = seeded(f"bf16 grads {op}")
    # four a thread (aligned, a multiple of 4), the element loop (10, 7 x 3)
    shapes = [(64, 32), (10,), (7, 3)]
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [bf16.to_bits(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    attrs = (dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
             if op == "adam_update" else
             dict(momentum=0.9, dampening=0.0, weight_decay=1e-4, nesterov=True))
    n_slots = 2 if op == "adam_update" else 1
    got = _update(ctx, op, params, grads, n_slots, attrs)
    want = _update(ctx, op, params, [bf16.from_bits(g) for g in grads], n_slots, attrs)
    assert any(not np.array_equal(g, p) for g, p in zip(got, params))      # it moved
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_global_norm_of_bf16_gradients_equals_that_of_the_widened_ones(ctx):
    rng = seeded("bf16 norm")
    shapes = [(64, 32), (13,), (7, 3)]            # vector loads; the element loop
    grads = [bf16.to_bits(rng.standard_normal(s).astype(np.float32)) for s in shapes]
    plain = rng.standard_normal((5,)).astype(np.float32)     # a float32 gradient beside them

    def norm(tensors):
        with ctx.stream:
            out = cp.full((), np.nan, np.float32)
            ins = [cp.asarray(t) for t in tensors]
        reduce.global_norm_forward(ctx, Node("global_norm", [], [], {}), ins, out)
        ctx.stream.synchronize()
        return float(out)

    got = norm(grads + [plain])
    assert np.isfinite(got) and got == norm([bf16.from_bits(g) for g in grads] + [plain])


@pytest.mark.parametrize("bad", [None, 0x7F80, 0xFF80, 0x7FC0])   # finite, +Inf, -Inf, NaN
@pytest.mark.parametrize("size", [4096, 13])                     # vector loads, element loop
def test_guard_check_finds_nan_and_inf_in_bf16_gradients(ctx, bad, size):
    rng = seeded("bf16 guard")
    grad = bf16.to_bits(rng.standard_normal(size).astype(np.float32))
    if bad is not None:
        grad[size // 2 + 1] = bad
    with ctx.stream:
        flags = cp.zeros(2, np.int32)
        ins = [flags, cp.asarray(np.float32(1.0)), cp.zeros(8, np.float32), cp.asarray(grad)]
    guards.guard_check(ctx, Node("guard_check", [], [], dict(classes=None)), ins)
    ctx.stream.synchronize()
    assert int(flags[0]) == (0 if bad is None else GUARD_GRADS)


@pytest.mark.parametrize("n, c", [(64, 10), (300, 65), (4000, 65)])   # short; one block; grid
@pytest.mark.parametrize("smoothing, ignore", [(0.0, -100), (0.1, 3)])
def test_cross_entropy_train_on_bf16_logits(ctx, n, c, smoothing, ignore):
    rng = seeded(f"bf16 ce {n} {c}")
    logits = bf16.to_bits((3 * rng.standard_normal((n, c))).astype(np.float32))
    labels = rng.integers(0, c, n).astype(np.int64)
    if ignore >= 0:
        labels[::7] = ignore

    def run(x, dx_poison):
        with ctx.stream:
            loss = cp.full((), np.nan, np.float32)
            dx = cp.full((n, c), dx_poison)           # a NaN of the dtype (0x7FA1: bf16's)
            xs, ys = cp.asarray(x), cp.asarray(labels)
        cross_entropy_train(ctx, Node("cross_entropy_train", [], [], {}), xs, ys, loss, dx,
                            smoothing, ignore)
        ctx.stream.synchronize()
        return float(loss), cp.asnumpy(dx)

    loss16, dx16 = run(logits, np.uint16(0x7FA1))
    loss32, dx32 = run(bf16.from_bits(logits), np.float32(np.nan))
    assert np.isfinite(loss32) and loss16 == loss32
    np.testing.assert_array_equal(dx16, bf16.to_bits(dx32))


@pytest.mark.parametrize("c", [384, 33, 8196])          # float4 registers; one a thread; loop
def test_layer_norm_with_a_bf16_y_and_dy(ctx, c):
    """The forward's bf16 y is its float32 y rounded once; the backward on a bf16 dy gives the
    float32 backward's dx, dweight and dbias on the widened dy, bit for bit."""
    rng = seeded(f"bf16 layer norm {c}")
    rows = 40
    x = (rng.standard_normal((rows, c)) * 2 + 0.5).astype(np.float32)
    w, b = (rng.standard_normal(c).astype(np.float32) for _ in range(2))
    dy = bf16.to_bits(rng.standard_normal((rows, c)).astype(np.float32))

    def forward(y_dtype, poison):
        with ctx.stream:
            xs, ws, bs = cp.asarray(x), cp.asarray(w), cp.asarray(b)
            y = cp.full((rows, c), poison, y_dtype)
            mean, rstd = cp.empty(rows, np.float32), cp.empty(rows, np.float32)
        layer_norm.layer_norm_forward(ctx, xs, ws, bs, y, mean, rstd, 1e-5)
        ctx.stream.synchronize()
        return cp.asnumpy(y), mean, rstd

    y16, mean, rstd = forward(np.uint16, np.uint16(0x7FA1))
    y32, _, _ = forward(np.float32, np.float32(np.nan))
    np.testing.assert_array_equal(y16, bf16.to_bits(y32))

    def backward(d):
        node = Node("layer_norm_grad", [], [], {})
        with ctx.stream:
            dx = cp.full((rows, c), np.nan, np.float32)
            dw, db = cp.full(c, np.nan, np.float32), cp.full(c, np.nan, np.float32)
            ins = cp.asarray(d), cp.asarray(x), cp.asarray(w)
        layer_norm.layer_norm_backward(ctx, node, ins[0], ins[1], ins[2], mean, rstd, dx, dw, db)
        ctx.stream.synchronize()
        return [cp.asnumpy(a) for a in (dx, dw, db)]

    got, want = backward(dy), backward(bf16.from_bits(dy))
    assert np.isfinite(want[0]).all()
    for g, wnt in zip(got, want):
        np.testing.assert_array_equal(g, wnt)


@pytest.mark.parametrize("c", [384, 33, 8196])          # float4 registers; one a thread; loop
@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm", "rms_norm"])
@pytest.mark.parametrize("half", [np.uint16, np.float16], ids=["bf16", "fp16"])
def test_norm_grads_store_dx_in_half_beside_or_alone(ctx, c, op, half):
    """compile/norm_casts.py: the backward's half dx (the node's dx_half copy beside the
    float32 dx, or a half dx in its place) is its float32 dx rounded once, as the cast it
    replaces; the float32 dx, dweight and dbias are the plain kernel's, bit for bit."""
    rng = seeded(f"norm grad half dx {op} {c}")
    rows = 40
    x = (rng.standard_normal((rows, c)) * 2 + 0.5).astype(np.float32)
    w, dy, ds = (rng.standard_normal(s).astype(np.float32) for s in (c, (rows, c), (rows, c)))
    mean = x.mean(axis=1, dtype=np.float32)
    rstd = (1 / np.sqrt(x.var(axis=1) + 1e-5)).astype(np.float32)
    poison = np.uint16(0x7FA1) if half is np.uint16 else np.float16(np.nan)

    def backward(dx_dtype, copy: bool):
        node = Node(f"{op}_grad", [], [], {})
        with ctx.stream:
            ins = [cp.asarray(a) for a in (dy, x, w, mean, rstd, ds)]
            dx = cp.full((rows, c), np.nan if dx_dtype == np.float32 else poison, dx_dtype)
            dw = cp.full(c, np.nan, np.float32)
            dx_half = cp.full((rows, c), poison, half) if copy else None
        if op == "rms_norm":
            layer_norm.rms_norm_backward(ctx, node, ins[0], ins[1], ins[2], ins[4], dx, dw,
                                         dx_half=dx_half)
        else:
            layer_norm.layer_norm_backward(ctx, node, *ins[:5], dx, dw,
                                           ds=ins[5] if op == "add_layer_norm" else None,
                                           dx_half=dx_half)
        ctx.stream.synchronize()
        return [None if a is None else cp.asnumpy(a) for a in (dx, dw, dx_half)]

    dx32, dw32, _ = backward(np.float32, False)
    assert np.isfinite(dx32).all() and np.isfinite(dw32).all()
    rounded = bf16.to_bits(dx32) if half is np.uint16 else dx32.astype(np.float16)
    dx, dw, copy = backward(np.float32, True)
    np.testing.assert_array_equal(dx, dx32)
    np.testing.assert_array_equal(dw, dw32)
    np.testing.assert_array_equal(copy, rounded)
    alone, dw, _ = backward(half, False)
    np.testing.assert_array_equal(alone, rounded)
    np.testing.assert_array_equal(dw, dw32)


@pytest.mark.parametrize("c", [384, 33, 8196])          # float4 registers; one a thread; loop
def test_layer_norm_reads_a_bf16_x(ctx, c):
    """compile/norm_casts.py fuse_norm_input_casts: layer_norm and layer_norm_grad on a bf16
    x (float32 parameters) give, bit for bit, what they give on that x widened to float32
    (the cast they replace): y, mean, rstd, dx, dweight and dbias."""
    rng = seeded(f"bf16 x layer norm {c}")
    rows = 40
    x16 = bf16.to_bits((rng.standard_normal((rows, c)) * 2 + 0.5).astype(np.float32))
    w, b = (rng.standard_normal(c).astype(np.float32) for _ in range(2))
    dy = rng.standard_normal((rows, c)).astype(np.float32)

    def run(x):
        node = Node("layer_norm_grad", [], [], {})
        with ctx.stream:
            xs, ws, bs, dys = (cp.asarray(a) for a in (x, w, b, dy))
            y = cp.full((rows, c), np.nan, np.float32)
            mean, rstd = cp.full(rows, np.nan, np.float32), cp.full(rows, np.nan, np.float32)
            dx = cp.full((rows, c), np.nan, np.float32)
            dw, db = cp.full(c, np.nan, np.float32), cp.full(c, np.nan, np.float32)
        layer_norm.layer_norm_forward(ctx, xs, ws, bs, y, mean, rstd, 1e-5)
        layer_norm.layer_norm_backward(ctx, node, dys, xs, ws, mean, rstd, dx, dw, db)
        ctx.stream.synchronize()
        return [cp.asnumpy(a) for a in (y, mean, rstd, dx, dw, db)]

    got, want = run(x16), run(bf16.from_bits(x16))
    assert all(np.isfinite(a).all() for a in want)
    for g, wnt in zip(got, want):
        np.testing.assert_array_equal(g, wnt)
