"""Launchers of elementwise.cu: activations and their gradients, add, fill, dropout (Philox
masks, per element or per channel) and the bf16 linear's bias + activation epilogue.

precision="bf16": the act, act_grad, add and dropout kernels are templates on the element
storage (ELEMENT_CTYPES: float32, or bfloat16 as uint16 raw bits), computing in float32 and
rounding each bf16 output once. `BF16_OPS` lists the ops of this family that take bf16
operands (compile/autocast.py check_bf16_support). float16 (ELEMENT_CTYPES' fp16_bits) takes
the same kernels, rounded once on store as float16; `FP16_OPS` lists them, fill among them (its
value rounded on the host, written as bits).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ... import rng
from ...errors import ShapeError
from .runtime.launch import (BLOCK, ELEMENT_CTYPES, _act_code, _aligned, _check, _check_int32,
                             _check_scalar, _element_ctype, _grid, _launch, _or_null, _slope,
                             _typed)

FILL_CTYPES = {np.dtype("float32"): "float", np.dtype("float64"): "double",
               np.dtype("int32"): "int", np.dtype("int64"): "long long",
               np.dtype("uint8"): "unsigned char", np.dtype("uint16"): "unsigned short"}
# fill: zero blocks of bf16 gradients (compile/slice_sums.py)
BF16_OPS = frozenset({"act", "act_grad", "add", "dropout", "dropout_grad", "fill"})
FP16_OPS = BF16_OPS | {"fill"}


def act_forward(ctx, x, y, kind: str, slope: float = 0.01) -> None:
    """y = kind(x) elementwise, float32 or bf16 (y of x's dtype); y may be x (in place)."""
    code = _act_code(kind)
    ctype = _element_ctype("act input", x)
    _check("act output", y, x.dtype, x.shape)
    n = x.size
    if n:
        _launch(ctx, "elementwise.cu", _typed("act_forward_kernel", ctype), _grid((n + 3) // 4),
                (BLOCK,),
                (x, y, np.int64(n), np.int32(code), np.float32(slope), np.int32(_aligned(x, y))))


def act_backward(ctx, dy, saved, dx, kind: str, slope: float = 0.01) -> None:
    """dx = dy * kind'(saved): saved is y for relu/sigmoid/tanh, the input z otherwise. All
    three float32 or all bf16."""
    code = _act_code(kind)
    ctype = _element_ctype("act_grad dy", dy)
    _check("act_grad saved", saved, dy.dtype, dy.shape)
    _check("act_grad dx", dx, dy.dtype, dy.shape)
    n = dy.size
    if n:
        _launch(ctx, "elementwise.cu", _typed("act_backward_kernel", ctype),
                _grid((n + 3) // 4), (BLOCK,),
                (dy, saved, dx, np.int64(n), np.int32(code), np.float32(slope),
                 np.int32(_aligned(dy, saved, dx))))


def add_forward(ctx, a, b, c) -> None:
    """c = a + b, same shapes, all float32 or all bf16; c may be a or b."""
    ctype = _element_ctype("add a", a)
    _check("add b", b, a.dtype, a.shape)
    _check("add output", c, a.dtype, a.shape)
    n = a.size
    if n:
        _launch(ctx, "elementwise.cu", _typed("add_forward_kernel", ctype), _grid((n + 3) // 4),
                (BLOCK,), (a, b, c, np.int64(n), np.int32(_aligned(a, b, c))))


def fill_forward(ctx, y, value) -> None:
    """y[...] = value, for every stepgraph dtype (uint16 storage: bfloat16, value rounded;
    float16: value rounded from float32 as the NumPy backend's store, written as its bits)."""
    _check("fill output", y, dtype=None)
    bits = np.dtype("uint16") if y.dtype == np.float16 else y.dtype    # float16: its bits
    if y.dtype == np.float16:
        with np.errstate(over="ignore"):       # overflow: inf, as the kernels' stores
            scalar = np.float32(value).astype(np.float16).view(np.uint16)
    elif y.dtype == np.uint16:
        from ..numpy import bf16   # the rounding rule every bf16 kernel uses

        scalar = np.uint16(bf16.to_bits(np.float32(value)))
    elif y.dtype in FILL_CTYPES:
        scalar = y.dtype.type(value)
    else:
        raise ShapeError(f"fill: unsupported dtype {y.dtype}")
    if y.size:
        _launch(ctx, "elementwise.cu", f"fill_forward_kernel<{FILL_CTYPES[bits]}>",
                _grid(y.size), (BLOCK,), (y, np.int64(y.size), scalar))


def dropout_constants(p: float) -> tuple[np.uint32, np.float32]:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    # As the numpy reference: integer threshold on 24 bits, scale = float32(1 / (1 - p)).
    return np.uint32(rng.keep_threshold(p)), np.float32(1.0 / (1.0 - p))


def _mask_shape(x, per_channel: bool) -> tuple:
    if per_channel and x.ndim < 2:
        raise ShapeError(f"dropout per_channel needs (N, C, ...) input, got {tuple(x.shape)}")
    return tuple(x.shape[:2]) if per_channel else tuple(x.shape)


def dropout_forward(ctx, x, step, y, mask, p: float, seed: int, site: int,
                    per_channel: bool = False) -> None:
    """y = x * mask / (1 - p) with the Philox mask of (seed, site, step) (rng.py); step is the
    int64 device counter. per_channel: mask (N, C), one decision per plane (Dropout2d)."""
    threshold, scale = dropout_constants(p)
    if not 0 <= site < 2**32:
        raise ValueError(f"dropout site must fit in 32 bits, got {site}")
    ctype = _element_ctype("dropout input", x)
    _check_scalar("dropout step", step, "int64")
    _check("dropout output", y, x.dtype, x.shape)
    _check("dropout mask", mask, "uint8", _mask_shape(x, per_channel))
    n = x.size
    if not n:
        return
    key = (np.uint64(seed & (2**64 - 1)), np.uint32(site), threshold, scale)
    if per_channel:
        _check_int32("dropout per_channel", n)
        plane = n // mask.size
        name = _typed("dropout_channel_forward_kernel", ctype)
        _launch(ctx, "elementwise.cu", name, _grid(n), (BLOCK,),
                (x, step, y, mask, np.int32(n), np.int32(plane)) + key)
    else:
        vec = _aligned(x, y) and _aligned(mask, to=4)
        name = _typed("dropout_forward_kernel", ctype)
        _launch(ctx, "elementwise.cu", name, _grid((n + 3) // 4), (BLOCK,),
                (x, step, y, mask, np.int64(n)) + key + (np.int32(vec),))


def dropout_backward(ctx, dy, mask, dx, p: float, per_channel: bool = False) -> None:
    """dx = dy * mask / (1 - p), the mask broadcast over each plane when per_channel."""
    _, scale = dropout_constants(p)
    ctype = _element_ctype("dropout_grad dy", dy)
    _check("dropout_grad mask", mask, "uint8", _mask_shape(dy, per_channel))
    _check("dropout_grad dx", dx, dy.dtype, dy.shape)
    n = dy.size
    if not n:
        return
    if per_channel:
        _check_int32("dropout_grad per_channel", n)
        name = _typed("dropout_channel_backward_kernel", ctype)
        _launch(ctx, "elementwise.cu", name, _grid(n), (BLOCK,),
                (dy, mask, dx, np.int32(n), np.int32(n // mask.size), scale))
    else:
        vec = _aligned(dy, dx) and _aligned(mask, to=4)
        name = _typed("dropout_backward_kernel", ctype)
        _launch(ctx, "elementwise.cu", name, _grid((n + 3) // 4), (BLOCK,),
                (dy, mask, dx, np.int64(n), scale, np.int32(vec)))


def linear_bias_act(ctx, acc, bias, y, z, kind: str, slope: float = 0.01) -> None:
    """The bf16 linear's epilogue from its float32 GEMM result acc (N, M): z = acc + bias
    (bias (M,) or None), y = kind(z); y and z (None: not saved) bf16, each rounded once
    (linear.py runs it where cuBLASLt has no epilogue for the activation)."""
    code = _act_code(kind)
    _check("linear acc", acc)
    if acc.ndim != 2:
        raise ShapeError(f"linear acc: expected (N, M), got {tuple(acc.shape)}")
    ctype = _element_ctype("linear output", y)
    _check("linear output", y, y.dtype, acc.shape)
    if z is not None:
        _check("linear preactivation", z, y.dtype, acc.shape)
    if bias is not None:
        _check("linear bias", bias, y.dtype, (acc.shape[1],))
    if acc.size:
        name = _typed("linear_bias_act_kernel", ctype)
        _launch(ctx, "elementwise.cu", name, _grid(acc.size), (BLOCK,),
                (acc, _or_null(bias), y, _or_null(z), np.int64(acc.size),
                 np.int32(acc.shape[1]), np.int32(code), np.float32(slope)))


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name these launchers may launch}, templates expanded over the
    C types they are instantiated with (the compiler declares them; the NVRTC test checks
    that each exists and that none is missing here)."""
    typed = ("act_forward_kernel", "act_backward_kernel", "add_forward_kernel",
             "dropout_forward_kernel", "dropout_backward_kernel",
             "dropout_channel_forward_kernel", "dropout_channel_backward_kernel")
    return {"elementwise.cu": {_typed("linear_bias_act_kernel", c)
                               for c in ("unsigned short", "fp16_bits")}
            | {_typed(k, ctype) for k in typed for ctype in ELEMENT_CTYPES.values()}
            | {f"fill_forward_kernel<{ctype}>" for ctype in FILL_CTYPES.values()}}


IMPLS: dict[str, Callable] = {
    "act": lambda node, ins, outs, ctx: act_forward(
        ctx, ins[0], outs[0], node.attrs["kind"], _slope(node.attrs)),
    "act_grad": lambda node, ins, outs, ctx: act_backward(
        ctx, ins[0], ins[1], outs[0], node.attrs["kind"], _slope(node.attrs)),
    "add": lambda node, ins, outs, ctx: add_forward(ctx, ins[0], ins[1], outs[0]),
    "fill": lambda node, ins, outs, ctx: fill_forward(ctx, outs[0], node.attrs["value"]),
    "dropout": lambda node, ins, outs, ctx: dropout_forward(
        ctx, ins[0], ins[1], outs[0], outs[1], node.attrs["p"], node.attrs["seed"],
        node.attrs["site"], bool(node.attrs.get("per_channel"))),
    "dropout_grad": lambda node, ins, outs, ctx: dropout_backward(
        ctx, ins[0], ins[1], outs[0], node.attrs["p"], bool(node.attrs.get("per_channel"))),
}
