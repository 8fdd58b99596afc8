"""Fixtures of the cuda tests. Their imports sit inside them, so that modules which skip (no
CuPy, no GPU, no nvmath) still collect on any machine."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ctx():
    """A launcher context on its own non-blocking stream. Modules that run ops through the
    backend's GEMM context define their own `ctx`."""
    import cupy as cp

    from stepgraph.backends.cuda.runtime.context import CudaContext

    return CudaContext(stream=cp.cuda.Stream(non_blocking=True))


@pytest.fixture(scope="module")
def backend():
    """The CUDA backend; the module's tests skip where it cannot start."""
    from stepgraph.backends.cuda.backend import CudaBackend
    from stepgraph.errors import BackendUnavailableError

    try:
        return CudaBackend()
    except BackendUnavailableError as err:    # e.g. nvmath without its cuBLASLt library
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def impls(backend):
    """The backend's merged op table: a family the module tests must be in IMPL_MODULES."""
    return backend.impls
