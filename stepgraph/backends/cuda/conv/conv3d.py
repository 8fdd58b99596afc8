"""conv3d and its two gradients on the cuda backend: cuDNN's graphs (conv_cudnn.py) over 5-D
NCDHW tensors, the only family that runs them (the own kernels of conv.py are 2-D).

  conv3d             conv_fprop; with a bias, either in the graph ("cudnn:<i>") or a plain
                     plan followed by conv.py's bias epilogue over y viewed as (N, O,
                     Do*Ho, Wo) ("cudnn:<i>+epilogue"), as conv2d's forward offers them
  conv3d_grad_input  conv_dgrad
  conv3d_grad_weight conv_wgrad (the bias's gradient is a reduce_sum node of its own)
Every plan that builds is a candidate, timed once per problem on the real buffers and the
fastest kept (conv.py `_run_faster`, `_with_cudnn`: the same autotuner, keys and on-disk
choices as conv2d's). float32 (precision "fp32" excludes tensor-core engines, "tf32" lets
them compete) and bfloat16 (uint16 bits, float32 accumulation), as conv_cudnn's filters say.
Without a usable cuDNN the ops raise BackendUnavailableError naming the cuda extra; with no
plan for a problem (float64, say), UnsupportedOpError with cuDNN's reason.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

from ....errors import ShapeError
from ....ops.conv import conv_out
from . import conv_cudnn
from .conv import (EPILOGUE_SUFFIX, Offer, _contiguous, _run_offer, _same_dtype, _then,
                   conv2d_bias_act, start_plans)


@dataclass(frozen=True)
class Geometry3d:
    """One 3-D convolution: x (n, c, d, h, w), weight (o, c / groups, *kernel), and per
    spatial axis (depth, height, width) its kernel, stride, padding and dilation."""
    n: int
    c: int
    d: int
    h: int
    w: int
    o: int
    kernel: tuple[int, int, int]
    stride: tuple[int, int, int]
    padding: tuple[int, int, int]
    dilation: tuple[int, int, int] = (1, 1, 1)
    groups: int = 1

    plain = False            # conv_cudnn.needed: only cuDNN runs a 3-D convolution

    @property
    def out(self) -> tuple[int, int, int]:
        """(Do, Ho, Wo)."""
        return tuple(conv_out(*a) for a in zip((self.d, self.h, self.w), self.kernel,
                                               self.stride, self.padding, self.dilation))

    @property
    def w_shape(self) -> tuple[int, ...]:
        return (self.o, self.c // self.groups, *self.kernel)

    @property
    def macs(self) -> int:
        """Multiply-adds of the forward (and of each gradient), as Geometry.macs."""
        return math.prod(self.y_shape) * math.prod(self.w_shape[1:])

    @property
    def x_shape(self) -> tuple[int, ...]:
        return (self.n, self.c, self.d, self.h, self.w)

    @property
    def y_shape(self) -> tuple[int, ...]:
        return (self.n, self.o, *self.out)

    def cudnn_dims(self) -> dict[str, list[int]]:
        """Dims of the cuDNN graph's tensors x, w, y and the bias b (conv_cudnn._graph)."""
        return {"x": list(self.x_shape), "w": list(self.w_shape), "y": list(self.y_shape),
                "b": [1, self.o, 1, 1, 1]}

    def cudnn_conv(self) -> dict[str, list[int]]:
        return {"padding": list(self.padding), "stride": list(self.stride),
                "dilation": list(self.dilation)}


def geometry(x_shape, w_shape, attrs: dict) -> Geometry3d:
    """The Geometry3d of a conv3d node's NCDHW x and weight shapes and attrs."""
    groups = int(attrs.get("groups", 1))
    n, c, d, h, w = x_shape
    o, c_group, *kernel = w_shape
    if c != c_group * groups or o % groups:
        raise ShapeError(f"conv3d: input has {c} channels and weight {tuple(w_shape)}, which "
                         f"do not make {groups} group(s) (want C = {c_group} * groups, "
                         f"O % groups 0)")
    return Geometry3d(n, c, d, h, w, o, tuple(kernel), tuple(attrs["stride"]),
                      tuple(attrs["padding"]), tuple(attrs.get("dilation", (1, 1, 1))), groups)


def _as_4d(y):
    """y (N, O, Do, Ho, Wo) viewed as (N, O, Do * Ho, Wo): the bias epilogue's NCHW shape
    (a channel's elements stay contiguous)."""
    n, o, d, h, w = y.shape
    return y.reshape(n, o, d * h, w)


