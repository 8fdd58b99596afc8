"""torch's dtype names (`torch.float32`, `torch.long`, ...) over stepgraph's dtype strings.

A `dtype` is a str subclass equal to the IR dtype name ("float32", "bfloat16", ...), so
`x.dtype == torch.float32` and `x.dtype == "float32"` both hold, and a dtype can be handed to
anything that takes stepgraph's dtype strings. Only the dtypes in `ir.graph.DTYPES` can be held
by a tensor; the others (int16, int8) exist so model code can name them, and a
tensor of one is refused with UnsupportedOpError.
"""
from __future__ import annotations

import numpy as np

from .errors import UnsupportedOpError, called_in
from .ir.graph import BF16, DTYPES


class dtype(str):
    """A torch dtype: compares and hashes as its stepgraph name; repr torch.<name>."""

    def __repr__(self):
        return f"torch.{str.__str__(self)}"

    @property
    def is_floating_point(self) -> bool:
        return self in ("float64", "float32", "float16", BF16)

    @property
    def is_signed(self) -> bool:
        return self not in ("uint8", "bool")

    @property
    def itemsize(self) -> int:
        return 2 if self == BF16 else np.dtype(str(self)).itemsize


# torch name -> stepgraph dtype name (the aliases share one object)
_NAMES = {"float32": "float32", "float": "float32", "float64": "float64", "double": "float64",
          "float16": "float16", "half": "float16", "bfloat16": BF16, "int64": "int64",
          "long": "int64", "int32": "int32", "int": "int32", "int16": "int16", "short": "int16",
          "int8": "int8", "uint8": "uint8", "bool": "bool"}
_OBJECTS = {name: dtype(name) for name in set(_NAMES.values())}
TORCH_DTYPES: dict[str, dtype] = {torch_name: _OBJECTS[name] for torch_name, name in
                                  _NAMES.items()}


def __getattr__(name: str) -> dtype:
    # torch's names (float, int, bool among them) as module attributes, without shadowing
    # the builtins inside this module
    if name in TORCH_DTYPES:
        return TORCH_DTYPES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_default_dtype = TORCH_DTYPES["float32"]


def as_dtype(d, what: str = "dtype") -> dtype:
    """`d` as a torch dtype: a dtype, a stepgraph or torch name ("float32", "long"), a NumPy
    dtype or the Python types float, int and bool (torch's defaults: float32, int64, bool)."""
    if isinstance(d, dtype):
        return d
    if d is float:
        return _default_dtype
    if d is int:
        return TORCH_DTYPES["int64"]
    if d is bool:
        return TORCH_DTYPES["bool"]
    name = d if isinstance(d, str) else None
    if name is None:
        try:
            name = np.dtype(d).name
        except TypeError:
            name = None
    if name not in TORCH_DTYPES:
        raise TypeError(f"{what}: {d!r} is not a dtype stepgraph knows")
    return TORCH_DTYPES[name]


def tensor_dtype(d, what: str) -> dtype:
    """`d` (as `as_dtype` takes it) checked to be one a stepgraph tensor can hold."""
    d = as_dtype(d, what)
    if d not in DTYPES:
        raise UnsupportedOpError(f"{what}: tensors of {d!r} are not supported by stepgraph "
                                 f"(supported: {', '.join(DTYPES)}){called_in()}")
    return d


def get_default_dtype() -> dtype:
    """The dtype of float tensors made without one: always torch.float32."""
    return _default_dtype


def set_default_dtype(d) -> None:
    """Accepts torch.float32 only: stepgraph's kernels and compiled steps are float32 (bf16
    is a compile option, `precision="bf16"`, not a default dtype)."""
    if as_dtype(d, "set_default_dtype") != "float32":
        raise UnsupportedOpError(f"torch.set_default_dtype({d!r}) is not supported by "
                                 "stepgraph: the default dtype is float32 (use "
                                 "compile_train_step(precision='bf16') for bf16 training)")


def is_floating_point(x) -> bool:
    """True when tensor `x` holds floats (torch.is_floating_point)."""
    return as_dtype(x.dtype).is_floating_point


class finfo:
    """Limits of a float dtype (torch.finfo): bits, eps, max, min, tiny, resolution, as
    NumPy reports them (bfloat16's from its 8-bit exponent and 7-bit mantissa)."""

    def __init__(self, type=None):
        d = as_dtype(_default_dtype if type is None else type, "finfo")
        if not d.is_floating_point:
            raise TypeError(f"finfo: {d!r} is not a floating point dtype")
        self.dtype = d
        if d == BF16:
            self.bits, self.eps, self.max, self.tiny = 16, 2.0 ** -7, 3.3895313892515355e38, \
                2.0 ** -126
            self.min, self.resolution = -self.max, 0.01
        else:
            info = np.finfo(str(d))
            self.bits, self.eps, self.max = info.bits, float(info.eps), float(info.max)
            self.min, self.tiny = float(info.min), float(info.tiny)
            self.resolution = float(info.resolution)
        self.smallest_normal = self.tiny

    def __repr__(self):
        return f"finfo(dtype={self.dtype!r}, eps={self.eps}, max={self.max}, min={self.min})"


class iinfo:
    """Limits of an integer dtype (torch.iinfo): bits, max, min."""

    def __init__(self, type):
        d = as_dtype(type, "iinfo")
        if d.is_floating_point:
            raise TypeError(f"iinfo: {d!r} is not an integer dtype")
        info = np.iinfo("uint8" if d == "bool" else str(d))
        self.dtype, self.bits, self.max, self.min = d, info.bits, int(info.max), int(info.min)

    def __repr__(self):
        return f"iinfo(dtype={self.dtype!r}, max={self.max}, min={self.min})"


__all__ = ["dtype", *TORCH_DTYPES, "get_default_dtype", "set_default_dtype",
           "is_floating_point", "finfo", "iinfo"]
