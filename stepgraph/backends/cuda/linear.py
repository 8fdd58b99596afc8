"""The dense ops on cuBLASLt: `matmul` and the fused `linear` (GEMM + bias + activation).

Row-major throughout; gemm.py says how a row-major product becomes a column-major cuBLASLt
call without copies. For linear, y (N, M) = x (N, K) @ w (M, K)^T:
  cuBLASLt A = w's memory, stored (K, M) ld K, op T -> (M, K)
  cuBLASLt B = x's memory, stored (K, N) ld K, op N -> (K, N)
  cuBLASLt D = y's memory, stored (M, N) ld M; the bias (M,) runs along D's rows.
Backward GEMMs arrive as matmul nodes (autodiff/rules.py) and need no copies either:
  dx = matmul(dz, w):               A = w   (K, M) ld K op N, B = dz (M, N) ld M op N, D (K, N)
  dw = matmul(dz, x, trans_a=True): A = x   (K, N) ld K op N, B = dz (M, N) ld M op T, D (K, M)
"""
from __future__ import annotations

from . import gemm
from .small_matmul import is_small, small_matmul_forward

# cuBLASLt's GELU epilogue is the tanh approximation, so it serves gelu_tanh only; exact (erf)
# gelu takes the BIAS epilogue and the activation kernel. Set False to run gelu_tanh through
# the kernel too (if the epilogue's tanh differs from the reference by more than wanted).
GELU_TANH_IN_EPILOGUE = True


def _slope(attrs: dict) -> float:
    slope = attrs.get("slope")
    return 0.01 if slope is None else float(slope)


def _act_forward(ctx, x, y, kind: str, slope: float) -> None:
    from . import launchers  # imported on use: written beside this file, may import later

    launchers.act_forward(ctx, x, y, kind, slope)


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

    if x.dtype == "float32" and is_small(x.shape[0], w.shape[0], x.shape[1]):
        small_matmul_forward(ctx, x, w, y, trans_b=True, bias=bias, z=z, act=kind, slope=slope)
        return
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
    # Otherwise: the GEMM with bias into z (or into y, then the activation in place).
    pre = y if z is None else z
    gemm.matmul(ctx, x, w, pre, trans_b=True, epilogue=_epilogue("DEFAULT", bias), bias=bias)
    _act_forward(ctx, pre, y, kind, slope)


def matmul_forward(node, ins, outs, ctx) -> None:
    """c = op(a) @ op(b) with attrs trans_a / trans_b (ops.py, "matmul")."""
    a, b, c = ins[0], ins[1], outs[0]
    trans_a, trans_b = bool(node.attrs.get("trans_a")), bool(node.attrs.get("trans_b"))
    k = a.shape[0] if trans_a else a.shape[1]
    if a.dtype == "float32" and is_small(c.shape[0], c.shape[1], k):
        small_matmul_forward(ctx, a, b, c, trans_a=trans_a, trans_b=trans_b)
        return
    gemm.matmul(ctx, a, b, c, trans_a=trans_a, trans_b=trans_b)


IMPLS = {
    "matmul": matmul_forward,
    "linear": linear_forward,
}
