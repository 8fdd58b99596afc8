"""Launchers of broadcast.cu: binary (NumPy broadcasting), scalar, expand, permute,
layout_copy and layout_concat, and the cuda op table `IMPLS` of those ops.

Strided launches describe their operands by a layout: the output's dims with every size-1
dim dropped and neighbours merged where each operand walks them contiguously (a (N, C, H, W)
plus (1, C, 1, 1) add becomes (N, C, H*W) with strides (C*H*W, H*W, 1) and (0, 1, 0)), so
most launches index 1 to 3 dims. Launchers allocate nothing and never sync (capture-safe).

precision="bf16": binary, scalar, expand, permute and the layout ops take float32 or bfloat16
(uint16 raw bits) operands, all of one dtype (autocast promotes a mixed binary to float32),
through kernels templated on the storage (runtime/launch.py ELEMENT_CTYPES); `BF16_OPS` lists
them. float16 (fp16_bits) takes the same kernels: `FP16_OPS`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...errors import ShapeError
from ...ops.shape import contiguous_strides
from .pointwise import as_program, generated_kernels, instruction_forward
from .runtime.launch import (BLOCK, ELEMENT_CTYPES, _aligned, _buffers_key, _check,
                             _check_int32, _chunk_jobs, _element_ctype, _grid, _launch,
                             _node_memory, _typed)

MAX_DIMS = 6                  # broadcast.cu MAX_DIMS: dims of a layout after collapsing
TILE = 32                     # broadcast.cu TILE: transpose tiles are TILE x TILE
TRANSPOSE_BLOCK = (32, 8)     # (TILE, TILE_ROWS)
TRANSPOSE_MIN_SIDE = 16       # narrower matrices waste most of a tile: strided copy instead
MAX_GRID_YZ = 65535
BINARY_CODES = {"add": 0, "sub": 1, "mul": 2, "div": 3}            # BINARY_* of broadcast.cu
SCALAR_CODES = dict(BINARY_CODES, rsub=4, rdiv=5, pow=6)           # and SCALAR_*
BF16_OPS = frozenset({"binary", "scalar", "expand", "permute", "permute_group", "layout_copy",
                      "layout_concat"})
PERMUTE_ENTRY_WIDTH = 16      # include/permute.cuh: a row of the multi-tensor permute tables
# Elements a block of the multi-tensor permute gathers: on an H200 a U-Net's 31M float32 conv
# weights permuted to channels-last took 102.2 us in 1,024-element blocks, 83.7 in 4,096 (a
# flat copy of the same bytes 82.9), 86.6 in 8,192; their bf16 twins 78.6 / 52.6 / 53.3
# (docs/perf-notes.md, 2026-12-01).
PERMUTE_CHUNK = 4096
FP16_OPS = BF16_OPS


def division_magic(d: int) -> tuple[int, int]:
    """(m, l) with n // d == (umulhi(n, m) + n) >> l for every 0 <= n < 2^31
    (include/divide.cuh): l = ceil(log2 d), m = floor(2^32 (2^l - d) / d) + 1 < 2^32."""
    if not 0 < d < 2**31:
        raise ShapeError(f"division by {d}: the kernels' divisors are in [1, 2^31)")
    l = (d - 1).bit_length()
    return (1 << 32) * ((1 << l) - d) // d + 1, l


@dataclass(frozen=True)
class Layout:
    """Collapsed dims of a contiguous output: sizes, and per operand its strides (elements)."""

    sizes: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]

    def args(self) -> tuple:
        """The kernels' layout parameters, each padded to MAX_DIMS: the sizes, their division
        pairs (multipliers, then shifts: division_magic), then each operand's strides."""
        pad = MAX_DIMS - len(self.sizes)
        sizes = list(self.sizes) + [1] * pad
        pairs = [division_magic(n) for n in sizes]
        strides = [v for st in self.strides for v in list(st) + [0] * pad]
        return (tuple(np.int32(v) for v in sizes) + tuple(np.uint32(m) for m, _ in pairs) +
                tuple(np.uint32(l) for _, l in pairs) + tuple(np.int32(v) for v in strides))

    def vectorised(self, out) -> bool:
        """Groups of 4 along the innermost dim: it must hold whole groups, and out take float4s."""
        return self.sizes[-1] % 4 == 0 and _aligned(out)


def collapse(shape: tuple, operand_strides: list[tuple]) -> Layout:
    """The layout of a contiguous output of `shape` whose operands have the given strides
    (elements, one per output dim): size-1 dims dropped, dim d merged into its outer neighbour
    when every operand's outer stride is its stride times size[d]."""
    sizes: list[int] = []
    strides: list[list[int]] = [[] for _ in operand_strides]
    for d, size in enumerate(shape):
        if size == 1:
            continue
        here = [s[d] for s in operand_strides]
        if sizes and all(st[-1] == h * size for st, h in zip(strides, here)):
            sizes[-1] *= size
            for st, h in zip(strides, here):
                st[-1] = h
            continue
        sizes.append(size)
        for st, h in zip(strides, here):
            st.append(h)
    if not sizes:                               # a single element
        return Layout((1,), tuple((0,) for _ in operand_strides))
    return Layout(tuple(sizes), tuple(tuple(st) for st in strides))


