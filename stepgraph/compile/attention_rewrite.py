"""Attention written by hand becomes the fused `sdpa` op, on the traced forward before autodiff.

minGPT, nanoGPT's slow path and most research code write attention out:
    att = (q @ k.transpose(-2, -1)) * scale          (or / math.sqrt(d), or q * scale first)
    att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))   (or + mask, optional)
    att = F.softmax(att, dim=-1)
    att = self.attn_dropout(att)                      (optional)
    y = att @ v
which traces as bmm, scalar, compare/masked_fill, softmax, dropout, bmm (and the reshapes of
Tensor @ on 4-D operands), each a kernel with the (..., L, S) scores in memory, forward and
backward. `rewrite_attention` replaces that chain by one `sdpa(q, k, v)` node; it runs before
autodiff, so the backward is sdpa's own VJP (`sdpa_grad`), and before compile/attention.py
packs the heads of the result.

What it matches, each intermediate (scores, probabilities) read by nothing else:
- bmm(q, k^T) over q (..., L, E), k (..., S, E): k^T a transpose of k's last two axes (or the
  bmm's trans_b); head dims up to MAX_HEAD_DIM;
- scales: `scalar` mul / div by a nonzero constant, on the scores or on q or k before the
  product (folded into sdpa's scale), all before any mask; and a tensor factor of the scores
  constant along queries and keys (shape (..., 1, 1): a learned per-head temperature, as
  Swin v2's logit scale or a `nn.Parameter(torch.full((heads, 1, 1), s))`), which multiplies
  q instead (q * f @ k^T is the scores times f), so its gradient still flows;
- masks, in any number and order: masked_fill(scores, bool mask, value) with value -inf or at
  most BLOCKING (a finite "large negative"), and scores + float mask (a mask no parameter
  feeds: sdpa gives a mask no gradient). A mask whose values the compiler knows (constants,
  factories like torch.tril(torch.ones(T, T)), and module buffers the step never writes, read
  at compile time, through slices and comparisons: minGPT's `self.bias[:, :, :T, :T] == 0`)
  that blocks exactly sdpa's causal pattern (key j > query i + (S - L): tril when L == S) for
  every batch entry becomes causal=True; any other mask becomes sdpa's additive mask input,
  where the backend's sdpa takes one (the NumPy reference and the CUDA kernels both do);
- softmax over the last axis (the `softmax` op without its own scale or causal attrs);
- dropout on the probabilities: sdpa keeps its p, seed and site, and draws the dropout op's
  very mask (ops/attention.py: same Philox rule at the same flat index), so with p > 0 the
  rewritten step drops the same elements as the composed one;
- bmm(probabilities, v) with v (..., S, Ev);
- grouped heads: k and v both repeat_interleave'd along the head axis (-3) by one factor
  (unsqueeze, expand, merge: what Tensor.repeat_interleave and Hugging Face's repeat_kv
  trace as), the copies read by the chain alone, become sdpa's grouped k and v (query head h
  reads kv head h // group: no repeated copies, dk and dv summed in the kernels).

What it leaves: a score or probability read by anything else (or a step output), softmax over
another axis, a tensor scale that varies along the queries or keys, a scale after a
mask, masked_fill with a value above BLOCKING or a where(), a finite fill over a mask whose
rows the compiler cannot prove are never wholly blocked (the composed op then gives a
uniform row, sdpa's additive mask a NaN one), a known mask blocking a whole row, a mask fed by
a parameter, a mask that is not causal where the backend takes no mask, a causal mask with
L > S, and head dims above MAX_HEAD_DIM: those run as written.

A row that a mask known only at run time blocks wholly (-inf at every key) gives NaN through
the written softmax and 0 through sdpa (with no gradient), as torch's
F.scaled_dot_product_attention gives: the one place the rewritten step differs, and only
where the written one is NaN.

A module buffer folded into the step (the causal case, or a constant mask) is read when the
step is compiled (compile/build.py ModuleValues); a compiled step whose folded buffer was
later given other values (load_state_dict, `.data =`) refuses to run, naming it.
STEPGRAPH_ATTENTION_REWRITE=0 turns the pass off (read when a step is compiled), to compare.

Dropout: the CUDA kernels and the NumPy reference draw the dropout op's mask bit for bit;
cuDNN's bf16 attention draws its own (same distribution and 1 / (1 - p) scaling, other bits).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..ir.graph import PARAM, STATE, Graph, Node, Value, storage_dtype
from ..ir.ops import IMPLS, OPS, infer_outputs
from ..ir.trace import Constant
from ..ops.attention import MAX_HEAD_DIM
from ..ops.softmax import causal_mask
from .rewrite import splice

SWITCH_ENV = "STEPGRAPH_ATTENTION_REWRITE"
# masked_fill values at or below this block an entry as -inf does: exp(v - row max) is 0 in
# float32 and float64 for any row max above v + 750, i.e. any score of a row that is not
# wholly blocked, unless scores reach 1e9 in magnitude.
BLOCKING = -1e9
# Devices whose sdpa takes an additive mask input (the NumPy reference, the CUDA kernels).
MASKED_SDPA_DEVICES = frozenset({"cpu", "cuda"})
# Ops the compiler evaluates to know a mask's values: deterministic, of their inputs only.
FOLDABLE_OPS = frozenset({
    "constant", "fill", "arange", "triangle", "slice", "reshape", "permute", "expand",
    "compare", "compare_scalar", "logical", "logical_not", "cast", "where", "masked_fill",
    "binary", "scalar", "unary", "stop_gradient", "concat"})
FOLD_LIMIT = 1 << 24          # elements of a mask the compiler evaluates at most


def enabled() -> bool:
    """Whether the rewrite runs: STEPGRAPH_ATTENTION_REWRITE=0 in the environment turns it off
    (to compare a step with and without it)."""
    return os.environ.get(SWITCH_ENV, "1") != "0"


def masks_supported(device: str | None) -> bool:
    """Whether a step on `device` may get an sdpa with an additive mask input."""
    return device in MASKED_SDPA_DEVICES


@dataclass
class _Mask:
    """One mask op of the chain: masked_fill (`fill`: bool mask, value) or an add (float mask)."""
    node: Node
    operand: Value
    fill: float | None = None       # masked_fill's value; None for an add


@dataclass
class _Chain:
    q: Value
    k: Value
    v: Value
    out: Value                       # the (..., L, Ev) value sdpa's first output becomes
    scale: float
    masks: list[_Mask]
    dropout: Node | None
    nodes: list[Node] = field(default_factory=list)    # the nodes sdpa replaces
    factors: list[Value] = field(default_factory=list)   # tensor scales, (..., 1, 1)


def _per_score_matrix(shape: tuple, rank: int) -> bool:
    """Whether a factor of this shape is constant along the scores' last two axes (queries
    and keys): its last two dims are 1 (or it has no more dims than ones)."""
    return len(shape) <= rank and all(n == 1 for n in shape[-2:])


def _positive_swap(n: Node | None) -> bool:
    """A permute exchanging the last two axes only."""
    if n is None or n.op != "permute":
        return False
    dims = tuple(n.attrs["dims"])
    rank = len(dims)
    return rank >= 2 and dims == tuple(range(rank - 2)) + (rank - 1, rank - 2)


def _scale_of(n: Node | None) -> float | None:
    """The factor of a scalar mul / div by a finite nonzero constant, else None."""
    if n is None or n.op != "scalar" or n.attrs.get("kind") not in ("mul", "div"):
        return None
    value = float(n.attrs["value"])
    if value == 0.0 or not math.isfinite(value):
        return None
    return value if n.attrs["kind"] == "mul" else 1.0 / value


class _Matcher:
    """Finds the chains of one graph (module docstring); reads, never writes, the graph."""

    def __init__(self, graph: Graph, kept: set[Value]):
        self.graph = graph
        self.users = graph.consumers()
        self.producers = graph.producers()
        self.kept = set(graph.outputs.values()) | kept

    def single(self, v: Value, reader: Node) -> bool:
        """v is read by `reader` alone (once) and is no step output."""
        return v not in self.kept and self.users.get(v, []) == [reader]

    def lone_producer(self, v: Value, reader: Node, op: str) -> Node | None:
        """v's producer when it is an `op` node whose outputs only `reader` reads."""
        n = self.producers.get(v)
        if n is None or n.op != op or not self.single(v, reader):
            return None
        return n

    def unflatten(self, v: Value, reader: Node, lead: tuple) -> tuple[Value, list[Node]]:
        """The (lead..., rows, cols) value a (N, rows, cols) bmm operand was reshaped from
        (Tensor @ on 4-D operands), or v itself when it is that already."""
        n = self.lone_producer(v, reader, "reshape")
        if n is not None and n.inputs[0].shape == lead + v.shape[1:]:
            return n.inputs[0], [n]
        return v, []

    def folded_scale(self, v: Value, reader: Node) -> tuple[Value, float, list[Node]]:
        """Strip scalar mul / div nodes read only along the chain: (source, factor, nodes)."""
        scale, nodes = 1.0, []
        while True:
            n = self.producers.get(v)
            factor = _scale_of(n)
            if factor is None or not self.single(v, reader):
                return v, scale, nodes
            scale, nodes, reader, v = scale * factor, nodes + [n], n, n.inputs[0]

    def scores_source(self, x: Value, reader: Node, lead: tuple, chain: _Chain) -> Node | None:
        """Walk back from the softmax's input through masks and scales to the bmm of q and
        k^T; fills chain.masks (program order), chain.scale and chain.nodes."""
        scaled = False             # a scale seen: what comes before it may not be a mask
        while True:
            n = self.producers.get(x)
            if n is None or not self.single(x, reader):
                return None
            if n.op == "masked_fill" and n.inputs[0].shape == n.outputs[0].shape and \
                    not scaled:
                chain.masks.insert(0, _Mask(n, n.inputs[1], float(n.attrs["value"])))
                nxt = n.inputs[0]
            elif n.op == "binary" and n.attrs.get("kind") == "add" and not scaled:
                a, b = n.inputs
                nxt, m = (a, b) if self.reaches_bmm(a) else (b, a)
                if nxt.shape != n.outputs[0].shape or m.dtype != x.dtype:
                    return None
                chain.masks.insert(0, _Mask(n, m))
            elif _scale_of(n) is not None:
                chain.scale *= _scale_of(n)
                scaled, nxt = True, n.inputs[0]
            elif n.op == "binary" and n.attrs.get("kind") == "mul":
                a, b = n.inputs
                nxt, f = (a, b) if self.reaches_bmm(a) else (b, a)
                if nxt.shape != n.outputs[0].shape or f.dtype != x.dtype or \
                        not _per_score_matrix(f.shape, len(x.shape)):
                    return None
                chain.factors.append(f)
                scaled = True
            elif n.op == "reshape" and n.inputs[0].shape == (math.prod(lead),) + x.shape[-2:]:
                nxt = n.inputs[0]
            elif n.op == "bmm" and not n.attrs.get("trans_a"):
                chain.nodes.append(n)
                return n
            else:
                return None
            chain.nodes.append(n)
            reader, x = n, nxt

    def repeated_heads(self, x: Value, chain: _Chain) -> tuple[Value, int, list[Node]] | None:
        """(source (..., Hkv, S, E), group, nodes) where x (..., Hkv * group, S, E) is the
        source repeat_interleave'd along the head axis: reshape of an expand of source
        reshaped to (..., Hkv, 1, S, E), each copy read once, x by the chain alone."""
        readers = self.users.get(x, [])
        if len(x.shape) < 3 or x in self.kept or len(readers) != 1 or \
                readers[0] not in chain.nodes:
            return None
        merge = self.producers.get(x)
        if merge is None or merge.op != "reshape":
            return None
        spread = self.lone_producer(merge.inputs[0], merge, "expand")
        if spread is None:
            return None
        one = self.lone_producer(spread.inputs[0], spread, "reshape")
        lead, (heads, group) = x.shape[:-3], spread.outputs[0].shape[-4:-2]
        if one is None or spread.outputs[0].shape != lead + (heads, group) + x.shape[-2:] \
                or one.outputs[0].shape != lead + (heads, 1) + x.shape[-2:] \
                or one.inputs[0].shape != lead + (heads,) + x.shape[-2:] or group < 2:
            return None
        return one.inputs[0], group, [merge, spread, one]

    def reaches_bmm(self, x: Value) -> bool:
        """Whether x is the scores side of an add: a bmm through scales, masks and reshapes."""
        for _ in range(16):
            n = self.producers.get(x)
            if n is None:
                return False
            if n.op == "bmm":
                return True
            if n.op not in ("scalar", "masked_fill", "binary", "reshape"):
                return False
            x = n.inputs[0]
        return False

    def operands(self, mm: Node, lead: tuple, chain: _Chain) -> tuple[Value, Value] | None:
        """q and k of bmm(q, k^T), with the scales before the product folded into chain."""
        a, b = mm.inputs
        q, nodes = self.unflatten(a, mm, lead)
        q, sq, scaled = self.folded_scale(q, nodes[-1] if nodes else mm)
        chain.nodes += nodes + scaled
        kt, nodes = self.unflatten(b, mm, lead)
        kt, sk, scaled_t = self.folded_scale(kt, nodes[-1] if nodes else mm)
        chain.nodes += nodes + scaled_t
        sk_before = 1.0
        if not mm.attrs.get("trans_b"):
            reader = scaled_t[-1] if scaled_t else (nodes[-1] if nodes else mm)
            swap = self.lone_producer(kt, reader, "permute")
            if not _positive_swap(swap):
                return None
            kt, sk_before, scaled_k = self.folded_scale(swap.inputs[0], swap)
            chain.nodes += [swap] + scaled_k
        chain.scale *= sq * sk * sk_before
        return q, kt

    def chain(self, sm: Node) -> _Chain | None:
        """The attention around softmax node `sm`, or None."""
        if float(sm.attrs.get("scale", 1.0)) != 1.0 or sm.attrs.get("causal"):
            return None
        x = sm.inputs[0]
        if len(x.shape) < 3:
            return None
        lead, (length, keys) = x.shape[:-2], x.shape[-2:]
        tail = self.tail(sm.outputs[0], sm, lead)
        if tail is None:
            return None
        v, out, dropout, tail_nodes = tail
        chain = _Chain(x, x, v, out, 1.0, [], dropout, [sm] + tail_nodes)
        mm = self.scores_source(x, sm, lead, chain)
        if mm is None:
            return None
        qk = self.operands(mm, lead, chain)
        if qk is None:
            return None
        chain.q, chain.k = qk
        q, k = qk
        fits = q.shape == lead + (length, q.shape[-1]) and k.shape == lead + (keys, q.shape[-1]) \
            and max(q.shape[-1], v.shape[-1]) <= MAX_HEAD_DIM and q.dtype == k.dtype == v.dtype
        return chain if fits else None

    def tail(self, p: Value, reader: Node, lead: tuple):
        """(v, out, dropout node, nodes) of probabilities p -> [dropout] -> bmm(p, v)."""
        nodes, dropout = [], None
        readers = self.users.get(p, [])
        if p in self.kept or len(readers) != 1:
            return None
        n = readers[0]
        if n.op == "dropout" and not n.attrs.get("per_channel") and n.inputs[0] is p:
            if n.outputs[1] in self.kept or self.users.get(n.outputs[1]) or \
                    not 0.0 <= float(n.attrs["p"]) < 1.0:
                return None
            dropout, p = n, n.outputs[0]
            nodes.append(n)
            readers = self.users.get(p, [])
            if p in self.kept or len(readers) != 1:
                return None
            n = readers[0]
        if n.op == "reshape" and n.inputs[0] is p:
            nodes.append(n)
            p = n.outputs[0]
            readers = self.users.get(p, [])
            if p in self.kept or len(readers) != 1:
                return None
            n = readers[0]
        if n.op != "bmm" or n.inputs[0] is not p or n.inputs[1] is p or \
                n.attrs.get("trans_a") or n.attrs.get("trans_b"):
            return None
        nodes.append(n)
        v, flat = self.unflatten(n.inputs[1], n, lead)
        nodes += flat
        out = n.outputs[0]
        if len(lead) != 1:
            view = self.users.get(out, [])
            if out in self.kept or len(view) != 1 or view[0].op != "reshape" or \
                    view[0].outputs[0].shape != lead + out.shape[1:]:
                return None
            nodes.append(view[0])
            out = view[0].outputs[0]
        if v.shape[:-2] != lead:
            return None
        return v, out, dropout, nodes


