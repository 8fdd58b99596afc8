"""The reference backend: NumPy arrays on the CPU, one function per op (kernels.py)."""
from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from ..base import Backend
from .kernels import IMPLS


class NumpyBackend(Backend):
    name = "numpy"
    device = "cpu"

    def __init__(self):
        self.impls = IMPLS

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=dtype)

    def to_numpy(self, array) -> np.ndarray:
        return np.array(array, copy=True)

    def copy_into(self, dst, src) -> None:
        if not isinstance(src, np.ndarray):
            device = getattr(src, "__dlpack_device__", None)
            if device is not None and device()[0] != 1:    # 1: kDLCPU
                raise ShapeError(f"cannot copy an array on DLPack device {tuple(device())} "
                                 "into host memory: this step runs on the CPU")
            src = np.from_dlpack(src) if device is not None else np.asarray(src)
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ShapeError(f"cannot copy {src.dtype}{list(src.shape)} into "
                             f"{dst.dtype}{list(dst.shape)}")
        np.copyto(dst, src)

    def view(self, arena, offset, shape, dtype):
        return np.ndarray(shape, dtype=dtype, buffer=arena, offset=offset)

    def host_mirror(self, array):
        return array

    def owns(self, array) -> bool:
        return isinstance(array, np.ndarray)

    def copy_result(self, buffer):
        return buffer.copy()

    def synchronize(self) -> None:
        pass