def _forward_paths(ctx, g: Geometry3d, x, w, y, bias,
                   only: str | None) -> dict[str, Callable[[], None]]:
    """The forward's cuDNN candidates: each plan with the bias in its graph, and, with a
    bias, each plain plan followed by the bias epilogue; `only`: that one candidate (as
    conv.py's _forward_cudnn_paths)."""
    def with_epilogue(plain_only: str | None) -> dict[str, Callable[[], None]]:
        if bias is None:
            return {}
        epilogue = functools.partial(conv2d_bias_act, ctx, _as_4d(y), bias, False)
        plain = conv_cudnn.conv2d_paths(ctx, g, x, w, y, op="conv3d", only=plain_only)
        return {name + EPILOGUE_SUFFIX: _then(run, epilogue) for name, run in plain.items()}

    if only is not None and only.endswith(EPILOGUE_SUFFIX):
        return with_epilogue(only.removesuffix(EPILOGUE_SUFFIX))
    fused = conv_cudnn.conv2d_paths(ctx, g, x, w, y, bias, op="conv3d", only=only)
    # bf16: the epilogue rounds the sum before adding the bias; only where nothing fuses it
    # (ahead of the builds, the fused plans are expected to build: conv_cudnn.starting_ahead)
    fuses = bool(fused) or conv_cudnn.is_starting_ahead()
    if only is not None or (str(x.dtype) in ("uint16", "float16") and bias is not None and fuses):
        return fused
    return fused | with_epilogue(None)


def conv3d_forward(node, ins, outs, ctx) -> None:
    """y = conv3d(x, w) + b (ops/conv.py, "conv3d")."""
    _run_offer(conv3d_forward, _forward_offer, node, ins, outs, ctx)


def _forward_offer(node, ins, outs, ctx) -> Offer:
    x, w = _contiguous(ins[0], "x"), _contiguous(ins[1], "weight")
    g = geometry(x.shape, w.shape, node.attrs)
    bias = _contiguous(ins[2], "bias", (g.o,)) if len(ins) == 3 else None
    y = _contiguous(outs[0], "y", g.y_shape)
    _same_dtype(node.op, x=x, weight=w, bias=bias, y=y)
    return Offer(g, conv_cudnn.ir_dtype(x.dtype), {}, functools.partial(
        _forward_paths, ctx, g, x, w, y, bias))


def conv3d_grad_input(node, ins, outs, ctx) -> None:
    """dx of conv3d given dy and w (ops/conv.py, "conv3d_grad_input"): cuDNN conv_dgrad."""
    _run_offer(conv3d_grad_input, _grad_input_offer, node, ins, outs, ctx)


def _grad_input_offer(node, ins, outs, ctx) -> Offer:
    w = _contiguous(ins[1], "weight")
    g = geometry(tuple(node.attrs["input_shape"]), w.shape, node.attrs)
    dy = _contiguous(ins[0], "dy", g.y_shape)
    dx = _contiguous(outs[0], "dx", g.x_shape)
    _same_dtype(node.op, dy=dy, weight=w, dx=dx)
    return Offer(g, conv_cudnn.ir_dtype(dy.dtype), {}, lambda only: (
        conv_cudnn.grad_input_paths(ctx, g, dy, w, dx, op=node.op, only=only)))


def conv3d_grad_weight(node, ins, outs, ctx) -> None:
    """dw of conv3d given dy and x (ops/conv.py, "conv3d_grad_weight"): cuDNN conv_wgrad."""
    _run_offer(conv3d_grad_weight, _grad_weight_offer, node, ins, outs, ctx)


def _grad_weight_offer(node, ins, outs, ctx) -> Offer:
    x = _contiguous(ins[1], "x")
    g = geometry(x.shape, tuple(node.attrs["weight_shape"]), node.attrs)
    dy = _contiguous(ins[0], "dy", g.y_shape)
    dw = _contiguous(outs[0], "dw", g.w_shape)
    _same_dtype(node.op, dy=dy, x=x, dw=dw)
    return Offer(g, conv_cudnn.ir_dtype(x.dtype), {}, lambda only: (
        conv_cudnn.grad_weight_paths(ctx, g, dy, x, dw, op=node.op, only=only)))


IMPLS = {
    "conv3d": conv3d_forward,
    "conv3d_grad_input": conv3d_grad_input,
    "conv3d_grad_weight": conv3d_grad_weight,
}
OFFERS = {"conv3d": _forward_offer, "conv3d_grad_input": _grad_input_offer,
          "conv3d_grad_weight": _grad_weight_offer}
# op -> start(node, ins, outs, ctx): its cuDNN plans, built ahead (CudaBackend.prepare)
BUILDS_AHEAD = {op: functools.partial(start_plans, offer) for op, offer in OFFERS.items()}
BF16_OPS = frozenset(IMPLS)        # cuDNN's bf16 graphs; the epilogue's uint16 instantiation
FP16_OPS = BF16_OPS                # cuDNN's HALF graphs; the epilogue's fp16_bits one


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: the kernels this module launches}: conv.py's bias epilogue."""
    from .conv import EPILOGUE_CTYPES, EPILOGUE_KERNEL

    return {"conv.cu": {f"{EPILOGUE_KERNEL}<{ctype}>" for ctype in EPILOGUE_CTYPES.values()}}
