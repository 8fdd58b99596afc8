"""Dependent launches (runtime/dependent_launch.py) are safe only where every kernel waits for
the one before it before touching memory: every kernel stepgraph compiles, from its .cu files
and from generated sources, opens with await_previous_kernel() (include/launch_order.cuh).
Also the launch's argument packing, which must pass each value as CuPy's launch does. No GPU
needed."""
from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from stepgraph.backends.cuda.runtime import compiler
from stepgraph.compile.fuse import fuse
from stepgraph.compile.pointwise import fuse_pointwise
from stepgraph.ir.trace import Tracer
from tests.unit.test_pointwise_views import sum_graph

WAIT = "await_previous_kernel();"


def kernel_bodies(source: str) -> list[tuple[str, str]]:
    """(signature, body text from its opening brace on) of each __global__ function defined
    in `source` (declarations and comments skipped)."""
    found = []
    for match in re.finditer(r"__global__", source):
        line = source[source.rfind("\n", 0, match.start()) + 1:match.start()]
        if "//" in line:
            continue
        depth, j = 0, match.end()
        while not (depth == 0 and source[j] in "{;"):
            depth += {"(": 1, ")": -1}.get(source[j], 0)
            j += 1
        if source[j] == "{":
            found.append((source[match.start():j], source[j + 1:]))
    return found


def assert_every_kernel_waits_first(source: str, where: str) -> int:
    kernels = kernel_bodies(source)
    for signature, body in kernels:
        first = body.lstrip().split("\n", 1)[0].strip()
        assert first == WAIT, f"{where}: {' '.join(signature.split())[:120]} opens with {first!r}"
    if kernels:
        assert '#include "launch_order.cuh"' in source, where
    return len(kernels)


def test_every_kernel_file_waits_for_the_previous_kernel_first():
    count = sum(assert_every_kernel_waits_first(path.read_text(), path.name)
                for path in compiler.kernel_sources())
    assert count > 150


def test_the_parser_sees_a_kernel_that_does_not_wait():
    source = '#include "launch_order.cuh"\n__global__ void k(int* x) {\n    x[0] = 1;\n}\n'
    with pytest.raises(AssertionError, match="opens with 'x\\[0\\] = 1;'"):
        assert_every_kernel_waits_first(source, "sample")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generated_pointwise_kernels_wait_first(dtype):
    """Both kernels of a program (one element a thread, four a thread) and the row sums'."""
    from stepgraph.backends.cuda import pointwise

    t = Tracer()
    x, y = (t.input((4, 8), dtype, name) for name in ("x", "y"))
    t.graph.outputs = {"y": (x.masked_fill(x > 0.5, 0.0) * y).value}
    (node,) = fuse_pointwise(t.graph).nodes
    (source, _), *_ = pointwise.generated_kernels(node)
    assert assert_every_kernel_waits_first(source, "pointwise") == 2


def test_the_row_sums_and_the_host_gate_wait_first():
    from stepgraph.backends.cuda import pointwise_sum
    from stepgraph.backends.cuda.runtime import host_gate

    (node,) = fuse(sum_graph()).nodes          # one pointwise_sum node
    assert assert_every_kernel_waits_first(pointwise_sum._source(node), "sum") == 1
    assert assert_every_kernel_waits_first(host_gate.SOURCE, "host gate") == 1


def packed(value) -> bytes:
    from stepgraph.backends.cuda.runtime.dependent_launch import _argument

    held = _argument(value)
    return ctypes.string_at(ctypes.addressof(held), ctypes.sizeof(held))


def test_arguments_are_packed_as_cupy_packs_them():
    assert packed(np.int32(-7)) == np.int32(-7).tobytes()
    assert packed(np.float32(0.1)) == np.float32(0.1).tobytes()
    assert packed(np.int64(2**40)) == np.int64(2**40).tobytes()
    assert packed(np.float64(1.5)) == np.float64(1.5).tobytes()
    assert packed(np.uint16(0x3F80)) == np.uint16(0x3F80).tobytes()
    assert packed(3) == np.int64(3).tobytes()                 # a Python int: int64
    assert packed(0.25) == np.float64(0.25).tobytes()         # a Python float: float64
    assert packed(True) == b"\x01" and packed(np.bool_(False)) == b"\x00"
    assert packed(None) == bytes(8)                            # a null pointer
    with pytest.raises(TypeError, match="str cannot be passed"):
        packed("x")


def test_grids_and_blocks_take_cudas_three_dimensions():
    from stepgraph.backends.cuda.runtime.dependent_launch import _dims

    assert list(_dims((7,))) == [7, 1, 1] and list(_dims(5)) == [5, 1, 1]
    assert list(_dims((np.int64(3), 4))) == [3, 4, 1] and list(_dims([2, 3, 4])) == [2, 3, 4]
