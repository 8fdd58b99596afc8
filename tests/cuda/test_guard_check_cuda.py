"""guard_check_kernel (guard.cu) on its own: float32, bf16 and float16 gradients of sizes
around its chunk (guards.py GUARD_CHUNK) and its 16-byte loads, 16-byte aligned and not, each
with one bad value placed in a vector load, in a ragged tail, in the last chunk or not at all.
The flags must hold exactly the gradients' bit (or the loss's), and a clean table none."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

from stepgraph.backends.cuda.guards import GUARD_CHUNK  # noqa: E402
from stepgraph.backends.numpy import bf16  # noqa: E402
from stepgraph.ir.graph import Node, Value  # noqa: E402
from stepgraph.ir.ops import OPS  # noqa: E402
from stepgraph.ops.guard import GUARD_GRADS, GUARD_LOSS  # noqa: E402
from tests.ops.helpers import seeded  # noqa: E402

SIZES = [1, 7, 8, 9, GUARD_CHUNK - 1, GUARD_CHUNK, GUARD_CHUNK + 3, 3 * GUARD_CHUNK + 8]
# values whose square is not finite in float32 (the last finite in bf16 and float32 alike);
# float16 cannot hold a finite one, so its overflow is Inf
BAD = {"nan": np.nan, "inf": -np.inf, "square": 3e19}


def storage(values: np.ndarray, dtype: str) -> np.ndarray:
    return bf16.to_bits(values) if dtype == "bfloat16" else values.astype(dtype)


def gradient_on_device(values: np.ndarray, dtype: str, offset: int) -> cp.ndarray:
    """`values` stored as dtype, starting `offset` elements into a fresh buffer (offset 1:
    not 16-byte aligned, so the kernel takes its element-by-element path)."""
    host = storage(values, dtype)
    buffer = cp.zeros(host.size + offset, host.dtype)
    buffer[offset:] = cp.asarray(host)
    return buffer[offset:]


def check(backend, ctx, grads: list[cp.ndarray], loss: float = 1.0) -> int:
    cp.cuda.Stream.null.synchronize()    # the gradients were written on the default stream
    with ctx.stream:
        ins = [cp.zeros(2, np.int32), cp.asarray(np.float32(loss)), *grads]
    values = [Value(tuple(a.shape), "bfloat16" if a.dtype == np.uint16 else str(a.dtype))
              for a in ins]
    node = Node("guard_check", values, [], {}, OPS["guard_check"].mutates({}))
    backend.impls["guard_check"](node, ins, [], ctx)
    ctx.stream.synchronize()
    return int(ins[0][0].get())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("offset", [0, 1])
def test_one_bad_value_anywhere_is_flagged(backend, ctx, dtype, offset):
    rng = seeded(f"guard check {dtype} {offset}")
    for size in SIZES:
        clean = rng.standard_normal(size).astype(np.float32)
        others = [gradient_on_device(rng.standard_normal(s).astype(np.float32), dtype, 0)
                  for s in (5, GUARD_CHUNK + 1)]
        assert check(backend, ctx, [*others, gradient_on_device(clean, dtype, offset)]) == 0
        for at in sorted({0, size // 2, size - 1, max(0, size - 9)}):
            for name, bad in BAD.items():
                values = clean.copy()
                values[at] = bad if dtype != "float16" or name != "square" else np.inf
                got = check(backend, ctx, [others[0], gradient_on_device(values, dtype, offset),
                                           others[1]])
                assert got == GUARD_GRADS, (size, at, name)


def test_loss_and_gradients_flag_their_own_bits(backend, ctx):
    grads = [gradient_on_device(np.ones(GUARD_CHUNK + 5, np.float32), "float32", 0)]
    assert check(backend, ctx, grads, loss=np.nan) == GUARD_LOSS
    grads[0][-1] = np.inf
    assert check(backend, ctx, grads, loss=np.inf) == GUARD_LOSS | GUARD_GRADS
