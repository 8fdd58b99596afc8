"""NVRTC compilation of the op families' `.cu` files, memoised per process.

A kernel file lives beside the launchers of its family (backends/cuda/<family>.cu, or
backends/cuda/<family>/<file>.cu for the families of several modules) and is named by its file
name alone, unique across the backend; the headers the files share are in include/, the one
include directory NVRTC is given.

A file is compiled as one module holding every template instantiation its launchers declared
(`declare`), or, for the files templated on the element type of the values they read
(TYPED_SOURCES), as one module per C type: NVRTC's cost grows with the kernels instantiated
(loss.cu: 0.23 s with its plain kernels alone, 0.96 s with the int64-label templates, 2.3 s with
the int32 ones as well), so a float32 plan with int64 labels does not wait for the bf16 or
int32-label kernels it never launches. Kernels instantiated per problem (the tiled
convolutions, attention) are compiled one name at a time. Every compile runs on a small thread pool
(NVRTC releases the GIL): `prefetch` starts those a plan will need when it is built, and they
go on beside the host work that follows (planning, the first step's GEMM timing) until a
launch waits for its module. CuPy keeps the cubins in its on-disk kernel cache
(~/.cupy/kernel_cache), so a module is compiled once per machine. `compile_to_cubin` compiles
without a GPU, for CI.
"""
from __future__ import annotations

import functools
import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

SOURCE_ROOT = Path(__file__).resolve().parents[1]    # backends/cuda: the families' .cu files
INCLUDE_DIR = SOURCE_ROOT / "include"                 # the .cuh headers the .cu files share
NVRTC_OPTIONS = ("-std=c++17", f"-I{INCLUDE_DIR}")
FLOAT_CTYPES = {"float32": "float", "float64": "double"}   # templates' T per array dtype
COMPILE_THREADS = max(1, min(32, os.cpu_count() or 1))    # NVRTC compiles side by side
# Instantiated per problem (tiled conv shapes; attention head dims, storages, arithmetics):
# compiled one kernel name at a time, only those a plan names (KERNELS_AHEAD hooks)
PER_SHAPE_SOURCES = frozenset({"conv_tiled.cu", "attention.cu"})
# Templated on the element type (first template argument: the C type of the values read):
# one module per type, and one for the plain extern "C" kernels
TYPED_SOURCES = frozenset({"elementwise.cu", "loss.cu", "reduce.cu", "broadcast.cu",
                           "embedding.cu", "norm.cu", "pool.cu", "avgpool.cu"})

_declared: dict[str, frozenset[str]] = {}          # file -> the kernel names its launchers use
_compiles: dict[tuple, Future] = {}                # every compile started, done or under way
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


@functools.cache
def _source_paths() -> dict[str, Path]:
    """{file name: path} of every .cu file of the families. Launchers name a file by its name
    alone, so two files of one name would be ambiguous."""
    paths: dict[str, Path] = {}
    for path in sorted(SOURCE_ROOT.rglob("*.cu")):
        if path.name in paths:
            raise ValueError(f"kernel file name {path.name!r} is used twice: {paths[path.name]} "
                             f"and {path}")
        paths[path.name] = path
    return paths


def kernel_sources() -> list[Path]:
    """Every family's .cu file, ordered by file name."""
    return sorted(_source_paths().values(), key=lambda path: path.name)


def source_path(filename: str) -> Path:
    """The path of the kernel file named `filename` (e.g. "loss.cu")."""
    try:
        return _source_paths()[filename]
    except KeyError:
        raise FileNotFoundError(f"no kernel file {filename!r} under {SOURCE_ROOT}") from None


def headers() -> list[Path]:
    """The shared .cuh headers of include/."""
    return sorted(INCLUDE_DIR.glob("*.cuh"))


@functools.cache
def _headers_digest() -> str:
    digest = hashlib.sha256()
    for header in headers():
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


def _start(key: tuple, build: Callable[[], object]) -> Future:
    """The compile named `key`: started now on the pool (on the caller's current device)
    unless it was started before."""
    global _pool
    import cupy as cp

    with _lock:
        future = _compiles.get(key)
        if future is None:
            if _pool is None:
                _pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="nvrtc")
            future = _compiles[key] = _pool.submit(_on_device, cp.cuda.Device().id, build)
    return future


def _on_device(device: int, build: Callable[[], object]):
    import cupy as cp

    with cp.cuda.Device(device):        # the current device is per thread
        return build()


def _source(text: str) -> str:
    # CuPy's disk cache keys on the source text alone: name the headers' hash in it, so an
    # edited .cuh recompiles every file that includes it.
    return f"// headers {_headers_digest()}\n" + text


def _compile(source: str, name_expressions: tuple[str, ...]):
    import cupy as cp

    compiled = cp.RawModule(code=source, options=NVRTC_OPTIONS,
                            name_expressions=name_expressions or None)
    compiled.compile()      # now, on this thread: CuPy would compile at the first get_function
    return compiled


def _start_module(filename: str, name_expressions: tuple[str, ...] = ()) -> Future:
    return _start(("file", filename, name_expressions), lambda: _compile(
        _source(source_path(filename).read_text()), name_expressions))


def module(filename: str, name_expressions: tuple[str, ...] = ()):
    """The compiled RawModule of kernel file `filename` (templates named in name_expressions)."""
    return _start_module(filename, name_expressions).result()


