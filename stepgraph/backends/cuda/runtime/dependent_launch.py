"""Programmatic dependent launch of stepgraph's own kernels inside a captured step.

In a CUDA graph each kernel still starts only after the one before it has completed and the
GPU has noticed. Launched with the attribute CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_
SERIALIZATION, a kernel may be scheduled while its predecessor's last blocks drain; every
stepgraph kernel opens with `await_previous_kernel()` (include/launch_order.cuh: PTX
`griddepcontrol.wait`), which holds it until the kernels before it have completed and their
writes are visible, so results do not change, bit for bit. Measured on an H200
(docs/perf-notes.md, 2026-12-02): 0.4-0.6 µs less a launch in captured chains of kernels
(triggering the next launch early from inside the kernel gained less); inside whole steps,
where kernels already follow one another closely, torchvision's ResNet-18 file 1-2% faster
and the other files and workloads timed level.

Only launches made while the stream captures take the attribute (a step's graph and the
autotuner's timed graphs, which time what the step will run); eager calls keep CuPy's launch.
Kernels of libraries (cuBLASLt, cuDNN, NCCL) and CuPy's own are launched as they launch
themselves, and a kernel after one of them waits for its completion as usual. GPUs before
sm_90 have no such launches; STEPGRAPH_DEPENDENT_LAUNCH=0 turns them off (to time both).
"""
from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

ENV = "STEPGRAPH_DEPENDENT_LAUNCH"
PROGRAMMATIC_STREAM_SERIALIZATION = 6      # CUlaunchAttributeID


class _Attribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


@functools.cache
def _driver():
    """libcuda's cuLaunchKernelEx and the attribute every dependent launch passes."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    attribute = _Attribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value[0] = 1                 # programmaticStreamSerializationAllowed
    return lib, attribute


@functools.cache
def supported(device: int) -> bool:
    """Whether GPU `device` takes dependent launches (compute capability 9.0 or later)."""
    import cupy as cp

    return os.environ.get(ENV, "1") != "0" and \
        int(cp.cuda.Device(device).compute_capability) >= 90


def _argument(value):
    """A ctypes object holding one kernel argument as CuPy's launch passes it: an array's
    device pointer; a NumPy scalar's bytes; a Python int as int64, a float as float64, a bool
    as one byte; None as a null pointer."""
    import cupy as cp

    if isinstance(value, cp.ndarray):
        return ctypes.c_void_p(value.data.ptr)
    if value is None:
        return ctypes.c_void_p(0)
    if isinstance(value, np.generic):
        raw = value.tobytes()
        return (ctypes.c_char * len(raw)).from_buffer_copy(raw)
    if isinstance(value, bool):
        return ctypes.c_bool(value)
    if isinstance(value, int):
        return ctypes.c_int64(value)
    if isinstance(value, float):
        return ctypes.c_double(value)
    raise TypeError(f"a kernel argument of type {type(value).__name__} cannot be passed")


def _dims(sizes) -> ctypes.Array:
    """A grid or block (an int, or a tuple of 1-3 ints) as CUDA's three dimensions."""
    sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else (sizes,)
    return (ctypes.c_uint * 3)(*(int(v) for v in sizes + (1,) * (3 - len(sizes))))


def launch(raw, grid: tuple, block: tuple, args: tuple, stream, shared_mem: int) -> None:
    """Launch CuPy RawKernel `raw` on `stream` with programmatic stream serialization."""
    lib, attribute = _driver()
    held = [_argument(a) for a in args]
    params = (ctypes.c_void_p * max(1, len(held)))(*[ctypes.addressof(h) for h in held])
    config = _Config(_dims(grid), _dims(block), int(shared_mem), stream.ptr,
                     ctypes.pointer(attribute), 1)
    status = lib.cuLaunchKernelEx(ctypes.byref(config), raw.kernel.ptr, params, None)
    if status:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"cuLaunchKernelEx of {getattr(raw, 'name', 'a kernel')} failed: "
                           f"{(name.value or b'?').decode()} ({status})")


class Kernel:
    """A compiled stepgraph kernel, called as a CuPy RawKernel is (grid, block, args,
    stream=, shared_mem=): launched dependently while its stream captures on a GPU that
    takes it, through CuPy otherwise. Other attributes are the RawKernel's."""

    __slots__ = ("raw",)

    def __init__(self, raw):
        object.__setattr__(self, "raw", raw)

    def __call__(self, grid, block, args, stream=None, shared_mem: int = 0) -> None:
        import cupy as cp

        stream = stream if stream is not None else cp.cuda.get_current_stream()
        if stream.is_capturing() and supported(cp.cuda.runtime.getDevice()):
            launch(self.raw, grid, block, args, stream, shared_mem)
        else:
            self.raw(grid, block, args, stream=stream, shared_mem=shared_mem)

    def __getattr__(self, name):
        return getattr(self.raw, name)

    def __setattr__(self, name, value):
        setattr(self.raw, name, value)
