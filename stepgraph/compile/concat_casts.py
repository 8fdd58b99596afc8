"""Casts around a promoted concat, moved to its inputs (after autocast, before autodiff).

Under autocast a torch.cat of bf16 and float32 maps is promoted to float32 (torch's promote
list), and the lower-precision op that reads the result casts it back:

    a (bf16) -> cast f32 --\\
                            concat (f32) -> cast bf16 -> conv2d
    b (f32) ---------------/

Rounding the joined value to bf16 rounds each piece, and a bf16 value widened and narrowed is
itself, so this computes the same bits:

    a (bf16) ---------------\\
                             concat (bf16) -> conv2d
    b (f32) -> cast bf16 ---/

The float32 concat, the widening casts only it read and its output's cast are gone: a U-Net's
skip connections lose two full-size copies each, and the backward slices the joined gradient
in bf16 too (the float32 piece's gradient is widened once, by its cast's VJP, as before: the
same bits again). Matched: a cast to the low dtype that is the only reader of a float32
concat's output, which is no step output; the concat's inputs bf16 (or float16) values
widened by casts, low-dtype values, or float32 ones. Left alone: anything else.
"""
from __future__ import annotations

from ..ir.graph import Graph, Node, Value
from ..ir.ops import infer_outputs


def narrow_concats(graph: Graph, low: str) -> Graph:
    """`graph`, in place, with each matched float32 concat computed in `low` (module
    docstring)."""
    producers, users = graph.producers(), graph.consumers()
    kept = set(graph.outputs.values())
    replace: dict[Node, list[Node]] = {}
    drop: set[Node] = set()
    for cast in graph.nodes:
        if cast.op != "cast" or cast.attrs["dtype"] != low:
            continue
        joined = cast.inputs[0]
        concat = producers.get(joined)
        if concat is None or concat.op != "concat" or joined.dtype != "float32" or \
                joined in kept or users.get(joined) != [cast]:
            continue
        pieces = _narrowed(concat, low, producers, users, kept)
        if pieces is None:
            continue
        ins, casts, widenings = pieces
        spec = infer_outputs("concat", ins, concat.attrs)
        if spec != [(cast.outputs[0].shape, low)]:
            continue
        replace[concat] = casts + [Node("concat", ins, [cast.outputs[0]], dict(concat.attrs),
                                        (), concat.label)]
        drop.add(cast)
        drop.update(widenings)
    if replace:
        graph.nodes = [m for n in graph.nodes if n not in drop for m in replace.get(n, [n])]
    return graph


def _narrowed(concat: Node, low: str, producers, users, kept
              ) -> tuple[list[Value], list[Node], list[Node]] | None:
    """(the concat's inputs in `low`, the casts to make them, the widening casts that only
    this concat read), or None when an input is neither low, float32 nor widened from low."""
    ins, casts, widenings = [], [], []
    narrowed: dict[Value, Value] = {}           # a float32 input joined twice: one cast
    for v in concat.inputs:
        widen = producers.get(v)
        if widen is not None and widen.op == "cast" and widen.inputs[0].dtype == low:
            ins.append(widen.inputs[0])          # widening then narrowing: the value itself
            if users.get(v) == [concat] and v not in kept:
                widenings.append(widen)
        elif v.dtype == low:
            ins.append(v)
        elif v.dtype == "float32":
            if v not in narrowed:
                narrowed[v] = Value(v.shape, low)
                casts.append(Node("cast", [v], [narrowed[v]], {"dtype": low}, (),
                                  concat.label))
            ins.append(narrowed[v])
        else:
            return None
    return ins, casts, widenings
