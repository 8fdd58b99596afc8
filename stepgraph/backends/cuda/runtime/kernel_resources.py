"""What a kernel holds on an SM, read from ptxas at an NVRTC compile, without a GPU.

The column and LayerNorm kernels are bound by how many of their blocks an SM holds at once
(docs/perf-notes.md): their registers decide it, and a `__launch_bounds__` that forces more
blocks spills. `kernel_resources` compiles a .cu file for sm_90 with ptxas's report on and
returns each kernel's registers, spills and static shared memory; `blocks_per_sm` turns them
into resident blocks by the sm_90 limits of CUDA's occupancy calculator.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from . import compiler

# sm_90 (H100, H200) per-SM limits: registers, threads, blocks, shared memory (228 KiB, of
# which 1 KiB is reserved per block); registers are allocated per warp in units of 256.
SM90_REGISTERS = 65536
SM90_THREADS = 2048
SM90_BLOCKS = 32
SM90_SHARED = 228 * 1024
SHARED_RESERVED_PER_BLOCK = 1024
REGISTER_UNIT = 256


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    spill_stores: int     # bytes a thread
    spill_loads: int
    stack: int            # bytes of stack frame a thread
    shared: int           # static shared memory a block (dynamic shared memory not included)

    def blocks_per_sm(self, threads: int, dynamic_shared: int = 0) -> int:
        """Blocks of `threads` threads an sm_90 SM holds at once."""
        warps = -(-threads // 32)
        per_warp = -(-self.registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        limits = [SM90_BLOCKS, SM90_THREADS // (32 * warps),
                  SM90_REGISTERS // (warps * per_warp) if self.registers else SM90_BLOCKS]
        shared = self.shared + dynamic_shared
        if shared:
            limits.append(SM90_SHARED // (shared + SHARED_RESERVED_PER_BLOCK))
        return min(limits)


_FUNCTION = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers.*?(?:, (\d+) bytes smem)?$")


def parse_ptxas_log(log: str, lowered: dict[str, str]) -> dict[str, KernelResources]:
    """ptxas's -v report ({mangled: readable} names the templates) as {name: resources}."""
    found, name, frame = {}, None, (0, 0, 0)
    for line in log.splitlines():
        if m := _FUNCTION.search(line):
            name, frame = lowered.get(m.group(1), m.group(1)), (0, 0, 0)
        elif (m := _FRAME.search(line)) and name:
            frame = tuple(int(g) for g in m.groups())
        elif (m := _USED.search(line)) and name:
            stack, stores, loads = frame
            found[name] = KernelResources(name, int(m.group(1)), stores, loads, stack,
                                          int(m.group(2) or 0))
            name = None
    return found


def kernel_resources(filename: str, name_expressions: tuple[str, ...] = (),
                     arch: str = "sm_90") -> dict[str, KernelResources]:
    """Each kernel of `filename` (its extern "C" kernels and the named template
    instantiations) with the resources ptxas gave it for `arch`."""
    log, lowered = compiler.ptxas_report(filename, arch, name_expressions)
    return parse_ptxas_log(log, lowered)