class _Folder:
    """The values of masks the compiler knows: computed here by the ops' NumPy references
    from constants, factories and buffers the step never writes."""

    def __init__(self, graph: Graph, known: Callable[[Value], np.ndarray | None]):
        self.producers = graph.producers()
        self.written = {n.inputs[i] for n in graph.nodes for i in n.mutates}
        self.known = known
        self.values: dict[Value, np.ndarray | None] = {}
        self.read: set[Value] = set()        # the buffers a folded value read

    def value(self, v: Value) -> np.ndarray | None:
        if v not in self.values:
            self.values[v] = self._compute(v)
        return self.values[v]

    def _compute(self, v: Value) -> np.ndarray | None:
        if math.prod(v.shape) > FOLD_LIMIT:
            return None
        if v.role == STATE:
            if v in self.written:
                return None
            array = self.known(v)
            if array is None or tuple(array.shape) != v.shape:
                return None
            self.read.add(v)
            return np.asarray(array, dtype=storage_dtype(v.dtype))
        n = self.producers.get(v)
        if v.role != "temp" or n is None or n.op not in FOLDABLE_OPS or n.mutates:
            return None
        ins = [self.value(i) for i in n.inputs]
        if any(a is None for a in ins):
            return None
        outs = [np.empty(o.shape, storage_dtype(o.dtype)) for o in n.outputs]
        IMPLS[n.op](n, ins, outs, None)
        return outs[n.outputs.index(v)]


