"""torch's type promotion for the operands of an elementwise op (torch.result_type,
promote_types, can_cast), over the IR dtypes.

Kernels see one dtype: the Tensor methods (tensor_math, tensor_compare) compute the result
type here and cast the operands to it before the op is recorded. torch's rule, in short:
operands fall in three classes, tensors of one or more dimensions, 0-d tensors, and Python
numbers (a float one counts as the default dtype, float32; an int one as int64). Each class
promotes within itself; a lower class changes the result only where it is of a higher
category (bool < integer < floating), so `float16 tensor * 2.5` stays float16 and
`int32 tensor + 0-d float64 tensor` is float64.
"""
from __future__ import annotations

import numbers

import numpy as np

from ..errors import TypePromotionError

BOOL, INTEGER, FLOATING = 0, 1, 2
_CATEGORY = {"bool": BOOL, "uint8": INTEGER, "int32": INTEGER, "int64": INTEGER,
             "float16": FLOATING, "bfloat16": FLOATING, "float32": FLOATING,
             "float64": FLOATING}
# within a category the wider wins; float16 with bfloat16 is float32 (neither holds the other)
_RANK = {"bool": 0, "uint8": 1, "int32": 2, "int64": 3,
         "float16": 4, "bfloat16": 4, "float32": 5, "float64": 6}
DEFAULT_FLOAT = "float32"

_TORCH_NAME = {"bool": "Bool", "uint8": "Byte", "int32": "Int", "int64": "Long",
               "float16": "Half", "bfloat16": "BFloat16", "float32": "Float",
               "float64": "Double"}


def promote_types(a: str, b: str) -> str:
    """torch.promote_types of two IR dtype names."""
    if a == b:
        return a
    if _CATEGORY[a] != _CATEGORY[b]:
        return a if _CATEGORY[a] > _CATEGORY[b] else b
    if _RANK[a] == _RANK[b]:                 # float16 and bfloat16
        return "float32"
    return a if _RANK[a] > _RANK[b] else b


def is_floating(dtype: str) -> bool:
    return _CATEGORY[dtype] == FLOATING


def _number_dtype(x) -> str:
    if isinstance(x, (bool, np.bool_)):
        return "bool"
    return "int64" if isinstance(x, numbers.Integral) else DEFAULT_FLOAT


def _combine(higher: str | None, lower: str | None) -> str | None:
    """The result of a higher-priority class given a lower one (c10's combine_categories)."""
    if higher is None:
        return lower
    if lower is None or _CATEGORY[higher] == FLOATING:
        return higher
    if higher == "bool" or _CATEGORY[lower] == FLOATING:
        return promote_types(higher, lower)
    return higher


def result_type(*operands) -> str:
    """torch.result_type over tensors (anything with .dtype and .ndim) and numbers (Python's
    or NumPy's scalars, which torch takes as Python numbers)."""
    classes: list[str | None] = [None, None, None]    # dim > 0, 0-d, numbers
    for x in operands:
        if isinstance(x, (numbers.Number, np.bool_)):
            at, dtype = 2, _number_dtype(x)
        else:
            at, dtype = (0 if x.ndim > 0 else 1), str(x.dtype).removeprefix("torch.")
        classes[at] = dtype if classes[at] is None else promote_types(classes[at], dtype)
    return _combine(classes[0], _combine(classes[1], classes[2]))


def can_cast(from_: str, to: str) -> bool:
    """torch.can_cast: no float to an integer or bool, no integer to bool."""
    return _CATEGORY[from_] <= _CATEGORY[to]


def check_cast(from_: str, to: str) -> None:
    """An in-place op's result of dtype `from_` written into a tensor of dtype `to`."""
    if not can_cast(from_, to):
        raise TypePromotionError(f"result type {_TORCH_NAME[from_]} can't be cast to the "
                                 f"desired output type {_TORCH_NAME[to]}")
