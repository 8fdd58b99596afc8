"""pointwise_sum (ops/pointwise.py, compile/pointwise_sums.py) as one generated kernel.

A warp per row, as reduce_sum's rows kernel (reduce.cu reduce_sum_rows_kernel): lane l
computes the prologue program at columns l, l + 32, ... and adds each value in float64 in that
order, then the warp's butterfly sum (warp_sum); lane 0 rounds the sum to float32 (what the
unfused reduce_sum stored), runs the epilogue program on it and the row's other inputs, and
stores the results: the same float32 values added in the same order as the unfused
pointwise, reduce_sum (on its rows path) and pointwise kernels add them
(tests/cuda/test_pointwise_cuda.py judges it against NumPy by the summation bound). The program
code is pointwise.py's, float32 only (the pass fuses float32 sums alone).
"""
from __future__ import annotations

import functools
import math

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ...errors import ShapeError
from ...ir.graph import Node
from ...ops.pointwise import Instr, register_dtypes
from .pointwise import _CTYPES, _HELPERS, _offset, instruction_lines
from .reduce import ROW_SUM_ROWS
from .runtime import compiler
from .runtime.launch import MAX_INT, _row_grid

KERNEL_NAME = "pointwise_sum_kernel"


@functools.cache
def kernel_source(program: tuple[Instr, ...], summed: int, shape: tuple,
                  input_shapes: tuple[tuple, ...], views: tuple | None,
                  epilogue: tuple[Instr, ...], epilogue_results: tuple[int, ...],
                  epilogue_shapes: tuple[tuple, ...]) -> str:
    """CUDA source of KERNEL_NAME: pointwise_sum over shape (module docstring)."""
    k, m = len(input_shapes), len(epilogue_shapes)
    views = views or (None,) * k
    cols, rows_shape = shape[-1], shape[:-1]
    pro = register_dtypes(program, ("float32",) * k)
    epi = register_dtypes(epilogue, ("float32",) * (m + 1))
    if set(pro + epi) - {"float32", "bool"}:
        raise ShapeError("pointwise_sum: the cuda kernel computes float32 programs only")
    p_names = [f"p{j}" for j in range(len(pro))]
    e_names = [f"e{j}" for j in range(len(epi))]
    results = epilogue_results if epilogue else (0,)
    params = [f"const float* __restrict__ in{j}" for j in range(k + m)]
    params += [f"{_CTYPES[epi[r]]}* __restrict__ out{j}" for j, r in enumerate(results)]
    loads = [f"const float p{j} = in{j}[{_offset(s, shape, views[j])}];"
             for j, s in enumerate(input_shapes)]
    row_loads = [f"const float e{j + 1} = in{k + j}[{_offset(s, rows_shape)}];"
                 for j, s in enumerate(epilogue_shapes)]
    stores = [f"out{j}[i] = {e_names[r]};" for j, r in enumerate(results)]
    return "\n".join([
        '#include "launch_order.cuh"',
        '#include "elementwise.cuh"',
        '#include "reduce.cuh"',
        _HELPERS,
        f'extern "C" __global__ void {KERNEL_NAME}({", ".join(params)}, int rows) {{',
        "    await_previous_kernel();",
        "    for (long long row = first_row_base() + threadIdx.y; row < rows;"
        " row += row_base_stride()) {",
        "        double acc = 0.0;",
        "#pragma unroll 4  // several loads in flight a lane; the additions keep their order",
        f"        for (int c = threadIdx.x; c < {cols}; c += 32) {{",
        f"            const int i = (int)row * {cols} + c;",
        *(f"            {line}" for line in loads + instruction_lines(program, p_names, pro, k)),
        f"            acc += (double){p_names[summed]};",
        "        }",
        "        acc = warp_sum(acc);",
        "        if (threadIdx.x != 0) continue;",
        "        const int i = (int)row;",
        "        const float e0 = (float)acc;",
        *(f"        {line}" for line in row_loads + instruction_lines(epilogue, e_names, epi, m + 1)),
        *(f"        {line}" for line in stores),
        "    }",
        "}",
        ""])


def _source(node: Node) -> str:
    a, k = node.attrs, int(node.attrs["n_prologue"])
    views = a.get("views")
    return kernel_source(a["program"], int(a["summed"]), tuple(a["shape"]),
                         tuple(tuple(v.shape) for v in node.inputs[:k]),
                         tuple(views) if views else None, tuple(a["epilogue"]),
                         tuple(a["epilogue_results"]),
                         tuple(tuple(v.shape) for v in node.inputs[k:]))


def pointwise_sum_forward(node: Node, ins: list, outs: list, ctx) -> None:
    shape = tuple(node.attrs["shape"])
    if max([math.prod(shape), *(a.size for a in ins)]) > MAX_INT:
        raise ShapeError(f"pointwise_sum: {shape} exceeds the kernel's 32-bit indexing")
    for what, arrays in (("input", ins), ("output", outs)):
        for a in arrays:
            if not isinstance(a, cp.ndarray) or not a.flags.c_contiguous or \
                    a.dtype not in (np.float32, np.bool_):
                raise ShapeError(f"pointwise_sum {what}: the cuda kernel takes C-contiguous "
                                 f"float32 CuPy arrays, got {type(a).__name__} "
                                 f"{getattr(a, 'dtype', '')}")
    rows = math.prod(shape[:-1])
    if rows == 0:
        return
    kernel = compiler.generated_kernel(_source(node), KERNEL_NAME)
    kernel(_row_grid(rows, ROW_SUM_ROWS), (32, ROW_SUM_ROWS), (*ins, *outs, np.int32(rows)),
           stream=ctx.stream)


IMPLS = {"pointwise_sum": pointwise_sum_forward}
GENERATED_KERNELS = {"pointwise_sum": lambda node: [(_source(node), KERNEL_NAME)]}
