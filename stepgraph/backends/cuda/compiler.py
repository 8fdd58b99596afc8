"""NVRTC compilation of the `.cu` files in kernels/, memoised per process.

CuPy keeps compiled cubins in its on-disk kernel cache (~/.cupy/kernel_cache), so a kernel is
compiled once per machine. `compile_to_cubin` compiles without a GPU, for CI.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "kernels"
NVRTC_OPTIONS = ("-std=c++17", f"-I{KERNEL_DIR}")
FLOAT_CTYPES = {"float32": "float", "float64": "double"}   # templates' T per array dtype


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
