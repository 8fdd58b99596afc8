"""The dense ops on cuBLASLt: `matmul` and the fused `linear` (GEMM + bias + activation).

Row-major throughout; gemm.py says how a row-major product becomes a column-major cuBLASLt
call without copies. For linear, y (N, M) = x (N, K) @ w (M, K)^T:
  cuBLASLt A = w's memory, stored (K, M) ld K, op T -> (M, K)
  cuBLASLt B = x's memory, stored (K, N) ld K, op N -> (K, N)
  cuBLASLt D = y's memory, stored (M, N) ld M; the bias (M,) runs along D's rows.
Backward GEMMs arrive as matmul nodes (autodiff/rules.py) and need no copies either:
  dx = matmul(dz, w):               A = w   (K, M) ld K op N, B = dz (M, N) ld M op N, D (K, N)
  dw = matmul(dz, x, trans_a=True): A = x   (K, N) ld K op N, B = dz (M, N) ld M op T, D (K, M)
Products of at most small_matmul.SMALL_MACS multiply-adds go to the small-GEMM kernel, float32
or bfloat16. In fp32 the others have a second candidate, small_matmul's tiled kernel (64 x 64
tiles, k split over blocks), timed against cuBLASLt once per problem (`_run_fastest`,
autotune.py).

bfloat16 (precision="bf16", operands as uint16 bits): small products on the small-GEMM kernel,
which keeps the float32 sum, bias and activation in registers and rounds y and z once each as
it stores them (the cnn's Linear(320, 50) and Linear(50, 10) at batch 64 and their gradients:
cuBLASLt spent ~23 µs a step there, in wmma, gemv and sgemm kernels). The others on cuBLASLt
(gemm.py: float32 accumulation and epilogue, D rounded once). A linear whose activation has no
cuBLASLt epilogue (exact gelu, or relu with its pre-activation saved) runs its GEMM into a
float32 scratch of the node and then elementwise.linear_bias_act, so that y and z are each
rounded once from float32 (the BIAS epilogue into bf16 z, then the activation of that, would
round y twice). The autotuner's key holds the operands' dtypes. float16 (precision="fp16",
model.half()) takes the same paths as bf16.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .. import elementwise, reduce
from ..runtime import autotune
from ..runtime.launch import _node_memory
from . import gemm, small_matmul
from .small_matmul import (has_small_kernel, is_small, small_matmul_forward, tile_matmul_forward,
                           tile_splits)

# cuBLASLt's GELU epilogue is the tanh approximation, so it serves gelu_tanh only; exact (erf)
# gelu takes the BIAS epilogue and the activation kernel. Set False to run gelu_tanh through
# the kernel too (if the epilogue's tanh differs from the reference by more than wanted).
GELU_TANH_IN_EPILOGUE = True
# Activations whose epilogue is timed against the BIAS GEMM + activation kernel: the GELU_AUX
# epilogue ran slower than the two launches on the GPT's (16384, 384) @ (384, 1536) (H200:
# tf32 144 against 116 µs, fp32 487 against 460; scripts/epilogue-bench).
TIMED_AGAINST_KERNEL = frozenset({"gelu_tanh"})
BF16_OPS = frozenset({"linear", "matmul"})
FP16_OPS = BF16_OPS            # float16 operands: the bf16 paths with CUDA_R_16F and fp16_bits


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this family may launch}: small_matmul's (the backend
    declares them, so the file compiles as one module, ahead of the first step)."""
    return small_matmul.kernel_names()


def _slope(attrs: dict) -> float:
    slope = attrs.get("slope")
    return 0.01 if slope is None else float(slope)


def _act_forward(ctx, x, y, kind: str, slope: float) -> None:

    elementwise.act_forward(ctx, x, y, kind, slope)


def _epilogue(name: str, bias) -> str:
    """RELU -> RELU_BIAS etc. when there is a bias; DEFAULT -> BIAS."""
    if bias is None:
        return name
    return "BIAS" if name == "DEFAULT" else f"{name}_BIAS"


