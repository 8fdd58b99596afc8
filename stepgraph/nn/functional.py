"""Functional ops on symbolic tensors: what modules and losses call while being traced."""
from __future__ import annotations

from ..errors import ShapeError
from ..ir.trace import Tensor
from .module import Parameter


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _p(x: Tensor, p: Parameter | None):
    return None if p is None else x.tracer.param(p)


def linear(x: Tensor, weight: Parameter, bias: Parameter | None = None) -> Tensor:
    ins = [x, _p(x, weight)] + ([_p(x, bias)] if bias is not None else [])
    return x.tracer.op("linear", ins, act=None)


def activation(x: Tensor, kind: str, slope: float = 0.01) -> Tensor:
    return x.tracer.op("act", [x], kind=kind, slope=float(slope))


def conv2d(x: Tensor, weight: Parameter, bias: Parameter | None, stride, padding) -> Tensor:
    ins = [x, _p(x, weight)] + ([_p(x, bias)] if bias is not None else [])
    return x.tracer.op("conv2d", ins, stride=_pair(stride), padding=_pair(padding))


def max_pool2d(x: Tensor, kernel_size, stride=None) -> Tensor:
    kernel = _pair(kernel_size)
    return x.tracer.op_all("maxpool2d", [x], kernel=kernel,
                           stride=_pair(stride) if stride is not None else kernel)[0]


def flatten(x: Tensor, start_dim: int = 1) -> Tensor:
    size = 1
    for d in x.shape[start_dim:]:
        size *= d
    return x.reshape(*x.shape[:start_dim], size)


def dropout(x: Tensor, p: float, training: bool, per_channel: bool = False) -> Tensor:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    if per_channel and x.ndim != 4:
        raise ShapeError(f"Dropout2d expects (N, C, H, W) input, got {x.shape}")
    t = x.tracer
    return t.op_all("dropout", [x, t.rng_step()], p=float(p), seed=t.seed,
                    site=t.next_dropout_site(), per_channel=per_channel)[0]


def log_softmax(x: Tensor, dim: int = 1) -> Tensor:
    if x.ndim != 2 or dim not in (1, -1):
        raise ShapeError(f"log_softmax supports (batch, classes) over dim 1, got {x.shape}, dim {dim}")
    return x.tracer.op("log_softmax", [x])