def _needs_grad(graph_producers: dict, v: Value) -> bool:
    """Whether a parameter feeds v (a mask sdpa would give no gradient)."""
    stack, seen = [v], set()
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.role == PARAM:
            return True
        n = graph_producers.get(x)
        if n is not None:
            stack.extend(n.inputs)
    return False


@dataclass
class _Plan:
    """What one chain's sdpa gets: causal, a mask (new nodes, the mask value) or nothing."""
    causal: bool = False
    nodes: list[Node] = field(default_factory=list)
    mask: Value | None = None


class _Emitter:
    def __init__(self, label: str):
        self.nodes: list[Node] = []
        self.label = label

    def __call__(self, op: str, inputs: list[Value], **attrs) -> Value:
        outs = [Value(s, d) for s, d in infer_outputs(op, inputs, attrs)]
        self.nodes.append(Node(op, list(inputs), outs, attrs, OPS[op].mutates(attrs), self.label))
        return outs[0]


def _known_part(masks: list[_Mask], values: list[np.ndarray], shape: tuple):
    """(blocked, added) arrays of the known masks, applied in order over a `shape` score
    tensor, or None where one is not expressible as an additive mask."""
    blocked = np.zeros(shape, bool)
    added = np.zeros(shape, np.float64)
    for m, a in zip(masks, values):
        if m.fill is not None:
            if m.fill > BLOCKING:
                return None
            blocked |= np.broadcast_to(a.astype(bool), shape)
        else:
            a = np.broadcast_to(a.astype(np.float64), shape)
            if np.isnan(a).any() or (a == np.inf).any():
                return None
            added = added + np.where(a <= BLOCKING, 0.0, a)
            blocked |= a <= BLOCKING
    if blocked.all(axis=-1).any():
        return None
    return blocked, np.where(blocked, 0.0, added)


