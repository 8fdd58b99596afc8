"""Fused pointwise programs (ops/pointwise.py) as generated CUDA kernels, one per program.

The generator writes one grid-stride loop over the output elements: each input is loaded once
per element (broadcast inputs through offsets computed from compile-time sizes), every
instruction becomes one expression on registers, and only the results are stored. Sums and
products use the round-to-nearest intrinsics (__fadd_rn, __fmul_rn, ...), which the compiler
never contracts into FMAs, so each instruction rounds as the op's own kernel and the NumPy
reference do. Activations reuse elementwise.cuh, the code of the standalone act kernels.

Where every input and output is float32, bf16, float16 or a one-byte mask (bool, uint8) and
every input has the output's shape or, with the last extent a multiple of four, broadcasts as
a per-channel vector of channels-last maps (last axis kept) or per row (last axis 1), the
source also has VEC_KERNEL_NAME: four consecutive elements a thread, each full or
per-channel input read and each output written in one 16- (float32), 8- (bf16) or 4-byte
(masks: a ReLU6's or hardswish's backward reads the forward's) access, a per-row input read
once for the four, the same per-element code in between. The launcher takes it when the
element count is a multiple of four and every array is 16-byte aligned: a thread then keeps
several accesses in flight (H200, resnet's gradient-sum + ReLU-gradient programs: see
docs/perf-notes.md).

An input read through a strided view (attrs views, compile/pointwise_views.py: a slice or
permute of it that no kernel copies out any more) is loaded at the offset its strides give;
in VEC_KERNEL_NAME four at once where the view's last axis is contiguous and its strides and
offset are multiples of four (the gate halves of a Linear's output, heads of a projection).

A program that draws dropout masks (`dropout_mask`) loops over groups of four consecutive
elements instead: one Philox4x32-10 call per group and site gives the four elements' words
(philox.cuh), as in the standalone dropout kernel, so the masks are the same bits and the
generator costs a quarter of a call per element. The step counter (int64) is read once.
VEC_KERNEL_NAME's four elements a thread are one such group, so dropout programs have it
too (gpt's residual dropout + add at bf16: one 8-byte load, one 16-byte and one 4-byte
store a thread where the element loop made four strided accesses of each).

bfloat16 programs (precision="bf16"; `BF16_OPS`): bf16 inputs are loaded as their raw bits
(unsigned short) and widened exactly; a bf16 register is a float holding a bf16 value, each
instruction that writes one rounds its float32 result to nearest even (bf16_round), as the
unfused node's kernel rounds on store and as the NumPy reference (ops/pointwise.py) does; a bf16
result is stored as its bits (exact: the value is already bf16). So fused and unfused bf16
graphs give the same bits. float16 programs (precision="fp16", model.half(); `FP16_OPS`) are
the same with float16's conversions (fp16.cuh: storage fp16_bits, fp16_round).
"""
from __future__ import annotations

import functools
import math
import struct

import cupy as cp  # imports without a GPU; kernels compile at their first launch
import numpy as np

from ...errors import ShapeError, UnsupportedOpError
from ...ir.graph import BF16, FP16, HALF_DTYPES, Node, storage_dtype
from ... import rng
from ...ops.pointwise import Instr, as_program, register_dtypes, result_stores
from ...ops.shape import contiguous_strides
from .runtime import compiler
from .runtime.launch import ACT_CODES, BLOCK, MAX_INT, _grid, _slope

KERNEL_NAME = "pointwise_kernel"
VEC_KERNEL_NAME = "pointwise_vec4_kernel"
VEC = 4                      # elements a thread of VEC_KERNEL_NAME
BF16_OPS = frozenset({"pointwise", "unary", "compare", "compare_scalar", "where",
                      "masked_fill"})
FP16_OPS = BF16_OPS
_BINARY = {"add": "__fadd_rn({a}, {b})", "sub": "__fsub_rn({a}, {b})",
           "mul": "__fmul_rn({a}, {b})", "div": "__fdiv_rn({a}, {b})",
           "pow": "powf({a}, {b})", "maximum": "fmax_nan({a}, {b})",
           "minimum": "fmin_nan({a}, {b})"}
