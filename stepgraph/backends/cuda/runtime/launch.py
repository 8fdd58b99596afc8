"""The launch helpers every op family shares: argument checks that say what mismatched, grid
sizes, kernel lookup and launch on ctx.stream, and the device memory a node keeps between calls.

Each launcher of a family checks its preconditions (CuPy arrays, float32 unless stated,
C-contiguous, shapes) with these, computes the grid and launches one kernel on ctx.stream: no
host sync, no allocation. Some nodes keep device memory that is made once, at the first EAGER
call on a set of buffers, and reused by every later call and by a captured graph (Executable
warms up eagerly before capture): `_node_memory`.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ....errors import CaptureError, ShapeError
from ....ir.graph import Node
from . import compiler

BLOCK = 256                   # threads of a 1-D elementwise block
MAX_BLOCKS = 8192             # grid-stride loops cover the rest
MAX_INT = 2**31 - 1           # kernels index (N, C) and NCHW shapes with 32-bit ints
MULTI_TENSOR_CHUNK = 1024     # elements a block of a multi-tensor copy kernel: one float4 a thread
# Elements per block of an optimizer update and of the gradient norm (update_chunk): up to
# four float4 groups a thread. Their blocks open with a serial prologue (one thread reads the
# parameter's table row and hyperparameters, then a barrier) that at one group a thread
# outlasted the loads: on the gpt's 10.8M parameters (H200, bf16) Adam's update took 122 µs at
# 4,096 against 182 at 1,024, the norm 18 against 38. Small models keep smaller chunks, so
# that every SM still gets UPDATE_BLOCKS_PER_SM blocks (a thread's groups load one after
# another: fewer blocks would leave SMs idle).
UPDATE_CHUNKS = (4096, 2048, 1024)
UPDATE_BLOCKS_PER_SM = 4      # of 256 threads: what the plain update kernels' registers allow
ACT_CODES = {"none": -1, "relu": 0, "leaky_relu": 1, "sigmoid": 2, "tanh": 3, "gelu": 4,
             "gelu_tanh": 5, "silu": 6}      # the ACT_* codes of include/elementwise.cuh
LABEL_CTYPES = {np.dtype("int32"): "int", np.dtype("int64"): "long long"}
# Storage -> C type of the kernels templated on their element type; uint16 is the storage of
# IR dtype bfloat16 only (ir/graph.py storage_dtype), so it always means bf16 bits here;
# float16 is its own storage, fp16_bits in the kernels (include/fp16.cuh).
ELEMENT_CTYPES = {np.dtype("float32"): "float", np.dtype("uint16"): "unsigned short",
                  np.dtype("float16"): "fp16_bits"}
# Storage -> the runtime storage code of a kernel that reads a table of tensors of mixed
# storages (include/bf16.cuh STORAGE_*: load_either_as_float).
FLOAT_KINDS = {np.dtype("float32"): 0, np.dtype("uint16"): 1, np.dtype("float16"): 2}


@functools.cache
def _kernel(filename: str, name: str):
    return compiler.kernel(filename, name)


def _launch(ctx, filename: str, name: str, grid: tuple, block: tuple, args: tuple,
            shared_mem: int = 0) -> None:
    _kernel(filename, name)(grid, block, args, stream=ctx.stream, shared_mem=shared_mem)


def _check(what: str, a, dtype: str | None = "float32", shape: tuple | None = None) -> None:
    if not isinstance(a, cp.ndarray):
        raise ShapeError(f"{what}: expected a CuPy array, got {type(a).__name__}")
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise ShapeError(f"{what}: the cuda kernels take {dtype}, got {a.dtype}")
    if not a.flags.c_contiguous:
        raise ShapeError(f"{what}: must be C-contiguous (strides {a.strides})")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ShapeError(f"{what}: expected shape {tuple(shape)}, got {tuple(a.shape)}")


def _check_scalar(what: str, a, dtype: str) -> None:
    _check(what, a, dtype)
    if a.size != 1:
        raise ShapeError(f"{what}: expected a scalar, got shape {tuple(a.shape)}")


def _element_ctype(what: str, a) -> str:
    """The C type of a float32, bf16 (uint16 bits) or float16 operand of a templated kernel."""
    _check(what, a, dtype=None)
    if a.dtype not in ELEMENT_CTYPES:
        raise ShapeError(f"{what}: the cuda kernels take float32, bfloat16 or float16, got "
                         f"{a.dtype}")
    return ELEMENT_CTYPES[a.dtype]


def _float_kind(what: str, a, allowed=("float32", "float16")) -> np.int32:
    """The storage code (FLOAT_KINDS) of an operand that may be any of `allowed` (a loss and
    its history: float16 where the model computes in float16, model.half())."""
    _check(what, a, dtype=None)
    if a.dtype.name not in allowed:
        raise ShapeError(f"{what}: the cuda kernels take {' or '.join(allowed)}, got {a.dtype}")
    return np.int32(FLOAT_KINDS[a.dtype])


def _typed(name: str, ctype: str) -> str:
    """The instantiation of kernel template `name` for element type `ctype`."""
    return f"{name}<{ctype}>"


def _check_int32(what: str, n: int) -> None:
    if n > MAX_INT:
        raise ShapeError(f"{what}: {n} elements exceed the kernels' 32-bit indexing")


@functools.cache
def sm_count(device: int) -> int:
    """GPU `device`'s SM count (launch shapes derived from it are fixed per GPU, so reruns
    are bit-identical)."""
    return cp.cuda.Device(device).attributes["MultiProcessorCount"]


def current_sm_count() -> int:
    """The current GPU's SM count."""
    return sm_count(cp.cuda.runtime.getDevice())


