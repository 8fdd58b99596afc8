"""cuda vs numpy for the cast family (precision="bf16"): float32 -> bfloat16 and back, bit for
bit, on fresh random values at several scales plus every special case of the rounding rule
(ties both ways, the overflow edge, subnormals, signed zeros, infinities, NaN), at sizes that
take the four-a-thread path and sizes that do not; outputs poisoned first."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

from stepgraph.backends.cuda import cast  # noqa: E402
from stepgraph.backends.numpy import bf16  # noqa: E402
from tests.ops.helpers import seeded  # noqa: E402

SPECIAL_BITS = np.array([0x00000000, 0x80000000, 0x3F808000, 0x3F818000, 0x3F808001,
                         0x3F80FFFF, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00000001,
                         0x00008000, 0x00018000, 0x807FFFFF, 0x7F800000, 0xFF800000,
                         0x7FC00000, 0xFFC00001, 0x7F800001], dtype=np.uint32)


def values(test_id: str, n: int) -> np.ndarray:
    rng = seeded(test_id)
    x = rng.standard_normal(n).astype(np.float32) * np.float32(10.0) ** rng.integers(
        -40, 37, n).astype(np.float32)
    x[:len(SPECIAL_BITS)] = SPECIAL_BITS[:n].view(np.float32)
    return x


@pytest.mark.parametrize("n", [4096, 4099, 18, 1])
def test_cast_to_bf16_and_back_matches_the_numpy_bits(ctx, n, request):
    x = values(request.node.name, n)
    want = bf16.to_bits(x)
    with ctx.stream:
        y = cp.full(n, 0x1234, dtype=cp.uint16)                  # poison
        back = cp.full(n, np.nan, dtype=cp.float32)
        cast.cast_forward(ctx, cp.asarray(x), y, "float32", "bfloat16")
        cast.cast_forward(ctx, y, back, "bfloat16", "float32")
    ctx.stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(y), want)
    np.testing.assert_array_equal(cp.asnumpy(back).view(np.uint32),
                                  bf16.from_bits(want).view(np.uint32))
