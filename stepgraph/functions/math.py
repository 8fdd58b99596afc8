"""torch.exp, torch.where, torch.clamp, torch.lerp, ...: elementwise math, comparisons and
selection.

Each is the Tensor method of the same name (ir/tensor_unary.py, tensor_compare.py,
tensor_math.py), so a model calling either records the same ops (ops/unary.py,
ops/compare.py, ops/elementwise.py).
"""
from __future__ import annotations

from ..ir.promotion import result_type
from ..ir.tensor import Tensor, _is_scalar
from ..ir.trace import current_tracer

__all__ = ["exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "abs", "neg", "negative",
           "reciprocal", "sign", "sin", "cos", "erf", "square", "floor", "ceil", "round",
           "trunc", "sigmoid", "tanh", "relu",
           "pow", "maximum", "minimum", "clamp", "clip", "clamp_min", "clamp_max",
           "lt", "le", "gt", "ge", "eq", "ne", "less", "less_equal", "greater", "greater_equal",
           "not_equal", "logical_and", "logical_or", "logical_xor", "logical_not",
           "where", "masked_fill", "isnan", "isinf", "isposinf", "isneginf", "isfinite",
           "isclose", "allclose", "equal", "all", "any", "lerp", "addcmul", "addcdiv", "hypot",
           "logaddexp", "xlogy", "frac", "fmod", "float_power", "nan_to_num", "heaviside",
           "sinc"]


def _traced(x):
    """A Parameter or Buffer used directly in a forward being traced (torch.exp(self.scale))
    as its traced tensor (its `traced(tracer)`, nn/module.py); anything else unchanged."""
    if isinstance(x, Tensor):       # its __getattr__ raises for names it lacks
        return x
    tracer, traced = current_tracer(), getattr(x, "traced", None)
    return traced(tracer) if tracer is not None and traced is not None else x


def _method(name: str):
    def fn(input: Tensor, *args, **kwargs) -> Tensor:
        return getattr(_traced(input), name)(*args, **kwargs)
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"torch.{name}(input, ...): the Tensor method {name}."
    return fn


exp, log, log1p, expm1 = (_method(n) for n in ("exp", "log", "log1p", "expm1"))
sqrt, rsqrt, abs, neg = (_method(n) for n in ("sqrt", "rsqrt", "abs", "neg"))
negative, reciprocal, sign = (_method(n) for n in ("negative", "reciprocal", "sign"))
sin, cos, erf, square = (_method(n) for n in ("sin", "cos", "erf", "square"))
floor, ceil, round, trunc = (_method(n) for n in ("floor", "ceil", "round", "trunc"))
sigmoid, tanh, relu = (_method(n) for n in ("sigmoid", "tanh", "relu"))
maximum, minimum = (_method(n) for n in ("maximum", "minimum"))
clamp, clip, clamp_min, clamp_max = (_method(n) for n in ("clamp", "clip", "clamp_min",
                                                          "clamp_max"))
lt, le, gt, ge, eq, ne = (_method(n) for n in ("lt", "le", "gt", "ge", "eq", "ne"))
less, less_equal, greater, greater_equal, not_equal = (
    _method(n) for n in ("less", "less_equal", "greater", "greater_equal", "not_equal"))
logical_and, logical_or, logical_xor, logical_not = (
    _method(n) for n in ("logical_and", "logical_or", "logical_xor", "logical_not"))
masked_fill = _method("masked_fill")
isnan, isinf, isposinf, isneginf, isfinite, isclose = (
    _method(n) for n in ("isnan", "isinf", "isposinf", "isneginf", "isfinite", "isclose"))
all, any = _method("all"), _method("any")
lerp, addcmul, addcdiv, hypot = (_method(n) for n in ("lerp", "addcmul", "addcdiv", "hypot"))
logaddexp, frac, fmod = (_method(n) for n in ("logaddexp", "frac", "fmod"))
nan_to_num, heaviside, sinc = (_method(n) for n in ("nan_to_num", "heaviside", "sinc"))


def _number_first(input, other, what: str):
    """(input, other) with a Python number input (torch.xlogy(2, y)) as a 0-d tensor of
    other's trace: a 0-d operand promotes as the number would (ir/promotion.py)."""
    input, other = _traced(input), _traced(other)
    if not _is_scalar(input):
        return input, other
    if _is_scalar(other):
        raise TypeError(f"{what}: expected a tensor among the arguments, got two numbers")
    return other.new_full((), input, dtype=result_type(input, other)), other


def xlogy(input, other) -> Tensor:
    """input * log(other), 0 where input is 0 (unless other is NaN), as torch.xlogy; either
    may be a Python number (Tensor.xlogy)."""
    input, other = _number_first(input, other, "xlogy")
    return input.xlogy(other)


def float_power(input, exponent) -> Tensor:
    """input ** exponent in float64, as torch.float_power; either may be a Python number
    (Tensor.float_power)."""
    input, exponent = _number_first(input, exponent, "float_power")
    return input.float_power(exponent)


def allclose(input, other, rtol: float = 1e-05, atol: float = 1e-08,
             equal_nan: bool = False) -> bool:
    """Whether every element of input is close to other's (isclose; the two broadcast), as
    torch.allclose: a Python bool, so the values are read (eager tensors; a traced one has
    none). Tensors of different dtypes raise RuntimeError, as torch's."""
    input, other = _traced(input), _traced(other)
    if isinstance(other, Tensor) and other.dtype != input.dtype:
        raise RuntimeError(f"allclose: {other.dtype} did not match {input.dtype}")
    return bool(input.isclose(other, rtol, atol, equal_nan).all())


def equal(input, other) -> bool:
    """Whether the two have the same shape and the same values (NaN equals nothing), as
    torch.equal: a Python bool (eager tensors)."""
    input, other = _traced(input), _traced(other)
    return tuple(input.shape) == tuple(other.shape) and bool((input == other).all())


def pow(input, exponent) -> Tensor:
    """input ** exponent; either may be a Python number (not both)."""
    return _traced(input) ** _traced(exponent)


def where(condition: Tensor, input, other) -> Tensor:
    """input where condition (bool) else other; input and other tensors or Python numbers,
    the three broadcast together. Two numbers give a tensor of condition's shape and their
    result type (float32, int64 or bool, as torch's)."""
    input, other = _traced(input), _traced(other)
    if not _is_scalar(input):
        return input.where(condition, other)
    if not _is_scalar(other):
        return other._cast(result_type(input, other)).masked_fill(condition, input)
    filled = condition.tracer.op("fill", [], value=float(other), shape=condition.shape,
                                 dtype=result_type(input, other))
    return filled.masked_fill(condition, input)