def _gemm_fused(ctx, x, w, out, epilogue: str, bias, aux=None) -> bool:
    """out = epilogue(x @ w.T + bias); False, having launched nothing, when cuBLASLt has no
    algorithm for this epilogue and layout (the caller then runs the unfused path)."""
    aux_ld = 0
    if aux is not None:
        aux_ld = aux.strides[0] // aux.itemsize if aux.shape[0] > 1 else aux.shape[1]
        if aux_ld % 8:        # cuBLASLt's GELU aux needs a leading dimension divisible by 8
            return False
    try:
        gemm.matmul(ctx, x, w, out, trans_b=True, epilogue=_epilogue(epilogue, bias),
                    bias=bias, aux=aux, aux_ld=aux_ld)
    except gemm.GemmUnsupportedError:
        return False
    return True


def _copy(ctx, dst, src) -> None:
    """Device-to-device copy of a contiguous array on the stream (capturable, no allocation)."""
    from cupy.cuda import runtime

    runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, runtime.memcpyDeviceToDevice,
                        ctx.stream.ptr)


def linear_forward(node, ins, outs, ctx) -> None:
    """y = act(x @ w.T + b), and z = x @ w.T + b when attrs save_preact (ops.py, "linear")."""
    x, w = ins[0], ins[1]
    bias = ins[2] if len(ins) == 3 else None
    kind = node.attrs.get("act") or None
    kind = None if kind == "none" else kind
    slope = _slope(node.attrs)
    y = outs[0]
    z = outs[1] if node.attrs.get("save_preact") else None

    if has_small_kernel(x, w, y) and is_small(x.shape[0], w.shape[0], x.shape[1]):
        small_matmul_forward(ctx, x, w, y, trans_b=True, bias=bias, z=z, act=kind, slope=slope)
        return
    paths = {"cublaslt": lambda: _linear_cublaslt(ctx, x, w, y, z, bias, kind, slope, node)}
    if kind in TIMED_AGAINST_KERNEL and x.dtype == "float32":
        paths["cublaslt:unfused"] = lambda: _linear_then_act(ctx, x, w, y, z, bias, kind, slope)
    paths.update(_tile_paths(node, ctx, x, w, y, trans_a=False, trans_b=True, bias=bias, z=z,
                             act=kind, slope=slope))
    _run_fastest(node, ctx, (x, w, y) + tuple(o for o in (bias, z) if o is not None), paths)


def _linear_cublaslt(ctx, x, w, y, z, bias, kind, slope, node=None) -> None:
    if kind is None:
        gemm.matmul(ctx, x, w, y, trans_b=True, epilogue=_epilogue("DEFAULT", bias), bias=bias)
        if z is not None:
            _copy(ctx, z, y)
        return
    # One GEMM writes y (and z) when cuBLASLt has the activation as an epilogue.
    if kind == "relu" and z is None and _gemm_fused(ctx, x, w, y, "RELU", bias):
        return
    if kind == "gelu_tanh" and GELU_TANH_IN_EPILOGUE:
        if z is None and _gemm_fused(ctx, x, w, y, "GELU", bias):
            return
        if z is not None and _gemm_fused(ctx, x, w, y, "GELU_AUX", bias, aux=z):
            return
    if gemm.ir_dtype(y) in gemm.HALF_GEMM_DTYPES:
        _linear_bf16_unfused(ctx, node, x, w, y, z, bias, kind, slope)
        return
    _linear_then_act(ctx, x, w, y, z, bias, kind, slope)


def _linear_then_act(ctx, x, w, y, z, bias, kind, slope) -> None:
    """The GEMM with bias into z (or into y, then the activation in place), and the
    activation kernel."""
    pre = y if z is None else z
    gemm.matmul(ctx, x, w, pre, trans_b=True, epilogue=_epilogue("DEFAULT", bias), bias=bias)
    _act_forward(ctx, pre, y, kind, slope)


def _linear_bf16_unfused(ctx, node, x, w, y, z, bias, kind, slope) -> None:
    """bf16 or float16 y = kind(x @ w.T + bias) (and z = x @ w.T + bias): the GEMM into the
    node's float32 scratch (16-bit A and B, float32 D), then bias, activation and both
    roundings in one elementwise launch."""
    import cupy as cp


    if node is None:
        raise ValueError("linear: the bf16 unfused path needs its node (scratch memory)")
    acc = _node_memory(node, ("bf16_acc", y.shape), ctx,
                                 lambda: cp.empty(y.shape, np.float32))
    gemm.matmul(ctx, x, w, acc, trans_b=True)
    elementwise.linear_bias_act(ctx, acc, bias, y, z, kind, slope)