def _mask_plan(chain: _Chain, folder: _Folder, producers: dict, masked: bool,
               label: str) -> _Plan | None:
    """How the chain's masks reach sdpa (None: they cannot)."""
    if not chain.masks:
        return _Plan()
    length, keys = chain.q.shape[-2], chain.k.shape[-2]
    values = [folder.value(m.operand) for m in chain.masks]
    known = [m for m, a in zip(chain.masks, values) if a is not None]
    runtime = [m for m, a in zip(chain.masks, values) if a is None]
    if any(m.fill is None and _needs_grad(producers, m.operand) for m in chain.masks):
        return None
    if any(m.fill is not None and m.fill != -math.inf for m in runtime):
        return None        # a finite fill: the composed op's wholly blocked rows differ
    shape = np.broadcast_shapes(*(a.shape for a in values if a is not None), (length, keys)) \
        if known else (length, keys)
    part = _known_part(known, [a for a in values if a is not None], shape) if known else None
    if known and part is None:
        return None
    plan = _Plan()
    emit, dtype = _Emitter(label), chain.q.dtype
    terms: list[Value] = []
    if part is not None:
        blocked, added = part
        if not added.any() and length <= keys and \
                (blocked == causal_mask(length, keys)).all():
            plan.causal = True
        else:
            data = np.where(blocked, -np.inf, added).astype(storage_dtype(dtype))
            terms.append(emit("constant", [], data=Constant(data), dtype=dtype))
    for m in runtime:
        if m.fill is None:
            terms.append(m.operand)
        else:                        # where(mask, -inf, 0) as F.scaled_dot_product_attention
            zero = emit("cast", [m.operand], dtype=dtype)
            terms.append(emit("masked_fill", [zero, m.operand], value=-math.inf))
    if terms and not masked:
        return None
    mask = terms[0] if terms else None
    for t in terms[1:]:
        mask = emit("binary", [mask, t], kind="add")
    plan.nodes, plan.mask = emit.nodes, mask
    return plan


