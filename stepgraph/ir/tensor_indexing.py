"""Index assignment (`x[idx] = v`, and `x[idx] += v`, which Python runs as a read, an in-place
add and this assignment) and formatting (`f"{loss:.4f}"`), attached to Tensor when this module
is imported (stepgraph/__init__.py imports it).

An eager tensor is written in place with NumPy's indexing, which is torch's for what model
code writes: ints, slices, `...`, None, bool masks, integer tensors and lists; v a number or a
tensor broadcast to the indexed shape (leading size-1 axes of v dropped, as torch). Reading
`x[mask]` or `x[[0, 2]]` of an eager tensor works the same way (the values are known).

A traced tensor is never overwritten: it is rebound to a functional index-put (`_assign`), with
gradients to both x (dy where not written) and v (dy gathered from where it was written):
- an index known at trace time (ints, slices, `...`, None, eager masks and integer tensors):
  the written positions are computed then, as a constant mask; a number is a `masked_fill`
  there (Swin's `attn_mask[h0:h1, w0:w1] = count`), a tensor v is broadcast, placed at those
  positions (`gather_grad`, the scatter of the gather family) and selected by the mask
  (`where`); where positions repeat, the last write wins, as in torch's CPU loop;
- a traced bool mask over x's leading axes, with a number or a one-element v: `where`;
- one traced 1-D integer tensor on one axis, full slices elsewhere: `scatter` along it
  (repeated indices add up; torch leaves which write wins unspecified).
Other traced indices (several traced tensors, a traced mask with per-element values, whose
count depends on the data) are refused with UnsupportedOpError.
"""
from __future__ import annotations

import numbers

import numpy as np

from ..errors import ShapeError
from . import tensor_select  # noqa: F401  (Tensor.__getitem__ first: wrapped below)
from .tensor import Tensor, _is_scalar
from .trace import current_tracer, tensor_of

_TRACED = object()     # an index item whose values exist only in the step


def _static(item):
    """An index item as NumPy reads it, or _TRACED for a traced tensor."""
    if item is None or item is Ellipsis or isinstance(item, (numbers.Integral, slice)):
        return item
    if isinstance(item, Tensor):
        return item.numpy() if item.is_eager else _TRACED
    if getattr(item, "traced", None) is not None:        # a Parameter or Buffer
        return _TRACED if current_tracer() is not None else item.numpy()
    if isinstance(item, (list, tuple, np.ndarray)):
        return np.asarray(item)
    raise IndexError(f"tensors are indexed by ints, slices, None, ..., bool masks and integer "
                     f"tensors or lists, got {type(item).__name__}")


def _items(index) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def _store(array: np.ndarray, dtype: str, index, values) -> None:
    """array[index] = values, values converted to the storage of IR dtype `dtype`."""
    if dtype == "bfloat16":
        from ..backends.numpy import bf16
        values = bf16.to_bits(np.asarray(values, np.float32))
    try:
        array[index] = values
    except ValueError as err:           # NumPy's broadcast failure, as torch's shape error
        raise ShapeError(f"__setitem__: a value of shape {np.shape(values)} cannot be "
                         f"broadcast to the indexed part of a {array.shape} tensor ({err})"
                         ) from None


def __setitem__(self: Tensor, index, value) -> None:
    """x[index] = value (module doc)."""
    items = _items(index)
    static = tuple(_static(i) for i in items)
    value_traced = isinstance(value, Tensor) and not value.is_eager or \
        getattr(value, "traced", None) is not None and current_tracer() is not None
    if self.is_eager:
        if value_traced or any(i is _TRACED for i in static):
            self._unsupported("writing traced values into an eager tensor (a tensor made "
                              "outside forward) inside a traced forward: make the tensor "
                              "in forward (x.new_zeros(...)) or register it as a buffer")
        values = value.numpy() if isinstance(value, Tensor) else \
            value.numpy() if hasattr(value, "traced") else np.asarray(value)
        _store(self.array, self.value.dtype, static, values)
        return
    if all(i is not _TRACED for i in static):
        result = _put_static(self, static, value)
    else:
        result = _put_traced(self, items, static, value)
    self._assign(result, "Tensor.__setitem__")


def _put_static(self: Tensor, index: tuple, value) -> Tensor:
    """x with `value` at the positions a trace-time index names (module doc)."""
    positions = np.arange(self.numel(), dtype=np.int64).reshape(self.shape)[index]
    mask = np.zeros(self.numel(), bool)
    mask[positions.ravel()] = True
    mask = tensor_of(mask.reshape(self.shape))
    if _is_scalar(value):
        return self.masked_fill(mask, value)
    v = _fitted(self, self._coerce(value, "__setitem__"), positions.shape)
    flat, where = v.reshape(-1), positions.ravel()
    # a position written twice keeps its last value: only the last occurrence is placed
    _, last = np.unique(where[::-1], return_index=True)
    keep = np.sort(where.size - 1 - last)
    if keep.size != where.size:
        flat, where = flat.index_select(0, tensor_of(keep)), where[keep]
    base = self if self.dtype.is_floating_point else self.double()
    placed = base.reshape(-1)._scattered(0, tensor_of(where), flat._cast(base.dtype),
                                         "__setitem__")
    return placed.reshape(*self.shape).where(mask, base)._cast(self.dtype)


