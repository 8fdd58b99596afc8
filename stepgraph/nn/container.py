"""Containers with torch.nn's behaviour: Sequential, ModuleList, ModuleDict, ParameterList,
ParameterDict. Items are registered under their keys ("0", "1", ... for the lists), so the
state_dict keys are torch's ("0.weight", "blocks.3.bias", "<key>.weight")."""
from __future__ import annotations

import operator
from collections import OrderedDict

from .module import Module, Parameter


class _Indexed(Module):
    """What the list-like containers share: items under "0".."n-1" of one member table,
    integer (negative too) and slice indexing, len, iteration, append/extend/insert."""

    _table = "_modules"

    def _items(self) -> list:
        return list(getattr(self, self._table).values())

    def _index(self, i) -> int:
        i = operator.index(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of range for {type(self).__name__} of {n}")
        return i % n

    def _renumber(self, items: list) -> None:
        for key in list(getattr(self, self._table)):
            delattr(self, key)
        for i, item in enumerate(items):
            setattr(self, str(i), item)

    def __len__(self):
        return len(getattr(self, self._table))

    def __iter__(self):
        return iter(self._items())

    def __getitem__(self, i):
        if isinstance(i, slice):
            return type(self)(self._items()[i])
        return self._items()[self._index(i)]

    def __setitem__(self, i, item) -> None:
        setattr(self, str(self._index(i)), item)

    def __delitem__(self, i) -> None:
        items = self._items()
        del items[i if isinstance(i, slice) else self._index(i)]
        self._renumber(items)

    def append(self, item):
        setattr(self, str(len(self)), item)
        return self

    def extend(self, items):
        for item in items:
            self.append(item)
        return self

    def insert(self, index: int, item) -> None:
        items = self._items()
        items.insert(index, item)
        self._renumber(items)

    def __iadd__(self, items):
        return self.extend(items)


class Sequential(_Indexed):
    """Calls its modules in order. Built from modules (keys "0", "1", ...) or from one
    OrderedDict of named modules (its keys); a slice is a Sequential of the same modules."""

    def __init__(self, *modules):
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], OrderedDict):
            for key, m in modules[0].items():
                self.register_module(key, m)
        else:
            for i, m in enumerate(modules):
                self.register_module(str(i), m)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Sequential(OrderedDict(list(self._modules.items())[i]))
        return self._items()[self._index(i)]

    def __setitem__(self, i, module: Module) -> None:
        setattr(self, list(self._modules)[self._index(i)], module)

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x


class ModuleList(_Indexed):
    """A list of modules, registered under "0", "1", ... (state_dict keys "0.weight", ...).
    It has no forward: the owner calls its items."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.extend(modules)


class ParameterList(_Indexed):
    """A list of Parameters under "0", "1", ... (a value that is not a Parameter is made
    one, as torch's)."""

    _table = "_params"

    def __init__(self, values=None):
        super().__init__()
        if values is not None:
            self.extend(values)

    def __setattr__(self, name, value):
        if name.isdigit() and value is not None and not isinstance(value, Parameter):
            value = Parameter(value)
        super().__setattr__(name, value)

    def extra_repr(self):
        return "\n".join(f"({i}): Parameter containing: shape {p.shape}"
                         for i, p in enumerate(self))


class _Keyed(Module):
    """What the dict-like containers share: items by key, reachable as attributes too."""

    _table = "_modules"

    def _mapping(self) -> OrderedDict:
        return getattr(self, self._table)

    def __getitem__(self, key: str):
        return self._mapping()[key]

    def __setitem__(self, key: str, value) -> None:
        setattr(self, key, value)

    def __delitem__(self, key: str) -> None:
        delattr(self, key)

    def __contains__(self, key) -> bool:
        return key in self._mapping()

    def __len__(self):
        return len(self._mapping())

    def __iter__(self):
        return iter(list(self._mapping()))

    def keys(self):
        return self._mapping().keys()

    def items(self):
        return self._mapping().items()

    def values(self):
        return self._mapping().values()

    def pop(self, key: str):
        value = self[key]
        del self[key]
        return value

    def clear(self) -> None:
        for key in list(self._mapping()):
            del self[key]

    def update(self, values) -> None:
        """Add (key, value) pairs from a mapping or an iterable of pairs, in order."""
        for key, value in (values.items() if hasattr(values, "items") else values):
            self[key] = value


class ModuleDict(_Keyed):
    """Modules by name, registered under their keys (state_dict keys "<key>.weight", ...) and
    reachable as items or attributes, as PyTorch's. It has no forward: the owner calls its
    items."""

    def __init__(self, modules=None):
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __setitem__(self, key: str, module: Module) -> None:
        self.register_module(key, module)


class ParameterDict(_Keyed):
    """Parameters by name (a value that is not a Parameter is made one, as torch's)."""

    _table = "_params"

    def __init__(self, parameters=None):
        super().__init__()
        if parameters is not None:
            self.update(parameters)

    def __setitem__(self, key: str, value) -> None:
        self.register_parameter(key, value if isinstance(value, Parameter)
                                else Parameter(value))
