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
