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
from ..ir.trace import Tensor


def to_numpy(array) -> np.ndarray:
    """A host NumPy copy of a NumPy, CuPy or DLPack array."""
    if isinstance(array, np.ndarray):
        return array.copy()
    if hasattr(array, "get"):             # CuPy
        _device_synchronize()   # steps run on a private stream: wait for every one of them
        return array.get()
    if not hasattr(array, "__dlpack__") and hasattr(array, "__array__"):
        return np.array(array)            # e.g. a step's LossHandle
    return np.from_dlpack(array).copy()


def _device_synchronize() -> None:
    import cupy
    cupy.cuda.Device().synchronize()


class _Stored:
    """A named array a model owns (NumPy or CuPy storage) that compiled steps bind by name."""

    data: np.ndarray
    name: str
    # Bumped by every assign: compiled steps holding a derived copy (the bf16 weight copies of
    # precision="bf16") refresh it when the storage was written from outside the step.
    version: int = 0

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
        values = np.asarray(values, dtype=self.dtype)
        if values.shape != self.shape:
            raise StateDictError(f"{self.name}: expected shape {self.shape}, got {values.shape}")
        if isinstance(self.data, np.ndarray):
            self.data[...] = values
        else:                                # no step may still be reading the old values
            _device_synchronize()
            self.data.set(np.ascontiguousarray(values))
            _device_synchronize()
        self.version += 1

    def __repr__(self):
        return f"{type(self).__name__}({self.name or '?'}, shape={self.shape})"


class Parameter(_Stored):
    """A trainable float32 tensor. `name` is its state_dict key once owned by a model."""

    def __init__(self, data: np.ndarray):
        self.data = np.ascontiguousarray(data, dtype=np.float32)
        self.name = ""

    def traced(self, tracer) -> Tensor:
        """This parameter in `tracer`'s trace: its `param` value, made once per trace."""
        return tracer.param(self)


class Buffer(_Stored):
    """A module's non-trainable state (BatchNorm's running statistics), registered with
    `Module.register_buffer`. It keeps its dtype (num_batches_tracked is int64) and is in the
    state_dict; compiled steps bind it as graph state and update it in place."""

    def __init__(self, data: np.ndarray):
        self.data = np.array(data, order="C")   # a copy: 0-d stays 0-d
        self.name = ""

    def traced(self, tracer) -> Tensor:
        """This buffer in `tracer`'s trace: its `state` value, made once per trace."""
        return tracer.buffer(self)