_SCALAR = {"add": "__fadd_rn({x}, {v})", "sub": "__fsub_rn({x}, {v})",
           "rsub": "__fsub_rn({v}, {x})", "mul": "__fmul_rn({x}, {v})",
           "div": "__fdiv_rn({x}, {v})", "rdiv": "__fdiv_rn({v}, {x})",
           "pow": "powf({x}, {v})", "rpow": "powf({v}, {x})",
           "maximum": "fmax_nan({x}, {v})", "minimum": "fmin_nan({x}, {v})"}
# Unary kinds (ops/unary.py); rsqrt rounds twice, as the NumPy reference's 1 / sqrt(x).
_UNARY = {"exp": "expf({x})", "log": "logf({x})", "log1p": "log1pf({x})",
          "expm1": "expm1f({x})", "sqrt": "__fsqrt_rn({x})",
          "rsqrt": "__fdiv_rn(1.f, __fsqrt_rn({x}))", "abs": "fabsf({x})",
          "sign": "sign_nan({x})", "sin": "sinf({x})", "cos": "cosf({x})", "erf": "erff({x})",
          "floor": "floorf({x})", "ceil": "ceilf({x})", "round": "rintf({x})",
          "trunc": "truncf({x})"}
_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_LOGICAL = {"and": "&&", "or": "||", "xor": "!="}
BYTE_DTYPES = ("bool", "uint8")   # masks: VEC_KERNEL_NAME moves four in one 4-byte access
_BYTE_HELPERS = """\
template <typename T>
__device__ __forceinline__ void load4_bytes(const T* p, long long i, T* v) {
    const uchar4 a = *reinterpret_cast<const uchar4*>(p + i);
    v[0] = (T)a.x; v[1] = (T)a.y; v[2] = (T)a.z; v[3] = (T)a.w;
}
template <typename T>
__device__ __forceinline__ void store4_bytes(T* p, long long i, const T* v) {
    *reinterpret_cast<uchar4*>(p + i) = make_uchar4((unsigned char)v[0], (unsigned char)v[1],
                                                    (unsigned char)v[2], (unsigned char)v[3]);
}"""
# NaN-propagating max/min and sign, as NumPy's (fmaxf would drop a NaN operand).
_HELPERS = """\
__device__ __forceinline__ float fmax_nan(float a, float b) { return (a >= b || a != a) ? a : b; }
__device__ __forceinline__ float fmin_nan(float a, float b) { return (a <= b || a != a) ? a : b; }
__device__ __forceinline__ float sign_nan(float x) {
    return x != x ? x : (float)((x > 0.f) - (x < 0.f));
}"""


def _float(value: float) -> str:
    """An exact float32 literal: the bits of float32(value)."""
    bits = struct.unpack("<i", struct.pack("<f", np.float32(value)))[0]
    return f"__int_as_float({bits})"


def _offset(in_shape: tuple, out_shape: tuple, view=None) -> str:
    """The C expression of an input element's offset for output element i (broadcasting;
    through view (shape, strides, offset) of the input's elements where one is given)."""
    if view is None:
        if tuple(in_shape) == tuple(out_shape):
            return "i"
        view = (tuple(in_shape), contiguous_strides(in_shape), 0)
    return _view_offset(view, out_shape)