def broadcast_strides(shape: tuple, out_shape: tuple) -> tuple[int, ...]:
    """Strides (elements) of a contiguous `shape` read as `out_shape` (NumPy broadcasting):
    0 along broadcast dims."""
    padded = (1,) * (len(out_shape) - len(shape)) + tuple(shape)
    return tuple(0 if size == 1 else stride
                 for size, stride in zip(padded, contiguous_strides(padded)))


def _broadcast_shape(what: str, *shapes) -> tuple:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError as err:
        raise ShapeError(f"{what}: shapes {' and '.join(map(str, shapes))} do not broadcast"
                         ) from err


def _check_layout(what: str, layout: Layout, shape: tuple) -> None:
    if len(layout.sizes) > MAX_DIMS:
        raise ShapeError(f"{what}: output {shape} needs {len(layout.sizes)} strided dims after "
                         f"collapsing, the kernels index at most {MAX_DIMS}")


def _code(table: dict, kind: str, op: str) -> int:
    if kind not in table:
        raise ValueError(f"{op}: unknown kind {kind!r}; expected one of {sorted(table)}")
    return table[kind]


# ---- binary and scalar ---------------------------------------------------------------------

def binary_forward(ctx, a, b, c, kind: str) -> None:
    """c = a kind b with NumPy broadcasting (kind add, sub, mul, div; IEEE division); a, b and
    c all float32 or all bf16 (computed in float32, c rounded once)."""
    code = _code(BINARY_CODES, kind, "binary")
    ctype = _element_ctype("binary a", a)
    _check("binary b", b, a.dtype)
    shape = _broadcast_shape("binary", tuple(a.shape), tuple(b.shape))
    _check("binary output", c, a.dtype, shape)
    for what, t in (("a", a), ("b", b), ("output", c)):
        _check_int32(f"binary {what}", t.size)
    n = c.size
    if not n:
        return
    if a.shape == b.shape:
        _launch(ctx, "broadcast.cu", _typed("binary_forward_kernel", ctype), _grid((n + 3) // 4),
                (BLOCK,),
                (a, b, c, np.int64(n), np.int32(code), np.int32(_aligned(a, b, c))))
        return
    layout = collapse(shape, [broadcast_strides(a.shape, shape),
                              broadcast_strides(b.shape, shape)])
    _check_layout("binary", layout, shape)
    vec = layout.vectorised(c)
    _launch(ctx, "broadcast.cu", f"binary_broadcast_kernel<{ctype}, {len(layout.sizes)}>",
            _grid(n // 4 if vec else n), (BLOCK,),
            (a, b, c, np.int32(n), np.int32(code), np.int32(vec)) + layout.args())


def scalar_forward(ctx, x, y, kind: str, value: float) -> None:
    """y = x kind value: x+v, x-v, v-x (rsub), x*v, x/v, v/x (rdiv), x**v (pow); the value
    rounded to float32 first, as NumPy does with a Python float and a float32 array; x and y
    float32 or both bf16 (computed in float32, y rounded once)."""
    code = _code(SCALAR_CODES, kind, "scalar")
    ctype = _element_ctype("scalar input", x)
    _check("scalar output", y, x.dtype, x.shape)
    n = x.size
    if n:
        _launch(ctx, "broadcast.cu", _typed("scalar_forward_kernel", ctype), _grid((n + 3) // 4),
                (BLOCK,),
                (x, y, np.int64(n), np.int32(code), np.float32(value),
                 np.int32(_aligned(x, y))))


# ---- strided copies: expand and permute ----------------------------------------------------

def strided_copy(ctx, x, y, layout: Layout, what: str) -> None:
    """y (contiguous) = x read at the layout's strides; x and y float32 or bf16 (one dtype)."""
    _check_layout(what, layout, tuple(y.shape))
    ctype = ELEMENT_CTYPES[x.dtype]
    vec = layout.vectorised(y)
    n = y.size
    _launch(ctx, "broadcast.cu", f"strided_copy_kernel<{ctype}, {len(layout.sizes)}>",
            _grid(n // 4 if vec else n), (BLOCK,),
            (x, y, np.int32(n), np.int32(vec)) + layout.args())


def expand_forward(ctx, x, y, shape) -> None:
    """y = np.broadcast_to(x, shape), materialised; float32 or bf16 (y of x's dtype)."""
    shape = tuple(shape)
    _element_ctype("expand input", x)
    if _broadcast_shape("expand", tuple(x.shape), shape) != shape:
        raise ShapeError(f"expand: {tuple(x.shape)} does not broadcast to {shape}")
    _check("expand output", y, x.dtype, shape)
    _check_int32("expand output", y.size)
    if y.size:
        strided_copy(ctx, x, y, collapse(shape, [broadcast_strides(x.shape, shape)]), "expand")


def _transpose_dims(layout: Layout) -> tuple[int, int, int] | None:
    """(batch, rows, cols) when the layout reads a contiguous (batch, rows, cols) input
    transposed into (batch, cols, rows), and tiles pay off; else None."""
    sizes, (strides,) = layout.sizes, layout.strides
    if len(sizes) == 2 and strides == (1, sizes[0]):
        batch, (cols, rows) = 1, sizes
    elif len(sizes) == 3 and strides == (sizes[1] * sizes[2], 1, sizes[1]):
        batch, cols, rows = sizes
    else:
        return None
    if min(rows, cols) < TRANSPOSE_MIN_SIDE or -(-rows // TILE) > MAX_GRID_YZ:
        return None
    return batch, rows, cols


def permute_forward(ctx, x, y, dims) -> None:
    """y = x.transpose(dims), materialised (contiguous). Swaps of the last two dims (after
    collapsing: 2-D transposes, (B, M, N) -> (B, N, M), NCHW -> NHWC) go through shared-memory
    tiles; other permutations through the strided copy."""
    dims = tuple(int(d) for d in dims)
    ctype = _element_ctype("permute input", x)
    if sorted(dims) != list(range(x.ndim)):
        raise ShapeError(f"permute: dims {dims} are not a permutation of {x.ndim} axes")
    shape = tuple(x.shape[d] for d in dims)
    _check("permute output", y, x.dtype, shape)
    _check_int32("permute", x.size)
    if not y.size:
        return
    contiguous = contiguous_strides(x.shape)
    layout = collapse(shape, [tuple(contiguous[d] for d in dims)])
    tiles = _transpose_dims(layout)
    if tiles is None:
        strided_copy(ctx, x, y, layout, "permute")
        return
    batch, rows, cols = tiles
    grid = (-(-cols // TILE), -(-rows // TILE), min(batch, MAX_GRID_YZ))
    _launch(ctx, "broadcast.cu", _typed("transpose_forward_kernel", ctype), grid, TRANSPOSE_BLOCK,
            (x, y, np.int32(batch), np.int32(rows), np.int32(cols)))


def permute_row(source: int, destination: int, shape, strides, dims) -> list[int]:
    """A row of a multi-tensor permute table (include/permute.cuh) for y = x.transpose(dims),
    x of `shape` with `strides` (elements) at address `source`, y at `destination`: n, the
    transposed shape padded to 4 dims in front, its strides in the source, and the division
    pairs of its last three dims."""
    if len(dims) > 4:
        raise ShapeError(f"multi-tensor permute: {len(dims)} dims, at most 4")
    pad = 4 - len(shape)
    out = [1] * pad + [shape[d] for d in dims]
    return [source, destination, math.prod(shape), *out[1:], *([0] * pad),
            *(strides[d] for d in dims), *(v for o in out[:0:-1] for v in division_magic(o))]


def permute_tables(permuted: list) -> dict:
    """The device tables of a multi-tensor permute gather (include/permute.cuh) over
    `permuted`, (source, destination, dims) triples: a row per destination (permute_row) and
    the (tensor, chunk) jobs, PERMUTE_CHUNK elements a block (its "chunk")."""
    import cupy as cp

    entries = []
    for x, y, dims in permuted:
        _check_int32("permuted tensor", x.size)        # the kernels index in 32 bits
        entries.append(permute_row(x.data.ptr, y.data.ptr, x.shape,
                                   [st // x.itemsize for st in x.strides], dims))
    rows = np.array(entries, dtype=np.int64).reshape(-1, PERMUTE_ENTRY_WIDTH)
    jobs = _chunk_jobs([y.size for _, y, _ in permuted], PERMUTE_CHUNK)
    return dict(entries=cp.asarray(rows), chunk=np.int32(PERMUTE_CHUNK), jobs=cp.asarray(jobs))


def permute_group_forward(ctx, node, ins, outs) -> None:
    """Every y_i = x_i.transpose(attrs dims[i]) of a permute_group in one gather launch
    (broadcast.cu permute_group_kernel); one dtype across the group."""
    ctype = _element_ctype("permute_group input", ins[0])
    for x, y, dims in zip(ins, outs, node.attrs["dims"]):
        _check("permute_group input", x, ins[0].dtype, tuple(x.shape))
        _check("permute_group output", y, x.dtype, tuple(x.shape[d] for d in dims))
    permuted = [(x, y, dims) for x, y, dims in zip(ins, outs, node.attrs["dims"]) if y.size]
    if not permuted:
        return
    tables = _node_memory(node, ("permute group",) + _buffers_key([*ins, *outs]), ctx,
                          lambda: permute_tables(permuted))
    _launch(ctx, "broadcast.cu", _typed("permute_group_kernel", ctype),
            (len(tables["jobs"]),), (BLOCK,),
            (tables["entries"], tables["jobs"], tables["chunk"]))


def layout_copy_forward(ctx, x, y, shape, strides, offset: int) -> None:
    """y (contiguous, `shape`) = x's elements read at offset + sum(i_k * strides_k): a chain
    of slices, reshapes and permutes (compile/layout_chains.py) as one strided copy."""
    shape = tuple(int(d) for d in shape)
    _element_ctype("layout_copy input", x)
    _check("layout_copy output", y, x.dtype, shape)
    _check_int32("layout_copy", x.size)
    if y.size:
        source = x.reshape(-1)[int(offset):]
        strided_copy(ctx, source, y, collapse(shape, [tuple(int(s) for s in strides)]),
                     "layout_copy")


def layout_concat_forward(ctx, roots, y, dim: int, views) -> None:
    """y = the concat along `dim` of each root read at its (shape, strides, offset) view: one
    strided copy per input, from its root to its range of y."""
    _element_ctype("layout_concat output", y)
    _check_int32("layout_concat", y.size)
    out_strides = contiguous_strides(y.shape)
    at = 0
    for x, (shape, strides, offset) in zip(roots, views):
        _check("layout_concat input", x, y.dtype, tuple(x.shape))
        _check_int32("layout_concat input", x.size)
        n = math.prod(shape)
        if n:
            layout = collapse(tuple(shape), [tuple(strides), tuple(out_strides)])
            _check_layout("layout_concat", layout, tuple(shape))
            source = x.reshape(-1)[int(offset):]
            target = y.reshape(-1)[at * out_strides[dim]:]
            _launch(ctx, "broadcast.cu",
                    f"strided_copy_to_kernel<{ELEMENT_CTYPES[y.dtype]}, {len(layout.sizes)}>",
                    _grid(n), (BLOCK,), (source, target, np.int32(n)) + layout.args())
        at += shape[dim]


# ---- the op table --------------------------------------------------------------------------

def kernel_names() -> dict[str, set[str]]:
    """{file: every kernel name these launchers may launch} (the NVRTC CI test)."""
    names = set()
    for ctype in ELEMENT_CTYPES.values():
        names |= {_typed(k, ctype) for k in ("binary_forward_kernel", "scalar_forward_kernel",
                                             "transpose_forward_kernel",
                                             "permute_group_kernel")}
        for nd in range(1, MAX_DIMS + 1):
            names |= {f"binary_broadcast_kernel<{ctype}, {nd}>",
                      f"strided_copy_kernel<{ctype}, {nd}>",
                      f"strided_copy_to_kernel<{ctype}, {nd}>"}
    return {"broadcast.cu": names}


def _generated(node) -> bool:
    """Whether node's kind has no broadcast.cu kernel (pow of two tensors, rpow, maximum,
    minimum): it runs as a generated one-instruction program (pointwise.py)."""
    codes = BINARY_CODES if node.op == "binary" else SCALAR_CODES
    return node.attrs["kind"] not in codes


def _binary_or_scalar(node, ins, outs, ctx) -> None:
    if _generated(node):
        instruction_forward(ctx, node, ins, outs)
    elif node.op == "binary":
        binary_forward(ctx, ins[0], ins[1], outs[0], node.attrs["kind"])
    else:
        scalar_forward(ctx, ins[0], outs[0], node.attrs["kind"], node.attrs["value"])


IMPLS: dict[str, Callable] = {
    "binary": _binary_or_scalar,
    "scalar": _binary_or_scalar,
    "expand": lambda node, ins, outs, ctx: expand_forward(
        ctx, ins[0], outs[0], node.attrs["shape"]),
    "permute": lambda node, ins, outs, ctx: permute_forward(
        ctx, ins[0], outs[0], node.attrs["dims"]),
    "permute_group": lambda node, ins, outs, ctx: permute_group_forward(ctx, node, ins, outs),
    "layout_copy": lambda node, ins, outs, ctx: layout_copy_forward(
        ctx, ins[0], outs[0], node.attrs["shape"], node.attrs["strides"], node.attrs["offset"]),
    "layout_concat": lambda node, ins, outs, ctx: layout_concat_forward(
        ctx, ins, outs[0], node.attrs["dim"], node.attrs["views"]),
}
# The generated programs the backend compiles ahead (backend.prepare).
GENERATED_KERNELS = {op: lambda node: generated_kernels(as_program(node)) if _generated(node)
                     else [] for op in ("binary", "scalar")}
