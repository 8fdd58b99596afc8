"""Tensor arithmetic: + - * / ** // % and @ with tensors (broadcasting) or Python scalars on
either side, their names (add, sub, mul, div, floor_divide, remainder, fmod, ...), the
composed binary functions (lerp, addcmul, addcdiv, hypot, logaddexp, xlogy, float_power) and
the products mm / bmm / mv / dot / outer / addmm / baddbmm / kron / t. Attached to Tensor when
this module is imported (ir/tensor.py `attach_methods`).
"""
from __future__ import annotations

import math
import numbers

from ..errors import ShapeError, TypePromotionError
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
        """floor(a / b) (kind "floor"), trunc(a / b) ("trunc"), a - b * floor(a / b)
        ("mod", the remainder with the divisor's sign, as Python's %) or a - b * trunc(a / b)
        ("fmod", the remainder with the dividend's sign, as C's fmod), a = self and b = other
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
        y = q.trunc() if kind in ("trunc", "fmod") else q.floor()
        if kind in ("mod", "fmod"):
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

    def fmod(self, other) -> Tensor:
        """self - other * trunc(self / other): the remainder with the dividend's sign, as
        torch.fmod (`_rounded`; remainder takes the divisor's). Float operands give NaN for a
        zero divisor, as torch; the quotient has gradient zero (torch's: -trunc(a / b) to b)."""
        if not _is_scalar(other):
            other = self._coerce(other, "fmod")
        return self._rounded(other, "fmod")

    # ---- composed binary and ternary functions (torch.lerp, addcmul, ...) ----
    def _float_operands(self, *others, what: str):
        """self and others (tensors of this trace or Python numbers) cast to their result
        type, the default float where that is an integer type: the inputs of a function
        that is only defined on floats (hypot, logaddexp, xlogy)."""
        others = [o if _is_scalar(o) else self._coerce(o, what) for o in others]
        dtype = result_type(self, *others)
        dtype = dtype if is_floating(dtype) else DEFAULT_FLOAT
        return [self._cast(dtype)] + [o if _is_scalar(o) else o._cast(dtype) for o in others]

    def lerp(self, end, weight) -> Tensor:
        """self + weight * (end - self), as torch.lerp: weight a number or a tensor (the three
        broadcast); end and a tensor weight must have self's dtype (TypePromotionError, a
        RuntimeError with torch's message, otherwise). Where weight >= 0.5 it is computed
        end - (end - self) * (1 - weight), torch's form, exact at weight 1."""
        end = self._coerce(end, "lerp")
        if end.dtype != self.dtype:
            raise TypePromotionError(f"expected dtype {self.dtype} for `end` but got dtype "
                                     f"{end.dtype}")
        diff = end - self
        if _is_scalar(weight):
            return self + diff * weight if abs(weight) < 0.5 else end - diff * (1.0 - weight)
        weight = self._coerce(weight, "lerp")
        if weight.dtype != self.dtype:
            raise TypePromotionError(f"expected dtype {self.dtype} for `weight` but got dtype "
                                     f"{weight.dtype}")
        low = weight.abs() < 0.5        # torch's test, so NaN and |w| >= 0.5 take the end form
        return (self + diff * weight).where(low, end - diff * (1.0 - weight))

    def addcmul(self, tensor1, tensor2, *, value=1) -> Tensor:
        """self + value * tensor1 * tensor2 (the three broadcast), as torch.addcmul."""
        t1 = self._coerce(tensor1, "addcmul")
        return self + (t1 * value if value != 1 else t1) * self._coerce(tensor2, "addcmul")

    def addcdiv(self, tensor1, tensor2, *, value=1) -> Tensor:
        """self + value * tensor1 / tensor2 (the three broadcast), as torch.addcdiv; integer
        tensor1 and tensor2 are refused, as torch's (their quotient would truncate there)."""
        t1, t2 = self._coerce(tensor1, "addcdiv"), self._coerce(tensor2, "addcdiv")
        if not (t1.dtype.is_floating_point or t2.dtype.is_floating_point):
            raise TypePromotionError("Integer division with addcdiv is no longer supported, "
                                     "and in a future release addcdiv will perform a true "
                                     "division of tensor1 and tensor2 (torch's message): cast "
                                     "them to a float")
        return self + (t1 * value if value != 1 else t1) / t2

    def hypot(self, other) -> Tensor:
        """sqrt(self^2 + other^2), as torch.hypot (float tensors; no rescaling, so squares past
        the dtype's range overflow where torch's would not)."""
        x, y = self._float_operands(other, what="hypot")
        return (x * x + y * y).sqrt()

    def logaddexp(self, other) -> Tensor:
        """log(exp(self) + exp(other)) without overflow, as torch.logaddexp: max(a, b) +
        log1p(exp(-|a - b|)); equal infinities give themselves (their difference, NaN, is
        taken as 0), and the gradient at a tie is half each, as torch's."""
        a, b = self._float_operands(other, what="logaddexp")
        tie = a.isinf() & (a == b)
        d = (a - b).masked_fill(tie, 0.0)
        return a.maximum(b) + (-d.abs()).exp().log1p()

    def xlogy(self, other) -> Tensor:
        """self * log(other), 0 where self is 0 (unless other is NaN), as torch.xlogy; other
        may be a Python number. Where self is 0 and other <= 0 or +inf (places the product
        would be NaN), other is replaced by 1, so the result and self's gradient are 0 there,
        as torch's (torch gives other a NaN gradient at other == 0; this gives 0)."""
        x, y = self._float_operands(other, what="xlogy")
        if _is_scalar(y):
            if math.isnan(y) or 0 < y < math.inf:
                return x * (y if math.isnan(y) else math.log(y))
            log_y = -math.inf if y == 0 else math.inf if y == math.inf else math.nan
            return (x * log_y).masked_fill(x == 0, 0.0)
        bad = (x == 0) & ((y <= 0) | (y == math.inf))
        return x * y.masked_fill(bad, 1.0).log()

    def float_power(self, exponent) -> Tensor:
        """self ** exponent in float64, as torch.float_power: both operands are cast to
        float64 first and the result is float64 (the cuda backend's elementwise kernels
        refuse float64, so there it is refused)."""
        x = self._cast("float64")
        return x ** (float(exponent) if _is_scalar(exponent) else
                     self._coerce(exponent, "float_power")._cast("float64"))

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

    def kron(self, other) -> Tensor:
        """The Kronecker product, as torch.kron: both viewed with one rank (leading 1s), then
        one broadcast multiply of (a0, 1, a1, 1, ...) by (1, b0, 1, b1, ...) merged pairwise
        into (a0 * b0, a1 * b1, ...)."""
        other = self._coerce(other, "kron")
        n = max(self.ndim, other.ndim)
        a = self.reshape(*(1,) * (n - self.ndim), *self.shape)
        b = other.reshape(*(1,) * (n - other.ndim), *other.shape)
        y = a.reshape(*(d for s in a.shape for d in (s, 1))) * \
            b.reshape(*(d for s in b.shape for d in (1, s)))
        return y.reshape(*(p * q for p, q in zip(a.shape, b.shape)))

    def t(self) -> Tensor:
        """The transpose of a matrix; a 0-d or 1-d tensor as it is."""
        if self.ndim > 2:
            raise ShapeError(f"t: expects a tensor of at most 2 axes, got {self.shape}")
        return self.T


def attach(cls: type) -> None:
    """Give Tensor the arithmetic and products of this module."""
    attach_methods(_MathMethods, cls)


attach(Tensor)
