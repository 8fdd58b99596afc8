"""The cuda-vs-numpy harness of the op tests: nodes built from arrays, fresh random inputs,
outputs poisoned before a run, one node run through the numpy reference and through a table
of cuda launchers, and the comparisons. Test modules import it only once CuPy sees a GPU."""
from __future__ import annotations

import cupy as cp
import numpy as np

from stepgraph.ir.graph import Node, Value
from stepgraph.ir.ops import IMPLS as NUMPY_IMPLS
from stepgraph.ir.ops import OPS, infer_outputs
from stepgraph.nn import functional as F
from stepgraph.ops.optim import HYPER_COLUMNS, hyperparameter_table

# What outputs hold before a run, so that an element no kernel wrote cannot pass for a result.
POISON = {"float32": np.nan, "float64": np.nan, "int32": -7, "int64": -7, "uint8": 7}
# reduce_sum over the last axes of contiguous x (shape, axes), float32 and bf16 alike: the warp
# per row path (backends/cuda/reduce.py _sums_rows) for (B, H, W, C) over C, rows shorter than a
# warp, of odd lengths and of the longest it takes, and two last axes; the few-row ones (mid
# 15, 6) stay on the planes path, for comparison.
ROW_SUM_CASES = [((4, 16, 16, 96), (3,)), ((32768, 96), (1,)), ((1000, 7), (1,)),
                 ((600, 300), (1,)), ((520, 1024), (1,)), ((128, 4, 4, 5), (2, 3)),
                 ((3, 5, 300), (2,)), ((2, 3, 4, 5), (2, 3))]
# reduce_sum over a middle run of axes (batched column sums: reduce.py _reduced_block): H and W
# of channels-last maps, one with its rows split (float64 partials, then their in-order sum),
# the shortest kept run taken, a single middle axis; (4, 5, 6) over 1 keeps the strided path.
MIDDLE_SUM_CASES = [((8, 16, 16, 96), (1, 2)), ((2, 64, 32, 24), (1, 2)),
                    ((3, 5, 7, 16), (1, 2)), ((4, 6, 5, 20), (1,)), ((4, 5, 6), (1,))]


def random(rng, *shape, scale=1.0, shift=0.1, dtype="float32"):
    """Normal values shifted off zero, so no input is all zeros even at size 1."""
    return (rng.standard_normal(shape) * scale + shift).astype(dtype)


def make_node(op, arrays, **attrs) -> Node:
    ins = [Value(a.shape, str(a.dtype)) for a in arrays]
    outs = [Value(s, d) for s, d in infer_outputs(op, ins, attrs)]
    return Node(op, ins, outs, attrs, mutates=OPS[op].mutates(attrs))


def to_device(ctx, arrays):
    with ctx.stream:
        return [cp.asarray(a) for a in arrays]


def poisoned(ctx, node):
    with ctx.stream:
        return [cp.full(v.shape, POISON[v.dtype], v.dtype) for v in node.outputs]


def to_host(ctx, arrays):
    ctx.stream.synchronize()
    return [cp.asnumpy(a) for a in arrays]


def reference(node, arrays):
    """The numpy outputs of one node, run on copies of the inputs into poisoned outputs."""
    ref = [np.full(v.shape, POISON[v.dtype], v.dtype) for v in node.outputs]
    NUMPY_IMPLS[node.op](node, [a.copy() for a in arrays], ref, None)
    return ref


def run_cuda(ctx, node, arrays, impls):
    """The outputs of impls[node.op] on device copies of the inputs, poisoned first."""
    dev_out = poisoned(ctx, node)
    impls[node.op](node, to_device(ctx, arrays), dev_out, ctx)
    return to_host(ctx, dev_out)


def run_both(ctx, node, arrays, impls):
    """(numpy outputs, cuda outputs) of one node on copies of the same inputs; impls is the
    launcher table under test."""
    return reference(node, arrays), run_cuda(ctx, node, arrays, impls)


def assert_close(got, want, rtol=1e-5, atol=1e-6, what="", all_finite=False):
    """got is want within tolerance, with its shape and dtype and finite where want is.
    all_finite: both must be finite everywhere (families whose outputs never hold NaN)."""
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    if all_finite:
        assert np.isfinite(want).all(), f"{what}: the reference is not finite"
        assert np.isfinite(got).all(), f"{what}: not every element written (NaN left)"
    else:
        assert (np.isfinite(got) == np.isfinite(want)).all(), f"{what}: not every element written"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=what)


