"""A concat that a pointwise program can write is written by that program.

A gated unit's backward computes the gradients of both halves of one projection in one
program (`a, b = self.gate(x).chunk(2, -1)`, SwiGLU, GLU, a product gate), and the projection's
backward reads them joined: `torch.cat` of the two, a copy of both. A packed q, k, v projection
whose q and k are normalised (or rotated) after the head split joins their gradients and v's
the same way, each read through the head split's permute (a `layout_concat`). The program can
store each part straight into its place in the joined value (ops/pointwise.py `Joined`: the
part is a strided view of the output), so the concat goes with its pass over memory:

- the program's own results that only the concat reads are stored there and not kept;
- the concat's other inputs, of the program's shape, are read by the program as inputs and
  stored as they are (a copy, as the concat made). The program chosen is the last of the
  concat's producers, so every such input is made before it runs.

Only where at least one part is the program's own result, a layout_concat reads each input
through a permutation of its axes (the head split's transpose; a slice or reshape is left to
the concat), every part can be stored four elements at a time (rows of a multiple of four),
and the program's results given up are no graph output and nothing writes them in place.
Same bits: the program stores the values the concat copied.
"""
from __future__ import annotations

import math

from ..ir.graph import Graph, Node, Value
from ..ops.pointwise import Joined, input_views, renumbered
from ..ops.shape import contiguous_strides, matched_axes
from .aliases import view_roots, written_buffers
from .pointwise_views import program_of
from .rewrite import _copy

VECTOR = 4          # elements a thread of the CUDA vector kernel (backends/cuda/pointwise.py)


def join_pointwise_results(graph: Graph) -> Graph:
    graph = _copy(graph)
    producers, users = graph.producers(), graph.consumers()
    outputs = set(graph.outputs.values())
    written = written_buffers(graph.nodes, view_roots(graph.nodes))
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    gone: set[int] = set()
    for cat in graph.nodes:
        if cat.op not in ("concat", "layout_concat") or len(cat.inputs) < 2:
            continue
        programs = [producers[v] for v in cat.inputs
                    if v in producers and program_of(producers[v]) is not None]
        if not programs:
            continue
        last = max(programs, key=lambda n: order[id(n)])
        program = program_of(last)
        shape = tuple(program.attrs["shape"])
        parts = part_views(cat, shape)
        if parts is None or not all(_four_at_a_time(shape, part) for part in parts):
            continue

        def own(v: Value) -> bool:
            return producers.get(v) in (last, program) and v not in outputs \
                and v not in written \
                and isinstance(program.attrs["results"][program.outputs.index(v)], int) \
                and all(u is cat for u in users[v])

        def readable(v: Value) -> bool:
            p = producers.get(v)
            return p is None or order[id(p)] < order[id(last)]

        if not all(own(v) or readable(v) for v in cat.inputs) or \
                not any(own(v) for v in cat.inputs):
            continue
        if program is not last:                  # a lone elementwise node: its program
            graph.nodes[order[id(last)]] = program
            order[id(program)] = order[id(last)]
            producers.update((v, program) for v in program.outputs)
        read = {id(v): _read(program, v) for v in cat.inputs if not own(v)}
        results = list(program.attrs["results"])
        registers = tuple(read[id(v)] if id(v) in read else results[program.outputs.index(v)]
                          for v in cat.inputs)
        mine = sorted({program.outputs.index(v) for v in cat.inputs if own(v)})
        results[mine[0]] = Joined(tuple(cat.outputs[0].shape), registers, parts)
        program.outputs[mine[0]] = cat.outputs[0]
        keep = [j for j in range(len(results)) if j not in mine[1:]]
        program.outputs = [program.outputs[j] for j in keep]
        program.attrs = {**program.attrs, "results": tuple(results[j] for j in keep)}
        producers[cat.outputs[0]] = program
        gone.add(id(cat))
    graph.nodes = [n for n in graph.nodes if id(n) not in gone]
    return graph


def _four_at_a_time(shape: tuple, part) -> bool:
    """Whether a part can be stored four elements at a time, as the CUDA vector kernel stores
    (backends/cuda/pointwise.py VEC): rows whose length is a multiple of four, contiguous, at
    multiples of four. A part that cannot would turn the whole program's kernel to one element
    a thread, which may cost more than the concat's copy saves."""
    strides, offset = part
    return bool(shape) and shape[-1] % VECTOR == 0 and strides[-1] == 1 and \
        all(s % VECTOR == 0 for s in (*strides[:-1], offset))


def part_views(cat: Node, shape: tuple) -> tuple | None:
    """(strides, offset) over the output's elements of each input of a concat or
    layout_concat, the input indexed as `shape` (the program's: each input holds that many
    elements), or None where an input does not have that shape (a concat) or is read
    through a view that is no permutation of the axes of `shape` (a layout_concat)."""
    out = tuple(cat.outputs[0].shape)
    dim, at, parts = int(cat.attrs["dim"]), contiguous_strides(out), []
    views = cat.attrs.get("views") or [None] * len(cat.inputs)
    start = 0
    for v, view in zip(cat.inputs, views):
        if view is None:
            axes = tuple(range(len(shape))) if tuple(v.shape) == shape else None
        else:
            axes = permuted_axes(shape, view) if v.size == math.prod(shape) else None
        if axes is None:
            return None
        # axis axes[d] of the input, indexed as `shape`, is the output's axis d
        strides = [0] * len(shape)
        for d, a in enumerate(axes):
            strides[a] = at[d]
        parts.append((tuple(strides), start * at[dim]))
        start += (v.shape if view is None else view[0])[dim]
    return tuple(parts)


def permuted_axes(shape: tuple, view) -> tuple | None:
    """axes such that the view (vshape, strides, offset) reads a contiguous array of `shape`
    as its transpose by axes (view axis d is axis axes[d]), or None."""
    vshape, strides, _ = view            # a full-size view of the array: its offset is 0
    matched = matched_axes(vshape, strides, shape) if len(vshape) == len(shape) else None
    free = [a for a in range(len(shape)) if shape[a] == 1]
    if matched is None or len(matched) + len(free) != len(shape):     # an axis unmatched
        return None
    return tuple(matched[d] if d in matched else free.pop() for d in range(len(vshape)))


def _read(program: Node, v: Value) -> int:
    """The register in which program reads v at its shape (v holds as many elements,
    contiguous; read through a reshaping view where its shape differs): an input it has, or
    one more (the registers from the new one on move up by one)."""
    shape = tuple(program.attrs["shape"])
    wanted = None if tuple(v.shape) == shape else (shape, contiguous_strides(shape), 0)
    views = input_views(program.attrs, len(program.inputs))
    for j, (x, view) in enumerate(zip(program.inputs, views)):
        if x is v and view == wanted:
            return j
    k = len(program.inputs)
    program.inputs.append(v)
    attrs = dict(program.attrs)
    attrs["program"], attrs["results"] = renumbered(attrs["program"], attrs["results"],
                                                    lambda r: r + 1 if r >= k else r)
    if attrs.get("views") or wanted is not None:
        attrs["views"] = (*input_views(attrs, k), wanted)
    program.attrs = attrs
    return k
