"""Index arithmetic of the gathers that divide by launch-fixed sizes (include/divide.cuh),
followed here in integers: the multi-tensor permute tables (broadcast.py permute_row,
include/permute.cuh) and the strided kernels' layout arguments (Layout.args, broadcast.cu
strided_offsets). Every division by a size equals Python's for every index the kernels take,
and every element reads the source element numpy puts there."""
from __future__ import annotations

import numpy as np
import pytest

from stepgraph.backends.cuda.broadcast import (PERMUTE_ENTRY_WIDTH, broadcast_strides, collapse,
                                               division_magic, permute_row)
from stepgraph.errors import ShapeError

LIMIT = 2**31      # the kernels' indices and divisors stay below it


def divide(n: int, m: int, l: int) -> int:
    """divide.cuh's (__umulhi(n, m) + n) >> l, with its 32-bit ranges checked."""
    t = (n * m) >> 32
    assert 0 <= m < 2**32 and t + n < 2**32
    return (t + n) >> l


def test_division_is_exact_for_every_kernel_index():
    rng = np.random.default_rng(0)
    divisors = {1, 2, 3, 5, 7, 9, 49, 58, 116, 232, 1000, 4096, 4097, 65535, LIMIT - 1,
                *(2**k + e for k in range(1, 31) for e in (-1, 0, 1) if 2**k + e < LIMIT),
                *rng.integers(1, LIMIT, 300).tolist()}
    for d in sorted(divisors):
        m, l = division_magic(d)
        numerators = {0, 1, d - 1, d, d + 1, 2 * d - 1, LIMIT - 1, LIMIT - 2,
                      (LIMIT - 1) // d * d, (LIMIT - 1) // d * d - 1,
                      *rng.integers(0, LIMIT, 200).tolist()}
        for n in numerators:
            if 0 <= n < LIMIT:
                assert divide(n, m, l) == n // d, (n, d)


def test_divisors_outside_the_kernels_range_are_refused():
    for d in (0, -3, LIMIT):
        with pytest.raises(ShapeError):
            division_magic(d)


def gathered_offsets(row: list[int]) -> list[int]:
    """permute_chunk's source offset of each destination element of `row`."""
    n, (o1, o2, o3), (s0, s1, s2, s3) = row[2], row[3:6], row[6:10]
    m3, l3, m2, l2, m1, l1 = row[10:16]
    offsets = []
    for i in range(n):
        q3 = divide(i, m3, l3)
        q2 = divide(q3, m2, l2)
        i0 = divide(q2, m1, l1)
        offsets.append(i0 * s0 + (q2 - i0 * o1) * s1 + (q3 - q2 * o2) * s2 + (i - q3 * o3) * s3)
    return offsets


@pytest.mark.parametrize("shape, dims", [
    ((16, 3, 7, 7), (0, 2, 3, 1)),       # a conv weight to channels-last
    ((16, 7, 7, 3), (0, 3, 1, 2)),       # its gradient back
    ((58, 58, 3, 3), (0, 2, 3, 1)),
    ((5, 7), (1, 0)),
    ((2, 3, 4), (2, 0, 1)),
    ((6,), (0,)),
    ((1, 1, 1, 1), (3, 2, 1, 0)),
])
def test_rows_gather_numpys_transpose(shape, dims):
    strides = [int(s) // 4 for s in np.zeros(shape, np.float32).strides]
    row = permute_row(1000, 2000, shape, strides, dims)
    assert len(row) == PERMUTE_ENTRY_WIDTH and row[:2] == [1000, 2000]
    want = np.arange(int(np.prod(shape))).reshape(shape).transpose(dims).ravel()
    assert gathered_offsets(row) == want.tolist()


def test_rows_of_more_than_four_dims_are_refused():
    with pytest.raises(ShapeError, match="at most 4"):
        permute_row(0, 0, (1, 2, 3, 4, 5), (120, 60, 20, 5, 1), (4, 3, 2, 1, 0))


def strided_offsets(i: int, args: tuple, ndim: int, operand: int) -> int:
    """broadcast.cu strided_offsets over Layout.args(): sizes, multipliers, shifts, then each
    operand's strides, MAX_DIMS apiece."""
    sizes, m, l = args[0:6], args[6:12], args[12:18]
    strides = args[18 + 6 * operand: 24 + 6 * operand]
    offset = 0
    for d in range(ndim - 1, 0, -1):
        q = divide(i, int(m[d]), int(l[d]))
        offset += (i - q * int(sizes[d])) * int(strides[d])
        i = q
    return offset + i * int(strides[0])


@pytest.mark.parametrize("shape, dims", [((4, 5, 6), (2, 0, 1)), ((3, 58, 7, 7), (0, 2, 3, 1)),
                                         ((2, 3, 4, 5, 6), (4, 1, 3, 0, 2))])
def test_layout_args_give_the_strided_kernels_their_offsets(shape, dims):
    """A permute read through collapse(): each output element's input offset, and a broadcast
    operand's, as numpy has them."""
    x = np.arange(int(np.prod(shape))).reshape(shape)
    y = x.transpose(dims)
    elem = [s // x.itemsize for s in x.strides]
    bias = np.arange(y.shape[-1])                  # broadcast along every outer dim
    layout = collapse(y.shape, [tuple(elem[d] for d in dims), broadcast_strides(bias.shape,
                                                                                y.shape)])
    args = layout.args()
    assert len(args) == 18 + 6 * 2
    got = [[strided_offsets(i, args, len(layout.sizes), k) for i in range(y.size)]
           for k in (0, 1)]
    assert got[0] == y.ravel().tolist()
    assert got[1] == np.broadcast_to(bias, y.shape).ravel().tolist()