def rewrite_attention(graph: Graph, known: Callable[[Value], np.ndarray | None] | None = None,
                      masked: bool = False, kept: tuple[Value, ...] = ()) -> Graph:
    """The forward `graph` with each hand-written attention chain (module docstring) as one
    sdpa node. known(v) gives the host values of a `state` value (a module buffer), or None;
    masked: the backend's sdpa takes an additive mask input (masks_supported); kept: values the
    caller still reads beyond graph.outputs (the loss). The graph given is not changed."""
    if not enabled() or not any(n.op == "softmax" for n in graph.nodes):
        return graph
    matcher = _Matcher(graph, set(kept))
    folder = _Folder(graph, known or (lambda v: None))
    replaced: dict[Node, list[Node]] = {}       # the chain's last node -> what runs instead
    dropped: set[Node] = set()
    for sm in [n for n in graph.nodes if n.op == "softmax"]:
        chain = matcher.chain(sm)
        if chain is None or dropped & set(chain.nodes):
            continue
        plan = _mask_plan(chain, folder, matcher.producers, masked, sm.label)
        if plan is None:
            continue
        _group_heads(matcher, chain)
        factors = _scale_q(chain, sm.label)
        replaced[_last(graph, chain.nodes)] = plan.nodes + factors + \
            [_sdpa_node(chain, plan, sm.label)]
        dropped |= set(chain.nodes)
    return splice(graph, replaced, dropped) if replaced else graph


