"""Tensor arithmetic: + - * / ** // % and @ with tensors (broadcasting) or Python scalars on
either side, their names (add, sub, mul, div, floor_divide, remainder, ...), and the products
mm / bmm / mv / dot / outer / addmm / baddbmm / t. Attached to Tensor when this module is
imported (ir/tensor.py `attach_methods`).
"""
from __future__ import annotations

import numbers

from ..errors import ShapeError
from .promotion import DEFAULT_FLOAT, is_floating, result_type
from .tensor import Tensor, _is_scalar, attach_methods


class _MathMethods:
    """Tensor's arithmetic and products (module doc)."""

    # ---- arithmetic ----
    def _binary(self, other, kind: str, reverse: bool = False) -> Tensor:
        """self kind other (other kind self when reverse), both cast first to torch's result
        type (ir/promotion.py): a true division of integers gives the default float."""
        if not _is_scalar(other):
            other = self._coerce(other, kind)
        dtype = result_type(self, other)
        if kind == "div" and not is_floating(dtype):
            dtype = DEFAULT_FLOAT
        x = self._cast(dtype)
        if _is_scalar(other):
            if reverse and kind in ("sub", "div"):
                kind = "r" + kind
            return self.tracer.op("scalar", [x], kind=kind, value=float(other))
        a, b = (other._cast(dtype), x) if reverse else (x, other._cast(dtype))
        return self.tracer.op("binary", [a, b], kind=kind)

    def __add__(self, other):
        return self._binary(other, "add")

    def __radd__(self, other):
        return self._binary(other, "add", reverse=True)

    def __sub__(self, other):
        return self._binary(other, "sub")

    def __rsub__(self, other):
        return self._binary(other, "sub", reverse=True)

    def __mul__(self, other):
        return self._binary(other, "mul")

    def __rmul__(self, other):
        return self._binary(other, "mul", reverse=True)

    def __truediv__(self, other):
        return self._binary(other, "div")

    def __rtruediv__(self, other):
        return self._binary(other, "div", reverse=True)

    def __neg__(self):
        return self.tracer.op("scalar", [self], kind="mul", value=-1.0)

    def __pos__(self):
        return self

    def __pow__(self, exponent):
        if not _is_scalar(exponent):
            return self._binary(exponent, "pow")
        x = self._cast(result_type(self, exponent))
        return x.tracer.op("scalar", [x], kind="pow", value=float(exponent))

    pow = __pow__

    def __matmul__(self, other):
        other = self._coerce(other, "matmul")
        if other.ndim == 1:                                   # (..., K) @ (K,) -> (...)
            y = self @ other.reshape(other.shape[0], 1)
            return y.reshape(*y.shape[:-1])
        if other.ndim >= 3:
            return self._batched_matmul(other)
        if other.ndim != 2 or self.ndim == 0:
            self._unsupported(f"matmul of {self.shape} @ {other.shape} (only (..., K) @ (K, N) "
                              "and (..., M, K) @ (..., K, N))")
        if self.ndim == 1:                                    # (K,) @ (K, N) -> (N,)
            return (self.reshape(1, -1) @ other).reshape(other.shape[1])
        if self.ndim == 2:
            return self.tracer.op("matmul", [self, other])
        lead = self.shape[:-1]                                # (..., K): rows of one matmul
        y = self.tracer.op("matmul", [self.reshape(-1, self.shape[-1]), other])
        return y.reshape(*lead, other.shape[1])

    matmul = __matmul__

    def _batched_matmul(self, other: Tensor) -> Tensor:
        """(..., M, K) @ (..., K, N) with the same batch dims: one bmm over their product.
        Batch dims that would broadcast are not supported."""
        if self.ndim != other.ndim or self.shape[:-2] != other.shape[:-2]:
            self._unsupported(f"matmul of {self.shape} @ {other.shape} (batched operands need "
                              "the same batch dims; broadcasting them is not supported)")
        lead = self.shape[:-2]
        a = self.reshape(-1, *self.shape[-2:])
        b = other.reshape(-1, *other.shape[-2:])
        y = self.tracer.op("bmm", [a, b])
        return y.reshape(*lead, *y.shape[-2:])

    # ---- arithmetic and products by name (torch.Tensor.add, mm, outer, ...) ----
    def add(self, other, *, alpha=1) -> Tensor:
        """self + alpha * other."""
        return self + (other if alpha == 1 else self._coerce_any(other, "add") * alpha)

    def sub(self, other, *, alpha=1) -> Tensor:
        """self - alpha * other."""
        return self - (other if alpha == 1 else self._coerce_any(other, "sub") * alpha)

    def mul(self, other) -> Tensor:
        return self * other

    def div(self, other, *, rounding_mode=None) -> Tensor:
        """self / other; rounding_mode "trunc" or "floor" rounds the quotient."""
        if rounding_mode not in (None, "trunc", "floor"):
            raise ValueError(f"div: rounding_mode must be None, 'trunc' or 'floor', got "
                             f"{rounding_mode!r}")
        return self / other if rounding_mode is None else self._rounded(other, rounding_mode)

    subtract, multiply, divide, true_divide = sub, mul, div, div

    def _rounded(self, other, kind: str, reverse: bool = False) -> Tensor:
        """floor(a / b) (kind "floor"), trunc(a / b) ("trunc") or a - b * floor(a / b)
        ("mod", the remainder with the divisor's sign, as Python's %), a = self and b = other
        (swapped when reverse). With integer operands only, the result is an integer tensor
        computed in float64: exact for magnitudes below 2^53."""
        ints = not self.dtype.is_floating_point and (
            isinstance(other, numbers.Integral) or
            isinstance(other, Tensor) and not other.dtype.is_floating_point)
        x = self._cast("float64") if ints else self
        o = other if _is_scalar(other) else self._coerce(other, kind)
        o = o._cast("float64") if ints and isinstance(o, Tensor) else o
        a, b = (o, x) if reverse else (x, o)
        q = a / b
        y = q.trunc() if kind == "trunc" else q.floor()
        if kind == "mod":
            y = a - b * y
        return y._cast(self.dtype) if ints else y

    def __floordiv__(self, other):
        """floor(self / other), as torch.floor_divide (`_rounded`)."""
        return self._rounded(other, "floor")

    def __rfloordiv__(self, other):
        return self._rounded(other, "floor", reverse=True)

    def __mod__(self, other):
        """self - other * floor(self / other), as torch.remainder (`_rounded`)."""
        return self._rounded(other, "mod")

    def __rmod__(self, other):
        return self._rounded(other, "mod", reverse=True)

    floor_divide, remainder = __floordiv__, __mod__

    def _coerce_any(self, other, op: str):
        """A Python number as it is, anything else as a tensor of this trace."""
        return other if _is_scalar(other) else self._coerce(other, op)

    def mm(self, mat2) -> Tensor:
        """(n, k) @ (k, m)."""
        mat2 = self._coerce(mat2, "mm")
        if self.ndim != 2 or mat2.ndim != 2:
            raise ShapeError(f"mm: needs two matrices, got {self.shape} and {mat2.shape}")
        return self @ mat2

    def bmm(self, mat2) -> Tensor:
        """(b, n, k) @ (b, k, m)."""
        mat2 = self._coerce(mat2, "bmm")
        if self.ndim != 3 or mat2.ndim != 3:
            raise ShapeError(f"bmm: needs two 3-d tensors, got {self.shape} and {mat2.shape}")
        return self @ mat2

    def mv(self, vec) -> Tensor:
        """(n, k) @ (k,)."""
        vec = self._coerce(vec, "mv")
        if self.ndim != 2 or vec.ndim != 1:
            raise ShapeError(f"mv: needs a matrix and a vector, got {self.shape} and "
                             f"{vec.shape}")
        return self @ vec

    def dot(self, other) -> Tensor:
        """The sum of the products of two 1-d tensors of one length."""
        other = self._coerce(other, "dot")
        if self.ndim != 1 or other.shape != self.shape:
            raise ShapeError(f"dot: needs two 1-d tensors of one length, got {self.shape} and "
                             f"{other.shape}")
        return (self * other).sum()

    inner = dot

    def outer(self, vec2) -> Tensor:
        """The (n, m) products of two 1-d tensors: one broadcast multiply, as exact as
        torch's."""
        vec2 = self._coerce(vec2, "outer")
        if self.ndim != 1 or vec2.ndim != 1:
            raise ShapeError(f"outer: needs two 1-d tensors, got {self.shape} and {vec2.shape}")
        return self.reshape(-1, 1) * vec2.reshape(1, -1)

    ger = outer

    def addmm(self, mat1, mat2, *, beta=1, alpha=1) -> Tensor:
        """beta * self + alpha * (mat1 @ mat2)."""
        return self._scaled_sum(self._coerce(mat1, "addmm").mm(mat2), beta, alpha)

    def baddbmm(self, batch1, batch2, *, beta=1, alpha=1) -> Tensor:
        """beta * self + alpha * (batch1 @ batch2), batched."""
        return self._scaled_sum(self._coerce(batch1, "baddbmm").bmm(batch2), beta, alpha)

    def _scaled_sum(self, product: Tensor, beta, alpha) -> Tensor:
        product = product if alpha == 1 else product * alpha
        # torch ignores self when beta is 0 (NaN in it does not propagate)
        return product if beta == 0 else (self if beta == 1 else self * beta) + product

    def t(self) -> Tensor:
        """The transpose of a matrix; a 0-d or 1-d tensor as it is."""
        if self.ndim > 2:
            raise ShapeError(f"t: expects a tensor of at most 2 axes, got {self.shape}")
        return self.T


def attach(cls: type) -> None:
    """Give Tensor the arithmetic and products of this module."""
    attach_methods(_MathMethods, cls)


attach(Tensor)
