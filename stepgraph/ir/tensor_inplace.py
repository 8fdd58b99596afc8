"""Tensor's in-place forms: x.add_(y), x += y, x.relu_(), x.masked_fill_(m, v), ... (each the
out-of-place method's result, held from then on by the same object: `_assign`), and fill_ /
zero_ / copy_. Attached to Tensor when this module is imported (ir/tensor.py
`attach_methods`).
"""
from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from .promotion import check_cast
from .tensor import Tensor, _is_scalar, attach_methods
from .trace import EAGER, tensor_of


def _inplace(name: str):
    """Tensor.<name>_: the out-of-place method's result, held from then on by the same
    tensor object (`Tensor._assign`)."""
    def method(self, *args, **kwargs):
        return self._assign(getattr(self, name)(*args, **kwargs), f"Tensor.{name}_")
    method.__name__ = method.__qualname__ = f"{name}_"
    method.__doc__ = f"In-place {name}: this tensor now holds x.{name}(...) (see _assign)."
    return method


class _InplaceMethods:
    """Tensor's in-place forms (module doc)."""

    # ---- in-place forms: x.add_(y), x += y, x.relu_(), x.masked_fill_(m, v) ----
    def _assign(self, result: Tensor, what: str) -> Tensor:
        """Make this tensor hold `result` (an in-place method's work). An eager tensor's
        array is written. A traced value is never overwritten: the object is rebound to the
        new node, so every name bound to it sees the change, as model code expects of
        `x += residual`; views taken before the call keep the old values (torch's views
        share storage and would see it). A result of another dtype is cast to this one
        where torch casts it (float32 into bfloat16); a float into an integer tensor, or
        anything but bool into a bool one, raises TypePromotionError as torch does."""
        if result.shape != self.shape:
            raise ShapeError(f"{what}: the result {result.dtype}{list(result.shape)} cannot "
                             f"be written in place into a {self.dtype}{list(self.shape)} "
                             "tensor")
        if result.value.dtype != self.value.dtype:
            check_cast(result.value.dtype, self.value.dtype)
            result = result._cast(self.value.dtype)
        if self.is_eager and result.is_eager:
            self.array[...] = result.array
        elif result.is_eager:                   # eager values for a traced tensor: a constant
            self.value = self.tracer.constant(result)
        else:
            self.value, self.tracer, self.array = result.value, result.tracer, None
        return self

    add_, sub_, mul_, div_, pow_ = (_inplace(n) for n in ("add", "sub", "mul", "div", "pow"))
    __iadd__, __isub__, __imul__, __itruediv__, __ipow__ = add_, sub_, mul_, div_, pow_
    floor_divide_, remainder_ = _inplace("floor_divide"), _inplace("remainder")
    __ifloordiv__, __imod__ = floor_divide_, remainder_
    subtract_, multiply_, divide_, true_divide_ = sub_, mul_, div_, div_
    neg_, negative_, reciprocal_, square_ = (_inplace(n) for n in ("neg", "negative",
                                                                   "reciprocal", "square"))
    clamp_, clamp_min_, clamp_max_, clip_ = (_inplace(n) for n in ("clamp", "clamp_min",
                                                                   "clamp_max", "clip"))
    relu_, sigmoid_, tanh_ = (_inplace(n) for n in ("relu", "sigmoid", "tanh"))
    exp_, log_, log1p_, expm1_ = (_inplace(n) for n in ("exp", "log", "log1p", "expm1"))
    sqrt_, rsqrt_, abs_, sign_ = (_inplace(n) for n in ("sqrt", "rsqrt", "abs", "sign"))
    floor_, ceil_, round_, trunc_ = (_inplace(n) for n in ("floor", "ceil", "round", "trunc"))
    sin_, cos_, erf_ = (_inplace(n) for n in ("sin", "cos", "erf"))
    masked_fill_, addmm_, baddbmm_ = (_inplace(n) for n in ("masked_fill", "addmm",
                                                            "baddbmm"))
    scatter_, scatter_add_ = _inplace("scatter"), _inplace("scatter_add")
    lerp_, addcmul_, addcdiv_ = (_inplace(n) for n in ("lerp", "addcmul", "addcdiv"))
    fmod_, frac_, hypot_, xlogy_ = (_inplace(n) for n in ("fmod", "frac", "hypot", "xlogy"))
    nan_to_num_, heaviside_, sinc_, renorm_ = (_inplace(n) for n in ("nan_to_num", "heaviside",
                                                                     "sinc", "renorm"))

    # ---- writes ----
    def fill_(self, value) -> Tensor:
        """Every element set to `value` (a number), in place: an eager tensor's array is
        written, a traced one holds a `fill` node from then on (`_assign`)."""
        if not _is_scalar(value):
            self._unsupported(f"Tensor.fill_ with a {type(value).__name__} value (a number)")
        if not self.is_eager:
            return self._assign(self.new_full(self.shape, value), "Tensor.fill_")
        self.array[...] = EAGER.op("fill", [], value=value, shape=(),
                                   dtype=self.value.dtype).array
        return self

    def zero_(self) -> Tensor:
        return self.fill_(0)

    def copy_(self, src, non_blocking: bool = False) -> Tensor:
        """`src`'s values (broadcast to this shape, cast to this dtype) written in place; a
        traced tensor, or one given traced values, holds them from then on (`_assign`)."""
        if not self.is_eager or isinstance(src, Tensor) and not src.is_eager:
            if not isinstance(src, Tensor):     # a Parameter or Buffer, or array-like values
                src = self._coerce(src, "copy_") if hasattr(src, "traced") else \
                    tensor_of(np.asarray(src))
            return self._assign(src._cast(self.dtype).expand(*self.shape), "Tensor.copy_")
        values = src.numpy() if isinstance(src, Tensor) else np.asarray(src)
        if self.value.dtype == "bfloat16":
            from ..backends.numpy import bf16
            values = bf16.to_bits(np.asarray(values, np.float32))
        self.array[...] = np.broadcast_to(values, self.shape)
        return self


def attach(cls: type) -> None:
    """Give Tensor the in-place forms of this module."""
    attach_methods(_InplaceMethods, cls)


attach(Tensor)
