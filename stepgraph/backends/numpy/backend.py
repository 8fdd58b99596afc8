"""The reference backend: NumPy arrays on the CPU, one function per op: the references the op
families (stepgraph/ops/) register in ir/ops.py IMPLS.

bfloat16 values (precision="bf16") live as their raw bits in uint16 arrays (bf16.py), exactly
as on the GPU: two bytes an element in the planner's arena. `run_node` hands every kernel
float32 arrays instead: a bf16 input widened exactly, a bf16 output as a float32 scratch that
is rounded to nearest even when the node finishes, and so is a bf16 input the node writes in
place. A bf16 value is thus rounded exactly once, by the node that writes it, after that node
computed everything in float32: what a CUDA kernel does (load bf16, compute in float32
registers, round on store), cuBLASLt's bf16 GEMMs included (float32 accumulation, epilogue
in float32, one rounding of D). float16 (precision="fp16", model.half()) is NumPy's own
float16, handed to kernels the same way: widened, computed in float32, rounded once on store.
"""
from __future__ import annotations

import numpy as np

from ...errors import ShapeError
from ...ir.graph import storage_dtype
from ...ir.ops import IMPLS
from ..base import Backend
from . import bf16


class NumpyBackend(Backend):
    name = "numpy"
    device = "cpu"

    def __init__(self):
        self.impls = IMPLS

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=storage_dtype(dtype))

    def to_numpy(self, array) -> np.ndarray:
        """A copy; bf16 bits come back as their float32 values."""
        return bf16.from_bits(array) if bf16.is_bf16(array) else np.array(array, copy=True)

    def copy_into(self, dst, src) -> None:
        if not isinstance(src, np.ndarray):
            device = getattr(src, "__dlpack_device__", None)
            if device is not None and device()[0] != 1:    # 1: kDLCPU
                raise ShapeError(f"cannot copy an array on DLPack device {tuple(device())} "
                                 "into host memory: this step runs on the CPU")
            src = np.from_dlpack(src) if device is not None else np.asarray(src)
        if bf16.is_bf16(dst) and src.dtype.kind == "f" and src.shape == dst.shape:
            src = bf16.to_bits(src)             # float values into a bf16 buffer: rounded
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ShapeError(f"cannot copy {src.dtype}{list(src.shape)} into "
                             f"{dst.dtype}{list(dst.shape)}")
        dst[...] = src                  # np.copyto's copy, without its dispatch

    def view(self, arena, offset, shape, dtype):
        return np.ndarray(shape, dtype=storage_dtype(dtype), buffer=arena, offset=offset)

    def host_mirror(self, array):
        return array

    def owns(self, array) -> bool:
        return isinstance(array, np.ndarray)

    def copy_result(self, buffer):
        return self.to_numpy(buffer)

    def run_node(self, node, ins, outs, ctx=None) -> None:
        # Overflow and NaN are reported by the step's guard (on_bad_batch), naming the step,
        # as the CUDA kernels' are; NumPy's RuntimeWarnings would name a line of an op's
        # reference instead, before that error, and torch does not warn either.
        with np.errstate(all="ignore"):
            self._run_node(node, ins, outs, ctx)

    def _run_node(self, node, ins, outs, ctx) -> None:
        if not any(map(_is_half, ins)) and not any(map(_is_half, outs)):
            return super().run_node(node, ins, outs, ctx)
        wide_ins = [_widen(a) if _is_half(a) else a for a in ins]
        wide_outs = [np.empty(a.shape, np.float32) if _is_half(a) else a for a in outs]
        super().run_node(node, wide_ins, wide_outs, ctx)
        for a, wide in zip(outs, wide_outs):
            if _is_half(a):
                _store(a, wide)
        for i in node.mutates:
            if _is_half(ins[i]):
                _store(ins[i], wide_ins[i])

    def synchronize(self) -> None:
        pass


# float16 is handled as bf16 is: its kernels see float32 arrays, and what they write is rounded
# once (NumPy's float32 -> float16 conversion rounds to nearest even, overflow to +-inf, as
# torch's and the CUDA kernels' do).
def _is_half(array) -> bool:
    return bf16.is_bf16(array) or getattr(array, "dtype", None) == np.float16


def _widen(array) -> np.ndarray:
    return bf16.from_bits(array) if bf16.is_bf16(array) else array.astype(np.float32)


def _store(array, wide) -> None:
    array[...] = bf16.to_bits(wide) if bf16.is_bf16(array) else wide
