"""NVRTC compilation of the op families' `.cu` files, memoised per process.

A kernel file lives beside the launchers of its family (backends/cuda/<family>.cu, or
backends/cuda/<family>/<file>.cu for the families of several modules) and is named by its file
name alone, unique across the backend; the headers the files share are in include/, the one
include directory NVRTC is given. A file instantiates no template itself: what NVRTC compiles
of a template is named per module (name expressions), so that a module holds only those.

NVRTC's time grows with the kernels instantiated in a module (loss.cu's float kernels: 0.74 s
as one module on a build machine, ~0.15 s each in four), and a step's first launch of a kernel
waits for the module that holds it. So a file's template instantiations that its launchers
declared (`declare`) are compiled as several modules of a few instantiations each, the
file's chunks (CHUNK_INSTANTIATIONS, sized so each compiles in about 0.2 s there), all
started side by side; a launch waits only for the chunk holding its kernel. A file's plain
extern "C" kernels are compiled as one module without name expressions (a file whose cost is
in plain kernels is split into files by sub-family: optim_*.cu). The chunks of a
TYPED_SOURCES file (templated on the element type of the values they read) are made per C
type, so a float32 plan does not wait for the bf16 kernels it never launches. Kernels
instantiated per problem (the tiled convolutions, attention) and any instantiation nobody
declared are compiled one name at a time.

Every compile runs on a thread pool (NVRTC releases the GIL): `prefetch` starts those a plan
will need when it is built (the backend starts the families most steps need when it is made),
and they go on beside the host work that follows (planning, the first step's GEMM timing). A
launch that needs a module no pool thread has started yet compiles it itself, so it never
waits behind the queue. CuPy keeps the cubins in its on-disk kernel cache
(~/.cupy/kernel_cache, CUPY_CACHE_DIR), so a module is compiled once per machine; a warm
start looks each module up there (one lookup per chunk). `precompile` fills that cache with
every declared module (`stepgraph precompile`, once per install). `compile_to_cubin` compiles
without a GPU, for CI.
"""
from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

from . import setup_log
from .ahead import Job, on_device
from .dependent_launch import Kernel

