"""nvmath_bindings.load: the bindings without nvmath/__init__, and no lasting stub packages.
A fake nvmath package (the same layout: nvmath/__init__.py that must not run, _utils.py,
bindings/cublas*.py) stands in for nvmath-python, which this machine may lack."""
from __future__ import annotations

import sys

import pytest

from stepgraph.backends.cuda.runtime import nvmath_bindings


@pytest.fixture
def fake_nvmath(tmp_path, monkeypatch):
    root = tmp_path / "nvmath"
    (root / "bindings").mkdir(parents=True)
    (root / "__init__.py").write_text("raise RuntimeError('the package __init__ ran')\n")
    (root / "_utils.py").write_text("class CudaDataType:\n    CUDA_R_16BF = 14\n")
    (root / "bindings" / "__init__.py").write_text("raise RuntimeError('bindings __init__')\n")
    (root / "bindings" / "cublasLt.py").write_text("NAME = 'lt'\n")
    (root / "bindings" / "cublas.py").write_text("NAME = 'blas'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "nvmath" or m.startswith("nvmath.")]:
        monkeypatch.delitem(sys.modules, name)
    nvmath_bindings.load.cache_clear()
    yield
    for name in [m for m in sys.modules if m == "nvmath" or m.startswith("nvmath.")]:
        del sys.modules[name]
    nvmath_bindings.load.cache_clear()


def test_load_skips_the_package_init_and_removes_its_stubs(fake_nvmath):
    nv = nvmath_bindings.load()
    assert (nv.cublasLt.NAME, nv.cublas.NAME, nv.CudaDataType.CUDA_R_16BF) == ("lt", "blas", 14)
    assert "nvmath" not in sys.modules and "nvmath.bindings" not in sys.modules
    assert sys.modules["nvmath.bindings.cublasLt"] is nv.cublasLt
    with pytest.raises(RuntimeError, match="package __init__ ran"):
        import nvmath  # noqa: F401   a later import runs the real package


def test_load_without_nvmath_raises_import_error(monkeypatch):
    monkeypatch.setattr(nvmath_bindings.importlib.util, "find_spec", lambda name: None)
    nvmath_bindings.load.cache_clear()
    try:
        with pytest.raises(ImportError, match="nvmath"):
            nvmath_bindings.load()
    finally:
        nvmath_bindings.load.cache_clear()