@functools.cache
def sources_digest() -> str:
    """A hash of every kernel source and header: cached kernel choices depend on it."""
    digest = hashlib.sha256()
    for path in sorted([*kernel_sources(), *headers()], key=lambda path: path.name):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def compile_parallel(kernels: Iterable[tuple[str, str]],
                     compile_one: Callable[[tuple[str, str]], None] | None = None) -> None:
    """Compile (file, kernel name) pairs side by side and wait for them, ahead of their first
    launch; a failure is left for that launch to report. compile_one(pair) compiles one
    (default: the pair's module on the pool)."""
    todo = list(dict.fromkeys(kernels))
    if compile_one is None:
        futures = [_start_kernel(*pair) for pair in todo]
    else:
        with ThreadPoolExecutor(max(1, min(COMPILE_THREADS, len(todo)))) as pool:
            futures = [pool.submit(compile_one, pair) for pair in todo]
    for future in futures:
        try:
            future.result()
        except Exception:   # the launch that needs the kernel reports it
            pass


def declare(names: dict[str, Iterable[str]]) -> None:
    """Record {file: kernel names} that launchers may launch: each file's template
    instantiations (of a TYPED_SOURCES file, those of one element type) are then compiled
    together, in one NVRTC run."""
    for filename, kernels in names.items():
        if filename not in PER_SHAPE_SOURCES:
            _declared[filename] = _declared.get(filename, frozenset()) | frozenset(kernels)


def _element_type(name: str) -> str:
    """The first template argument of kernel `name` ("" for a plain kernel)."""
    return name[name.index("<") + 1:-1].split(",")[0].strip() if "<" in name else ""


def _templates(filename: str, ctype: str | None = None) -> tuple[str, ...]:
    """The declared template instantiations of `filename` (whose element type is `ctype`, when
    given): the name expressions of its module. Plain kernels need none."""
    return tuple(sorted(k for k in _declared.get(filename, ()) if "<" in k
                        and (ctype is None or _element_type(k) == ctype)))


def _start_kernel(filename: str, name: str) -> Future:
    """The compile of the module that holds kernel `name` of kernel file `filename`: the file's
    module (or its module for name's element type), or one of its own for a template
    instantiation nobody declared."""
    if "<" in name and name not in _declared.get(filename, ()):
        return _start_module(filename, (name,))
    if filename in TYPED_SOURCES:
        return _start_module(filename, _templates(filename, _element_type(name)))
    return _start_module(filename, _templates(filename))


def kernel(filename: str, name: str):
    """One kernel function of kernel file `filename`; `name` may be a template instantiation."""
    return _start_kernel(filename, name).result().get_function(name)


def prefetch(filenames: Iterable[str], generated: Iterable[tuple[str, str]] = (),
             kernels: Iterable[tuple[str, str]] = (), ctypes: Iterable[str] = ()) -> None:
    """Start compiling these kernel files (with their declared instantiations; of a
    TYPED_SOURCES file, its plain kernels and those for the element types in `ctypes`),
    generated (source, kernel name) pairs and (file, kernel name) pairs, without waiting: the
    first launch of a kernel waits for its module. What was compiled before, in this process
    or in CuPy's disk cache, costs little."""
    ctypes = set(ctypes)
    for filename in filenames:
        if filename in TYPED_SOURCES:
            declared = _declared.get(filename, ())
            for ctype in ({""} | ctypes) & {_element_type(k) for k in declared}:
                _start_module(filename, _templates(filename, ctype))
        elif filename not in PER_SHAPE_SOURCES:
            _start_kernel(filename, "")
    for filename, name in kernels:
        _start_kernel(filename, name)
    for source, name in generated:
        _start_generated(source)


def _start_generated(source: str) -> Future:
    return _start(("generated", source), lambda: _compile(_source(source), ()))


def generated_kernel(source: str, name: str):
    """Kernel `name` of generated CUDA source (e.g. a fused pointwise program), which may
    include the headers of include/; memoised per source, cached on disk by CuPy."""
    return _start_generated(source).result().get_function(name)


def compile_to_cubin(path: Path, arch: str = "sm_90",
                     name_expressions: tuple[str, ...] = ()) -> bytes:
    """Compile one .cu file with NVRTC for `arch`, instantiating the templates named in
    `name_expressions`; needs libnvrtc but no GPU. Raises RuntimeError with the log."""
    return compile_source_to_cubin(path.read_text(), path.name, arch, name_expressions)


def compile_source_to_cubin(source: str, name: str, arch: str = "sm_90",
                            name_expressions: tuple[str, ...] = ()) -> bytes:
    """compile_to_cubin for source text (generated kernels); `name` labels errors."""
    from cupy.cuda import nvrtc

    shared = headers()
    prog = nvrtc.createProgram(source, name,
                               [h.read_text().encode() for h in shared],
                               [h.name.encode() for h in shared])
    for expr in name_expressions:
        nvrtc.addNameExpression(prog, expr)
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}", "-std=c++17", "-ftz=true"])
    except nvrtc.NVRTCError as err:
        raise RuntimeError(f"{name}: {err}\n{nvrtc.getProgramLog(prog)}") from err
    return nvrtc.getCUBIN(prog)