SOURCE_ROOT = Path(__file__).resolve().parents[1]    # backends/cuda: the families' .cu files
INCLUDE_DIR = SOURCE_ROOT / "include"                 # the .cuh headers the .cu files share
NVRTC_OPTIONS = ("-std=c++17", f"-I{INCLUDE_DIR}")
FLOAT_CTYPES = {"float32": "float", "float64": "double"}   # templates' T per array dtype
# NVRTC compiles side by side: half again as many threads as cores, so a plan's per-shape
# kernels start in one wave, not two behind the last ones. (On a 16-core H200 host, cnn's
# cold start with an installed kernel cache: 8 threads 1.74-1.77 s, 16 1.36-1.52 s, 24
# 1.30-1.36 s; its 20 per-shape compiles took 0.3-1 s each, docs/perf-notes.md.)
COMPILE_THREADS = max(1, min(32, 3 * (os.cpu_count() or 1) // 2))
# Files of templates instantiated per problem (tiled conv shapes; attention head dims,
# storages, arithmetics), each with the names of those templates ("": all of the file's):
# compiled one kernel name at a time, only those a plan names (KERNELS_AHEAD hooks). Their
# other templates (the tiled conv's partial-sum kernel, one per storage) are declared and
# precompiled like any other file's.
PER_SHAPE_TEMPLATES = {
    "conv_tiled.cu": ("conv2d_tiled_kernel", "conv2d_tiled_grad_weight_kernel"),
    "attention.cu": ("",)}
PER_SHAPE_SOURCES = frozenset(PER_SHAPE_TEMPLATES)
# Per-shape files whose declared kernels are every kernel they can launch (attention: each head
# dim, tile, storage and arithmetic), which `precompile` therefore compiles too, one a module;
# the tiled convolutions declare a few sample geometries only (the NVRTC test's).
PRECOMPILED_PER_SHAPE = frozenset({"attention.cu"})
# Templated on the element type (first template argument: the C type of the values read):
# chunks per type, and one module for the plain extern "C" kernels
TYPED_SOURCES = frozenset({"elementwise.cu", "loss.cu", "reduce.cu", "broadcast.cu",
                           "embedding.cu", "norm.cu", "pool.cu", "avgpool.cu", "conv.cu",
                           "conv_direct.cu", "layer_norm.cu", "small_matmul.cu",
                           "reduce_axis.cu", "pool3d.cu", "softmax.cu", "conv_depthwise.cu"})
# Instantiations per module (chunk) of a file's declared templates, where not
# DEFAULT_CHUNK_INSTANTIATIONS: sized with compile_to_cubin (scripts/nvrtc-chunks) so a chunk
# compiles in about 0.2 s on a build machine (its kernels cost 0.03-0.15 s each, the file's
# parse 0.02-0.1 s). Smaller chunks cost more modules to look up in a warm start.
DEFAULT_CHUNK_INSTANTIATIONS = 4
CHUNK_INSTANTIATIONS = {"elementwise.cu": 3, "layer_norm.cu": 2, "loss.cu": 2, "norm.cu": 2,
                        "pool3d.cu": 2, "reduce.cu": 3, "conv.cu": 3, "conv_direct.cu": 2,
                        "reduce_axis.cu": 3, "index.cu": 5, "shape.cu": 6}

_declared: dict[str, frozenset[str]] = {}          # file -> the kernel names its launchers use
# file of PRECOMPILED_PER_SHAPE -> its declared kernels (each its own module)
_declared_per_shape: dict[str, frozenset[str]] = {}
_chunk_maps: dict[str, dict[str, tuple[str, ...]]] = {}   # file -> {instantiation: its chunk}
_compiles: dict[tuple, Job] = {}            # every compile started, done or under way
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


def _start(key: tuple, build: Callable[[], object]) -> Job:
    """The compile named `key`: queued now on the pool (on the caller's current device)
    unless it was started before."""
    global _pool
    device = _current_device()
    with _lock:
        compile_ = _compiles.get(key)
        if compile_ is None:
            if _pool is None:
                _pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="nvrtc")
            # on the device it was started for, whichever thread runs it
            compile_ = _compiles[key] = Job(functools.partial(on_device, device,
                                                              _logged(key, build)))
            _pool.submit(compile_.run)
    return compile_


def _logged(key: tuple, build: Callable[[], object]) -> Callable[[], object]:
    """build, writing to the setup log (when it is on) when it was queued, started and ended,
    and on which thread (a caller that needed it before a pool thread took it runs it)."""
    if not setup_log.enabled():
        return build
    queued = time.perf_counter()
    if key[0] == "file":
        what, names = key[1], list(key[2])
    else:                          # generated source: named by its hash
        what, names = f"generated {hashlib.sha256(key[1].encode()).hexdigest()[:8]}", []

    def run():
        started = time.perf_counter()
        try:
            return build()
        finally:
            setup_log.write({"compile": what, "names": names,
                             "queued": queued, "start": started, "end": time.perf_counter(),
                             "thread": threading.current_thread().name})
    return run


def _current_device() -> int:
    import cupy as cp

    return cp.cuda.Device().id


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


def _start_module(filename: str, name_expressions: tuple[str, ...] = ()) -> Job:
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
    (default: the pair's module on the pool, which this thread helps with)."""
    todo = list(dict.fromkeys(kernels))
    if compile_one is None:
        compiles = [_start_kernel(*pair) for pair in todo]
        results = [compile_.result for compile_ in compiles]
    else:
        with ThreadPoolExecutor(max(1, min(COMPILE_THREADS, len(todo)))) as pool:
            results = [pool.submit(compile_one, pair).result for pair in todo]
    for result in results:
        try:
            result()
        except Exception:   # the launch that needs the kernel reports it
            pass


def declare(names: dict[str, Iterable[str]]) -> None:
    """Record {file: kernel names} that launchers may launch: each file's template
    instantiations (of a TYPED_SOURCES file, those of one element type) are then compiled in
    chunks of a few (CHUNK_INSTANTIATIONS), side by side; the per-shape ones among them
    (PER_SHAPE_TEMPLATES) one a module, as their launches compile them (and `precompile`,
    those of PRECOMPILED_PER_SHAPE)."""
    with _lock:
        for filename, kernels in names.items():
            kept = frozenset(k for k in kernels if not per_shape(filename, k))
            if kept:
                _declared[filename] = _declared.get(filename, frozenset()) | kept
                _chunk_maps.pop(filename, None)
            shaped = frozenset(kernels) - kept
            if shaped and filename in PRECOMPILED_PER_SHAPE:
                _declared_per_shape[filename] = \
                    _declared_per_shape.get(filename, frozenset()) | shaped


def per_shape(filename: str, name: str) -> bool:
    """Whether kernel `name` of `filename` is instantiated per problem (PER_SHAPE_TEMPLATES)."""
    template = name.split("<")[0]
    return any(t in ("", template) for t in PER_SHAPE_TEMPLATES.get(filename, ()))


def _element_type(name: str) -> str:
    """The first template argument of kernel `name` ("" for a plain kernel)."""
    return name[name.index("<") + 1:-1].split(",")[0].strip() if "<" in name else ""


def _group(filename: str, name: str) -> str:
    """The group of instantiation `name` that is chunked apart from the others of its file:
    its element type in a TYPED_SOURCES file, else "" (one group)."""
    return _element_type(name) if filename in TYPED_SOURCES else ""


def split_evenly(names: list[str], size: int) -> list[tuple[str, ...]]:
    """`names` in order, cut into the fewest runs of at most `size` whose lengths differ by at
    most one (10 by 4: 4, 3, 3, not 4, 4, 2)."""
    if not names:
        return []
    count = -(-len(names) // max(1, size))
    quotient, extra = divmod(len(names), count)
    runs, start = [], 0
    for i in range(count):
        end = start + quotient + (i < extra)
        runs.append(tuple(names[start:end]))
        start = end
    return runs


def chunks(filename: str, group: str | None = None) -> list[tuple[str, ...]]:
    """The chunks (name expressions of one module each) of `filename`'s declared template
    instantiations, of one group (an element type of a TYPED_SOURCES file) when given: the
    names sorted, each group cut by split_evenly."""
    groups: dict[str, list[str]] = {}
    for name in sorted(_declared.get(filename, ())):
        if "<" in name:
            groups.setdefault(_group(filename, name), []).append(name)
    size = CHUNK_INSTANTIATIONS.get(filename, DEFAULT_CHUNK_INSTANTIATIONS)
    return [chunk for key, names in sorted(groups.items()) if group in (None, key)
            for chunk in split_evenly(names, size)]


def chunk_of(filename: str, name: str) -> tuple[str, ...]:
    """The name expressions of the module that holds kernel `name` of `filename`: () for a
    plain kernel (the file's plain module), its chunk for a declared instantiation, the name
    alone for one nobody declared (a per-shape one included)."""
    if "<" not in name:
        return ()
    with _lock:
        chunk_map = _chunk_maps.get(filename)
        if chunk_map is None:
            chunk_map = _chunk_maps[filename] = {
                kernel: chunk for chunk in chunks(filename) for kernel in chunk}
    return chunk_map.get(name, (name,))


def _has_plain_kernels(filename: str) -> bool:
    """Whether `filename` has plain kernels to compile: declared ones, or nothing declared
    (a file of plain kernels only whose family declares none)."""
    declared = _declared.get(filename)
    return not declared or any("<" not in name for name in declared)


def file_modules(filename: str, groups: Iterable[str] | None = None) -> list[tuple[str, ...]]:
    """The name expressions of every module `filename` is compiled as (its plain module first,
    if it has plain kernels), of its chunks only those of `groups` when given (element types
    of a TYPED_SOURCES file; a file of one group always has all); of a PER_SHAPE_SOURCES
    file, the chunks of its shape-free templates only."""
    if filename in PER_SHAPE_SOURCES:
        return chunks(filename)       # its declared shape-free templates, if any
    wanted = None if groups is None or filename not in TYPED_SOURCES else set(groups)
    plain = [()] if _has_plain_kernels(filename) else []
    return plain + [chunk for chunk in chunks(filename)
                    if wanted is None or _group(filename, chunk[0]) in wanted]


def _start_kernel(filename: str, name: str) -> Job:
    """The compile of the module that holds kernel `name` of kernel file `filename`."""
    return _start_module(filename, chunk_of(filename, name))


def kernel(filename: str, name: str):
    """One kernel function of kernel file `filename`; `name` may be a template instantiation.
    A dependent_launch.Kernel: inside a capture it is launched dependently."""
    return Kernel(_start_kernel(filename, name).result().get_function(name))


def prefetch(filenames: Iterable[str], generated: Iterable[tuple[str, str]] = (),
             kernels: Iterable[tuple[str, str]] = (), ctypes: Iterable[str] = ()) -> None:
    """Start compiling every module of these kernel files (of a TYPED_SOURCES file, its plain
    kernels and the chunks of the element types in `ctypes`), generated (source, kernel name)
    pairs and (file, kernel name) pairs, in that order, without waiting: the first launch of
    a kernel waits for its module (or compiles it, if no pool thread has started it yet).
    What was compiled before, in this process or in CuPy's disk cache, costs little."""
    ctypes = set(ctypes)
    for filename in filenames:
        for name_expressions in file_modules(filename, ctypes):
            _start_module(filename, name_expressions)
    for filename, name in kernels:
        _start_kernel(filename, name)
    for source, name in generated:
        _start_generated(source)


def declared_modules() -> list[tuple[str, tuple[str, ...]]]:
    """(file, name expressions) of every module the declared kernels are compiled as, every
    element type's, then those of PRECOMPILED_PER_SHAPE's kernels (one name a module, as
    chunk_of makes them): what `precompile` compiles."""
    return [(path.name, names) for path in kernel_sources()
            for names in file_modules(path.name)] + \
        [(filename, (name,)) for filename in sorted(_declared_per_shape)
         for name in sorted(_declared_per_shape[filename])]


def precompile(progress: Callable[[str, tuple[str, ...]], None] | None = None) -> int:
    """Compile every declared module (every element type's) for the current GPU into CuPy's
    kernel cache, side by side, so that a later process finds each one there: its cold start
    then costs what a warm one does. progress(file, name expressions) is called as each
    module is done, in order; a module that fails raises. Returns the number of modules."""
    started = [(filename, names, _start_module(filename, names))
               for filename, names in declared_modules()]
    for filename, names, compile_ in started:
        compile_.result()
        if progress is not None:
            progress(filename, names)
    return len(started)


def _start_generated(source: str) -> Job:
    return _start(("generated", source), lambda: _compile(_source(source), ()))


def generated_kernel(source: str, name: str):
    """Kernel `name` of generated CUDA source (e.g. a fused pointwise program), which may
    include the headers of include/; memoised per source, cached on disk by CuPy."""
    return Kernel(_start_generated(source).result().get_function(name))


def compile_to_cubin(path: Path, arch: str = "sm_90",
                     name_expressions: tuple[str, ...] = ()) -> bytes:
    """Compile one .cu file with NVRTC for `arch`, instantiating the templates named in
    `name_expressions`; needs libnvrtc but no GPU. Raises RuntimeError with the log."""
    return compile_source_to_cubin(path.read_text(), path.name, arch, name_expressions)


def compile_source_to_cubin(source: str, name: str, arch: str = "sm_90",
                            name_expressions: tuple[str, ...] = ()) -> bytes:
    """compile_to_cubin for source text (generated kernels); `name` labels errors."""
    from cupy.cuda import nvrtc

    prog = _nvrtc_program(source, name, name_expressions,
                          [f"-arch={arch}", "-std=c++17", "-ftz=true"])
    return nvrtc.getCUBIN(prog)


def ptxas_report(filename: str, arch: str = "sm_90",
                 name_expressions: tuple[str, ...] = ()) -> tuple[str, dict[str, str]]:
    """ptxas's resource report (-v) for kernel file `filename` compiled for `arch` with the
    run-time options, and {mangled name: name expression} of the named instantiations."""
    from cupy.cuda import nvrtc

    prog = _nvrtc_program(source_path(filename).read_text(), filename, name_expressions,
                          [f"-arch={arch}", *NVRTC_OPTIONS, "--ptxas-options=-v"])
    return (nvrtc.getProgramLog(prog),
            {nvrtc.getLoweredName(prog, expr): expr for expr in name_expressions})


def _nvrtc_program(source: str, name: str, name_expressions: tuple[str, ...], options: list):
    """An NVRTC program of `source` with the shared headers, compiled with `options`."""
    from cupy.cuda import nvrtc

    shared = headers()
    prog = nvrtc.createProgram(source, name,
                               [h.read_text().encode() for h in shared],
                               [h.name.encode() for h in shared])
    for expr in name_expressions:
        nvrtc.addNameExpression(prog, expr)
    try:
        nvrtc.compileProgram(prog, options)
    except nvrtc.NVRTCError as err:
        raise RuntimeError(f"{name}: {err}\n{nvrtc.getProgramLog(prog)}") from err
    return prog
