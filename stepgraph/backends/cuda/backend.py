"""The cuda backend: CuPy memory, NVRTC kernels (the op families' launchers beside their .cu
files) and cuBLASLt (matmul/gemm.py); runtime/ holds the machinery the families share.

All device work of the backend goes to one private non-blocking stream (the default stream
cannot be captured): feed copies, every op of every plan, result copies. Contexts made by
`make_context` share that stream and one GemmCache, so work stays ordered without host syncs.
CuPy is imported when a CudaBackend is created, so importing this module needs no GPU.
"""
from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import BackendUnavailableError, CaptureError, PlanError, ShapeError
from ...ir.graph import storage_dtype
from ..base import Backend
from .runtime import nvmath_bindings

# The op families: modules of this package (dotted below it) whose IMPLS tables (op -> impl)
# make up the backend's op table, in this order; a later module's entry replaces an earlier
# one's for the same op.
IMPL_MODULES = ("elementwise", "reduce", "loss", "optim", "matmul.linear", "conv.conv",
                "broadcast", "softmax", "norm", "pool", "pointwise", "pointwise_sum", "guards",
                "embedding",
                "layer_norm", "matmul.bmm", "shape", "collective", "cast", "attention.attention",
                "index", "reduce_axis", "recurrent", "conv.conv3d", "pool3d", "random",
                "lstm_cell", "sync_batch_norm")
# The families whose kernels most plans launch (fills, activations, sums, losses, the step
# bookkeeping and updates; other families call the first three): their files are compiled
# for every op's plan.
SHARED_FAMILIES = ("elementwise", "reduce", "loss", "optim")
# The families whose float32 kernels are started first, when the backend is made, before the
# rest of its setup (cuBLASLt, the other families' imports) and the tracing: the shared ones,
# the guards of every train step, and linear's GEMM kernels, whose timing opens most first
# steps. None of the others declares instantiations in their files, so these chunks are final.
EARLY_FAMILIES = SHARED_FAMILIES + ("guards", "matmul.linear")


def _families(modules: tuple[str, ...] = IMPL_MODULES) -> list:
    import importlib

    return [importlib.import_module(f"{__package__}.{family}") for family in modules]


def declared_kernel_names(modules: tuple[str, ...] = IMPL_MODULES) -> dict[str, set[str]]:
    """{.cu file: every kernel name any of these families may launch from it} (importable
    without a GPU: the NVRTC compile test compiles each file with its union)."""
    names: dict[str, set[str]] = {}
    for family in _families(modules):
        for filename, kernels in getattr(family, "kernel_names", dict)().items():
            names.setdefault(filename, set()).update(kernels)
    return names


def declared_bf16_ops() -> frozenset[str]:
    """Ops whose cuda launchers accept bfloat16 operands: the union of the families'
    `BF16_OPS` (importable without a GPU; compile/autocast.py check_bf16_support)."""
    return frozenset(op for family in _families() for op in getattr(family, "BF16_OPS", ()))


def declared_fp16_ops() -> frozenset[str]:
    """Ops whose cuda launchers accept float16 operands: the union of the families'
    `FP16_OPS` (importable without a GPU; compile/autocast.py check_fp16_support)."""
    return frozenset(op for family in _families() for op in getattr(family, "FP16_OPS", ()))


# DLPack device types that name CUDA device memory (kDLCUDA, kDLCUDAManaged).
_DLPACK_CUDA = (2, 13)


@dataclass
class _Staging:
    """Pinned host buffer of one destination, and the event of the last copy out of it."""

    memory: Any
    host: np.ndarray
    event: Any = None


