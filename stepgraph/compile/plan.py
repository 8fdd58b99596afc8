"""The Plan: schedule, liveness and a memory plan placing every intermediate in one arena.

The schedule is the graph's program order (already topological; nodes that mutate state keep
their place relative to readers). Aliases (compile/aliases.py: views, contiguous slices, concats
whose inputs are written in place) live inside another value's buffer, at an offset, and extend
its lifetime; the nodes computing them run no kernel. Intermediates get offsets in one arena by
first-fit over lifetimes, so buffers whose lifetimes do not overlap share memory. Externals
(inputs, params, state) live in their own fixed buffers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PlanError
from ..ir.graph import Graph, Node, Value
from .aliases import VIEW_OPS, find_aliases, view_roots

ALIGN = 256          # bytes; cuBLASLt and float4 kernels want aligned operands
__all__ = ["ALIGN", "VIEW_OPS", "Plan", "make_plan"]


@dataclass(frozen=True)
class Slot:
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Lifetime:
    first: int       # index of the node that writes the buffer
    last: int        # index of its last reader (len(steps) for step outputs)


@dataclass(frozen=True)
class PlanSummary:
    ops: int
    arena_bytes: int
    bytes_without_reuse: int
    externals_bytes: int

    def __str__(self):
        saved = 1 - self.arena_bytes / max(self.bytes_without_reuse, 1)
        return (f"{self.ops} ops, arena {self.arena_bytes / 2**20:.2f} MiB "
                f"(without reuse {self.bytes_without_reuse / 2**20:.2f} MiB, {saved:.0%} saved), "
                f"externals {self.externals_bytes / 2**20:.2f} MiB")


@dataclass
class Plan:
    graph: Graph
    steps: list[Node]
    slots: dict[Value, Slot]                 # intermediates -> arena placement
    views: dict[Value, Value]                # alias -> the value whose memory it shares
    lifetimes: dict[Value, Lifetime] = field(repr=False, default_factory=dict)
    arena_bytes: int = 0
    offsets: dict[Value, int] = field(repr=False, default_factory=dict)  # alias -> byte offset
    elided: frozenset[int] = frozenset()     # positions in steps of nodes that run no kernel

    def runs(self, i: int) -> bool:
        """Whether steps[i] launches work (else all its outputs are aliases)."""
        return i not in self.elided

    def summary(self) -> PlanSummary:
        return PlanSummary(len(self.steps), self.arena_bytes,
                           sum(_aligned(s.nbytes) for s in self.slots.values()),
                           sum(v.nbytes for v in self.graph.externals))


def _aligned(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


_view_roots = view_roots      # compile/overlap.py reads views of the graph before planning


def _check_order(graph: Graph) -> None:
    defined = set(graph.externals)
    for i, n in enumerate(graph.nodes):
        for v in n.inputs:
            if v not in defined:
                raise PlanError(f"node {i} ({n.op}) reads {v!r} before it is written")
        for v in n.outputs:   # one writer per value: a second would share its memory slot
            if v.is_external:
                raise PlanError(f"node {i} ({n.op}) outputs external {v!r} "
                                "(in-place updates are declared with `mutates`)")
            if v in defined:
                raise PlanError(f"node {i} ({n.op}) writes {v!r}, already written earlier")
        defined.update(n.outputs)
    for name, v in graph.outputs.items():
        if v not in defined:
            raise PlanError(f"step output {name!r} is never computed")


def _lifetimes(graph: Graph, steps: list[Node], roots: dict[Value, Value]) -> dict[Value, Lifetime]:
    first: dict[Value, int] = {}
    last: dict[Value, int] = {}
    for i, n in enumerate(steps):
        for v in n.outputs:
            r = roots.get(v, v)
            first.setdefault(r, i)
            last[r] = max(last.get(r, i), i)
        for v in n.inputs:
            r = roots.get(v, v)
            last[r] = max(last.get(r, i), i)
    for v in graph.outputs.values():
        last[roots.get(v, v)] = len(steps)
    return {v: Lifetime(first[v], last[v]) for v in first if not v.is_external}


def _place(lifetimes: dict[Value, Lifetime], n_steps: int) -> tuple[dict[Value, Slot], int]:
    """First-fit placement in schedule order: a buffer is freed after its last reader, and a
    node's outputs never share memory with its inputs (they are placed before frees)."""
    by_first: dict[int, list[Value]] = {}
    by_last: dict[int, list[Value]] = {}
    for v, lt in lifetimes.items():
        by_first.setdefault(lt.first, []).append(v)
        by_last.setdefault(lt.last, []).append(v)
    free: list[tuple[int, int]] = []       # (offset, size), sorted by offset
    slots: dict[Value, Slot] = {}
    top = 0
    for i in range(n_steps + 1):
        for v in sorted(by_first.get(i, []), key=lambda v: -v.nbytes):
            size = _aligned(v.nbytes)
            for j, (off, avail) in enumerate(free):
                if avail >= size:
                    free[j:j + 1] = [(off + size, avail - size)] if avail > size else []
                    break
            else:
                off, top = top, top + size
            slots[v] = Slot(off, v.nbytes)
        for v in by_last.get(i, []):
            free.append((slots[v].offset, _aligned(v.nbytes)))
        free = _coalesce(free)
    return slots, top


def _coalesce(free: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for off, size in sorted(free):
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + size)
        else:
            merged.append((off, size))
    return merged


def make_plan(graph: Graph, aliases: bool = True) -> Plan:
    """The plan of `graph`; aliases False keeps every slice and concat a kernel of its own
    (views only), the reference the aliased plan must match bit for bit."""
    _check_order(graph)
    steps = list(graph.nodes)
    found = find_aliases(steps, ALIGN, aliases)
    lifetimes = _lifetimes(graph, steps, found.roots)
    slots, arena = _place(lifetimes, len(steps))
    return Plan(graph, steps, slots, found.roots, lifetimes, arena, found.offsets,
                frozenset(found.elided))