def _view_offset(view, out_shape: tuple) -> str:
    """The offset of output element i's element of an input read through view (shape,
    strides, offset), the view broadcast to out_shape."""
    shape, strides, offset = view
    pad = len(out_shape) - len(shape)
    shape, strides = (1,) * pad + tuple(shape), (0,) * pad + tuple(strides)
    terms, inner = [], 1
    for d in reversed(range(len(out_shape))):
        if shape[d] != 1 and strides[d]:
            index = "i" if inner == 1 else f"(i / {inner})"
            if d > 0:
                index = f"({index} % {out_shape[d]})"
            terms.append(index if strides[d] == 1 else f"{index} * {strides[d]}")
        inner *= out_shape[d]
    return " + ".join([*reversed(terms), *([str(offset)] if offset else [])]) or "0"


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
    if instr.op == "cast":   # a narrowing cast to bf16 or float16 rounds as any such register
        return f"({_REGISTER_CTYPES[attr['dtype']]})({args[0]})"
    if instr.op == "unary":
        return _UNARY[attr["kind"]].format(x=args[0])
    if instr.op == "compare":
        return f"({args[0]} {_COMPARE[attr['kind']]} {args[1]})"
    if instr.op == "compare_scalar":
        return f"({args[0]} {_COMPARE[attr['kind']]} {_float(attr['value'])})"
    if instr.op == "logical":
        return f"({args[0]} {_LOGICAL[attr['kind']]} {args[1]})"
    if instr.op == "logical_not":
        return f"(!{args[0]})"
    if instr.op == "where":
        return f"({args[0]} ? {args[1]} : {args[2]})"
    if instr.op == "masked_fill":
        return f"({args[1]} ? {_float(attr['value'])} : {args[0]})"
    if instr.op == "dropout_grad":      # x * mask * scale, as the dropout kernels round it
        scale = _float(1.0 / (1.0 - float(attr["p"])))
        return f"__fmul_rn(__fmul_rn({args[0]}, (float){args[1]}), {scale})"
    if instr.op == "dropout_mask":      # the group's Philox words, drawn before the lane loop
        return f"(unsigned char)dropout_keep(philox_word({_words(instr, r)}, lane), " \
               f"{rng.keep_threshold(float(attr['p']))}u)"
    raise ShapeError(f"pointwise: no CUDA code for op {instr.op!r}")


# IR dtype -> C type of a kernel parameter (storage); registers of 16-bit values are float.
_CTYPES = {"float32": "float", "uint8": "unsigned char", "int64": "long long",
           "int32": "int", "bool": "bool", BF16: "unsigned short", FP16: "fp16_bits"}
_REGISTER_CTYPES = {**_CTYPES, BF16: "float", FP16: "float"}
# 16-bit IR dtype -> (widening of a stored element, rounding of a float, narrowing to storage)
_HALF_CODE = {BF16: ("bf16_to_float", "bf16_round", "bf16_from_float"),
              FP16: ("fp16_to_float", "fp16_round", "fp16_from_float")}


def instruction_lines(program: tuple[Instr, ...], names: list[str], dtypes: list[str],
                      k: int) -> list[str]:
    """One declaration per instruction of `program`, register k + j named names[k + j]; a
    bf16 or float16 register rounds its value, as the unfused node's store did."""
    lines = []
    for j, instr in enumerate(program):
        value = _expression(instr, names)
        if dtypes[k + j] in HALF_DTYPES:
            value = f"{_HALF_CODE[dtypes[k + j]][1]}({value})"
        lines.append(f"const {_REGISTER_CTYPES[dtypes[k + j]]} {names[k + j]} = {value};")
    return lines


def _words(instr: Instr, r: list[str]) -> str:
    """The name of the Philox words of a dropout_mask instruction's (step register, site)."""
    return f"w_{r[instr.args[0]]}_{int(instr.attr['site'])}"


def _words_line(instr: Instr, r: list[str]) -> str:
    attr = instr.attr
    seed = int(attr["seed"]) & (2**64 - 1)
    return (f"        const uint4 {_words(instr, r)} = dropout_words((unsigned long long)g, "
            f"{int(attr['site'])}u, {r[instr.args[0]]}, {seed}ull);")


def vectorizable(program: tuple[Instr, ...], results: tuple[int, ...], shape: tuple,
                 input_shapes: tuple[tuple, ...], input_dtypes: tuple[str, ...],
                 input_views: tuple | None = None) -> bool:
    """True when every input and result is float32, bf16, float16 or a one-byte mask (bool,
    uint8), besides a dropout program's step counter, and every input either has `shape` or,
    where the last axis's extent is a multiple of four, broadcasts along other axes only or
    along the last one (_lane_load), and every part of a joined result is stored as such a
    view would be read: the source then has VEC_KERNEL_NAME too. Its four
    elements a thread are one dropout group (the Philox call of a group's four words)."""
    dtypes = register_dtypes(program, input_dtypes)
    moved = ("float32", *HALF_DTYPES, *BYTE_DTYPES)
    steps = _step_counters(input_shapes, dtypes)
    views = input_views or (None,) * len(input_shapes)
    stores = result_stores(results, shape)
    return all(_lane_load(s, shape, view) is not None for s, view in zip(input_shapes, views)) \
        and all(dtypes[j] in moved for j in range(len(input_shapes)) if j not in steps) \
        and all(dtypes[s.register] in moved for s in stores) \
        and all(_lane_load(shape, shape, s.view) is not None for s in stores)