class CudaBackend(Backend):
    name = "cuda"
    device = "cuda"

    def __init__(self, device: int = 0):
        cp = _import_cupy()
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except Exception as err:   # no driver, driver too old, no device: all say the same
            raise BackendUnavailableError(
                f"device='cuda' found no usable NVIDIA GPU ({err})") from err
        if not 0 <= device < count:
            raise BackendUnavailableError(
                f"device='cuda' wants GPU {device}, but {count} GPU(s) are visible")
        from .runtime import compiler, host_gate

        self._cp = cp
        self.device_id = device
        cp.cuda.Device(device).use()
        # Most steps need them, on float32 values: NVRTC starts on them now, beside the rest
        early = declared_kernel_names(EARLY_FAMILIES)
        compiler.declare(early)
        compiler.prefetch(sorted(early), ctypes=("float",))
        host_gate.start_compile()            # the autotuner's timing gate (graph.py)
        try:
            nvmath_bindings.load()
        except ImportError as err:
            raise BackendUnavailableError(
                "device='cuda' needs nvmath-python for cuBLASLt: pip install -e '.[cuda]' "
                f"({err})") from err
        from .matmul import gemm

        self.stream = cp.cuda.Stream(non_blocking=True)
        try:
            self.gemm = gemm.GemmCache()
        except Exception as err:
            raise BackendUnavailableError(f"device='cuda': cuBLASLt is not usable ({err})") from err
        self.paths: dict = {}        # autotune.py's choices, shared like the GemmCache
        self.impls = {}
        # op -> the kernel files its family launches from, and hooks naming a node's
        # generated kernels (source, name) and, given the precision, its per-shape kernels
        # (file, name): prepare()
        # starts compiling what a plan needs, side by side, before its first step.
        self.kernel_files: dict[str, frozenset[str]] = {}
        self.generated_kernels: dict[str, Any] = {}
        self.kernels_ahead: dict[str, Any] = {}
        # op -> start(node, ins, outs, ctx): the host builds (cuDNN plans) a node's first
        # launch would make, started by prepare() on the ahead lane (runtime/ahead.py)
        self.builds_ahead: dict[str, Any] = {}
        shared = frozenset(declared_kernel_names(SHARED_FAMILIES))
        for family in _families():
            names = getattr(family, "kernel_names", dict)()
            compiler.declare(names)
            self.impls.update(family.IMPLS)
            self.kernel_files.update(dict.fromkeys(family.IMPLS, frozenset(names) | shared))
            self.generated_kernels.update(getattr(family, "GENERATED_KERNELS", {}))
            self.kernels_ahead.update(getattr(family, "KERNELS_AHEAD", {}))
            self.builds_ahead.update(getattr(family, "BUILDS_AHEAD", {}))
        self._staging: dict[tuple, _Staging] = {}
        self._being_read: list[tuple[Any, list]] = []   # (event, device sources): keep_until_read
        self._order_event = None     # _copy_device's: the caller's stream, recorded again

    @property
    def bf16_ops(self) -> frozenset[str]:
        """The ops whose launchers take bfloat16 operands (compile/autocast.py refuses a bf16
        plan with any other op on bf16 values)."""
        return declared_bf16_ops()

    @property
    def fp16_ops(self) -> frozenset[str]:
        """The ops whose launchers take float16 operands (compile/autocast.py refuses a plan
        with any other op on float16 values)."""
        return declared_fp16_ops()

    def prepare(self, nodes, precision: str = "fp32", calls=(), ctx=None) -> None:
        """What a plan needs before its first step, started now so that the step's launches
        wait only for their own: the kernel files and generated kernels these nodes launch at
        `precision`, compiled side by side (compiler.prefetch), then, given the plan's calls
        ((node, inputs, outputs) on their buffers) and the context that will run them, the
        host builds of the families' BUILDS_AHEAD hooks (cuDNN plans), one after another on
        the ahead lane (runtime/ahead.py)."""
        from .elementwise import FILL_CTYPES
        from .runtime import compiler
        from .runtime.launch import ELEMENT_CTYPES

        # Each file with the element types of the nodes that launch from it (a float32 conv
        # does not wait behind the float64 chunks the optimizer's float64 table would name),
        # in the order of the nodes' first launches: the pool takes them in that order.
        # (the fills' element types, and the storages' of the typed kernels: float16's is
        # fp16_bits)
        wanted: dict[str, set[str]] = {}
        for n in nodes:
            ctypes = {table.get(np.dtype(storage_dtype(v.dtype))) for v in (*n.inputs, *n.outputs)
                      for table in (FILL_CTYPES, ELEMENT_CTYPES)} - {None}
            for filename in sorted(self.kernel_files.get(n.op, ())):
                wanted.setdefault(filename, set()).update(ctypes)
        for filename, ctypes in wanted.items():
            compiler.prefetch([filename], ctypes=ctypes)
        generated = [pair for n in nodes if n.op in self.generated_kernels
                     for pair in self.generated_kernels[n.op](n)]
        kernels = [pair for n in nodes if n.op in self.kernels_ahead
                   for pair in self.kernels_ahead[n.op](n, precision)]
        compiler.prefetch((), generated, kernels)
        for node, ins, outs in calls if ctx is not None else ():
            start = self.builds_ahead.get(node.op)
            if start is None:
                continue
            try:
                start(node, ins, outs, ctx)
            except Exception:     # the node's launch meets the same error and reports it
                pass

    # ---- contexts and capture ------------------------------------------------------------

    def make_context(self, precision: str = "fp32", deterministic: bool = True):
        """A CudaContext on the backend's stream, sharing its GemmCache (keyed by precision)
        and its kernel choices (keyed by problem, precision and determinism included)."""
        from .runtime.context import CudaContext

        return CudaContext(stream=self.stream, precision=precision, gemm=self.gemm,
                           paths=self.paths, deterministic=deterministic)

    def capture(self, run, ctx):
        """Record run() as one CUDA graph on ctx.stream (runtime/graph.py)."""
        from .runtime.graph import capture

        return capture(run, ctx)

    def host_mirror(self, array):
        """Mapped host memory that guard_advance posts a bad step's number to (guards.py)."""
        from .guards import mailbox

        return mailbox(array)

    def annotate(self, name: str):
        if not self._cp.cuda.nvtx.available:
            return nullcontext()
        return _nvtx_range(self._cp.cuda.nvtx, name)

    # ---- memory --------------------------------------------------------------------------

    def empty(self, shape, dtype):
        return self._cp.empty(tuple(shape), dtype=storage_dtype(dtype))

    def view(self, arena, offset: int, shape, dtype):
        dtype = storage_dtype(dtype)      # bfloat16: its raw bits, uint16
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if offset < 0 or offset + nbytes > arena.nbytes:
            raise PlanError(f"view of {nbytes} bytes at offset {offset} overruns the "
                            f"{arena.nbytes}-byte arena")
        return self._cp.ndarray(tuple(shape), dtype=dtype, memptr=arena.data + offset)

    def owns(self, array) -> bool:
        return isinstance(array, self._cp.ndarray) and array.device.id == self.device_id

    def to_numpy(self, array) -> np.ndarray:
        if isinstance(array, np.ndarray):
            return array.copy()
        return array.get(stream=self.stream)   # blocking: waits for the copy, in stream order

    def copy_result(self, buffer):
        """A new device array holding buffer's current value (ordered after the step). The
        caller's current stream waits for the copy on the device (no host sync): CuPy or
        PyTorch code reading the result on its own stream (cp.asnumpy, a kernel) then sees
        the value, not the memory before the step's work on this non-blocking stream wrote it."""
        with self.stream:
            result = buffer.copy()
        current = self._cp.cuda.get_current_stream()
        if current != self.stream:
            current.wait_event(self.stream.record())
        return result

    def synchronize(self) -> None:
        self.stream.synchronize()

    # ---- copies --------------------------------------------------------------------------

    def copy_into(self, dst, src) -> None:
        """Copy src into the fixed buffer dst on the backend's stream, without host sync:
        NumPy (or any host array) through a pinned staging buffer kept per destination;
        CuPy, DLPack or __cuda_array_interface__ device arrays device-to-device."""
        cp = self._cp
        if isinstance(src, cp.ndarray):
            self._copy_device(dst, src)
        elif isinstance(src, np.ndarray):
            self._copy_host(dst, src)
        elif hasattr(src, "__dlpack_device__") and src.__dlpack_device__()[0] in _DLPACK_CUDA:
            with self.stream:    # the producer orders its work before our stream (DLPack)
                src = cp.from_dlpack(src)
            self._copy_device(dst, src, ordered=True)
        elif hasattr(src, "__dlpack_device__"):
            self._copy_host(dst, np.from_dlpack(src))
        elif hasattr(src, "__cuda_array_interface__"):
            self._copy_device(dst, cp.asarray(src))
        else:
            self._copy_host(dst, np.asarray(src))

    def keep_until_read(self, sources) -> None:
        """Hold references to the device arrays among `sources` until the copies queued on our
        stream have read them. The caller may drop an input as soon as the step returns; its
        allocator (CuPy's pool, PyTorch's caching allocator) then gives the memory to the next
        allocation on the caller's stream, whose writes are not ordered after our pending copy
        (a replayed step returns long before its copies run): without the hold, the next
        batch can overwrite this one while it is being read."""
        pending, spare = [], None
        for event, arrays in self._being_read:
            if event.done:
                spare = event       # its arrays are read: they may go, the event serves again
            else:
                pending.append((event, arrays))
        self._being_read = pending
        held = [a for a in sources if not isinstance(a, np.ndarray)]
        if held and not self.stream.is_capturing():
            event = spare or self._cp.cuda.Event(disable_timing=True)
            event.record(self.stream)
            pending.append((event, held))

    def _check(self, dst, src) -> None:
        if tuple(src.shape) != tuple(dst.shape) or np.dtype(src.dtype) != np.dtype(dst.dtype):
            raise ShapeError(f"cannot copy {np.dtype(src.dtype)}{list(src.shape)} into a "
                             f"{np.dtype(dst.dtype)}{list(dst.shape)} buffer")
        if not dst.flags.c_contiguous:
            raise ShapeError(f"copy_into: destination {dst.shape} must be contiguous")

    def _copy_host(self, dst, src: np.ndarray) -> None:
        self._check(dst, src)
        if self.stream.is_capturing():
            raise CaptureError("copy_into: a host-to-device copy cannot be captured; feed "
                               "inputs before replaying the graph")
        if dst.nbytes == 0:
            return
        cp = self._cp
        key = (dst.data.ptr, dst.nbytes, str(dst.dtype), tuple(dst.shape))
        stage = self._staging.get(key)
        if stage is None:
            memory = cp.cuda.alloc_pinned_memory(dst.nbytes)
            host = np.frombuffer(memory, dtype=dst.dtype, count=dst.size).reshape(dst.shape)
            stage = self._staging[key] = _Staging(memory, host)
        if stage.event is not None:
            stage.event.synchronize()    # the previous copy out of this buffer has finished
        np.copyto(stage.host, src)
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, stage.host.ctypes.data, dst.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, self.stream.ptr)
        if stage.event is None:
            stage.event = cp.cuda.Event(disable_timing=True)
        stage.event.record(self.stream)

    def _copy_device(self, dst, src, ordered: bool = False) -> None:
        self._check(dst, src)
        cp = self._cp
        if not ordered and not self.stream.is_capturing():
            # src was written on the caller's current stream: order our copy after it.
            current = cp.cuda.get_current_stream()
            if current.ptr != self.stream.ptr:
                # One event, recorded again for every copy: a wait already queued waits for
                # the record before it (cudaStreamWaitEvent), so reusing it is safe, and a
                # step no longer creates (and destroys) a timing event per device feed.
                if self._order_event is None:
                    self._order_event = cp.cuda.Event(disable_timing=True)
                self._order_event.record(current)
                self.stream.wait_event(self._order_event)
        if src.data.ptr == dst.data.ptr and src.strides == dst.strides:
            return
        if src.flags.c_contiguous:
            cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, dst.nbytes,
                                        cp.cuda.runtime.memcpyDefault, self.stream.ptr)
        else:
            with self.stream:
                cp.copyto(dst, src)     # strided source: an elementwise copy kernel


def _import_cupy():
    try:
        import cupy
    except ImportError as err:
        raise BackendUnavailableError(
            f"device='cuda' needs CuPy: pip install -e '.[cuda]' ({err})") from err
    return cupy


@contextmanager
def _nvtx_range(nvtx, name: str):
    nvtx.RangePush(name)
    try:
        yield
    finally:
        nvtx.RangePop()