def rel_err(got, want) -> float:
    """The relative error of got in the 2-norm, computed in float64."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def capture(ctx, program):
    """program() captured as one CUDA graph on ctx.stream (after the caller's eager warm-up)."""
    ctx.stream.synchronize()
    ctx.capturing = True
    ctx.stream.begin_capture()
    try:
        with ctx.stream:
            program()
    finally:
        ctx.capturing = False
        graph = ctx.stream.end_capture()
    return graph


# ---- inputs shared by several op families ---------------------------------------------------

def check_replays(backend, ctx, calls, x, dy, rng, replays, check):
    """Runs `calls` ((node, host arrays) pairs) through backend.run_node once eagerly (plans,
    timing, workspace), captures them, then replays them `replays` times, each with fresh
    random x and dy copied into the same device buffers and every output poisoned with NaN:
    check(replay, node, the replay's host arrays, the node's outputs on the host) after each
    replay. Returns the captured graph."""
    host = {id(a): a for _, arrays in calls for a in arrays}
    with ctx.stream:
        dev = {key: cp.asarray(a) for key, a in host.items()}
        outs = [[cp.full(v.shape, np.nan, np.float32) for v in n.outputs] for n, _ in calls]

    def step():
        for (node, arrays), out in zip(calls, outs):
            backend.run_node(node, [dev[id(a)] for a in arrays], out, ctx)

    step()
    captured = backend.capture(step, ctx)
    for replay in range(replays):
        new_x, new_dy = random(rng, *x.shape), random(rng, *dy.shape)
        backend.copy_into(dev[id(x)], new_x)
        backend.copy_into(dev[id(dy)], new_dy)
        with ctx.stream:
            for out in outs:
                for o in out:
                    o.fill(np.nan)
        captured.launch()
        for (node, arrays), out in zip(calls, outs):
            now = [new_x if a is x else new_dy if a is dy else a for a in arrays]
            check(replay, node, now, [backend.to_numpy(o) for o in out])
    return captured


def logits_and_labels(n, c, label_dtype, seed):
    rng = np.random.default_rng([seed, n, c])
    return random(rng, n, c) * 3, rng.integers(0, c, size=n).astype(label_dtype)


def pool_input(shape, seed):
    # Values on a coarse grid so that windows hold ties: the first maximum must win.
    return np.round(random(np.random.default_rng([seed, *shape]), *shape) * 2) / 2


# ---- optimizer updates ----------------------------------------------------------------------

PARAM_SHAPES = [(3, 5), (7,), (1,), (33, 17), (4100,), (2, 3, 3, 3)]


def update_hyperparameters(op, attrs, n):
    """(the attrs of the formula, the (n, columns) float64 hyperparameters) of an update from
    one dict: the HYPER_COLUMNS values (numbers, or tuples of one per parameter; lr_scale as
    the lr column, 1.0 when absent) and the formula's attrs."""
    columns = HYPER_COLUMNS[op]
    values = {k: v for k, v in attrs.items() if k in columns}
    values["lr"] = attrs.get("lr_scale", 1.0)
    rest = {k: v for k, v in attrs.items() if k not in columns and k != "lr_scale"}
    return rest, hyperparameter_table(op, values, n)


def run_update_steps(ctx, impls, op, attrs, n_slots, seed, clip=False, steps=3,
                     rows_reversed=False):
    """`steps` updates of every parameter through numpy and impls[op], compared after each;
    the device inputs after each step. attrs: update_hyperparameters's. clip: a global-norm
    scalar and max_norm 0.5. rows_reversed: the table's rows in reverse order behind two
    unused rows, the node's attrs hyper_rows saying which is whose."""
    rng = np.random.default_rng(seed)
    n = len(PARAM_SHAPES)
    attrs, hyper = update_hyperparameters(op, attrs, n)
    if rows_reversed:
        hyper = np.concatenate([np.full((2, hyper.shape[1]), np.nan), hyper[::-1]])
        attrs = dict(attrs, hyper_rows=tuple(2 + n - 1 - i for i in range(n)))
    params = [random(rng, *s) for s in PARAM_SHAPES]
    slots = [np.zeros(s, np.float32) for _ in range(n_slots) for s in PARAM_SHAPES]
    lr, step, norm = np.array(0.05, np.float32), np.array(0, np.int64), np.array(0, np.float32)
    scalars = [lr, step, hyper] + ([norm] if clip else [])
    attrs = dict(attrs, n_params=n, n_scalars=len(scalars), n_slots=n_slots,
                 max_norm=0.5 if clip else None)
    grads = [random(rng, *s) for s in PARAM_SHAPES]
    ref_ins = scalars + params + grads + slots
    node = make_node(op, ref_ins, **attrs)
    dev_ins = to_device(ctx, [a.copy() for a in ref_ins])
    results = []
    for t in range(1, steps + 1):
        fresh = [random(rng, *s) for s in PARAM_SHAPES]          # new grads every step
        new_scalars = [np.array(0.05 / t, np.float32), np.array(t, np.int64), None]
        if clip:
            new_scalars.append(np.array(np.sqrt(sum((g.astype(np.float64) ** 2).sum()
                                                    for g in fresh)), np.float32))
        for i, a in enumerate(new_scalars + [None] * n + fresh):
            if a is not None:
                ref_ins[i][...] = a
                dev_ins[i].set(a, stream=ctx.stream)
        NUMPY_IMPLS[op](node, ref_ins, [], None)
        impls[op](node, dev_ins, [], ctx)
        got = to_host(ctx, dev_ins)
        for i, (g, r) in enumerate(zip(got, ref_ins)):
            assert_close(g, r, rtol=1e-6, atol=1e-7, what=f"{op} step {t} input {i}")
        results.append(got)
    return results


def ce_smooth(logits, y):
    """The vision workloads' loss: cross-entropy with label smoothing 0.2."""
    return F.cross_entropy(logits, y, label_smoothing=0.2)


def image_batches(n, batch=16, size=16, seed=0):
    """n (images (batch, 3, size, size), labels of 10 classes) pairs in host memory."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, 3, size, size), dtype=np.float32),
             rng.integers(0, 10, batch)) for _ in range(n)]
