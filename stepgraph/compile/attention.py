"""Attention on packed heads: the head split and merge copies around `sdpa` disappear.

A GPT's attention traces as
    X (..., T, 3C) -> slice thirds -> reshape (..., T, H, D) -> permute -> q, k, v (..., H, T, D)
    sdpa(q, k, v) -> out -> permute -> reshape -> Y (..., T, C)
and its backward as
    G (..., T, C) -> reshape -> permute -> sdpa_grad -> dq, dk, dv -> permute -> reshape
    -> slice_grad (each a zero-filled (..., T, 3C)) -> add -> add -> dX.
or, as timm's ViT writes it (`qkv.reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)`),
    X (B, T, 3C) -> reshape (B, T, 3, H, D) -> permute (3, B, H, T, D) -> slice thirds
    -> reshape -> q, k, v
with the gradient's thirds summed into the (3, B, H, T, D) value, permuted back and reshaped
to dX: the same q, k, v read out of the same X. The sdpa kernels read and write through
strides, so this pass rewrites either into
    sdpa_qkv(X) -> Y, lse        sdpa_qkv_grad(G, X, Y, lse) -> dX
(attention.py ops: the same arithmetic on the same logical tensors, dropout mask included)
and every copy, zero fill and sum in between becomes dead code. It rewrites only the whole
pattern, each intermediate read by nothing else; a forward without a backward (inference)
is rewritten alone. It must run before pointwise fusion swallows the gradient sums.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.graph import Graph, Node, Value
from .rewrite import _copy, _live, _rebuild


# (B, T, 3, H, D) -> (3, B, H, T, D), and back: the stacked split's permutes
STACKED = (2, 0, 3, 1, 4)
UNSTACKED = (1, 3, 0, 2, 4)


def _swaps_heads(n: Node | None) -> bool:
    """A permute exchanging the last-but-one and last-but-two axes."""
    if n is None or n.op != "permute":
        return False
    dims, rank = tuple(n.attrs["dims"]), len(n.attrs["dims"])
    return rank >= 3 and dims == tuple(range(rank - 3)) + (rank - 2, rank - 3, rank - 1)


@dataclass
class _Site:
    """One matched attention: the forward and (when there) backward nodes it replaces."""

    sdpa: Node
    x: Value                   # the packed (..., T, 3C) projection
    y: Value                   # the (..., T, C) merged output
    y_producer: Node           # the reshape producing y
    heads: int
    grad: Node | None = None
    g: Value | None = None     # the (..., T, C) gradient of y
    dx: Value | None = None    # the summed gradient of x
    dx_producer: Node | None = None


class _Matcher:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.users = graph.consumers()
        self.producers = graph.producers()
        self.outputs = set(graph.outputs.values())

    def only_user(self, v: Value, op: str) -> Node | None:
        """v's single reader when it is an `op` node and v is no graph output."""
        readers = self.users.get(v, [])
        if len(readers) != 1 or readers[0].op != op or v in self.outputs:
            return None
        return readers[0]

    def split_source(self, v: Value, third: int):
        """X when v is the `third` head-first third of X (..., T, 3C), alone: sliced then
        permuted, or stacked (stacked_source)."""
        return self.sliced_source(v, third) or self.stacked_source(v, third)

    def stacked_source(self, v: Value, third: int):
        """X when v = reshape(slice(permute(reshape(X), STACKED), dim 0, third)), alone:
        X (B, T, 3C) viewed as (B, T, 3, H, D) and permuted to (3, B, H, T, D), whose three
        slices along dim 0 are read by nothing else."""
        view = self.producers.get(v)
        if view is None or view.op != "reshape":
            return None
        cut = self.producers.get(view.inputs[0])
        if cut is None or cut.op != "slice" or self.only_user(view.inputs[0], "reshape") \
                is not view or int(cut.attrs.get("step") or 1) != 1 or \
                int(cut.attrs["dim"]) % 5 != 0 or \
                (int(cut.attrs["start"]), int(cut.attrs["stop"])) != (third, third + 1):
            return None
        perm = self.producers.get(cut.inputs[0])
        if perm is None or perm.op != "permute" or tuple(perm.attrs["dims"]) != STACKED or \
                perm.outputs[0] in self.outputs or \
                [u.op for u in self.users.get(perm.outputs[0], [])] != ["slice"] * 3:
            return None
        split = self.producers.get(perm.inputs[0])
        if split is None or split.op != "reshape" or \
                self.only_user(perm.inputs[0], "permute") is not perm:
            return None
        x = split.inputs[0]
        if len(x.shape) != 3:
            return None
        b, t, c3 = x.shape
        _, heads, d = split.outputs[0].shape[2:]
        if split.outputs[0].shape != (b, t, 3, heads, d) or 3 * heads * d != c3 or \
                v.shape != (b, heads, t, d):
            return None
        return x

    def sliced_source(self, v: Value, third: int):
        """X when v = permute(reshape(slice(X, last axis, third))) heads-first, alone."""
        perm = self.producers.get(v)
        if not _swaps_heads(perm) or self.only_user(perm.inputs[0], "permute") is not perm:
            return None
        view = self.producers.get(perm.inputs[0])
        if view is None or view.op != "reshape" or self.only_user(view.inputs[0], "reshape") \
                is not view:
            return None
        cut = self.producers.get(view.inputs[0])
        if cut is None or cut.op != "slice" or int(cut.attrs.get("step") or 1) != 1:
            return None
        x = cut.inputs[0]
        c, rank = view.inputs[0].shape[-1], len(x.shape)
        if int(cut.attrs["dim"]) % rank != rank - 1 or x.shape[-1] != 3 * c or \
                (int(cut.attrs["start"]), int(cut.attrs["stop"])) != (third * c, third * c + c) \
                or view.outputs[0].shape != x.shape[:-1] + perm.outputs[0].shape[-3:-2] + \
                perm.outputs[0].shape[-1:]:
            return None
        return x

    def merge_target(self, out: Value, grad: Node | None = None) -> tuple[Value, Node] | None:
        """(y, its reshape) when out (..., H, T, D) -> permute -> reshape (..., T, H * D) = y;
        out's other reader may be its sdpa_grad `grad`."""
        perms = [u for u in self.users.get(out, []) if u is not grad]
        if len(perms) != 1 or not _swaps_heads(perms[0]):
            return None
        view = self.only_user(perms[0].outputs[0], "reshape")
        want = out.shape[:-3] + (out.shape[-2], out.shape[-3] * out.shape[-1])
        if view is None or view.outputs[0].shape != want:
            return None
        return view.outputs[0], view

    def merge_source(self, v: Value) -> Value | None:
        """G when v = permute(reshape(G)) splits (..., T, H * D) heads-first, alone."""
        perm = self.producers.get(v)
        if not _swaps_heads(perm) or self.only_user(v, "sdpa_grad") is None:
            return None
        view = self.producers.get(perm.inputs[0])
        if view is None or view.op != "reshape" or \
                self.only_user(perm.inputs[0], "permute") is not perm:
            return None
        g = view.inputs[0]
        return g if g.shape == v.shape[:-3] + (v.shape[-2], v.shape[-3] * v.shape[-1]) \
            else None

    def gradient_sum(self, grads: list[Value], x: Value) -> tuple[Value, Node] | None:
        """(dX, the node producing it) when dq, dk, dv each go into their third of x's
        gradient and the three are summed by `add` nodes reading nothing else: sliced
        (permute -> reshape -> slice_grad into x's third; the sum is dX) or stacked
        (reshape -> slice_grad into the (3, B, H, T, D) value; the sum permuted back and
        reshaped is dX)."""
        leaves = [self._sliced_leaf(v, third, x) for third, v in enumerate(grads)]
        stacked = None in leaves
        if stacked:
            leaves = [self._stacked_leaf(v, third) for third, v in enumerate(grads)]
            if None in leaves:
                return None
        covered = {v: 1 << i for i, v in enumerate(leaves)}
        for n in self.graph.nodes:
            if n.op == "add" and all(v in covered and self.only_user(v, "add") is n
                                     for v in n.inputs):
                covered[n.outputs[0]] = covered[n.inputs[0]] | covered[n.inputs[1]]
                if covered[n.outputs[0]] == 0b111:
                    return self._unstacked(n.outputs[0], x) if stacked else (n.outputs[0], n)
        return None

    def _sliced_leaf(self, v: Value, third: int, x: Value) -> Value | None:
        perm = self.only_user(v, "permute")
        view = self.only_user(perm.outputs[0], "reshape") if _swaps_heads(perm) else None
        back = self.only_user(view.outputs[0], "slice_grad") if view is not None else None
        if back is None or tuple(back.attrs["input_shape"]) != x.shape or \
                int(back.attrs["dim"]) % len(x.shape) != len(x.shape) - 1 or \
                int(back.attrs["start"]) != third * (x.shape[-1] // 3):
            return None
        return back.outputs[0]

    def _stacked_leaf(self, v: Value, third: int) -> Value | None:
        view = self.only_user(v, "reshape")
        back = self.only_user(view.outputs[0], "slice_grad") if view is not None else None
        if back is None or tuple(back.attrs["input_shape"]) != (3,) + v.shape or \
                int(back.attrs["dim"]) % 5 != 0 or int(back.attrs["start"]) != third:
            return None
        return back.outputs[0]

    def _unstacked(self, total: Value, x: Value) -> tuple[Value, Node] | None:
        """(dX, its reshape) when the summed (3, B, H, T, D) gradient is permuted back
        (UNSTACKED) and reshaped to x's shape, each read by nothing else."""
        perm = self.only_user(total, "permute")
        if perm is None or tuple(perm.attrs["dims"]) != UNSTACKED:
            return None
        view = self.only_user(perm.outputs[0], "reshape")
        if view is None or view.outputs[0].shape != x.shape:
            return None
        return view.outputs[0], view

    def site(self, n: Node) -> _Site | None:
        if n.attrs.get("mask"):         # the packed op takes no mask
            return None
        q, k, v = n.inputs[:3]
        if q.shape[:-2] != k.shape[:-2]:        # nor grouped heads
            return None
        x = self.split_source(q, 0)
        if x is None or self.split_source(k, 1) is not x or self.split_source(v, 2) is not x \
                or len({q, k, v}) != 3:
            return None
        out, lse = n.outputs
        grads = [u for u in self.users.get(out, []) if u.op == "sdpa_grad"]
        readers = self.users.get(out, [])
        if len(grads) > 1 or len(readers) != 1 + len(grads) or out in self.outputs:
            return None
        merged = self.merge_target(out, grads[0] if grads else None)
        if merged is None:
            return None
        site = _Site(n, x, merged[0], merged[1], q.shape[-3])
        if grads:
            g = grads[0]
            if g.inputs[1:6] != [q, k, v, out, lse] or g.inputs[6:] != n.inputs[3:] or \
                    g.attrs != n.attrs:
                return None
            dsrc = self.merge_source(g.inputs[0])
            total = self.gradient_sum(g.outputs, x)
            if dsrc is None or total is None:
                return None
            site.grad, site.g, (site.dx, site.dx_producer) = g, dsrc, total
        return site



def pack_attention_heads(graph: Graph) -> Graph:
    """sdpa (and sdpa_grad) between a packed projection's head split and the heads' merge
    =>   sdpa_qkv (and sdpa_qkv_grad) reading and writing the packed layouts directly."""
    graph = _copy(graph)
    matcher = _Matcher(graph)
    sites = [s for s in (matcher.site(n) for n in graph.nodes if n.op == "sdpa")
             if s is not None]
    if not sites:
        return graph
    replace: dict[Node, Node] = {}
    drop: set[Node] = set()
    for s in sites:
        step = s.sdpa.inputs[3:]
        lse = s.sdpa.outputs[1]
        replace[s.sdpa] = Node("sdpa_qkv", [s.x] + step, [s.y, lse],
                               dict(s.sdpa.attrs, heads=s.heads), (), s.sdpa.label)
        drop.add(s.y_producer)
        if s.grad is not None:
            replace[s.grad] = Node("sdpa_qkv_grad", [s.g, s.x, s.y, lse] + step, [s.dx],
                                   dict(s.grad.attrs, heads=s.heads), (), s.grad.label)
            drop.add(s.dx_producer)
    nodes = [replace.get(n, n) for n in graph.nodes if n not in drop]
    # The split and merge copies now read values nothing produces: they go before the
    # passes that follow.
    return _rebuild(graph, _live(nodes, graph.outputs.values()), {})
