"""kernel_resources: ptxas's report parsed per kernel, and the blocks an sm_90 SM holds (the
occupancy calculator's arithmetic, checked against occupancies measured on an H200)."""
from __future__ import annotations

import pytest

from stepgraph.backends.cuda.runtime.kernel_resources import KernelResources, parse_ptxas_log

LOG = """\
ptxas info    : Compiling entry function '_Z3fooIfEvPT_' for 'sm_90'
ptxas info    : Function properties for _Z3fooIfEvPT_
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 16512 bytes smem
ptxas info    : Compiling entry function 'bar_kernel' for 'sm_90'
ptxas info    : Function properties for bar_kernel
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 26 registers
"""


def test_the_report_is_read_per_kernel_with_template_names():
    found = parse_ptxas_log(LOG, {"_Z3fooIfEvPT_": "foo<float>"})
    assert found == {
        "foo<float>": KernelResources("foo<float>", 40, 8, 12, 16, 16512),
        "bar_kernel": KernelResources("bar_kernel", 26, 0, 0, 0, 0)}


# (registers, threads a block, blocks an SM): the LayerNorm kernels' occupancies that the
# profiler reported on an H200 (docs/perf-notes.md, 2026-12-02), and a column kernel's
@pytest.mark.parametrize("registers,threads,blocks", [
    (62, 256, 4), (80, 256, 3), (48, 256, 5), (71, 256, 3), (82, 256, 2), (44, 512, 2),
    (32, 512, 4), (16, 1024, 2), (0, 64, 32)])
def test_blocks_an_sm_follow_the_register_file(registers, threads, blocks):
    assert KernelResources("k", registers, 0, 0, 0, 0).blocks_per_sm(threads) == blocks


def test_shared_memory_limits_the_blocks_too():
    big = KernelResources("k", 32, 0, 0, 0, 100 * 1024)
    assert big.blocks_per_sm(128) == 2                      # 228 KiB / (100 KiB + 1 KiB)
    assert big.blocks_per_sm(128, dynamic_shared=20 * 1024) == 1


def test_a_column_kernel_compiled_for_sm90():
    """reduce.cu's bf16 act_bias_backward with four columns a thread: its shared partials
    (COLUMN_ROWS x (32 * 4 + 1) doubles) and no spills."""
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    try:
        nvrtc.getVersion()
    except Exception:
        pytest.skip("libnvrtc is not loadable")
    from stepgraph.backends.cuda.runtime.kernel_resources import kernel_resources

    name = "act_bias_backward_kernel<unsigned short, 4>"
    found = kernel_resources("reduce.cu", (name,))
    r = found[name]
    assert r.shared == 16 * (32 * 4 + 1) * 8
    assert r.spill_stores == r.spill_loads == 0
    assert 0 < r.registers <= 255
    assert "global_norm_forward_kernel" in found              # the file's extern "C" kernel
