"""Tensor comparisons (< <= > >= == != and lt ... ne, giving bool tensors; ops/compare.py),
the value tests (isnan, isinf, isposinf, isneginf, isfinite, isclose: comparisons composed),
logical and / or / xor / not of bool masks (& | ^ ~), and selection by a mask (masked_fill,
where). Attached to Tensor when this module is imported (ir/tensor.py `attach_methods`).
"""
from __future__ import annotations

import math

from .promotion import result_type
from .tensor import Tensor, _is_scalar, attach_methods


class _CompareMethods:
    """Tensor's comparisons, logic and masks (module doc)."""

    # ---- comparisons, logic and masks (ops/compare.py) ----
    def _compare(self, other, kind: str):
        """self kind other in torch's result type of the two (ir/promotion.py): an int
        tensor < 0.5 compares in float32, a float32 tensor == a float64 one in float64."""
        if _is_scalar(other):
            x = self._cast(result_type(self, other))
            return self.tracer.op("compare_scalar", [x], kind=kind, value=float(other))
        if not isinstance(other, Tensor) and getattr(other, "traced", None) is None:
            return NotImplemented       # == with any other object: Python's identity test
        other = self._coerce(other, kind)
        dtype = result_type(self, other)
        return self.tracer.op("compare", [self._cast(dtype), other._cast(dtype)], kind=kind)

    def __lt__(self, other):
        return self._compare(other, "lt")

    def __le__(self, other):
        return self._compare(other, "le")

    def __gt__(self, other):
        return self._compare(other, "gt")

    def __ge__(self, other):
        return self._compare(other, "ge")

    def __eq__(self, other):
        return self._compare(other, "eq")

    def __ne__(self, other):
        return self._compare(other, "ne")

    # Comparisons give tensors, so hashing stays by identity (tensors as dict keys).
    __hash__ = object.__hash__
    lt, le, gt, ge, eq, ne = __lt__, __le__, __gt__, __ge__, __eq__, __ne__
    less, less_equal, greater, greater_equal, not_equal = lt, le, gt, ge, ne

    # ---- value tests: comparisons, so every backend runs them ----
    def isnan(self) -> Tensor:
        """True where x is NaN (x != x); integer and bool tensors hold none."""
        return self != self

    def isposinf(self) -> Tensor:
        return self == math.inf if self.is_floating_point() else self != self

    def isneginf(self) -> Tensor:
        return self == -math.inf if self.is_floating_point() else self != self

    def isinf(self) -> Tensor:
        """True where x is +inf or -inf."""
        return self.isposinf() | self.isneginf()

    def isfinite(self) -> Tensor:
        """True where x is neither NaN nor +-inf."""
        return (self.isnan() | self.isinf()).logical_not()

    def isclose(self, other, rtol: float = 1e-05, atol: float = 1e-08,
                equal_nan: bool = False) -> Tensor:
        """x == other (equal infinities too), or both finite with |x - other| <= atol +
        rtol * |other|, or both NaN with equal_nan, as torch.isclose (x and other promoted
        together; other a tensor or a Python number)."""
        scalar = _is_scalar(other)
        other = other if scalar else self._coerce(other, "isclose")
        x = self._cast(result_type(self, other))
        y = other if scalar else other._cast(x.dtype)
        within = (x - y).abs() <= (abs(y) if scalar else y.abs()) * rtol + atol
        if scalar:
            close = (x == y) | (x.isfinite() & within) if math.isfinite(y) else x == y
            return close | x.isnan() if equal_nan and math.isnan(y) else close
        close = (x == y) | (x.isfinite() & y.isfinite() & within)
        return close | (x.isnan() & y.isnan()) if equal_nan else close

    def _logical(self, other, kind: str) -> Tensor:
        if self.dtype != "bool" or getattr(other, "dtype", None) != "bool":
            self._unsupported(f"logical {kind} of {self.dtype} and "
                              f"{getattr(other, 'dtype', type(other).__name__)} (bool masks "
                              "only)")
        return self.tracer.op("logical", [self, self._coerce(other, kind)], kind=kind)

    def _truth(self) -> Tensor:
        """This tensor as a bool mask: a non-bool one compared with zero (NaN is true)."""
        return self if self.dtype == "bool" else self != 0

    def logical_and(self, other) -> Tensor:
        """x and y elementwise; non-bool operands are compared with zero first, as
        torch.logical_and (the `&` operator takes bool masks only)."""
        return self._truth()._logical(self._coerce(other, "logical_and")._truth(), "and")

    def logical_or(self, other) -> Tensor:
        return self._truth()._logical(self._coerce(other, "logical_or")._truth(), "or")

    def logical_xor(self, other) -> Tensor:
        return self._truth()._logical(self._coerce(other, "logical_xor")._truth(), "xor")

    def logical_not(self) -> Tensor:
        """not x; a non-bool x is compared with zero first, as torch.logical_not."""
        x = self if self.dtype == "bool" else self != 0
        return self.tracer.op("logical_not", [x])

    def __and__(self, other) -> Tensor:
        return self._logical(other, "and")

    def __or__(self, other) -> Tensor:
        return self._logical(other, "or")

    def __xor__(self, other) -> Tensor:
        return self._logical(other, "xor")

    __rand__, __ror__, __rxor__ = __and__, __or__, __xor__

    def __invert__(self) -> Tensor:
        if self.dtype != "bool":
            self._unsupported(f"bitwise not (~) of a {self.dtype} tensor (bool masks only)")
        return self.logical_not()

    def masked_fill(self, mask, value) -> Tensor:
        """value where mask (bool, broadcast with x) is True, else x; value a Python number
        (float("-inf") included) or a 0-d tensor. No gradient reaches the filled places."""
        mask = self._coerce(mask, "masked_fill")
        if _is_scalar(value):
            return self.tracer.op("masked_fill", [self, mask], value=float(value))
        return self.tracer.op("where", [mask, self._coerce(value, "masked_fill"), self])

    def where(self, condition, other) -> Tensor:
        """x where condition (bool) else other, a tensor or a Python number; the three
        broadcast together (torch.Tensor.where)."""
        cond = self._coerce(condition, "where")
        other = other if _is_scalar(other) else self._coerce(other, "where")
        dtype = result_type(self, other)          # torch.where promotes x and other
        if _is_scalar(other):
            return self._cast(dtype).masked_fill(cond.logical_not(), other)
        return self.tracer.op("where", [cond, self._cast(dtype), other._cast(dtype)])


def attach(cls: type) -> None:
    """Give Tensor the comparisons, logic and masks of this module."""
    attach_methods(_CompareMethods, cls)


attach(Tensor)
