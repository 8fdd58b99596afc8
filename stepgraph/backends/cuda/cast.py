"""Launchers of cast.cu (cast between float32 and bfloat16) and their cuda op table.

bfloat16 values are uint16 arrays of raw bits (ir/graph.py storage_dtype); the kernel widens
or rounds (to nearest even) with the bit arithmetic of include/bf16.cuh, the NumPy
reference's rule bit for bit. Four elements a thread where n % 4 == 0 and both pointers are
16-byte aligned (the arena's 256-byte slots are). Launchers check their preconditions and
launch on ctx.stream: no host sync, no allocation.

`BF16_OPS` names the ops whose launchers of this module accept bfloat16 operands; the backend
refuses a bf16 plan holding any other op on bf16 values (compile/autocast.py
`check_bf16_support`), until its family declares it too.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ...errors import ShapeError
from .pointwise import as_program, generated_kernels, instruction_forward
from .runtime.launch import BLOCK, _aligned, _check, _grid, _launch

SOURCE = "cast.cu"
# IR dtype -> (storage dtype, C type of the kernel template)
CAST_CTYPES = {"float32": ("float32", "float"), "bfloat16": ("uint16", "unsigned short"),
               "float16": ("float16", "fp16_bits")}
BF16_OPS = frozenset({"cast"})
FP16_OPS = frozenset({"cast"})


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    return {SOURCE: {f"cast_forward_kernel<{s}, {d}>" for _, s in CAST_CTYPES.values()
                     for _, d in CAST_CTYPES.values() if s != d}}


def shared_ctype(op: str, arrays: dict) -> str:
    """The template argument (CAST_CTYPES) of an op's kernels whose float operands share one
    storage dtype, float32, uint16 (bfloat16) or float16: the first array's, each array (None
    entries skipped) checked to be a contiguous CuPy array of it."""
    present = {what: a for what, a in arrays.items() if a is not None}
    first = next(iter(present.values()))
    for storage, ctype in CAST_CTYPES.values():
        if getattr(first, "dtype", None) == np.dtype(storage):
            break
    else:
        storage, ctype = "float32", "float"    # _check below says what was wrong
    for what, a in present.items():
        _check(f"{op} {what}", a, storage)
    return ctype


def _ctype(what: str, a, dtype: str) -> str:
    if dtype not in CAST_CTYPES:
        raise ShapeError(f"{what}: the cuda cast converts between float32, bfloat16 and "
                         f"float16, got {dtype}")
    storage, ctype = CAST_CTYPES[dtype]
    _check(what, a, dtype=storage)
    return ctype


def cast_forward(ctx, x, y, src: str, dst: str) -> None:
    """y = x converted from IR dtype src to dst (two of float32, bfloat16 and float16), same
    shape: widened exactly, rounded once to nearest even."""
    if src == dst or not {src, dst} <= set(CAST_CTYPES):
        raise ShapeError(f"cast: the cuda kernel converts between float32, bfloat16 and "
                         f"float16, got {src} -> {dst}")
    s, d = _ctype("cast input", x, src), _ctype("cast output", y, dst)
    if tuple(x.shape) != tuple(y.shape):
        raise ShapeError(f"cast: input {tuple(x.shape)} vs output {tuple(y.shape)}")
    if not y.size:
        return
    vec = 4 if y.size % 4 == 0 and _aligned(x, y) else 1
    _launch(ctx, SOURCE, f"cast_forward_kernel<{s}, {d}>", _grid(y.size // vec), (BLOCK,),
            (x, y, np.int64(y.size), np.int32(vec)))


def _generated(node) -> bool:
    """Casts other than between float32, bfloat16 and float16 (to and from bool and ints: a
    model's `.long()`, `.bool()`, `.float()` of a mask) run as generated one-instruction
    programs."""
    src, dst = node.inputs[0].dtype, node.attrs["dtype"]
    return src == dst or not {src, dst} <= set(CAST_CTYPES)


def _cast(node, ins, outs, ctx) -> None:
    if _generated(node):
        instruction_forward(ctx, node, ins, outs)
    else:
        cast_forward(ctx, ins[0], outs[0], node.inputs[0].dtype, node.attrs["dtype"])


IMPLS: dict[str, Callable] = {"cast": _cast}
# The generated programs the backend compiles ahead (backend.prepare).
GENERATED_KERNELS = {"cast": lambda node: generated_kernels(as_program(node))
                     if _generated(node) else []}