def _fitted(self: Tensor, v: Tensor, shape: tuple) -> Tensor:
    """v in x's dtype broadcast to the indexed `shape` (leading size-1 axes dropped)."""
    while v.ndim > len(shape) and v.shape[0] == 1:
        v = v.squeeze(0)
    try:
        np.broadcast_shapes(tuple(v.shape), shape)
    except ValueError:
        raise ShapeError(f"__setitem__: a value of shape {tuple(v.shape)} cannot be broadcast "
                         f"to the indexed shape {shape}") from None
    if tuple(v.shape) != shape:
        v = v.expand(*shape)
    if not self.dtype.is_floating_point:
        return v.double()
    return v._cast(self.dtype)


def _put_traced(self: Tensor, items: tuple, static: tuple, value) -> Tensor:
    """x with `value` written where a traced mask or integer tensor index says."""
    traced = [i for i, s in enumerate(static) if s is _TRACED]
    index = self._coerce(items[traced[0]], "__setitem__")
    if len(items) == 1 and index.dtype in ("bool", "uint8"):
        mask = index if index.dtype == "bool" else index != 0
        if tuple(mask.shape) != tuple(self.shape[:mask.ndim]):
            raise ShapeError(f"__setitem__: mask {tuple(mask.shape)} does not match the "
                             f"leading axes of {tuple(self.shape)}")
        mask = mask.reshape(*mask.shape, *(1,) * (self.ndim - mask.ndim))
        if _is_scalar(value):
            return self.masked_fill(mask, value)
        v = self._coerce(value, "__setitem__")
        if v.numel() != 1:
            self._unsupported("x[traced_mask] = v with a v per masked element (their count "
                              "depends on the data; use torch.where(mask, v, x))")
        return self.where(mask.logical_not(), v.reshape(())._cast(self.dtype))
    static = list(static)
    if Ellipsis in static:                      # as the full slices it stands for
        at = static.index(Ellipsis)
        real = sum(s is not None and s is not Ellipsis for s in static)
        static[at:at + 1] = [slice(None)] * (self.ndim - real)
    axis = static.index(_TRACED)
    full = all(isinstance(s, slice) and s == slice(None)
               for i, s in enumerate(static) if i != axis)
    if len(traced) > 1 or index.ndim != 1 or index.dtype not in ("int32", "int64") or not full:
        self._unsupported("x[index] = v with this traced index (supported: a traced bool "
                          "mask, or one traced 1-D integer tensor on one axis with full "
                          "slices elsewhere)")
    shape = tuple(self.shape[:axis]) + (index.shape[0],) + tuple(self.shape[axis + 1:])
    along = index.reshape(*(index.shape[0] if a == axis else 1 for a in range(self.ndim)))
    along = along.expand(*shape)
    if _is_scalar(value):
        return self.scatter(axis, along, value=float(value))
    v = _fitted(self, self._coerce(value, "__setitem__"), shape)
    base = self if self.dtype.is_floating_point else self.double()
    return base.scatter(axis, along, v)._cast(self.dtype)


_getitem = Tensor.__getitem__


def __getitem__(self: Tensor, index):
    """x[index]; an eager tensor indexed by bool masks, lists or several integer tensors
    reads through NumPy (its values are known), every other case as ir/tensor_select.py's."""
    if self.is_eager:
        items = _items(index)
        advanced = [i for i in items if not (i is None or i is Ellipsis or
                                             isinstance(i, (numbers.Integral, slice)))]
        if advanced and all(not isinstance(i, Tensor) or i.is_eager for i in advanced) and (
                len(advanced) > 1 or any(np.asarray(_static(i)).dtype in (np.bool_, np.uint8)
                                         or isinstance(i, (list, tuple)) for i in advanced)):
            static = tuple(_static(i) for i in items)
            return tensor_of(np.array(self.array[static], order="C"))
    return _getitem(self, index)


def __format__(self: Tensor, spec: str) -> str:
    """format(x, spec): a one-element eager tensor formats as its number (`f"{loss:.4f}"`),
    as torch's 0-d tensors do; any tensor with an empty spec as str(x)."""
    if self.is_eager and self.ndim == 0:
        return format(self.item(), spec)
    if not spec:
        return str(self)
    if not self.is_eager:
        self._unsupported("formatting a traced tensor (a traced forward has no values)")
    raise TypeError(f"unsupported format string passed to a tensor of shape "
                    f"{tuple(self.shape)}: only 0-d tensors format as numbers")


def attach(cls: type) -> None:
    """Give Tensor the indexing surface of this module."""
    for fn in (__setitem__, __getitem__, __format__):
        setattr(cls, fn.__name__, fn)


attach(Tensor)
