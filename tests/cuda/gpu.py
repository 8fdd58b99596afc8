"""The guard that opens the cuda test modules which touch CuPy as they import: skip the module
unless CuPy, the libraries it names and a GPU are there. It imports nothing of CuPy itself, so
that it loads on any machine."""
from __future__ import annotations

import pytest


def require_gpu(*modules: str):
    """Skip the importing module unless CuPy, each of `modules` (e.g. "nvmath") and a GPU that
    CuPy sees are there; returns the cupy module."""
    cp = pytest.importorskip("cupy")
    for name in modules:
        pytest.importorskip(name)
    from stepgraph.backends import cuda_available

    if not cuda_available():
        pytest.skip("no GPU visible to CuPy", allow_module_level=True)
    return cp