def matmul_forward(node, ins, outs, ctx) -> None:
    """c = op(a) @ op(b) with attrs trans_a / trans_b (ops.py, "matmul"), and with bias_grad
    db = a.sum(0) beside it: cuBLASLt's BGRADB epilogue (the sums of op(a) over k, taken as
    the GEMM reads a) timed against the GEMM and reduce.cu's column sums, the latter also
    after the small and tiled kernels, which have no such epilogue. With add_c, c = op(a) @
    op(b) + ins[2] (compile/matmul_add.py): cuBLASLt's C with beta = 1, and the small and
    tiled kernels add it as they store c; no path launches an add."""
    a, b, c = ins[0], ins[1], outs[0]
    trans_a, trans_b = bool(node.attrs.get("trans_a")), bool(node.attrs.get("trans_b"))
    db = outs[1] if node.attrs.get("bias_grad") else None
    addend = ins[2] if node.attrs.get("add_c") else None
    k = a.shape[0] if trans_a else a.shape[1]
    product = dict(trans_a=trans_a, trans_b=trans_b, addend=addend)

    def then_sum(launch):
        if db is None:
            return launch
        return lambda: (launch(), reduce.reduce_sum_forward(ctx, node, a, db, (0,)))

    if has_small_kernel(a, b, c) and is_small(c.shape[0], c.shape[1], k):
        then_sum(lambda: small_matmul_forward(ctx, a, b, c, **product))()
        return
    paths = {"cublaslt": then_sum(lambda: gemm.matmul(ctx, a, b, c, **product))}
    if db is not None:
        paths["cublaslt:bgrad"] = lambda: _matmul_bias_grad(ctx, a, b, c, db, trans_b,
                                                            paths["cublaslt"])
    paths.update({name: then_sum(run) for name, run in
                  _tile_paths(node, ctx, a, b, c, **product).items()})
    _run_fastest(node, ctx, (a, b, c) + tuple(x for x in (db, addend) if x is not None), paths)


def _matmul_bias_grad(ctx, a, b, c, db, trans_b: bool, unfused: Callable[[], None]) -> None:
    """c = a^T @ op(b) and db = a.sum(0) in one GEMM (BGRADB); `unfused` where cuBLASLt has no
    algorithm for the epilogue with these layouts."""
    try:
        gemm.matmul(ctx, a, b, c, trans_a=True, trans_b=trans_b, epilogue="BGRADB", bias=db)
    except gemm.GemmUnsupportedError:
        unfused()


# ---- choosing between cuBLASLt and the tiled kernel ------------------------------------------

PATH = "auto"        # "auto" (timed per problem), "cublaslt" or "tile" (tests force one)


def _tile_paths(node, ctx, a, b, c, **kwargs) -> dict[str, Callable[[], None]]:
    """{"tile:sS": launch} for each k split of small_matmul.tile_splits, when the tiled kernel
    applies: float32 operands at precision fp32 (TF32 GEMMs are cuBLASLt's)."""
    if ctx.precision != "fp32" or any(x.dtype != "float32" for x in (a, b, c)):
        return {}

    m, n = c.shape
    k = a.shape[0] if kwargs.get("trans_a") else a.shape[1]
    paths = {}
    for splits in tile_splits(m, n, k):
        def run(splits=splits):
            partial = None
            if splits > 1:
                import cupy as cp

                partial = _node_memory(node, ("tile_matmul", splits * m * n), ctx,
                                                 lambda: cp.empty(splits * m * n, np.float32))
            tile_matmul_forward(ctx, a, b, c, splits=splits, partial=partial, **kwargs)
        paths[f"tile:s{splits}"] = run
    return paths


def _run_fastest(node, ctx, operands, paths: dict[str, Callable[[], None]]) -> None:
    """Run one of `paths` ("cublaslt" first): PATH's family when forced; else the fastest as
    timed on real buffers once per problem (autotune.py); during a capture with no timing
    yet, cuBLASLt."""
    if PATH != "auto":
        if PATH not in ("cublaslt", "tile"):
            raise ValueError(f"linear.PATH must be 'auto', 'cublaslt' or 'tile', got {PATH!r}")
        autotune.run_family(paths, PATH, "cublaslt")
        return
    key = (node.op, tuple(sorted(node.attrs.items())), ctx.precision, tuple(paths),
           tuple((x.shape, x.strides, str(x.dtype)) for x in operands))
    autotune.run_fastest(ctx, key, paths, "cublaslt")


IMPLS = {
    "matmul": matmul_forward,
    "linear": linear_forward,
}
