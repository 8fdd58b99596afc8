"""Every kernels/*.cu compiles with NVRTC for sm_90, and every kernel a launcher names (template
instantiations included) exists in the compiled code. Needs CuPy and libnvrtc, but no GPU."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("cupy")

from cupy.cuda import nvrtc  # noqa: E402

from stepgraph.backends.cuda import compiler  # noqa: E402

LAUNCHERS = Path(compiler.__file__).with_name("launchers.py")


def _nvrtc_usable() -> bool:
    try:
        nvrtc.getVersion()
    except Exception:      # CuPy without a loadable libnvrtc: nothing to compile with
        return False
    return True


pytestmark = pytest.mark.skipif(not _nvrtc_usable(), reason="libnvrtc is not loadable")


@pytest.mark.parametrize("path", compiler.kernel_sources(), ids=lambda p: p.name)
def test_kernel_source_compiles_for_sm90(path):
    assert compiler.compile_to_cubin(path, "sm_90")


def launched_kernels() -> dict[str, set[str]]:
    """{file: kernel names} named by launchers.py, templates expanded over the C types that
    launchers.py instantiates them with (LABEL_CTYPES, FILL_CTYPES)."""
    from stepgraph.backends.cuda import launchers

    found: dict[str, set[str]] = {}
    source = LAUNCHERS.read_text()
    for filename, name in re.findall(r'_launch\(ctx, "([\w.]+)", f?"([^"]+)"', source):
        table = launchers.LABEL_CTYPES if "LABEL" in name else launchers.FILL_CTYPES
        names = [re.sub(r"\{[^}]*\}", ctype, name) for ctype in table.values()] \
            if "{" in name else [name]
        found.setdefault(filename, set()).update(names)
    return found


def test_launchers_name_existing_kernels():
    """NVRTC rejects a name expression that names no kernel, so compiling each file with every
    name its launchers use proves that each one exists (templates get instantiated too)."""
    kernels = launched_kernels()
    assert {"elementwise.cu", "reduce.cu", "pool.cu", "loss.cu", "optim.cu"} <= set(kernels)
    for filename, names in sorted(kernels.items()):
        assert compiler.compile_to_cubin(compiler.KERNEL_DIR / filename, "sm_90", tuple(names))


def test_conv_launchers_name_existing_kernels():
    """conv.py names its kernels from template parts (dtype, tile), so it lists every name it
    may launch (im2col path and direct path); each one is instantiated here."""
    from stepgraph.backends.cuda import conv

    kernels = conv.kernel_names()
    assert {"conv.cu", "conv_direct.cu"} <= set(kernels)
    for filename, names in sorted(kernels.items()):
        assert compiler.compile_to_cubin(compiler.KERNEL_DIR / filename, "sm_90",
                                         tuple(sorted(names)))


@pytest.mark.parametrize("family", ["broadcast", "softmax"])
def test_family_launchers_name_existing_kernels(family):
    """Families whose launchers build kernel names (template dims) list them all in
    kernel_names(); each one is instantiated here."""
    import importlib

    module = importlib.import_module(f"stepgraph.backends.cuda.{family}")
    kernels = module.kernel_names()
    assert f"{family}.cu" in kernels
    for filename, names in sorted(kernels.items()):
        assert compiler.compile_to_cubin(compiler.KERNEL_DIR / filename, "sm_90",
                                         tuple(sorted(names)))


def test_reduce_sum_fallback_is_launched():
    """The any-axes reduce_sum kernel is among the names the launchers' test compiles."""
    assert "reduce_sum_strided_kernel" in launched_kernels()["reduce.cu"]


@pytest.mark.parametrize("family,source", [("norm", "norm.cu"), ("pool", "avgpool.cu")])
def test_norm_and_pool_launchers_name_existing_kernels(family, source):
    """norm.py and pool.py list every kernel they may launch (layouts, float4 variants) in
    kernel_names(); compiling with each name proves that it exists."""
    import importlib

    module = importlib.import_module(f"stepgraph.backends.cuda.{family}")
    kernels = module.kernel_names()
    assert set(kernels) == {source}
    for filename, names in sorted(kernels.items()):
        assert compiler.compile_to_cubin(compiler.KERNEL_DIR / filename, "sm_90",
                                         tuple(sorted(names)))


def test_norm_layouts_name_listed_kernels():
    """Every kernel name norm.py builds for a layout (planes, float4 planes, columns) is one
    that kernel_names() lists, so the compile test above covers it."""
    from stepgraph.backends.cuda import norm

    listed = norm.kernel_names()["norm.cu"]
    for columns, vec in ((False, 1), (False, 4), (True, 1)):
        layout = norm.Layout(n=2, c=3, inner=1 if columns else 4, columns=columns, vec=vec)
        for kind in norm.KINDS:
            assert norm.pass_kernel(kind, layout) in listed
