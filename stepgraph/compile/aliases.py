"""Memory aliases: values the planner (plan.py) places inside another value's buffer. A node
all of whose outputs are aliases computes nothing: it is elided, no kernel runs it.

Rules, each decided once per node of the schedule:

- views (VIEW_OPS: reshape, stop_gradient): the whole of their input, always.
- slices (unstack, slice with step 1): output k is the range of the input it copies, when
  that range is contiguous (every axis before the sliced one has extent 1): an unrolled
  recurrence's steps read the (T, B, ...) input projection in place.
- concat, already in place: the inputs lie one after the other, in order, in one buffer
  (an LSTM's dW_hh stacks rows the layer's output and input gradient already hold): the output
  is that range.
- concat in place: every input is a buffer of its own, written by one node, so each input is
  placed at its range of the output and its producer writes there (the (T, B, H) output of a
  recurrence, its input gradient, a U-Net's skip connections, torch.cat of a channel axis
  of extent 1... wherever the ranges are contiguous). Concats are decided largest output
  first, so a stack of many steps claims them before a shorter stack of a few of them, which
  then finds them in place.

An alias never takes part where it could change what a value holds while it is read: no
value that a node mutates (`mutates`), nor one sharing its memory through views, takes part
in a slice or concat alias; external values (inputs, parameters, state) live in their own
buffers and never do; a buffer is placed inside at most one other, once; the ranges start at
multiples of `align` bytes, so every kernel sees operands aligned as an arena slot. Each byte
of a buffer is then written by one node, the producer of the value placed there, and the
buffer lives from its first writer to its last reader (plan.py's lifetimes, on the roots).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..ir.graph import Node, Value, itemsize
from ..ops.recurrent import unstack_order
from ..ops.shape import _slice_bounds

VIEW_OPS = ("reshape", "stop_gradient")   # alias their input: no kernel runs them
SLICE_OPS = ("unstack", "slice")


@dataclass
class Aliases:
    """Where each alias lives: roots[v] the value whose buffer holds v (itself no alias),
    offsets[v] the byte offset of v in it; elided: positions in the schedule of the nodes
    that run no kernel."""

    roots: dict[Value, Value] = field(default_factory=dict)
    offsets: dict[Value, int] = field(default_factory=dict)
    elided: set[int] = field(default_factory=set)


def view_roots(steps: list[Node]) -> dict[Value, Value]:
    """The value each view (VIEW_OPS) output shares its whole buffer with."""
    roots: dict[Value, Value] = {}
    for n in steps:
        if n.op in VIEW_OPS:
            src = n.inputs[0]
            roots[n.outputs[0]] = roots.get(src, src)
    return roots


def written_buffers(steps: list[Node], views: dict[Value, Value]) -> set[Value]:
    """The buffers some node writes in place (`mutates`), each named by its view root
    (`views`, view_roots'): a write through a reshape writes its input."""
    return {views.get(n.inputs[i], n.inputs[i]) for n in steps for i in n.mutates}


class _Placer:
    """The alias decisions over one schedule: parent[v] = (value whose buffer holds v, byte
    offset of v in it)."""

    def __init__(self, steps: list[Node], align: int):
        self.steps, self.align = steps, align
        self.parent: dict[Value, tuple[Value, int]] = {}
        self.views = view_roots(steps)
        self.blocked = written_buffers(steps, self.views)

    def locate(self, v: Value) -> tuple[Value, int]:
        """(root, byte offset): the buffer holding v, following every alias."""
        offset = 0
        while v in self.parent:
            v, o = self.parent[v]
            offset += o
        return v, offset

    def free(self, values) -> bool:
        """None of `values` is mutated or external (nor shares memory with one via views)."""
        for v in values:
            root = self.views.get(v, v)
            if root in self.blocked or root.is_external or v.is_external or not v.nbytes:
                return False
        return True

    def slice_view(self, n: Node) -> bool:
        """An unstack or slice whose outputs are contiguous ranges of its input: placed
        there."""
        x = n.inputs[0]
        if n.op == "unstack":
            dim = int(n.attrs["dim"])
            starts = unstack_order(x.shape[dim], bool(n.attrs.get("reverse")))
        else:
            dim, start, stop, step = _slice_bounds("slice", x.shape, n.attrs)
            if step != 1 and stop - start > 1:
                return False
            starts = [start]
        if math.prod(x.shape[:dim]) != 1 or not self.free([x, *n.outputs]):
            return False
        row = math.prod(x.shape[dim + 1:]) * itemsize(x.dtype)
        offsets = [s * row for s in starts]
        if any(o % self.align for o in offsets):
            return False
        for out, o in zip(n.outputs, offsets):
            self.parent[out] = (x, o)
        return True

    def _contiguous(self, n: Node) -> bool:
        out = n.outputs[0]
        return math.prod(out.shape[:int(n.attrs["dim"])]) == 1 and self.free([out, *n.inputs])

    def concat_view(self, n: Node) -> bool:
        """A concat whose inputs already lie one after the other in one buffer: its output is
        that range."""
        out = n.outputs[0]
        if out in self.parent or not self._contiguous(n):
            return False
        places = [self.locate(v) for v in n.inputs]
        root, start = places[0]
        at = start
        for v, (r, o) in zip(n.inputs, places):
            if r is not root or o != at:
                return False
            at += v.nbytes
        if root is out or not self.free([root]) or start % self.align:
            return False
        self.parent[out] = (root, start)
        return True

    def concat_in_place(self, n: Node) -> bool:
        """A concat each of whose inputs is a whole buffer of its own: each placed at its
        range of the output, where its producer then writes."""
        out = n.outputs[0]
        if not self._contiguous(n):
            return False
        home, _ = self.locate(out)
        roots, at, offsets = [], 0, []
        for v in n.inputs:
            root, o = self.locate(v)
            if o or root.nbytes != v.nbytes or root is home or root in roots \
                    or not self.free([root]) or at % self.align:
                return False
            roots.append(root)
            offsets.append(at)
            at += v.nbytes
        for root, o in zip(roots, offsets):
            self.parent[root] = (out, o)
        return True


def find_aliases(steps: list[Node], align: int, enabled: bool = True) -> Aliases:
    """The aliases of a schedule (the module docstring); enabled False: views only."""
    placer = _Placer(steps, align)
    elided = set()
    for i, n in enumerate(steps):
        if n.op in VIEW_OPS:
            placer.parent[n.outputs[0]] = (n.inputs[0], 0)
            elided.add(i)
    if enabled:
        for i, n in enumerate(steps):
            if n.op in SLICE_OPS and placer.slice_view(n):
                elided.add(i)
        concats = [i for i, n in enumerate(steps) if n.op == "concat"]
        for i in sorted(concats, key=lambda i: -steps[i].outputs[0].nbytes):
            if placer.concat_view(steps[i]) or placer.concat_in_place(steps[i]):
                elided.add(i)
    aliases = Aliases(elided=elided)
    for v in placer.parent:
        aliases.roots[v], aliases.offsets[v] = placer.locate(v)
    return aliases
