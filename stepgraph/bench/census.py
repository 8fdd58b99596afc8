"""Counting what one training step launches: kernels and NCHW<->NHWC layout conversions.

Library-free text parsing, so it is tested without a GPU or the peers' libraries:
`hlo_census` reads XLA's optimized HLO (the JAX peer's compiled step), `kernel_name_census` the
kernel names a profiler saw (the PyTorch peers).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from stepgraph.bench.peers import KernelCensus

# cuDNN's and ATen's NCHW<->NHWC transposes, by kernel name. Inductor's fused layout copies carry
# the names of the ops they were fused with and are not recognisable.
LAYOUT_KERNEL = re.compile(r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw|transpose", re.IGNORECASE)


def kernel_name_census(names: Iterable[str], source: str) -> KernelCensus:
    """Kernels = the names counted; layout conversions = those named as a layout transpose."""
    names = list(names)
    return KernelCensus(len(names), sum(1 for name in names if LAYOUT_KERNEL.search(name)),
                        source)


# HLO instructions that launch nothing: bookkeeping, views, control flow whose bodies count.
NON_KERNEL_OPCODES = frozenset((
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain", "call", "while",
    "conditional", "async-start", "async-done", "async-update", "copy-start", "copy-done"))
# Instructions whose called computations run as they are (their instructions are counted), as
# opposed to a fusion's body or a reducer's lambda, which are part of the caller's kernel.
PASS_THROUGH_OPCODES = ("call", "while", "conditional", "async-start")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_NESTED = re.compile(r"(?:calls|to_apply|called_computations)=\{?%?([\w.\-]+(?:,\s*%?[\w.\-]+)*)")


def _opcode(instruction: str) -> str:
    """The opcode of one HLO instruction line ('%a = f32[2]{0} add(%b, %c)' -> 'add')."""
    rhs = instruction.split("=", 1)[1].lstrip()
    if rhs.startswith("("):  # a tuple shape: skip to its closing parenthesis
        depth = 0
        for i, char in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                rhs = rhs[i + 1:]
                break
    else:
        rhs = rhs.split(None, 1)[1] if " " in rhs else ""
    return rhs.lstrip().split("(", 1)[0].strip()


_ARRAY = re.compile(r"\w+\[([^\]]*)\](\{[^}]*\})?")


def _name(instruction: str) -> str:
    return instruction.split("=", 1)[0].removeprefix("ROOT ").strip().lstrip("%")


def _array(instruction: str) -> tuple[int, str]:
    """Rank and layout of an instruction's array result: 'f32[8,4]{0,1} ...' -> (2, '{0,1}')."""
    match = _ARRAY.match(instruction.split("=", 1)[1].lstrip())
    if match is None:
        return 0, ""
    return (match.group(1).count(",") + 1 if match.group(1) else 0), match.group(2) or ""


def _is_layout_conversion(line: str, opcode: str, fused_transpose: bool,
                          layouts: dict[str, str]) -> bool:
    """A transpose of a 4-D array (images or conv kernels), alone or inside a fusion, or a copy
    of one into another physical layout."""
    rank, layout = _array(line)
    if rank != 4:
        return False
    if opcode == "transpose" or (opcode == "fusion" and fused_transpose):
        return True
    if opcode == "copy":
        operand = re.search(r"copy\(\s*%?([\w.\-]+)", line)
        return operand is not None and layouts.get(operand.group(1), layout) != layout
    return False


def _computations(hlo: str) -> dict[str, list[str]]:
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = computations.setdefault(header.group(1), [])
        elif current is not None and " = " in line and line.startswith(" "):
            current.append(line.strip())
    return computations


def hlo_census(hlo: str) -> KernelCensus:
    """Kernels of one step read off XLA's optimized HLO: instructions that launch work (a
    fusion, a cuDNN/cuBLAS custom call, an unfused op) outside fused bodies and reducer
    lambdas. Layout conversions: those of them that transpose a 4-D array (images or conv
    kernels), on their own or fused into other work, or copy one into another layout."""
    computations = _computations(hlo)
    nested, transposing = set(), set()
    for name, lines in computations.items():
        for line in lines:
            if _opcode(line) == "transpose" and _array(line)[0] == 4:
                transposing.add(name)
            if _opcode(line) in PASS_THROUGH_OPCODES:  # e.g. a command buffer's body
                continue
            for match in _NESTED.finditer(line):
                nested.update(part.strip().lstrip("%") for part in match.group(1).split(","))
    kernels = layout = 0
    for name, lines in computations.items():
        if name in nested:
            continue
        layouts = {_name(line): _array(line)[1] for line in lines}
        for line in lines:
            opcode = _opcode(line)
            if opcode in NON_KERNEL_OPCODES:
                continue
            kernels += 1
            called = re.search(r"calls=%?([\w.\-]+)", line)
            fused_transpose = called is not None and called.group(1) in transposing
            layout += _is_layout_conversion(line, opcode, fused_transpose, layouts)
    return KernelCensus(kernels, layout, "XLA optimized HLO (kernel-launching instructions)")