def _step_counters(input_shapes: tuple[tuple, ...], dtypes) -> list[int]:
    """The inputs read once per kernel, not per element: 0-d int64s (dropout's step)."""
    return [j for j, s in enumerate(input_shapes) if dtypes[j] == "int64" and not s]


def _lane_load(in_shape: tuple, shape: tuple, view=None) -> str | None:
    """How VEC_KERNEL_NAME reads an input for its four consecutive output elements: "full"
    (the output's shape: four consecutive elements), "row" (a broadcast input whose last axis
    is the output's: four consecutive elements at the first one's offset; channels-last
    per-channel vectors (1, 1, 1, C), squeeze-excitation scales (N, 1, 1, C)), "one" (last
    axis 1: one element for the four; per-pixel statistics (N, H, W, 1), 0-d values; a
    broadcast input's last axis is one of the two), or None: the last two need the output's
    last extent a multiple of four, so the four elements share every other index. An input
    read through a view (shape, strides, offset) is "strided" where the view has the output's
    shape, its last axis is contiguous and every stride and the offset are multiples of four
    (the four elements lie together, as aligned as the buffer), else None."""
    if view is not None:
        vshape, strides, offset = view
        aligned = all(s % VEC == 0 for s in (*strides[:-1], offset))
        return "strided" if tuple(vshape) == tuple(shape) and shape[-1] % VEC == 0 and \
            strides[-1] == 1 and aligned else None
    if tuple(in_shape) == tuple(shape):
        return "full"
    if not shape or shape[-1] % VEC:
        return None
    return "one" if not in_shape or in_shape[-1] == 1 else "row"


def uses_groups(program: tuple[Instr, ...]) -> bool:
    """True when the kernel loops over groups of four elements (it draws dropout masks)."""
    return any(instr.op == "dropout_mask" for instr in program)


