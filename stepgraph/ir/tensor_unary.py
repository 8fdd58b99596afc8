"""Tensor's elementwise math (ops/unary.py: exp, log, sqrt, abs, sign, sin, floor, round,
...), the activations relu / sigmoid / tanh / softmax / log_softmax, and maximum / minimum /
clamp. Attached to Tensor when this module is imported (ir/tensor.py `attach_methods`).
"""
from __future__ import annotations

from ..errors import ShapeError
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
