"""NVRTC compilation of the `.cu` files in kernels/, memoised per process.

CuPy keeps compiled cubins in its on-disk kernel cache (~/.cupy/kernel_cache), so a kernel is
compiled once per machine. `compile_to_cubin` compiles without a GPU, for CI.
"""
from __future__ import annotations

import functools
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

KERNEL_DIR = Path(__file__).parent / "kernels"
NVRTC_OPTIONS = ("-std=c++17", f"-I{KERNEL_DIR}")
FLOAT_CTYPES = {"float32": "float", "float64": "double"}   # templates' T per array dtype
COMPILE_THREADS = max(1, min(8, os.cpu_count() or 1))     # NVRTC compiles side by side


def kernel_sources() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.cu"))


@functools.cache
def _headers_digest() -> str:
    digest = hashlib.sha256()
    for header in sorted(KERNEL_DIR.glob("*.cuh")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def module(filename: str, name_expressions: tuple[str, ...] = ()):
    """The compiled RawModule of kernels/<filename> (templates named in name_expressions)."""
    import cupy as cp

    # CuPy's disk cache keys on the source text alone: name the headers' hash in it, so an
    # edited .cuh recompiles every file that includes it.
    source = f"// headers {_headers_digest()}\n" + (KERNEL_DIR / filename).read_text()
    return cp.RawModule(code=source, options=NVRTC_OPTIONS,
                        name_expressions=name_expressions or None)


@functools.cache
def sources_digest() -> str:
    """A hash of every kernel source and header: cached kernel choices depend on it."""
    digest = hashlib.sha256()
    for path in sorted(KERNEL_DIR.glob("*.cu*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def compile_parallel(kernels: Iterable[tuple[str, str]],
                     compile_one: Callable[[tuple[str, str]], None] | None = None) -> None:
    """Compile (file, kernel name) pairs ahead of their first launch on a thread pool (NVRTC
    releases the GIL: independent variants compile side by side); later `kernel` calls find
    them compiled. A failure is left for that launch to report. compile_one(pair) compiles
    one (default: `kernel` on the caller's current device)."""
    todo = list(dict.fromkeys(kernels))
    if len(todo) < 2:
        return
    one = compile_one or _on_current_device(kernel)
    with ThreadPoolExecutor(min(COMPILE_THREADS, len(todo))) as pool:
        for future in [pool.submit(one, pair) for pair in todo]:
            try:
                future.result()
            except Exception:   # the launch that needs the kernel reports it
                pass


def _on_current_device(compile_: Callable[[str, str], object]):
    import cupy as cp

    device = cp.cuda.Device().id

    def one(pair: tuple[str, str]) -> None:
        with cp.cuda.Device(device):    # the current device is per thread
            compile_(*pair)
    return one


def kernel(filename: str, name: str):
    """One kernel function of kernels/<filename>; `name` may be a template instantiation."""
    if "<" in name:
        return module(filename, (name,)).get_function(name)
    return module(filename).get_function(name)


@functools.cache
def generated_kernel(source: str, name: str):
    """Kernel `name` of generated CUDA source (e.g. a fused pointwise program), which may
    include the headers of kernels/; memoised per source, cached on disk by CuPy."""
    import cupy as cp

    source = f"// headers {_headers_digest()}\n" + source
    return cp.RawModule(code=source, options=NVRTC_OPTIONS).get_function(name)


def compile_to_cubin(path: Path, arch: str = "sm_90",
                     name_expressions: tuple[str, ...] = ()) -> bytes:
    """Compile one .cu file with NVRTC for `arch`, instantiating the templates named in
    `name_expressions`; needs libnvrtc but no GPU. Raises RuntimeError with the log."""
    return compile_source_to_cubin(path.read_text(), path.name, arch, name_expressions)


def compile_source_to_cubin(source: str, name: str, arch: str = "sm_90",
                            name_expressions: tuple[str, ...] = ()) -> bytes:
    """compile_to_cubin for source text (generated kernels); `name` labels errors."""
    from cupy.cuda import nvrtc

    headers = sorted(KERNEL_DIR.glob("*.cuh"))
    prog = nvrtc.createProgram(source, name,
                               [h.read_text().encode() for h in headers],
                               [h.name.encode() for h in headers])
    for expr in name_expressions:
        nvrtc.addNameExpression(prog, expr)
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}", "-std=c++17", "-ftz=true"])
    except nvrtc.NVRTCError as err:
        raise RuntimeError(f"{name}: {err}\n{nvrtc.getProgramLog(prog)}") from err
    return nvrtc.getCUBIN(prog)
