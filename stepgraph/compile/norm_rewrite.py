"""Normalisations written out in a model file become one op each, on the traced forward after
autocast and before autodiff, so their backward is the fused op's own VJP.

rewrite_add_layer_norm: a pre-norm transformer block (nanoGPT, minGPT, ViT) runs
    x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))
so every residual sum s = a + b is read by the next block's LayerNorm and by the next residual
add. add(a, b) -> s; layer_norm(s, [w], [b]) -> y  becomes  add_layer_norm(a, b, [w], [b]) ->
(y, mean, rstd, s) (ops/layer_norm.py): one pass that reads a and b, writes s and y, and never
reads s back. On the backward side autodiff then hands the fused op's VJP both gradients, dy
(through the block) and ds (what the next residual add passes back unchanged), and it emits one
add_layer_norm_grad that adds ds to the LayerNorm's dx as it stores it: the `add` node that
joins the two paths at the residual is gone with it. Matched: an add of two values of one
shape and float dtype (no broadcasting) whose sum a layer_norm reads as its x (any other
readers of s keep reading it); the LayerNorm's weight and bias written before the add. The
residual dropout x + dropout(h) (nanoGPT's resid_dropout), the dropout's output read by the add
alone, is folded in too: add_layer_norm drops h itself (attrs dropout, seed, site: the dropout
op's Philox mask and rounding; the step counter its last input, the keep mask its last output),
and its VJP applies the mask to h's gradient (compile/norm_casts.py folds that into the norm
gradient's bf16 dx copy under bf16). Left alone: an add of another elementwise node's output as
wide as s that only the add reads, which compile/pointwise.py fuses into the add instead
(_pointwise_operand). STEPGRAPH_ADD_LAYER_NORM_REWRITE=0 turns it off.
    Under precision="bf16" (the pass runs after autocast) a float32 residual stream x (GPT's
embeddings, ViT's cat with the class token) meets the branch's bf16 GEMM output h through a
cast: add(x, cast(h -> float32)). When only the add reads the cast, add_layer_norm reads h
itself (b bf16, widened as loaded: exact, as the cast) and the cast goes; s, y and the
gradients are the bits of the unfused step, but for dx + ds, which the fused backward rounds
once where the unfused one rounded dx and then the sum (as in float32). Left alone: a bf16
residual stream (x itself the output of a GEMM: add(bf16, bf16) -> s, then cast(s -> float32)
for the LayerNorm), since the fused op would have to store s in bf16 yet normalise it with
float32 weights into a float32 y, which it does not do.
    An RMSNorm reading the sum (LLaMA-style blocks, after rewrite_rms_norm made it one op)
is fused alike: add(a, b) -> s; rms_norm(s, [w]) -> y  becomes  add_rms_norm(a, b, [w]) ->
(y, rstd, s), its backward add_rms_norm_grad.

rewrite_rms_norm: a hand-written RMSNorm (LLaMA's, and F.rms_norm over the last dim, which
composes the same ops)
    x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
becomes rms_norm(x, [weight]) -> (y, rstd) (ops/rms_norm.py). Matched, each intermediate read
only by the next step of the chain and no step output: the square of x (x.pow(2), x ** 2,
x * x, x.square()); its sum over the last axis, divided by C (mean; keepdim or unsqueezed back,
in either order); plus a positive constant eps; rsqrt, or 1 / sqrt, or x / sqrt(...); times x
itself; then, optionally, times a (C,) weight of x's dtype, on either side. Left alone: a mean
over another axis, no eps, a scale applied to x before the product (x * w * rsqrt(mean(x^2) +
eps) multiplies x * w, not x), and everything else. STEPGRAPH_RMS_NORM_REWRITE=0 turns it off.
    Under precision="bf16" a bf16 x's square stays bf16 (x * x, x.square(): on no autocast
list) and the float32 sum reads it through a cast, while the product reads x's float32 cast:
matched too, as rms_norm of that float32 cast (the square and its cast go). This one differs
from the unfused bf16 step: the op squares in float32 where the unfused step rounded each x^2
to bf16 before the sum, so its rstd is nearer float64's. (x.pow(2) is on autocast's float32
list: the whole chain reads x's float32 cast already.)

rewrite_layer_norm: a hand-written LayerNorm over the last axis (ConvNeXt's channels-first
LayerNorm, x.mean(1) of NCHW maps, is one once compile/layout.py stores them NHWC)
    u = x.mean(-1, keepdim=True); s = (x - u).pow(2).mean(-1, keepdim=True)
    x = (x - u) / torch.sqrt(s + eps); x = w * x + b
becomes layer_norm(x, [w], [b]) -> (y, mean, rstd) (ops/layer_norm.py): two kernels where the
chain ran about a dozen, and its backward the op's VJP. Matched, each intermediate read only
inside the chain and no step output: a last-axis sum divided by C (reshapes of the row
statistics anywhere between, as the layout pass leaves them); x - u once or once per use; its
square (pow 2, d * d, d ** 2) summed and divided by C; plus a positive eps; sqrt then a
division, or rsqrt then a product on either side; then optionally times a (C,) weight and
plus a (C,) bias (through views of them, w[:, None, None]). Left alone: an unbiased variance,
no eps, a mean read by anything else. The op's float32 two-pass statistics and its
rstd product round differently from the chain: results within the tolerance policy, not the
same bits. STEPGRAPH_LAYER_NORM_REWRITE=0 turns it off.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..ir.graph import FLOAT_DTYPES, HALF_DTYPES, Graph, Node, Value
from ..ir.ops import infer_outputs
from .pointwise import _eligible
from .rewrite import _join

ADD_LAYER_NORM_SWITCH = "STEPGRAPH_ADD_LAYER_NORM_REWRITE"
RMS_NORM_SWITCH = "STEPGRAPH_RMS_NORM_REWRITE"
LAYER_NORM_SWITCH = "STEPGRAPH_LAYER_NORM_REWRITE"


def enabled(switch: str) -> bool:
    """Whether the pass of environment variable `switch` runs (read when a step is compiled;
    "0" turns it off, to compare a step with and without it)."""
    return os.environ.get(switch, "1") != "0"


def _is_add(node: Node | None) -> bool:
    return node is not None and len(node.inputs) == 2 and (
        node.op == "add" or (node.op == "binary" and node.attrs.get("kind") == "add"))


def _replaced(graph: Graph, replace: dict[Node, Node], drop: set[Node]) -> Graph:
    nodes = [replace.get(n, n) for n in graph.nodes if n not in drop]
    return Graph(nodes, graph.inputs, graph.params, graph.state, dict(graph.outputs))


def _widening_cast(v: Value, add: Node, producers, users) -> Node | None:
    """The cast of a bfloat16 / float16 value to float32 that wrote `v`, when only `add`
    reads v: under precision="bf16" the residual branch's last GEMM writes bf16 and autocast
    widens it for the float32 residual add (torch's type promotion). add_layer_norm reads
    the half value itself and widens it as it loads it (exact), so the cast goes too."""
    p = producers.get(v)
    if p is None or p.op != "cast" or users.get(v) != [add] or v.dtype != "float32" or \
            p.inputs[0].dtype not in HALF_DTYPES:
        return None
    return p


def _dropout_of(v: Value, reader: Node, producers, users) -> Node | None:
    """The elementwise dropout that wrote `v`, when only `reader` reads v and nothing its
    keep mask (the forward graph: the backward's dropout_grad comes later, of the fused op's
    VJP)."""
    p = producers.get(v)
    if p is None or p.op != "dropout" or p.attrs.get("per_channel") or \
            users.get(v) != [reader] or users.get(p.outputs[1]):
        return None
    return p


def _branch(add: Node, producers, users) -> tuple[Value, Value, Node | None, Node | None]:
    """(a, b, cast, dropout): the add's operands with b the residual branch's value that
    add_<norm> reads, and the nodes it folds in on b's way: the widening cast (a half b,
    _widening_cast) and the dropout before it (x + dropout(proj(h)): nanoGPT's resid_dropout),
    None where there is none. a + b == b + a bit for bit, so either operand may be b."""
    for a, b in (add.inputs, add.inputs[::-1]):
        cast = _widening_cast(b, add, producers, users)
        v = cast.inputs[0] if cast is not None else b
        dropout = _dropout_of(v, cast or add, producers, users)
        if cast is not None or dropout is not None:
            return a, dropout.inputs[0] if dropout is not None else v, cast, dropout
    return add.inputs[0], add.inputs[1], None, None


def _pointwise_operand(add: Node, producers, users) -> bool:
    """Whether an operand of `add` comes from an elementwise node other than a dropout (which
    add_<norm> folds in, _branch) that only the add reads, as wide as the sum.
    compile/pointwise.py then makes one kernel of the two, and fusing the add into the
    LayerNorm instead would leave the elementwise node its own pass: it would write, and
    add_layer_norm read back, a value as large as the s the LayerNorm reads back now. A half
    operand behind a widening cast is fused all the same (add_layer_norm reads the half value
    the elementwise node writes, where the LayerNorm read the float32 s back)."""
    for v in add.inputs:
        if _widening_cast(v, add, producers, users) is not None:
            continue
        p = producers.get(v)
        if p is not None and users.get(v) == [add] and _eligible(p) and \
                _dropout_of(v, add, producers, users) is None and \
                not _linear_activation(p, producers):
            return True
    return False


def _linear_activation(node: Node, producers) -> bool:
    """An act on a linear's output (through its view): compile/fuse.py fuse_linear_activation
    takes it into the GEMM's epilogue, so it is no elementwise pass of its own."""
    if node.op != "act":
        return False
    p = producers.get(node.inputs[0])
    if p is not None and p.op == "reshape":
        p = producers.get(p.inputs[0])
    return p is not None and p.op == "linear"


RESIDUAL_NORMS = ("layer_norm", "rms_norm")     # the norms a residual add fuses into (add_<norm>)


def rewrite_add_layer_norm(graph: Graph) -> Graph:
    """`graph` with each add whose sum a layer_norm (rms_norm) reads as add_layer_norm
    (add_rms_norm) (module docstring); the graph given is not changed."""
    if not enabled(ADD_LAYER_NORM_SWITCH):
        return graph
    producers, users = graph.producers(), graph.consumers()
    position = {n: i for i, n in enumerate(graph.nodes)}
    replace: dict[Node, Node] = {}
    drop: set[Node] = set()
    for ln in graph.nodes:
        if ln.op not in RESIDUAL_NORMS:
            continue
        s = ln.inputs[0]
        add = producers.get(s)
        if not _is_add(add) or add in replace or s.dtype not in FLOAT_DTYPES or \
                any(v.shape != s.shape or v.dtype != s.dtype for v in add.inputs) or \
                s in ln.inputs[1:] or _pointwise_operand(add, producers, users):
            continue
        # The fused node runs where the add ran: the LayerNorm's parameters must exist there.
        if any(v in producers and position[producers[v]] > position[add]
               for v in ln.inputs[1:]):
            continue
        a, b, cast, dropout = _branch(add, producers, users)
        ins, outs, op = [a, b, *ln.inputs[1:]], [*ln.outputs, s], f"add_{ln.op}"
        attrs = dict(ln.attrs)
        if dropout is not None:
            ins.append(dropout.inputs[1])
            outs.append(dropout.outputs[1])
            attrs.update(dropout=dropout.attrs["p"], seed=dropout.attrs["seed"],
                         site=dropout.attrs["site"])
        drop.update(n for n in (cast, dropout) if n is not None)
        specs = infer_outputs(op, ins, attrs)
        if specs != [(v.shape, v.dtype) for v in outs]:
            raise AssertionError(f"{op} rewrite: the op gives {specs}, the graph "
                                 f"{[(v.shape, v.dtype) for v in outs]}")
        replace[add] = Node(op, ins, outs, attrs, (), _join(add.label, ln.label))
        drop.add(ln)
    return _replaced(graph, replace, drop) if replace else graph


@dataclass
class _Rms:
    """One matched RMSNorm chain: x, eps, the (C,) weight or None, the chain's nodes (the last
    writes y)."""
    x: Value
    eps: float
    weight: Value | None
    nodes: list[Node]


class _RmsMatcher:
    def __init__(self, graph: Graph, kept: set[Value]):
        self.producers, self.users = graph.producers(), graph.consumers()
        self.kept = set(graph.outputs.values()) | kept

    def reader_of(self, v: Value) -> Node | None:
        """The only reader of v, when v is no step output."""
        readers = self.users.get(v, [])
        if v in self.kept or len(readers) != 1:
            return None
        return readers[0]

    def next(self, node: Node) -> Node | None:
        """The only reader of node's (only) output, when that output is no step output."""
        return self.reader_of(node.outputs[0]) if len(node.outputs) == 1 else None

    def square_of(self, node: Node | None) -> Value | None:
        """x when node computes x^2: scalar pow 2, or x * x."""
        if node is None:
            return None
        if node.op == "scalar" and node.attrs.get("kind") == "pow" and \
                float(node.attrs["value"]) == 2.0:
            return node.inputs[0]
        if node.op == "binary" and node.attrs.get("kind") == "mul" and \
                node.inputs[0] is node.inputs[1]:
            return node.inputs[0]
        return None

    def mean(self, total: Node, x: Value, nodes: list[Node]) -> Node | None:
        """From the last-axis reduce_sum `total`: the division by C and the reshape to
        (..., 1) in either order; the node after them (appended to nodes), else None."""
        c, keep = x.shape[-1], x.shape[:-1] + (1,)
        divided = reshaped = False
        n = self.next(total)
        while n is not None and not (divided and reshaped):
            kind, value = n.attrs.get("kind"), n.attrs.get("value")
            if n.op == "scalar" and not divided and (
                    (kind == "div" and float(value) == c) or
                    (kind == "mul" and float(value) == 1.0 / c)):
                divided = True
            elif n.op == "reshape" and not reshaped and n.outputs[0].shape == keep:
                reshaped = True
            else:
                return None
            nodes.append(n)
            n = self.next(n)
        return n

    def product(self, n: Node | None, x: Value, nodes: list[Node]) -> Node | None:
        """From the node reading mean + eps: rsqrt then x * it, sqrt then 1 / it then x * it,
        or sqrt then x / it; the product node (appended to nodes), else None."""
        if n is None or n.op != "unary":
            return None
        nodes.append(n)
        kind = n.attrs.get("kind")
        if kind == "sqrt":
            m = self.next(n)
            if m is not None and m.op == "binary" and m.attrs.get("kind") == "div" and \
                    m.inputs[0] is x and m.inputs[1] is n.outputs[0]:
                nodes.append(m)
                return m
            if m is None or m.op != "scalar" or m.attrs.get("kind") != "rdiv" or \
                    float(m.attrs["value"]) != 1.0:
                return None
            nodes.append(m)
            n = m
        elif kind != "rsqrt":
            return None
        m = self.next(n)
        if m is None or m.op != "binary" or m.attrs.get("kind") != "mul" or \
                {id(v) for v in m.inputs} != {id(x), id(n.outputs[0])}:
            return None
        nodes.append(m)
        return m

    def weight(self, prod: Node, x: Value) -> tuple[Value | None, Node | None]:
        """The (C,) weight the normalised value is multiplied by next, and that node."""
        m = self.next(prod)
        if m is None or m.op != "binary" or m.attrs.get("kind") != "mul":
            return None, None
        y = prod.outputs[0]
        w = m.inputs[1] if m.inputs[0] is y else m.inputs[0]
        if w is y or w.shape != (x.shape[-1],) or w.dtype != x.dtype or \
                m.outputs[0].shape != x.shape:
            return None, None
        return w, m

    def widened(self, total: Node) -> tuple[Node | None, Node | None]:
        """(the square, the cast to float32 between it and `total`, or None): under autocast
        a bf16 x * x stays bf16 and the float32 reduce_sum reads it through a cast."""
        square = self.producers.get(total.inputs[0])
        if square is None or square.op != "cast" or square.attrs["dtype"] != "float32" or \
                square.inputs[0].dtype not in HALF_DTYPES or self.next(square) is not total:
            return square, None
        return self.producers.get(square.inputs[0]), square

    def float32_of(self, x: Value) -> Value | None:
        """The one float32 cast of half x (autocast's, which every float32 reader shares)."""
        casts = [u.outputs[0] for u in self.users.get(x, [])
                 if u.op == "cast" and u.attrs["dtype"] == "float32"]
        return casts[0] if len(casts) == 1 else None

    def chain(self, total: Node) -> _Rms | None:
        """The RMSNorm around reduce_sum node `total`, or None (module docstring)."""
        square, widen = self.widened(total)
        x = self.square_of(square)
        if x is None or x.dtype not in FLOAT_DTYPES or not x.shape or \
                tuple(total.attrs["axes"]) != (len(x.shape) - 1,) or \
                self.next(square) is not (widen or total):
            return None
        nodes = [square, total] if widen is None else [square, widen, total]
        if widen is not None:         # the chain goes on from x's float32 cast
            x = self.float32_of(x)
            if x is None:
                return None
        plus = self.mean(total, x, nodes)
        if plus is None or plus.op != "scalar" or plus.attrs.get("kind") != "add" or \
                not float(plus.attrs["value"]) > 0.0:
            return None
        nodes.append(plus)
        prod = self.product(self.next(plus), x, nodes)
        if prod is None or prod.outputs[0].shape != x.shape:
            return None
        w, scale = self.weight(prod, x)
        if scale is not None:
            nodes.append(scale)
        if any(v.dtype != x.dtype for n in nodes[1 if widen else 0:] for v in n.outputs):
            return None
        return _Rms(x, float(plus.attrs["value"]), w, nodes)


def rewrite_rms_norm(graph: Graph, kept: tuple[Value, ...] = ()) -> Graph:
    """`graph` with each hand-written RMSNorm over the last axis as one rms_norm node (module
    docstring); kept: values the caller still reads beyond graph.outputs (the loss). The
    graph given is not changed."""
    def operands(found: _Rms) -> tuple[list[Value], dict]:
        ins = [found.x] + ([found.weight] if found.weight is not None else [])
        return ins, {"eps": found.eps, "weight": found.weight is not None}
    return _rewrite_chains(graph, kept, RMS_NORM_SWITCH, _RmsMatcher, "rms_norm", operands)


def _rewrite_chains(graph: Graph, kept: tuple[Value, ...], switch: str, matcher_type,
                    op: str, operands) -> Graph:
    """`graph` with each chain a `matcher_type` finds from a reduce_sum node as one `op` node
    (operands(found): its inputs and attrs) that writes the chain's last value and its own
    statistics; the rest of the chain goes. The graph given is not changed."""
    if not enabled(switch) or not any(n.op == "reduce_sum" for n in graph.nodes):
        return graph
    matcher = matcher_type(graph, set(kept))
    replace: dict[Node, Node] = {}
    drop: set[Node] = set()
    for total in graph.nodes:
        if total.op != "reduce_sum":
            continue
        found = matcher.chain(total)
        if found is None or drop & set(found.nodes):
            continue
        last = found.nodes[-1]
        ins, attrs = operands(found)
        _, *stats = infer_outputs(op, ins, attrs)
        replace[last] = Node(op, ins, [last.outputs[0], *(Value(*spec) for spec in stats)],
                             attrs, (), _join(*(n.label for n in found.nodes)))
        drop.update(found.nodes[:-1])
    return _replaced(graph, replace, drop) if replace else graph


@dataclass
class _Ln:
    """One matched LayerNorm chain: x, eps, the (C,) weight and bias or None, the chain's
    nodes (the last writes y)."""
    x: Value
    eps: float
    weight: Value | None
    bias: Value | None
    nodes: list[Node]


class _LnMatcher(_RmsMatcher):
    def rows_of(self, x: Value) -> tuple[int, ...]:
        return x.shape[:-1] + (1,)

    def walk(self, v: Value, c: int, nodes: list[Node], divide: bool) -> Value:
        """From a row statistic v: through reshapes of it (views: one value per row) and,
        with divide, its one division by C (a mean), each read only by the next; the value
        reached (the division missing: v itself, which no rows_of shape check lets pass)."""
        divided = not divide
        while True:
            n = self.reader_of(v)
            if n is None:
                break
            kind, value = n.attrs.get("kind"), n.attrs.get("value")
            if n.op == "reshape" and math.prod(n.outputs[0].shape) == math.prod(v.shape):
                pass
            elif n.op == "scalar" and not divided and (
                    (kind == "div" and float(value) == c) or
                    (kind == "mul" and float(value) == 1.0 / c)):
                divided = True
            else:
                break
            nodes.append(n)
            v = n.outputs[0]
        return v if divided else None

    def vector_of(self, v: Value, c: int) -> Value | None:
        """The (C,) value whose reshapes (views) gave v, a (1, ..., 1, C) or (C,) operand."""
        if v.shape[-1:] != (c,) or math.prod(v.shape) != c:
            return None
        while v.shape != (c,):
            p = self.producers.get(v)
            if p is None or p.op != "reshape":
                return None
            v = p.inputs[0]
        return v

    def affine(self, y: Node, x: Value, kind: str) -> tuple[Value | None, Node | None]:
        """The (C,) operand and the node when y's only reader is a `kind` (mul, add) by one."""
        n = self.reader_of(y.outputs[0])
        if n is None or n.op != "binary" or n.attrs.get("kind") != kind or \
                n.outputs[0].shape != x.shape:
            return None, None
        other = n.inputs[1] if n.inputs[0] is y.outputs[0] else n.inputs[0]
        vec = self.vector_of(other, x.shape[-1])
        if other is y.outputs[0] or vec is None or vec.dtype != x.dtype:
            return None, None
        return vec, n

    def chain(self, total: Node) -> _Ln | None:
        """The LayerNorm whose mean is reduce_sum node `total`, or None (module docstring)."""
        x = total.inputs[0]
        if x.dtype not in FLOAT_DTYPES or len(x.shape) < 1 or \
                tuple(total.attrs["axes"]) != (len(x.shape) - 1,):
            return None
        c, rows = x.shape[-1], self.rows_of(x)
        nodes = [total]
        mean = self.walk(total.outputs[0], c, nodes, divide=True)
        if mean is None or mean.shape != rows or mean in self.kept:
            return None
        subs = self.users.get(mean, [])
        if not subs or any(n.op != "binary" or n.attrs.get("kind") != "sub" or
                           n.inputs[0] is not x or n.inputs[1] is not mean or
                           n.outputs[0] in self.kept for n in subs):
            return None
        nodes += subs
        centred = {n.outputs[0] for n in subs}
        readers = list(dict.fromkeys(r for v in centred for r in self.users.get(v, [])))
        square = next((r for r in readers if self.square_of(r) in centred), None)
        if square is None or len(readers) != 2:
            return None
        scale = next(r for r in readers if r is not square)
        variance = self.next(square)
        if variance is None or variance.op != "reduce_sum" or \
                tuple(variance.attrs["axes"]) != (len(x.shape) - 1,):
            return None
        nodes += [square, variance]
        var = self.walk(variance.outputs[0], c, nodes, divide=True)
        plus = self.reader_of(var) if var is not None else None
        if plus is None or plus.op != "scalar" or plus.attrs.get("kind") != "add" or \
                not float(plus.attrs["value"]) > 0.0:
            return None
        nodes.append(plus)
        root = self.walk(plus.outputs[0], c, nodes, divide=False)
        unary = self.reader_of(root)
        if unary is None or unary.op != "unary" or unary.attrs.get("kind") not in \
                ("sqrt", "rsqrt"):
            return None
        nodes.append(unary)
        r = self.walk(unary.outputs[0], c, nodes, divide=False)
        # (x - mean) / sqrt(var + eps), or (x - mean) * rsqrt(var + eps) on either side
        if r.shape != rows or self.reader_of(r) is not scale or scale.op != "binary" or \
                scale.outputs[0].shape != x.shape:
            return None
        if unary.attrs["kind"] == "sqrt":
            if scale.attrs.get("kind") != "div" or scale.inputs[1] is not r:
                return None
        elif scale.attrs.get("kind") != "mul" or r not in scale.inputs:
            return None
        nodes.append(scale)
        weight, mul = self.affine(scale, x, "mul")
        if mul is not None:
            nodes.append(mul)
        bias, add = self.affine(nodes[-1], x, "add")
        if add is not None:
            nodes.append(add)
        if any(v.dtype != x.dtype for n in nodes for v in n.outputs):
            return None
        return _Ln(x, float(plus.attrs["value"]), weight, bias, nodes)


def rewrite_layer_norm(graph: Graph, kept: tuple[Value, ...] = ()) -> Graph:
    """`graph` with each hand-written LayerNorm over the last axis as one layer_norm node
    (module docstring); kept: values the caller still reads beyond graph.outputs. The graph
    given is not changed."""
    def operands(found: _Ln) -> tuple[list[Value], dict]:
        ins = [found.x] + [v for v in (found.weight, found.bias) if v is not None]
        return ins, {"eps": found.eps, "weight": found.weight is not None,
                     "bias": found.bias is not None}
    return _rewrite_chains(graph, kept, LAYER_NORM_SWITCH, _LnMatcher, "layer_norm", operands)


def rewrite_norms(graph: Graph, kept: tuple[Value, ...] = ()) -> Graph:
    """The three rewrites: hand-written LayerNorms and RMSNorms first, then residual adds
    into their LayerNorm or RMSNorm."""
    return rewrite_add_layer_norm(rewrite_rms_norm(rewrite_layer_norm(graph, kept), kept))
