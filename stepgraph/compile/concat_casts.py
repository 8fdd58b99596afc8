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

Reshapes and permutes move no value, so a cast commutes with them: between the concat and
its cast, and between a float32 piece and the concat (each the only reader of what it reads),
they run in bf16 too, and a piece's cast moves above them. F.pad's zeros joined to a permuted
activation for a causal convolution (mixer.py: the padded h.transpose(1, 2), viewed as 4-D for
the convolution) is then joined, permuted and viewed in bf16, and the activation cast where it
is made (h, which its Linear reads through a cast to bf16 as well).
"""
from __future__ import annotations

from ..ir.graph import Graph, Node, Value
from ..ir.ops import infer_outputs


LAYOUT_OPS = ("reshape", "permute")


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
        views, joined = _views_above(cast.inputs[0], cast, producers, users, kept)
        concat = producers.get(joined)
        if concat is None or concat.op != "concat" or joined.dtype != "float32" or \
                joined in kept or users.get(joined) != [views[0] if views else cast]:
            continue
        pieces = _narrowed(concat, low, producers, users, kept)
        if pieces is None:
            continue
        ins, made, dropped = pieces
        spec = infer_outputs("concat", ins, concat.attrs)
        if spec != [(joined.shape, low)]:
            continue
        out = Value(joined.shape, low) if views else cast.outputs[0]
        replace[concat] = made + [Node("concat", ins, [out], dict(concat.attrs), (),
                                       concat.label)] + _relaid(views, out, cast.outputs[0])
        drop.update([cast, *views, *dropped])
    if replace:
        graph.nodes = [m for n in graph.nodes if n not in drop for m in replace.get(n, [n])]
    return graph


def _views_above(v: Value, reader: Node, producers, users, kept) -> tuple[list[Node], Value]:
    """The reshapes and permutes that make v, which `reader` reads, each read by the next
    alone (and its output no step output), in order from the first; and the value they start
    from (v when there are none)."""
    views: list[Node] = []
    while True:
        view = producers.get(v)
        if view is None or view.op not in LAYOUT_OPS or v in kept or \
                users.get(v) != [views[0] if views else reader]:
            return views, v
        views.insert(0, view)
        v = view.inputs[0]


def _relaid(views: list[Node], v: Value, last: Value | None = None) -> list[Node]:
    """`views` again, applied in turn to the low-dtype v: new nodes on new values, the last
    one writing `last` when given."""
    nodes = []
    for view in views:
        out = last if view is views[-1] and last is not None else \
            Value(view.outputs[0].shape, v.dtype)
        nodes.append(Node(view.op, [v], [out], dict(view.attrs), (), view.label))
        v = out
    return nodes


def _narrowed(concat: Node, low: str, producers, users, kept
              ) -> tuple[list[Value], list[Node], list[Node]] | None:
    """(the concat's inputs in `low`, the nodes that make them, the nodes that only made this
    concat's float32 inputs: widening casts, and reshapes and permutes now run in `low`), or
    None when an input is neither low, float32 nor widened from low."""
    ins, made, dropped = [], [], []
    narrowed: dict[Value, Value] = {}           # a float32 input joined twice: one cast
    for v in concat.inputs:
        widen = producers.get(v)
        if widen is not None and widen.op == "cast" and widen.inputs[0].dtype == low:
            ins.append(widen.inputs[0])          # widening then narrowing: the value itself
            if users.get(v) == [concat] and v not in kept:
                dropped.append(widen)
        elif v.dtype == low:
            ins.append(v)
        elif v.dtype == "float32":
            if v not in narrowed:
                views, top = _views_above(v, concat, producers, users, kept)
                made_top = producers.get(top)
                if made_top is not None and made_top.op == "fill" and top not in kept and \
                        users.get(top) == [views[0] if views else concat]:
                    dropped.append(made_top)             # F.pad's zeros: made in low
                    narrowing = Node("fill", [], [Value(top.shape, low)],
                                     dict(made_top.attrs, dtype=low), (), made_top.label)
                else:
                    narrowing = Node("cast", [top], [Value(top.shape, low)], {"dtype": low}, (),
                                     concat.label)
                relaid = _relaid(views, narrowing.outputs[0])
                made += [narrowing, *relaid]
                dropped += views
                narrowed[v] = (relaid[-1] if relaid else narrowing).outputs[0]
            ins.append(narrowed[v])
        else:
            return None
    return ins, made, dropped