@functools.cache
def kernel_source(program: tuple[Instr, ...], results: tuple[int, ...], shape: tuple,
                  input_shapes: tuple[tuple, ...],
                  input_dtypes: tuple[str, ...] | None = None,
                  input_views: tuple | None = None) -> str:
    """CUDA source of KERNEL_NAME computing `program` over `shape` (float32 values; bfloat16,
    float16, uint8 masks and the int64 step counter where input_dtypes say so; inputs read
    through the strided views of input_views where an entry is not None)."""
    k = len(input_shapes)
    views = input_views or (None,) * k
    dtypes = register_dtypes(program, input_dtypes or ("float32",) * k)
    # float64 would compute through float intrinsics and literals: refused, not rounded
    unsupported = sorted(set(dtypes) - set(_CTYPES))
    if unsupported:
        raise UnsupportedOpError(
            f"{', '.join(unsupported)} values in the cuda backend's elementwise kernels (they "
            "compute float32, bfloat16, float16, integers and bool; .double() / "
            ".to(torch.float64) "
            "run on device='cpu')")
    ctype = [_CTYPES[d] for d in dtypes]                     # storage: parameters
    rtype = [_REGISTER_CTYPES[d] for d in dtypes]                       # registers
    params = [f"const {ctype[j]}* __restrict__ in{j}" for j in range(k)]
    stores = result_stores(results, shape)
    kinds = {s.out: ctype[s.register] for s in stores}     # a joined output's parts: one dtype
    params += [f"{c}* __restrict__ out{j}" for j, c in kinds.items()]
    regs = [f"r{j}" for j in range(k + len(program))]
    scalars = _step_counters(input_shapes, dtypes)   # read once
    head = [f"    const long long r{j} = in{j}[0];" for j in scalars]
    at = lambda j, s: _offset(s, shape, views[j])   # noqa: E731
    load = lambda j, s: (f"{_HALF_CODE[dtypes[j]][0]}(in{j}[{at(j, s)}])"   # noqa
                         if dtypes[j] in HALF_DTYPES else f"in{j}[{at(j, s)}]")
    body = [f"const {rtype[j]} r{j} = {load(j, s)};"
            for j, s in enumerate(input_shapes) if j not in scalars]
    body += instruction_lines(program, regs, dtypes, k)
    stored = lambda s, value: (f"{_HALF_CODE[dtypes[s.register]][2]}({value})"   # noqa: E731
                               if dtypes[s.register] in HALF_DTYPES else value)
    body += [f"out{s.out}[{_store_offset(s, shape)}] = {stored(s, f'r{s.register}')};"
             for s in stores]
    words = {_words(i, regs): _words_line(i, regs) for i in program if i.op == "dropout_mask"}
    loaded = [j for j in range(k) if j not in scalars]
    vec = []
    if vectorizable(program, results, shape, input_shapes, dtypes[:k], input_views):
        vec = [f'extern "C" __global__ void {VEC_KERNEL_NAME}({", ".join(params)}, int n) {{',
               "    await_previous_kernel();",
               *head,
               f"    for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < n / {VEC};"
               " q += gridDim.x * blockDim.x) {",
               f"        const int i = {VEC} * q;",
               *(["        const int g = q;   // the dropout group of these four elements",
                  *words.values()] if words else []),
               *(f"        {rtype[j]} v{j}[{VEC}];" for j in loaded),
               *(_vector_load(j, input_shapes[j], shape, load, dtypes[j], views[j])
                 for j in loaded),
               *(f"        {rtype[s.register]} o{j}[{VEC}];" for j, s in enumerate(stores)),
               "#pragma unroll",
               f"        for (int lane = 0; lane < {VEC}; ++lane) {{",
               *(f"            const {rtype[j]} r{j} = v{j}[lane];" for j in loaded),
               *(f"            {b}" for b in body[len(loaded):len(body) - len(stores)]),
               *(f"            o{j}[lane] = r{s.register};" for j, s in enumerate(stores)),
               "        }",
               *(f"        store4_bytes(out{s.out}, {_vector_store_offset(s, shape)}, o{j});"
                 if dtypes[s.register] in BYTE_DTYPES else
                 f"        storev_from_float<{VEC}>(out{s.out}, "
                 f"{_vector_store_offset(s, shape)}, o{j});"
                 for j, s in enumerate(stores)),
               "    }",
               "}"]
    if not uses_groups(program):
        loop = ["    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n;"
                " i += gridDim.x * blockDim.x) {", *(f"        {b}" for b in body), "    }"]
    else:
        loop = ["    const int groups = (n >> 2) + ((n & 3) != 0);",
                "    for (int g = blockIdx.x * blockDim.x + threadIdx.x; g < groups;"
                " g += gridDim.x * blockDim.x) {",
                *words.values(),
                "#pragma unroll",
                "        for (unsigned int lane = 0; lane < 4; ++lane) {",
                "            const int i = 4 * g + (int)lane;",
                "            if (i >= n) break;",
                *(f"            {b}" for b in body),
                "        }",
                "    }"]
    return "\n".join([
        '#include "launch_order.cuh"',
        *(['#include "bf16.cuh"'] if set(HALF_DTYPES) & set(dtypes) or vec else []),
        '#include "elementwise.cuh"',
        *([_HELPERS] if any(i.op in ("unary", "binary", "scalar") for i in program) else []),
        *([_BYTE_HELPERS] if vec and set(BYTE_DTYPES) & set(dtypes) else []),
        *(['#include "philox.cuh"'] if uses_groups(program) else []),
        f'extern "C" __global__ void {KERNEL_NAME}({", ".join(params)}, int n) {{',
        "    await_previous_kernel();",
        *head,
        *loop,
        "}",
        *vec,
        ""])


def _store_offset(store, shape: tuple) -> str:
    """The C expression of the element output element i of the program stores to: i, or its
    place in a joined output (the view its part is)."""
    return "i" if store.view is None else _view_offset(store.view, shape)


def _vector_store_offset(store, shape: tuple) -> str:
    """VEC_KERNEL_NAME's offset of its four elements' store: the first's place in a joined
    output, else the elements' own index (spelt from q as it always was: the every-instruction
    program's comparisons came out different with `(long long)(i)` there, on an H200)."""
    if store.view is None:
        return f"{VEC}LL * q"
    return f"(long long)({_view_offset(store.view, shape)})"


