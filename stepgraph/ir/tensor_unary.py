"""Tensor's elementwise math (ops/unary.py: exp, log, sqrt, abs, sign, sin, floor, round,
...; frac, sinc, nan_to_num and heaviside composed of them), the activations relu / sigmoid /
tanh / softmax / log_softmax, and maximum / minimum / clamp. Attached to Tensor when this
module is imported (ir/tensor.py `attach_methods`).
"""
from __future__ import annotations

import math

from ..dtypes import finfo
from ..errors import ShapeError, TypePromotionError
from .promotion import DEFAULT_FLOAT
from .tensor import Tensor, _dim, _is_scalar, attach_methods


class _UnaryMethods:
    """Tensor's elementwise math and activations (module doc)."""

    # ---- activations ----
    def _act(self, kind: str) -> Tensor:
        return self.tracer.op("act", [self], kind=kind, slope=0.01)

    def relu(self) -> Tensor:
        return self._act("relu")

    def sigmoid(self) -> Tensor:
        return self._act("sigmoid")

    def tanh(self) -> Tensor:
        return self._act("tanh")

    def _last_axis(self, op: str, dim: int) -> Tensor:
        # The ops work over the last axis: move `dim` there and back. A 0-d tensor is one row
        # of one element; an empty one has no rows to normalise (the result is itself).
        d = _dim(dim, self.ndim, op)
        if self.ndim == 0:
            return self.reshape(1)._last_axis(op, 0).reshape()
        if self.value.size == 0:
            return self
        if d == self.ndim - 1:
            return self.tracer.op(op, [self])
        return self.transpose(d, -1)._last_axis(op, -1).transpose(d, -1)

    def softmax(self, dim: int) -> Tensor:
        """softmax over `dim`."""
        return self._last_axis("softmax", dim)

    def log_softmax(self, dim: int) -> Tensor:
        """log(softmax) over `dim`."""
        return self._last_axis("log_softmax", dim)

    # ---- elementwise math (ops/unary.py) ----
    def _unary(self, kind: str) -> Tensor:
        return self.tracer.op("unary", [self], kind=kind)

    def exp(self) -> Tensor:
        return self._unary("exp")

    def log(self) -> Tensor:
        return self._unary("log")

    def log1p(self) -> Tensor:
        """log(1 + x), accurate for small x."""
        return self._unary("log1p")

    def expm1(self) -> Tensor:
        """exp(x) - 1, accurate for small x."""
        return self._unary("expm1")

    def sqrt(self) -> Tensor:
        return self._unary("sqrt")

    def rsqrt(self) -> Tensor:
        """1 / sqrt(x)."""
        return self._unary("rsqrt")

    def abs(self) -> Tensor:
        return self._unary("abs")

    __abs__ = abs

    def sign(self) -> Tensor:
        """-1, 0 or 1 (NaN stays NaN); its gradient is zero."""
        return self._unary("sign")

    def sin(self) -> Tensor:
        return self._unary("sin")

    def cos(self) -> Tensor:
        return self._unary("cos")

    def erf(self) -> Tensor:
        return self._unary("erf")

    def floor(self) -> Tensor:
        return self._unary("floor")

    def ceil(self) -> Tensor:
        return self._unary("ceil")

    def round(self) -> Tensor:
        """Nearest integer, halves to even (torch.round without decimals)."""
        return self._unary("round")

    def trunc(self) -> Tensor:
        return self._unary("trunc")

    def neg(self) -> Tensor:
        return -self

    # ---- composed elementwise functions ----
    def frac(self) -> Tensor:
        """x - trunc(x): the fractional part with x's sign, as torch.frac (gradient 1)."""
        return self - self.trunc()

    def sinc(self) -> Tensor:
        """sin(pi x) / (pi x), 1 at x == 0, as torch.sinc (integer tensors give the default
        float). Zeros are replaced by 1 before the division, so their gradient is 0, as
        torch's, and no 0 / 0 reaches the backward."""
        x = self if self.dtype.is_floating_point else self._cast(DEFAULT_FLOAT)
        zero = x == 0
        px = x.masked_fill(zero, 1.0) * math.pi
        return (px.sin() / px).masked_fill(zero, 1.0)

    def nan_to_num(self, nan: float = 0.0, posinf=None, neginf=None) -> Tensor:
        """NaN, +inf and -inf replaced by `nan`, `posinf` and `neginf`, as torch.nan_to_num;
        the infinities default to the dtype's largest and lowest finite values. Integer and
        bool tensors hold none and come back as they are. No gradient reaches the replaced
        places (torch's: grad * isfinite(x))."""
        if not self.dtype.is_floating_point:
            return self
        big = finfo(self.value.dtype).max
        y = self.masked_fill(self.isnan(), nan)
        y = y.masked_fill(self.isposinf(), big if posinf is None else posinf)
        return y.masked_fill(self.isneginf(), -big if neginf is None else neginf)

    def heaviside(self, values) -> Tensor:
        """0 where x < 0, `values` (broadcast) where x == 0, 1 where x > 0 (NaN gives 0), as
        torch.heaviside; values must be a tensor of x's dtype, as torch's. No gradient (torch
        has none)."""
        values = self._coerce(values, "heaviside")
        if values.dtype != self.dtype:
            raise TypePromotionError("heaviside is not yet implemented for tensors with "
                                     "different dtypes.")
        step = (self > 0)._cast(self.dtype)
        return values.detach().where(self == 0, step)

    negative = neg

    def reciprocal(self) -> Tensor:
        """1 / x."""
        return 1.0 / self

    def square(self) -> Tensor:
        return self * self

    def __rpow__(self, base):
        """base ** self for a Python number base."""
        if not _is_scalar(base):
            return NotImplemented
        return self.tracer.op("scalar", [self], kind="rpow", value=float(base))

    def maximum(self, other) -> Tensor:
        """Elementwise max with a tensor (broadcasting; NaN propagates)."""
        return self._binary(self._coerce(other, "maximum"), "maximum")

    def minimum(self, other) -> Tensor:
        """Elementwise min with a tensor (broadcasting; NaN propagates)."""
        return self._binary(self._coerce(other, "minimum"), "minimum")

    def clamp(self, min=None, max=None) -> Tensor:
        """min(max(x, min), max); min and max Python numbers or tensors (broadcasting), either
        may be None. Gradient flows where x was kept (ties with a tensor bound: half, as
        torch.maximum's)."""
        if min is None and max is None:
            raise ShapeError("clamp: at least one of min and max must be given")
        y = self
        for bound, kind in ((min, "maximum"), (max, "minimum")):
            if bound is None:
                continue
            if _is_scalar(bound):
                y = y.tracer.op("scalar", [y], kind=kind, value=float(bound))
            else:
                y = y._binary(y._coerce(bound, "clamp"), kind)
        return y

    clip = clamp

    def clamp_min(self, min) -> Tensor:
        return self.clamp(min=min)

    def clamp_max(self, max) -> Tensor:
        return self.clamp(max=max)


def attach(cls: type) -> None:
    """Give Tensor the elementwise math and activations of this module."""
    attach_methods(_UnaryMethods, cls)


attach(Tensor)
