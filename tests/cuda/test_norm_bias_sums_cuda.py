"""The norm gradients' column sum of the dx copy they store (ops/layer_norm.py attrs dx_sum,
compile/norm_casts.py fuse_norm_grad_bias_sums: the bias gradient of the Linear before the
norm), summed per block in float32 (shared memory, or the block's own partial row) and added
over the blocks in float64 by the finalize: within float32 accumulation of the float64 sum of
the copy's stored values, rounded once to the copy's dtype; the same bits on a second launch;
and every other output the bits of the same launch without the sum."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

from stepgraph.backends.cuda import layer_norm  # noqa: E402
from stepgraph.backends.numpy import bf16  # noqa: E402
from stepgraph.ir.graph import Node  # noqa: E402
from tests.ops.helpers import seeded  # noqa: E402

# float4 registers, 8 row lanes a block; one float a thread; 2 row lanes; one row lane too wide
# for the kernel's shared sums (a column kernel sums the copy after); the loop kernel
WIDTHS = [384, 33, 2048, 6144, 8196]
# the copy the gradient stores last: dx itself, a half dx_half beside it (through a dropout's
# gradient too), or a bf16 dx alone
COPIES = ["float32", "bf16", "fp16", "dropped bf16", "bf16 alone"]
STORAGE = {"float32": np.float32, "bf16": np.uint16, "fp16": np.float16}
RESOLUTION = {"float32": 2.0 ** -23, "bf16": 2.0 ** -8, "fp16": 2.0 ** -10}   # one ulp


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("bf16")


def _values(a: np.ndarray) -> np.ndarray:
    return (bf16.from_bits(a) if a.dtype == np.uint16 else a).astype(np.float64)


def _backward(ctx, op: str, copy: str, arrays: dict, with_sum: bool, params: bool = True):
    """Every output of one launch of op's gradient (dx, dweight, dbias, the half copy, dsum),
    each poisoned first; None where not asked."""
    rows, c = arrays["dy"].shape
    kind = copy.split()[-1] if copy != "bf16 alone" else "bf16"
    half = STORAGE[kind] if copy not in ("float32", "bf16 alone") else None
    with ctx.stream:
        ins = {k: cp.asarray(v) for k, v in arrays.items()}
        dx = cp.full((rows, c), np.nan, np.float32) if copy != "bf16 alone" else \
            cp.full((rows, c), 0x7FA1, np.uint16)
        dx_half = None if half is None else cp.full((rows, c), 0x7FA1, half) \
            if half is np.uint16 else cp.full((rows, c), np.nan, half)
        dw = cp.full(c, np.nan, np.float32) if params else None
        db = cp.full(c, np.nan, np.float32) if params and "rms" not in op else None
        sum_dtype = STORAGE[kind]
        dsum = cp.full(c, 0x7FA1 if sum_dtype == np.uint16 else np.nan, sum_dtype) \
            if with_sum else None
    drop = layer_norm.HalfDropout(ins["mask"], 0.25) if copy.startswith("dropped") else None
    ds = ins["ds"] if op.startswith("add_") else None
    node = Node(f"{op}_grad", [], [], {})
    if "rms" in op:
        layer_norm.rms_norm_backward(ctx, node, ins["dy"], ins["x"], ins["w"], ins["rstd"], dx,
                                     dw, dx_half, ds=ds, half_dropout=drop, dsum=dsum)
    else:
        layer_norm.layer_norm_backward(ctx, node, ins["dy"], ins["x"], ins["w"], ins["mean"],
                                       ins["rstd"], dx, dw, db, ds=ds, dx_half=dx_half,
                                       half_dropout=drop, dsum=dsum)
    ctx.stream.synchronize()
    return [None if a is None else cp.asnumpy(a) for a in (dx, dw, db, dx_half, dsum)]


def _inputs(test_id: str, rows: int, c: int) -> dict:
    rng = seeded(test_id)
    x = (rng.standard_normal((rows, c)) * 2 + 0.5).astype(np.float32)
    return dict(dy=rng.standard_normal((rows, c)).astype(np.float32), x=x,
                w=rng.standard_normal(c).astype(np.float32),
                mean=x.mean(axis=1, dtype=np.float32),
                rstd=(1 / np.sqrt(x.var(axis=1) + 1e-5)).astype(np.float32),
                ds=rng.standard_normal((rows, c)).astype(np.float32),
                mask=(rng.random((rows, c)) >= 0.25).astype(np.uint8))


def _assert_sum_of(dsum: np.ndarray, stored: np.ndarray, kind: str) -> None:
    values = _values(stored)
    exact = values.sum(axis=0)
    bound = RESOLUTION[kind] * np.abs(exact) + 2.0 ** -18 * np.abs(values).sum(axis=0)
    got = _values(dsum)
    assert np.isfinite(got).all()
    worst = np.max(np.abs(got - exact) / bound)
    assert worst <= 1.0, f"column sum off by {worst:.3g} x its bound"


@pytest.mark.parametrize("copy", COPIES)
@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("c", WIDTHS)
def test_norm_grad_sums_the_copy_it_stores(ctx, c, op, copy):
    rows = 4000 if c <= 2048 else 600         # several rows a row lane in every block
    arrays = _inputs(f"norm bias sum {op} {c} {copy}", rows, c)
    plain = _backward(ctx, op, copy, arrays, with_sum=False)
    summed = _backward(ctx, op, copy, arrays, with_sum=True)
    for got, want in zip(summed[:4], plain[:4]):
        if want is not None:
            np.testing.assert_array_equal(got, want)
    stored = summed[3] if summed[3] is not None else summed[0]
    _assert_sum_of(summed[4], stored, copy.split()[-1] if copy != "bf16 alone" else "bf16")
    np.testing.assert_array_equal(_backward(ctx, op, copy, arrays, with_sum=True)[4],
                                  summed[4])


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_the_sum_alone_without_weight_or_bias_gradients(ctx, op):
    """The finalize's one table is then the sum's."""
    arrays = _inputs(f"norm bias sum alone {op}", 3000, 384)
    _, _, _, copy, dsum = _backward(ctx, op, "bf16", arrays, with_sum=True, params=False)
    _assert_sum_of(dsum, copy, "bf16")