def _vector_load(j: int, in_shape: tuple, shape: tuple, load, dtype: str, view=None) -> str:
    """VEC_KERNEL_NAME's read of input j into v{j} for output elements i .. i + VEC - 1."""
    how = _lane_load(in_shape, shape, view)
    if how == "one":
        return (f"        for (int lane = 0; lane < {VEC}; ++lane) "
                f"v{j}[lane] = {load(j, in_shape)};")
    at = "i" if how == "full" else _offset(in_shape, shape, view)
    if dtype in BYTE_DTYPES:
        return f"        load4_bytes(in{j}, (long long)({at}), v{j});"
    return f"        loadv_as_float<{VEC}>(in{j}, (long long)({at}), v{j});"


def _program(node: Node) -> tuple:
    """kernel_source's (and vectorizable's) arguments for node."""
    views = node.attrs.get("views")
    return (node.attrs["program"], node.attrs["results"], tuple(node.attrs["shape"]),
            tuple(tuple(v.shape) for v in node.inputs), tuple(v.dtype for v in node.inputs),
            tuple(views) if views else None)


def generated_kernels(node: Node) -> list[tuple[str, str]]:
    """The (source, kernel name)s of node's program, which the backend compiles ahead."""
    source = kernel_source(*_program(node))
    return [(source, KERNEL_NAME)] + (
        [(source, VEC_KERNEL_NAME)] if vectorizable(*_program(node)) else [])


def pointwise_forward(ctx, node: Node, ins: list, outs: list) -> None:
    """Run node's program (ops/pointwise.py) as one generated kernel."""
    shape = tuple(node.attrs["shape"])
    n = math.prod(shape)
    if max([n, *(v.size for v in (*node.inputs, *node.outputs))]) > MAX_INT:
        raise ShapeError(f"pointwise: {n} elements exceed the kernel's 32-bit indexing")
    for what, values, arrays in (("input", node.inputs, ins), ("output", node.outputs, outs)):
        for v, a in zip(values, arrays):
            # float32, bf16 or float16 values, bool masks and casts' ints; uint8 masks, int64
            # step counter of dropout programs
            if v.dtype not in _CTYPES or not isinstance(a, cp.ndarray) \
                    or a.dtype != np.dtype(storage_dtype(v.dtype)) or not a.flags.c_contiguous:
                raise ShapeError(f"pointwise {what}: the cuda kernel takes C-contiguous CuPy "
                                 f"arrays of the node's dtypes ({', '.join(_CTYPES)}), got "
                                 f"{type(a).__name__} {getattr(a, 'dtype', '')} for {v.dtype}")
            if tuple(a.shape) != tuple(v.shape):
                raise ShapeError(f"pointwise {what}: expected shape {v.shape}, got {a.shape}")
    if n == 0:
        return
    source = kernel_source(*_program(node))
    if n % VEC == 0 and vectorizable(*_program(node)) \
            and all(a.data.ptr % 16 == 0 for a in (*ins, *outs)):
        name, work = VEC_KERNEL_NAME, n // VEC
    else:
        name = KERNEL_NAME
        work = (n + 3) // 4 if uses_groups(node.attrs["program"]) else n
    kernel = compiler.generated_kernel(source, name)
    kernel(_grid(work), (BLOCK,), (*ins, *outs, np.int32(n)), stream=ctx.stream)


def instruction_forward(ctx, node: Node, ins: list, outs: list) -> None:
    """Run a lone elementwise node as the generated kernel of its one-instruction program."""
    pointwise_forward(ctx, as_program(node), ins, outs)


# Ops whose every node runs as a one-instruction program (binary, scalar and cast kinds
# without a kernel of their own come here through their families' launchers too).
INSTRUCTION_OPS = ("unary", "compare", "compare_scalar", "logical", "logical_not", "where",
                   "masked_fill")
IMPLS = {"pointwise": lambda node, ins, outs, ctx: pointwise_forward(ctx, node, ins, outs),
         **{op: lambda node, ins, outs, ctx: instruction_forward(ctx, node, ins, outs)
            for op in INSTRUCTION_OPS}}
GENERATED_KERNELS = {"pointwise": generated_kernels,
                     **{op: lambda node: generated_kernels(as_program(node))
                        for op in INSTRUCTION_OPS}}