def _scale_q(chain: _Chain, label: str) -> list[Node]:
    """The nodes multiplying q by the chain's tensor factors (each (..., 1, 1): constant
    along the queries and keys, so q * f @ k^T = (q @ k^T) * f), q replaced by the product."""
    emit = _Emitter(label)
    for f in chain.factors:
        chain.q = emit("binary", [chain.q, f], kind="mul")
    return emit.nodes


def _group_heads(matcher: _Matcher, chain: _Chain) -> None:
    """k and v repeated along the head axis by one factor: sdpa reads the sources as grouped
    heads instead, and the repeats go with the chain."""
    if chain.k is chain.v:
        return
    k, v = matcher.repeated_heads(chain.k, chain), matcher.repeated_heads(chain.v, chain)
    if k is None or v is None or k[1] != v[1] or k[0].shape[:-2] != v[0].shape[:-2]:
        return
    chain.k, chain.v = k[0], v[0]
    chain.nodes += k[2] + v[2]


def _last(graph: Graph, nodes: list[Node]) -> Node:
    chosen = set(nodes)
    return [n for n in graph.nodes if n in chosen][-1]


def _sdpa_node(chain: _Chain, plan: _Plan, label: str) -> Node:
    attrs: dict = {"scale": chain.scale, "causal": plan.causal, "dropout_p": 0.0}
    ins = [chain.q, chain.k, chain.v]
    if plan.mask is not None:
        attrs["mask"] = True
        ins.append(plan.mask)
    if chain.dropout is not None and float(chain.dropout.attrs["p"]) > 0.0:
        d = chain.dropout.attrs
        attrs.update(dropout_p=float(d["p"]), seed=d["seed"], site=d["site"])
        ins.append(chain.dropout.inputs[1])
    specs = infer_outputs("sdpa", ins, attrs)
    if specs[0] != (chain.out.shape, chain.out.dtype):
        raise AssertionError(f"attention rewrite: sdpa gives {specs[0]}, the chain "
                             f"{(chain.out.shape, chain.out.dtype)}")
    lse = Value(*specs[1])
    return Node("sdpa", ins, [chain.out, lse], attrs, (), label)
