"""nvmath-python's cuBLAS/cuBLASLt bindings without the rest of nvmath.

`import nvmath.bindings.cublasLt` first runs nvmath/__init__.py, which imports nvmath.fft,
linalg, sparse and tensor and every binding (cuFFT, cuSOLVER, cuSPARSE, cuTENSOR, ...): about
0.5 s of a fresh process on an H100 machine, for modules a step never calls. `load()` imports
only nvmath._utils (CudaDataType) and the two binding extension modules, under temporary
package entries for `nvmath` and `nvmath.bindings`. (nvmath/__init__ also preloads six CUDA
libraries so that CuPy's own wrappers find the same ones; stepgraph calls none of CuPy's
library wrappers, and each binding loads its library at its first call.) The entries are removed afterwards, so a later `import nvmath` by anyone
runs the real package __init__, which finds the loaded bindings in sys.modules.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types


@functools.cache
def load() -> types.SimpleNamespace:
    """cublasLt, cublas (nvmath.bindings modules) and CudaDataType; ImportError without
    nvmath-python."""
    if "nvmath" in sys.modules:        # already imported in full: use it
        from nvmath import CudaDataType
        from nvmath.bindings import cublas, cublasLt
        return types.SimpleNamespace(cublasLt=cublasLt, cublas=cublas, CudaDataType=CudaDataType)
    spec = importlib.util.find_spec("nvmath")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("No module named 'nvmath'")
    root = list(spec.submodule_search_locations)
    stubs = {"nvmath": root, "nvmath.bindings": [f"{p}/bindings" for p in root]}
    for name, path in stubs.items():
        module = types.ModuleType(name)
        module.__path__ = path
        sys.modules[name] = module
    try:
        utils = importlib.import_module("nvmath._utils")
        cublasLt = importlib.import_module("nvmath.bindings.cublasLt")
        cublas = importlib.import_module("nvmath.bindings.cublas")
    finally:
        for name in stubs:
            sys.modules.pop(name, None)
    return types.SimpleNamespace(cublasLt=cublasLt, cublas=cublas,
                                 CudaDataType=utils.CudaDataType)
