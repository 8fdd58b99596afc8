"""A step's loss kept on the device: returning it costs no sync; float() syncs and reads it."""
from __future__ import annotations


class DeviceScalar:
    """The loss of one step. It first refers to the step's own output buffer; before the step
    runs again and overwrites that buffer, `detach()` takes a device-side copy, so a loss that
    is kept around still reads its own step's value."""

    __slots__ = ("_buffer", "_stream", "__weakref__")

    def __init__(self, buffer, stream):
        self._buffer, self._stream = buffer, stream

    def detach(self) -> None:
        with self._stream:
            self._buffer = self._buffer.copy()

    def __float__(self) -> float:
        return float(self._buffer.get(stream=self._stream))

    def item(self) -> float:
        return float(self)

    def __array__(self, dtype=None, copy=None):
        import numpy as np
        return np.asarray(float(self), dtype=dtype)

    def __repr__(self):
        return f"DeviceScalar({float(self):.6g})"

    def __format__(self, spec):
        return format(float(self), spec)
