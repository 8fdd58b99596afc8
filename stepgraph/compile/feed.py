"""Feed signatures and validation: what a step accepts, checked before anything is copied.

A signature is the shapes and dtypes of the arrays a step is called with. The batch axis may
change from call to call (the last partial batch of an epoch); everything else must match the
example inputs exactly: nothing is silently broadcast or cast.

The batch axis of each input is decided once, from the example inputs: the first input's
axis 0 holds the batch, and every other input's batch axis is its first axis of that size
(axis 0 of a target; axis 1 of a recurrent layer's initial state (num_layers, batch, hidden),
as torch shapes it). An input without an axis of the batch size keeps its shape on every call.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

import numpy as np

from ..errors import LabelError, ShapeError


@dataclass(frozen=True)
class FeedSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    batch_axis: int | None = 0      # the axis that may change between calls (None: none)

    def dims(self) -> str:
        """The shape in words, "batch" at the batch axis: "(2, batch, 24)"."""
        return "(" + ", ".join("batch" if k == self.batch_axis else str(d)
                               for k, d in enumerate(self.shape)) + ")"


Signature = tuple[FeedSpec, ...]


def describe(array) -> tuple[tuple[int, ...], str]:
    """Shape and dtype of a NumPy, CuPy or DLPack array without copying it."""
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        raise ShapeError(f"expected an array (NumPy, CuPy or DLPack), got {type(array).__name__}")
    return tuple(int(d) for d in array.shape), _dtype_name(array.dtype)


def _dtype_name(dtype) -> str:
    try:
        return str(np.dtype(dtype))
    except TypeError:   # another library's dtype object, e.g. torch.float32: NumPy's names
        try:
            return str(np.dtype(str(dtype).rsplit(".", 1)[-1]))
        except TypeError:
            raise ShapeError(f"unsupported dtype {dtype}") from None


def _host_array(array) -> np.ndarray | None:
    """A NumPy view of an array in host memory (NumPy, or DLPack on the CPU), else None."""
    if isinstance(array, np.ndarray):
        return array
    device = getattr(array, "__dlpack_device__", None)
    if device is not None and device()[0] == 1:      # DLPack kDLCPU: no copy, no sync
        return np.from_dlpack(array)
    return None


def signature_of(names: tuple[str, ...], arrays) -> Signature:
    """The signature of example inputs, each input's batch axis decided from their shapes."""
    described = [describe(a) for a in arrays]
    batch = described[0][0][0] if described and described[0][0] else None
    return tuple(FeedSpec(n, shape, dtype, _batch_axis(shape, batch))
                 for n, (shape, dtype) in zip(names, described))


def _batch_axis(shape: tuple[int, ...], batch: int | None) -> int | None:
    """The first axis of `shape` of the batch size, None when it has none."""
    return next((k for k, d in enumerate(shape) if d == batch), None)


def check_feed(expected: Signature, arrays) -> Signature:
    """The signature of `arrays`, after checking it against the example signature."""
    _check_count(expected, arrays)
    return check_signature(expected, signature_of(tuple(s.name for s in expected), arrays))


def _check_count(expected: Signature, arrays) -> None:
    if len(arrays) != len(expected):
        raise ShapeError(f"expected {len(expected)} inputs "
                         f"({', '.join(s.name for s in expected)}), got {len(arrays)}")


def check_signature(expected: Signature, got: Signature) -> Signature:
    """`got` (one step's feed) with the example's batch axes, after checking it against the
    example signature: every axis but an input's batch axis as the example's, and every batch
    axis of the first input's batch size."""
    first = expected[0]
    batch = None if first.batch_axis is None or len(got[0].shape) != len(first.shape) \
        else got[0].shape[first.batch_axis]
    for want, have in zip(expected, got):
        if have.dtype != want.dtype:
            raise ShapeError(f"input {want.name!r}: expected dtype {want.dtype}, got {have.dtype}")
        if len(have.shape) != len(want.shape):
            raise ShapeError(f"input {want.name!r}: expected rank {len(want.shape)} "
                             f"{want.shape}, got rank {len(have.shape)} {have.shape}")
        if any(h != w for k, (h, w) in enumerate(zip(have.shape, want.shape))
               if k != want.batch_axis):
            raise ShapeError(f"input {want.name!r}: expected shape {want.dims()}, got "
                             f"{have.shape}")
        if want.batch_axis is not None and have.shape[want.batch_axis] != batch:
            where = "" if want.batch_axis == 0 else \
                f" (its batch axis is {want.batch_axis}: its first axis of the example's " \
                "batch size)"
            raise ShapeError(f"input {want.name!r}: batch size {have.shape[want.batch_axis]} "
                             f"does not match {got[0].name!r} batch size {batch}{where}")
    if batch == 0:
        raise ShapeError(f"input {got[0].name!r}: empty batch (batch size 0); a step needs at "
                         "least one sample")
    return tuple(replace(have, batch_axis=want.batch_axis) for want, have in zip(expected, got))


def check_steps_feed(expected: Signature, arrays, steps: int) -> tuple[Signature, int]:
    """(the signature of one step, launches) of a feed of `steps` steps per launch: each array
    stacks the steps' batches along a new leading axis of `steps` or a multiple of it, the
    same for every input; launches = that axis // steps."""
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    _check_count(expected, arrays)
    described = [describe(a) for a in arrays]
    for want, (shape, _) in zip(expected, described):
        if len(shape) != len(want.shape) + 1 or any(
                h != w for k, (h, w) in enumerate(zip(shape[1:], want.shape))
                if k != want.batch_axis):
            dims = want.dims()[1:-1]
            raise ShapeError(f"input {want.name!r}: expected shape ({steps}, {dims}) (a "
                             f"leading axis of steps={steps}, or a multiple of it, before "
                             f"each step's shape), got {shape}")
    lead = described[0][0][0]
    for want, (shape, _) in zip(expected, described):
        if shape[0] != lead:
            raise ShapeError(f"input {want.name!r}: leading (steps) axis {shape[0]} does not "
                             f"match {expected[0].name!r} leading axis {lead}")
    if lead == 0 or lead % steps:
        raise ShapeError(f"input {expected[0].name!r}: leading axis {lead} is not a positive "
                         f"multiple of steps={steps}")
    got = tuple(FeedSpec(want.name, shape[1:], dtype)
                for want, (shape, dtype) in zip(expected, described))
    return check_signature(expected, got), lead // steps


def check_labels(name: str, labels, classes: int, ignore_index: int | None = None) -> None:
    """Class labels must lie in [0, classes) or be the loss's ignore_index. Checked on host
    arrays only: a device array would need a sync, which a step must not do; kernels write
    NaN for an invalid label."""
    labels = _host_array(labels)
    if labels is None or labels.size == 0:
        return
    lo, hi = int(labels.min()), int(labels.max())
    if lo >= 0 and hi < classes:
        return                  # all in range (the common batch): no mask to build
    if ignore_index is not None:
        labels = labels[labels != ignore_index]
        if labels.size == 0:
            return
        lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= classes:
        raise LabelError(f"input {name!r}: labels must be in [0, {classes}), "
                         f"got values in [{lo}, {hi}]")