def update_chunk(total: int) -> int:
    """Elements a block of an optimizer update or gradient norm over `total` elements takes:
    the largest of UPDATE_CHUNKS that still makes UPDATE_BLOCKS_PER_SM blocks an SM."""
    target = UPDATE_BLOCKS_PER_SM * current_sm_count()
    return next((c for c in UPDATE_CHUNKS if total >= c * target), UPDATE_CHUNKS[-1])


def _aligned(*arrays, to: int = 16) -> bool:
    return all(a.data.ptr % to == 0 for a in arrays)


def _or_null(a):
    """a, or a null pointer argument for an absent optional array."""
    return np.uint64(0) if a is None else a


def _grid(work: int, block: int = BLOCK) -> tuple[int]:
    return (max(1, min((work + block - 1) // block, MAX_BLOCKS)),)


def _slope(attrs: dict) -> float:
    slope = attrs.get("slope")
    return 0.01 if slope is None else float(slope)


def _act_code(kind: str, allow_none: bool = False) -> int:
    if kind not in ACT_CODES or (kind == "none" and not allow_none):
        raise ValueError(f"unknown activation {kind!r}; expected one of {sorted(ACT_CODES)}")
    return ACT_CODES[kind]


def _capturing(ctx) -> bool:
    return bool(getattr(ctx, "capturing", False)) or ctx.stream.is_capturing()


# Device memory made once per (node, buffers): node -> {key: value}. Weak on the node, so it
# lives exactly as long as the plan that owns the node (and any graph captured from it).
_NODE_MEMORY: "weakref.WeakKeyDictionary[Node, dict]" = weakref.WeakKeyDictionary()


def _node_memory(node: Node, key: tuple, ctx, build: Callable[[], Any], required: bool = True):
    """The memory built for (node, key), building it now if this is an eager call. During a
    capture a missing one is a CaptureError (required) or None (the caller has a fallback)."""
    memory = _NODE_MEMORY.setdefault(node, {})
    if key not in memory:
        if _capturing(ctx):
            if not required:
                return None
            raise CaptureError(
                f"{node.op}: its device tables are built at the first eager run on these buffers;"
                " run the step eagerly once before capturing")
        with ctx.stream:   # allocation and upload ordered before the kernels that read them
            memory[key] = build()
    return memory[key]


def _buffers_key(arrays) -> tuple:
    return tuple((a.data.ptr, a.size) for a in arrays)


def _chunk_jobs(sizes: list[int], chunk: int | list[int] = MULTI_TENSOR_CHUNK) -> np.ndarray:
    """(tensor, chunk) work items of a multi-tensor kernel, `chunk` elements each, at least
    one per tensor; or, given one chunk a tensor, each tensor's own (0: no work items for
    that tensor, which another launch of the same table takes)."""
    chunks = chunk if isinstance(chunk, list) else [chunk] * len(sizes)
    jobs = [(t, c) for t, (n, size) in enumerate(zip(sizes, chunks)) if size
            for c in range(max(1, -(-n // size)))]
    if len(jobs) > MAX_INT:
        raise ShapeError(f"multi-tensor kernel: {len(jobs)} blocks exceed the grid limit")
    return np.array(jobs, dtype=np.int32).reshape(-1, 2)


def _row_block(cols: int, threads: int, narrow: bool = False) -> tuple[int, int]:
    """(threads per row, rows per block) for `threads` threads a block: one warp per row up
    to 1024 columns, more threads for longer rows. narrow (kernels whose row reductions are
    include/reduce.cuh's row_sum / row_max alone): rows of at most 16 columns take the power
    of two of lanes that covers them, several rows a warp (a segmentation head's per-pixel
    softmax over 2 classes kept 30 of a warp's 32 lanes idle: its two passes over 131K rows
    took 40 µs a step on an H200, 5.4 on two lanes a row)."""
    per_row = 32 if cols <= 1024 else 128 if cols <= 8192 else 256
    if narrow and cols <= 16:
        per_row = 1 << max(0, cols - 1).bit_length()
    return per_row, max(1, threads // per_row)


def _row_grid(n_rows: int, rows_per_block: int) -> tuple[int]:
    return (max(1, min(-(-n_rows // rows_per_block), MAX_BLOCKS)),)


def _check_rows(what: str, x) -> tuple[int, int]:
    """(rows, cols) of x (any rank >= 1) viewed as rows of its last axis."""
    _check(what, x)
    if x.ndim < 1:
        raise ShapeError(f"{what}: expected rank >= 1 (rows of the last axis), got a scalar")
    _check_int32(what, x.size)
    return math.prod(x.shape[:-1]), x.shape[-1]