class Module:
    """Base class of layers. Subclasses set Parameters and sub-Modules as attributes."""

    def __init__(self):
        object.__setattr__(self, "_params", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name, value):
        if isinstance(value, Parameter):
            self._params[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        elif isinstance(value, Buffer) or (value is None and name in self._buffers):
            self._buffers[name] = value
        object.__setattr__(self, name, value)

    def register_buffer(self, name: str, array) -> None:
        """Add non-trainable state under `name` (PyTorch's register_buffer): the attribute
        becomes a Buffer holding a copy of `array`, or None (registered, but not in the
        state_dict, as BatchNorm's statistics when it tracks none)."""
        if "." in name or not name:
            raise KeyError(f"buffer name must be a non-empty name without '.', got {name!r}")
        if name in self._params or name in self._modules:
            raise KeyError(f"attribute {name!r} already exists")
        self._buffers[name] = None
        setattr(self, name, None if array is None else Buffer(array))

    def __call__(self, *args, **kwargs):
        """forward(*args), traced under this module's path ("model.layer1.0") and label."""
        tracer = next((a.tracer for a in (*args, *kwargs.values())
                       if isinstance(a, Tensor) and not a.is_eager), None)   # eager: runs now
        if tracer is None:
            return self.forward(*args, **kwargs)
        with tracer.module_scope(self._trace_path(tracer), self._trace_label()):
            return self.forward(*args, **kwargs)

    def _trace_path(self, tracer) -> str:
        if not tracer.module_path and id(self) not in tracer.module_paths:
            # the root call: name every submodule once
            tracer.module_paths = {id(m): "model" + (f".{name}" if name else "")
                                   for name, m in self.named_modules()}
        path = tracer.module_paths.get(id(self))
        if path is None:                           # a module the root does not own
            path = f"{tracer.where()}.{type(self).__name__}"
        return path

    def _trace_label(self) -> str:
        """How profiles name this module's nodes: type name and extra_repr."""
        extra = self.extra_repr()
        return type(self).__name__ + (f"({extra})" if extra else "")

    def forward(self, *args):
        raise NotImplementedError(type(self).__name__)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, Parameter) pre-order: own parameters, then the children's. A
        Parameter held by several modules (weight tying) comes once, under its first name,
        as PyTorch's (remove_duplicate=False lists every name)."""
        seen: set[int] = set()
        for name, p in self._named_params(prefix, recurse):
            if not remove_duplicate or id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def _named_params(self, prefix: str, recurse: bool) -> Iterator[tuple[str, Parameter]]:
        for name, p in self._params.items():
            if p is not None:
                yield prefix + name, p
        if recurse:
            for name, m in self._modules.items():
                if m is not None:
                    yield from m._named_params(f"{prefix}{name}.", True)

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Buffer]]:
        for name, b in self._buffers.items():
            if b is not None:
                yield prefix + name, b
        for name, m in self._modules.items():
            yield from m.named_buffers(f"{prefix}{name}.")

    def buffers(self) -> list[Buffer]:
        return [b for _, b in self.named_buffers()]

    def named_children(self) -> Iterator[tuple[str, Module]]:
        seen: set[int] = set()
        for name, m in self._modules.items():
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                yield name, m

    def children(self) -> Iterator[Module]:
        for _, m in self.named_children():
            yield m

    def named_modules(self, prefix: str = "", _seen: set | None = None
                      ) -> Iterator[tuple[str, Module]]:
        """This module and every submodule once, pre-order, under dotted paths ("" first)."""
        seen = set() if _seen is None else _seen
        if id(self) in seen:
            return
        seen.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            if m is not None:
                yield from m.named_modules(f"{prefix}.{name}" if prefix else name, seen)

    def _named_state(self, prefix: str = "") -> Iterator[tuple[str, Parameter | Buffer]]:
        """PyTorch's state_dict order: per module its parameters, its buffers, then its
        children, recursively."""
        for name, p in self._params.items():
            if p is not None:
                yield prefix + name, p
        for name, b in self._buffers.items():
            if b is not None:
                yield prefix + name, b
        for name, m in self._modules.items():
            yield from m._named_state(f"{prefix}{name}.")

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
        """Give every parameter and buffer its state_dict key as its name; one held under
        several keys (weight tying) takes the first, its named_parameters name."""
        named: set[int] = set()
        for name, p in self._named_state():
            if id(p) not in named:
                named.add(id(p))
                p.name = name

    def state_dict(self) -> OrderedDict:
        """Current parameters and buffers as NumPy arrays under PyTorch's keys, in PyTorch's
        order; a tied parameter under each of its keys, as PyTorch's."""
        return OrderedDict((name, p.numpy()) for name, p in self._named_state())

    def load_state_dict(self, state_dict) -> None:
        """Load a state_dict (NumPy arrays, or anything np.asarray accepts). Missing or
        unexpected keys and wrong shapes raise StateDictError before anything is written. A
        tied parameter is written under each of its keys in order (the last wins, as in
        PyTorch)."""
        params = OrderedDict(self._named_state())
        missing = [k for k in params if k not in state_dict]
        extra = [k for k in state_dict if k not in params]
        if missing or extra:
            raise StateDictError(f"state_dict mismatch: missing keys {missing}, "
                                 f"unexpected keys {extra}")
        for name, p in params.items():
            got = tuple(np.shape(state_dict[name]))
            if got != p.shape:
                raise StateDictError(f"{name}: expected shape {p.shape}, got {got}")
        self.name_parameters()
        for name, p in params.items():
            p.assign(np.asarray(state_dict[name]))

    def extra_repr(self) -> str:
        return ""

    def __repr__(self):
        inner = "".join(f"\n  ({k}): " + repr(m).replace("\n", "\n  ")
                        for k, m in self._modules.items())
        return f"{type(self).__name__}({self.extra_repr()}{inner}{chr(10) if inner else ''})"
