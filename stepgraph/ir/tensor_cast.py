"""Tensor dtype and device methods: to, type, type_as, float / double / bfloat16 / long /
int / bool (half refused: float16 is no IR dtype), the memory_format arguments they accept,
and `dtype_name`, the IR dtype of whatever a model passes as a dtype. Attached to Tensor
when this module is imported (ir/tensor.py `attach_methods`).
"""
from __future__ import annotations

import numpy as np

from ..errors import UnsupportedOpError
from .graph import BF16, DTYPES
from .tensor import Tensor, attach_methods


# PyTorch's dtype names that differ from the IR's.
_DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64",
                  "int": "int32"}


def dtype_name(dtype) -> str:
    """The IR dtype of what a model passes as a dtype: a name ("float32", "long"), a dtype
    object whose str ends in its name ("torch.float32"), a NumPy dtype or a Python type (float
    is float64, as NumPy and torch.Tensor.to have it)."""
    if isinstance(dtype, (type, np.dtype)):
        name = np.dtype(dtype).name
    else:
        name = str(dtype).rsplit(".", 1)[-1]
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise UnsupportedOpError(f"dtype {dtype!r} is not supported by stepgraph: "
                                 f"one of {DTYPES}")
    return name


def _is_device(x) -> bool:
    """A device argument of Tensor.to: "cuda", "cpu:0", or a device object."""
    if isinstance(x, str):
        return x.split(":")[0] in ("cpu", "cuda")
    return hasattr(x, "type") and hasattr(x, "index")


class _CastMethods:
    """Tensor's dtype and device methods (module doc)."""

    # ---- dtype and device ----
    def _cast(self, dtype) -> Tensor:
        try:
            dtype = dtype_name(dtype)
        except UnsupportedOpError as err:       # the message gains the module path
            raise UnsupportedOpError(f"{err} (called in {self.tracer.where()})") from None
        if dtype == self.dtype:
            return self
        return self.tracer.op("cast", [self], dtype=dtype)

    def _memory_format(self, memory_format, what: str) -> None:
        """Accept torch's preserve_format and contiguous_format, by name: a traced tensor's
        layout is the planner's (compile_*(memory_format=...)), so both change nothing.
        Others (channels_last) would ask for a layout per tensor, which stepgraph lacks."""
        if memory_format is not None and str(memory_format).removeprefix("torch.") not in (
                "preserve_format", "contiguous_format"):
            self._unsupported(f"{what} with memory_format={memory_format} (the layout is "
                              "compile_train_step(memory_format=...)'s)")

    def to(self, *args, dtype=None, device=None, non_blocking=False, copy=False,
           memory_format=None) -> Tensor:
        """A cast to `dtype` or to another tensor's dtype; a device argument ("cuda", "cpu",
        a device object) changes nothing: a traced tensor lives where the step runs."""
        self._memory_format(memory_format, "Tensor.to")
        for a in args:
            if isinstance(a, bool):             # positional non_blocking, copy
                continue
            if isinstance(a, Tensor):
                dtype = a.dtype
            elif not _is_device(a):
                dtype = a
        return self if dtype is None else self._cast(dtype)

    def type(self, dtype=None, non_blocking: bool = False):
        """With a dtype, a cast to it (as `to`); without, torch's type string of this
        tensor ("torch.FloatTensor")."""
        if dtype is not None:
            return self._cast(dtype)
        names = {"float32": "Float", "float64": "Double", "int64": "Long", "int32": "Int",
                 "uint8": "Byte", "bool": "Bool", BF16: "BFloat16"}
        return f"torch.{names[self.value.dtype]}Tensor"

    def type_as(self, other) -> Tensor:
        return self._cast(other.dtype)

    def float(self, memory_format=None) -> Tensor:
        self._memory_format(memory_format, "Tensor.float")
        return self._cast("float32")

    def double(self, memory_format=None) -> Tensor:
        self._memory_format(memory_format, "Tensor.double")
        return self._cast("float64")

    def bfloat16(self) -> Tensor:
        return self._cast(BF16)

    def half(self, memory_format=None) -> Tensor:
        self._memory_format(memory_format, "Tensor.half")
        return self._cast("float16")

    def long(self, memory_format=None) -> Tensor:
        self._memory_format(memory_format, "Tensor.long")
        return self._cast("int64")

    def int(self, memory_format=None) -> Tensor:
        self._memory_format(memory_format, "Tensor.int")
        return self._cast("int32")

    def bool(self, memory_format=None) -> Tensor:
        self._memory_format(memory_format, "Tensor.bool")
        return self._cast("bool")


def attach(cls: type) -> None:
    """Give Tensor the dtype and device methods of this module."""
    attach_methods(_CastMethods, cls)


attach(Tensor)
