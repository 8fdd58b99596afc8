"""Module and Parameter: the torch.nn-shaped containers that hold trained values.

A Parameter's storage is one array on its current device (NumPy or CuPy). Compiled steps read
and update that array in place, so `state_dict()` always returns the trained values and
`load_state_dict()` writes into the buffers a compiled step already uses.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

import numpy as np

from ..errors import StateDictError


def to_numpy(array) -> np.ndarray:
    """A host NumPy copy of a NumPy, CuPy or DLPack array."""
    if isinstance(array, np.ndarray):
        return array.copy()
    if hasattr(array, "get"):             # CuPy
        _device_synchronize()   # steps run on a private stream: wait for every one of them
        return array.get()
    return np.from_dlpack(array).copy()


def _device_synchronize() -> None:
    import cupy
    cupy.cuda.Device().synchronize()


class Parameter:
    """A trainable float32 tensor. `name` is its state_dict key once owned by a model."""

    def __init__(self, data: np.ndarray):
        self.data = np.ascontiguousarray(data, dtype=np.float32)
        self.name = ""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> str:
        return str(self.data.dtype)

    def numpy(self) -> np.ndarray:
        return to_numpy(self.data)

    def assign(self, values: np.ndarray) -> None:
        """Copy values into the current storage in place (compiled steps keep their pointers)."""
        values = np.asarray(values, dtype=np.float32)
        if values.shape != self.shape:
            raise StateDictError(f"{self.name}: expected shape {self.shape}, got {values.shape}")
        if isinstance(self.data, np.ndarray):
            self.data[...] = values
        else:                                # no step may still be reading the old values
            _device_synchronize()
            self.data.set(np.ascontiguousarray(values))
            _device_synchronize()

    def __repr__(self):
        return f"Parameter({self.name or '?'}, shape={self.shape})"


class Module:
    """Base class of layers. Subclasses set Parameters and sub-Modules as attributes."""

    def __init__(self):
        object.__setattr__(self, "_params", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if isinstance(value, Parameter):
            self._params[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __call__(self, *args):
        return self.forward(*args)

    def forward(self, *args):
        raise NotImplementedError(type(self).__name__)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        for name, p in self._params.items():
            if p is not None:
                yield prefix + name, p
        for name, m in self._modules.items():
            yield from m.named_parameters(f"{prefix}{name}.")

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def modules(self) -> Iterator[Module]:
        yield self
        for m in self._modules.values():
            yield from m.modules()

    def train(self, mode: bool = True) -> Module:
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def name_parameters(self) -> None:
        """Give every parameter its state_dict key as its name."""
        for name, p in self.named_parameters():
            p.name = name

    def state_dict(self) -> OrderedDict:
        """Current trained values as NumPy arrays under PyTorch's keys."""
        return OrderedDict((name, p.numpy()) for name, p in self.named_parameters())

    def load_state_dict(self, state_dict) -> None:
        """Load a state_dict (NumPy arrays, or anything np.asarray accepts). Missing or
        unexpected keys and wrong shapes raise StateDictError before anything is written."""
        params = OrderedDict(self.named_parameters())
        missing = [k for k in params if k not in state_dict]
        extra = [k for k in state_dict if k not in params]
        if missing or extra:
            raise StateDictError(f"state_dict mismatch: missing keys {missing}, "
                                 f"unexpected keys {extra}")
        for name, p in params.items():
            got = tuple(np.shape(state_dict[name]))
            if got != p.shape:
                raise StateDictError(f"{name}: expected shape {p.shape}, got {got}")
        for name, p in params.items():
            p.name = name
            p.assign(np.asarray(state_dict[name]))

    def extra_repr(self) -> str:
        return ""

    def __repr__(self):
        inner = "".join(f"\n  ({k}): " + repr(m).replace("\n", "\n  ")
                        for k, m in self._modules.items())
        return f"{type(self).__name__}({self.extra_repr()}{inner}{chr(10) if inner else ''})"
