"""torch.utils.data.default_collate and default_convert: samples into batches, as torch.

default_collate stacks stepgraph tensors and NumPy arrays along a new first axis (keeping their
dtype), makes Python ints int64, Python floats float64 (torch's choice for collated floats,
unlike torch.tensor's float32), bools bool, NumPy scalars their own dtype; it recurses into
dicts (same keys), namedtuples, tuples (which become lists, as in torch) and lists, and leaves
strings as the sequence of them. Batches are eager stepgraph tensors in host memory.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping, Sequence

import numpy as np

from ...functions.factories import as_tensor as factory_as_tensor
from ...ir.trace import Tensor, tensor_of

ERROR = ("default_collate: batch must contain tensors, numpy arrays, numbers, dicts or lists; "
         "found {}")


def stacked(tensors: Sequence[Tensor]) -> Tensor:
    """Eager tensors of one shape stacked along a new first axis (their storage, so bfloat16
    stays bfloat16)."""
    if not all(t.is_eager for t in tensors):
        raise TypeError("default_collate: a traced tensor has no values to collate")
    shapes = [tuple(t.shape) for t in tensors]
    for i, shape in enumerate(shapes):
        if shape != shapes[0]:
            raise RuntimeError(f"stack expects each tensor to be equal size, but got "
                               f"{list(shapes[0])} at entry 0 and {list(shape)} at entry {i}")
    return tensor_of(np.stack([t.array for t in tensors]))


def as_tensor(array) -> Tensor:
    """A NumPy array or scalar as an eager tensor of its dtype (refused where stepgraph
    tensors cannot hold the dtype)."""
    return factory_as_tensor(np.asarray(array))


def is_numpy_data(elem) -> bool:
    """NumPy arrays and scalars, but not NumPy strings (which collate as strings)."""
    return isinstance(elem, (np.ndarray, np.generic)) \
        and not isinstance(elem, (np.str_, np.bytes_))


def is_namedtuple(elem) -> bool:
    return isinstance(elem, tuple) and hasattr(elem, "_fields")


def collate_numpy(batch) -> Tensor:
    elem = batch[0]
    if elem.dtype.kind in "SaUO":
        raise TypeError(ERROR.format(elem.dtype))
    if isinstance(elem, np.ndarray) and elem.ndim > 0:
        return stacked([as_tensor(b) for b in batch])
    return as_tensor(np.array(batch))


def collate_mapping(batch):
    elem = batch[0]
    collated = {key: default_collate([d[key] for d in batch]) for key in elem}
    if isinstance(elem, MutableMapping):
        clone = copy.copy(elem)
        clone.update(collated)
        return clone
    try:
        return type(elem)(collated)
    except TypeError:                # a Mapping type that cannot be built from a dict
        return collated


def collate_sequence(batch):
    elem = batch[0]
    if any(len(b) != len(elem) for b in batch):
        raise RuntimeError("each element in list of batch should be of equal size")
    collated = [default_collate(samples) for samples in zip(*batch)]
    if is_namedtuple(elem):
        return type(elem)(*collated)
    if isinstance(elem, tuple):
        return collated              # torch gives tuples back as lists
    try:
        return type(elem)(collated)
    except TypeError:
        return collated


def default_collate(batch):
    """A list of samples as one batch, as torch.utils.data.default_collate (module docstring)."""
    elem = batch[0]
    if isinstance(elem, Tensor):
        return stacked(batch)
    if is_numpy_data(elem):
        return collate_numpy(batch)
    if isinstance(elem, float):
        return tensor_of(np.array(batch, dtype=np.float64))
    if isinstance(elem, int):        # bools too: all bools give bool, else int64
        values = np.array(batch)
        return tensor_of(values if values.dtype == bool else values.astype(np.int64))
    if isinstance(elem, (str, bytes)):
        return batch
    if isinstance(elem, Mapping):
        return collate_mapping(batch)
    if isinstance(elem, Sequence):
        return collate_sequence(batch)
    raise TypeError(ERROR.format(type(elem)))


def default_convert(data):
    """One sample as it is, NumPy arrays and scalars made tensors, recursing into dicts,
    namedtuples, tuples (made lists) and lists: the collate of an unbatched DataLoader."""
    if is_numpy_data(data):
        return data if data.dtype.kind in "SaUO" else as_tensor(data)
    if isinstance(data, Mapping):
        converted = {key: default_convert(data[key]) for key in data}
        try:
            return type(data)(converted)
        except TypeError:
            return converted
    if is_namedtuple(data):
        return type(data)(*(default_convert(d) for d in data))
    if isinstance(data, tuple):
        return [default_convert(d) for d in data]
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        try:
            return type(data)([default_convert(d) for d in data])
        except TypeError:
            return [default_convert(d) for d in data]
    return data
