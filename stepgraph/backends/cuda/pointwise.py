"""Fused pointwise programs (ops/pointwise.py) as generated CUDA kernels, one per program.

The generator writes one grid-stride loop over the output elements: each input is loaded once
per element (broadcast inputs through offsets computed from compile-time sizes), every
instruction becomes one expression on registers, and only the results are stored. Sums and
products use the round-to-nearest intrinsics (__fadd_rn, __fmul_rn, ...), which the compiler
never contracts into FMAs, so each instruction rounds as the op's own kernel and the NumPy
reference do. Activations reuse elementwise.cuh, the code of the standalone act kernels.
"""
from __future__ import annotations

import functools
import math
import struct

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ...errors import ShapeError
from ...ir.graph import Node
from ...ops.pointwise import Instr
from . import compiler
from .launchers import ACT_CODES, BLOCK, MAX_INT, _grid, _slope

KERNEL_NAME = "pointwise_kernel"
_BINARY = {"add": "__fadd_rn({a}, {b})", "sub": "__fsub_rn({a}, {b})",
           "mul": "__fmul_rn({a}, {b})", "div": "__fdiv_rn({a}, {b})"}
_SCALAR = {"add": "__fadd_rn({x}, {v})", "sub": "__fsub_rn({x}, {v})",
           "rsub": "__fsub_rn({v}, {x})", "mul": "__fmul_rn({x}, {v})",
           "div": "__fdiv_rn({x}, {v})", "rdiv": "__fdiv_rn({v}, {x})",
           "pow": "powf({x}, {v})"}


def _float(value: float) -> str:
    """An exact float32 literal: the bits of float32(value)."""
    bits = struct.unpack("<i", struct.pack("<f", np.float32(value)))[0]
    return f"__int_as_float({bits})"


def _offset(in_shape: tuple, out_shape: tuple) -> str:
    """The C expression of an input element's offset for output element i (broadcasting)."""
    if tuple(in_shape) == tuple(out_shape):
        return "i"
    in_shape = (1,) * (len(out_shape) - len(in_shape)) + tuple(in_shape)
    terms, inner, stride = [], 1, 1
    for d in reversed(range(len(out_shape))):
        if in_shape[d] != 1:
            index = "i" if inner == 1 else f"(i / {inner})"
            if d > 0:
                index = f"({index} % {out_shape[d]})"
            terms.append(index if stride == 1 else f"{index} * {stride}")
            stride *= in_shape[d]
        inner *= out_shape[d]
    return " + ".join(reversed(terms)) or "0"


def _expression(instr: Instr, r: list[str]) -> str:
    attr = instr.attr
    args = [r[i] for i in instr.args]
    if instr.op == "add":
        return _BINARY["add"].format(a=args[0], b=args[1])
    if instr.op == "binary":
        return _BINARY[attr["kind"]].format(a=args[0], b=args[1])
    if instr.op == "scalar":
        return _SCALAR[attr["kind"]].format(x=args[0], v=_float(attr["value"]))
    if instr.op == "act":
        return f"act_value({args[0]}, {ACT_CODES[attr['kind']]}, {_float(_slope(attr))})"
    if instr.op == "act_grad":
        derivative = f"act_derivative({args[1]}, {ACT_CODES[attr['kind']]}, " \
                     f"{_float(_slope(attr))})"
        return f"__fmul_rn({args[0]}, {derivative})"
    if instr.op == "expand":
        return args[0]
    raise ShapeError(f"pointwise: no CUDA code for op {instr.op!r}")


@functools.cache
def kernel_source(program: tuple[Instr, ...], results: tuple[int, ...], shape: tuple,
                  input_shapes: tuple[tuple, ...]) -> str:
    """CUDA source of KERNEL_NAME computing `program` over `shape` (float32)."""
    k = len(input_shapes)
    params = [f"const float* __restrict__ in{j}" for j in range(k)]
    params += [f"float* __restrict__ out{j}" for j in range(len(results))]
    regs = [f"r{j}" for j in range(k + len(program))]
    body = [f"        const float r{j} = in{j}[{_offset(s, shape)}];"
            for j, s in enumerate(input_shapes)]
    body += [f"        const float r{k + j} = {_expression(instr, regs)};"
             for j, instr in enumerate(program)]
    body += [f"        out{j}[i] = r{r};" for j, r in enumerate(results)]
    return "\n".join([
        '#include "elementwise.cuh"',
        f'extern "C" __global__ void {KERNEL_NAME}({", ".join(params)}, int n) {{',
        "    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n;"
        " i += gridDim.x * blockDim.x) {",
        *body,
        "    }",
        "}",
        ""])


def generated_kernels(node: Node) -> list[tuple[str, str]]:
    """The (source, kernel name) of node's program, which the backend compiles ahead."""
    source = kernel_source(node.attrs["program"], node.attrs["results"],
                           tuple(node.attrs["shape"]), tuple(tuple(v.shape) for v in node.inputs))
    return [(source, KERNEL_NAME)]


def pointwise_forward(ctx, node: Node, ins: list, outs: list) -> None:
    """Run node's program (ops/pointwise.py) as one generated kernel."""
    shape = tuple(node.attrs["shape"])
    n = math.prod(shape)
    if n > MAX_INT:
        raise ShapeError(f"pointwise: {n} elements exceed the kernel's 32-bit indexing")
    for what, arrays in (("input", ins), ("output", outs)):
        for a in arrays:
            if not isinstance(a, cp.ndarray) or a.dtype != np.float32 \
                    or not a.flags.c_contiguous:
                raise ShapeError(f"pointwise {what}: the cuda kernel takes C-contiguous float32"
                                 f" CuPy arrays, got {type(a).__name__} {getattr(a, 'dtype', '')}")
    for v, a in zip(node.inputs, ins):
        if tuple(a.shape) != tuple(v.shape):
            raise ShapeError(f"pointwise input: expected shape {v.shape}, got {a.shape}")
    if n == 0:
        return
    kernel = compiler.generated_kernel(*generated_kernels(node)[0])
    kernel(_grid(n), (BLOCK,), (*ins, *outs, np.int32(n)), stream=ctx.stream)


IMPLS = {"pointwise": lambda node, ins, outs, ctx: pointwise_forward(ctx, node, ins, outs)}
GENERATED_KERNELS = {"pointwise": generated_kernels}
