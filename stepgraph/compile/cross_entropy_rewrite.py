"""Cross-entropy written by hand becomes the fused `cross_entropy` op, on the traced forward
before autocast and autodiff, so its backward is the op's own (`cross_entropy_grad`, fused
with the forward into one `cross_entropy_train` kernel by compile/fuse.py).

Model files often write the loss out:
    logp = F.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    loss = nll.mean()                                   (or nll.sum())
or F.nll_loss(F.log_softmax(logits, -1), targets) (torch.log_softmax, logits.log_softmax(-1),
and logp.view(-1, V) of (B, T, V) log-probabilities alike). Composed, each step pays a
log_softmax forward and backward, a gather and its scatter-style backward, and the
log-probabilities of every logit in memory; the fused op reads the logits once and writes the
loss and dlogits.

What it matches, each intermediate (the log-probabilities, the gathered values, the partial
sums) read by nothing else and no step output:
- log_softmax over the last axis of logits (..., V) of rank >= 2 (the op is last-axis only:
  another dim traces as a permute around it, which is no match), float32 or float64;
- either gather along that same last axis by an integer index (..., 1) of logits' leading
  shape, then, in any order, reshapes (the squeeze), one negation (a scale by exactly -1) and
  one sum over every axis, then optionally a division by the number of rows (the mean): the
  mean becomes cross_entropy itself, the sum cross_entropy * rows (one scalar node; its
  backward seed is then rows, not 1, so the forward and cross_entropy_grad stay two kernels
  where a mean's fuse into one cross_entropy_train);
- or the nll_loss op (F.nll_loss of (N, V) with mean reduction, no weight, the default
  ignore_index) reading the log-probabilities, or their (N, V) view merging the leading axes.
The logits go to cross_entropy as their (N, V) view (free), the targets as (N,).

What it leaves: log_softmax over another axis, a gather along another axis or of more than
one index per row, log-probabilities or gathered values read elsewhere (returned, logged,
another loss term), a sum over only some axes, a scale other than -1 (or none), a division by
anything but the row count, and F.nll_loss with class weights, reduction="sum" or another
ignore_index (those trace through one-hot products, not the nll_loss op).

Labels outside [0, V): the composed gather reads 0 there, the fused op NaN, and a label of
-100 (cross_entropy's ignore_index) is skipped, as torch's F.nll_loss skips it; torch's gather
raises on both, so only inputs torch refuses differ.
STEPGRAPH_CROSS_ENTROPY_REWRITE=0 turns the pass off (read when a step is compiled), to
compare.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..ir.graph import Graph, Node, Value
from ..ir.ops import OPS, infer_outputs
from .rewrite import _join, splice

SWITCH_ENV = "STEPGRAPH_CROSS_ENTROPY_REWRITE"
LOGIT_DTYPES = ("float32", "float64")         # cross_entropy's loss has its logits' dtype
LABEL_DTYPES = ("int32", "int64")


def enabled() -> bool:
    """Whether the rewrite runs: STEPGRAPH_CROSS_ENTROPY_REWRITE=0 in the environment turns
    it off (to compare a step with and without it)."""
    return os.environ.get(SWITCH_ENV, "1") != "0"


@dataclass
class _Loss:
    """One matched chain: logits (..., V), labels (any shape of N elements), the value the
    loss lands in, whether it is the sum (else the mean), and the nodes it replaces."""
    logits: Value
    labels: Value
    out: Value
    summed: bool
    nodes: list[Node] = field(default_factory=list)


def _negation(n: Node) -> bool:
    return n.op == "scalar" and n.attrs.get("kind") in ("mul", "div") and \
        float(n.attrs["value"]) == -1.0


def _row_mean(n: Node, rows: int) -> bool:
    """A scalar division by the row count (or product with its reciprocal)."""
    if n.op != "scalar":
        return False
    kind, value = n.attrs.get("kind"), float(n.attrs["value"])
    return (kind == "div" and value == rows) or (kind == "mul" and value == 1.0 / rows)


class _Matcher:
    """Finds the chains of one graph (module docstring); reads, never writes, the graph."""

    def __init__(self, graph: Graph, kept: set[Value]):
        self.users = graph.consumers()
        self.producers = graph.producers()
        self.kept = set(graph.outputs.values()) | kept

    def reader(self, v: Value) -> Node | None:
        """v's one reader when v is read once and is no step output."""
        readers = self.users.get(v, [])
        if v in self.kept or len(readers) != 1 or readers[0].inputs.count(v) != 1:
            return None
        return readers[0]

    def chain(self, ls: Node) -> _Loss | None:
        logits = ls.inputs[0]
        if len(logits.shape) < 2 or logits.dtype not in LOGIT_DTYPES:
            return None
        n = self.reader(ls.outputs[0])
        if n is None:
            return None
        if n.op == "gather":
            return self.gathered(ls, n)
        nodes = [ls]
        if n.op == "reshape" and n.outputs[0].shape == \
                (math.prod(logits.shape[:-1]), logits.shape[-1]):
            nodes.append(n)
            n = self.reader(n.outputs[0])
        if n is None or n.op != "nll_loss" or n.inputs[0] is n.inputs[1] or \
                n.inputs[0] is not nodes[-1].outputs[0]:
            return None
        labels = n.inputs[1]
        if labels.dtype not in LABEL_DTYPES or len(n.inputs[0].shape) != 2:
            return None
        return _Loss(logits, labels, n.outputs[0], False, nodes + [n])

    def gathered(self, ls: Node, g: Node) -> _Loss | None:
        """From gather node g reading ls's log-probabilities: reshapes, one negation, one
        sum over every axis, an optional division by the row count."""
        logits, (logp, index) = ls.inputs[0], g.inputs
        rank = len(logits.shape)
        if logp is index or int(g.attrs["dim"]) % rank != rank - 1 or \
                index.dtype not in LABEL_DTYPES or index.shape != logits.shape[:-1] + (1,):
            return None
        rows = math.prod(index.shape)
        nodes, v = [ls, g], g.outputs[0]
        negated = summed = averaged = False
        while True:
            n = self.reader(v)
            if n is None or n.inputs[0] is not v:
                break
            if n.op == "reshape" and not summed:
                pass
            elif _negation(n) and not negated:
                negated = True
            elif n.op == "reduce_sum" and not summed and n.outputs[0].shape == () and \
                    sorted(int(a) % max(len(v.shape), 1) for a in n.attrs["axes"]) == \
                    list(range(len(v.shape))):
                summed = True
            elif summed and not averaged and _row_mean(n, rows):
                averaged = True
            else:
                break
            nodes.append(n)
            v = n.outputs[0]
        # The loss lands in v, which may have any readers (a chain stopped early at a value
        # read elsewhere lacks its negation or its sum: no match).
        if not (negated and summed) or v.dtype != logits.dtype:
            return None
        return _Loss(logits, self.labels_of(index), v, not averaged, nodes)

    def labels_of(self, index: Value) -> Value:
        """The targets an (..., 1) index was unsqueezed from (targets.unsqueeze(-1)), else
        the index itself."""
        p = self.producers.get(index)
        if p is not None and p.op == "reshape" and p.inputs[0].shape == index.shape[:-1] and \
                p.inputs[0].dtype == index.dtype:
            return p.inputs[0]
        return index


class _Emitter:
    def __init__(self, label: str):
        self.nodes: list[Node] = []
        self.label = label

    def __call__(self, op: str, inputs: list[Value], outputs: list[Value] | None = None,
                 **attrs) -> list[Value]:
        specs = infer_outputs(op, inputs, attrs)
        outs = outputs or [Value(s, d) for s, d in specs]
        if [(o.shape, o.dtype) for o in outs] != specs:
            raise AssertionError(f"cross-entropy rewrite: {op} gives {specs}, the graph "
                                 f"{[(o.shape, o.dtype) for o in outs]}")
        self.nodes.append(Node(op, list(inputs), outs, attrs, OPS[op].mutates(attrs),
                               self.label))
        return outs


def _fused(loss: _Loss) -> list[Node]:
    """The nodes that compute loss.out from (N, V) logits and (N,) labels in one op."""
    emit = _Emitter(_join(*(n.label for n in loss.nodes)) or "cross_entropy")
    classes = loss.logits.shape[-1]
    rows = math.prod(loss.logits.shape[:-1])
    logits, labels = loss.logits, loss.labels
    if logits.shape != (rows, classes):
        logits = emit("reshape", [logits], shape=(rows, classes))[0]
    if labels.shape != (rows,):
        labels = emit("reshape", [labels], shape=(rows,))[0]
    lse = Value((rows,), logits.dtype)
    attrs = {"label_smoothing": 0.0, "ignore_index": -100}
    if not loss.summed:
        emit("cross_entropy", [logits, labels], [loss.out, lse], **attrs)
        return emit.nodes
    mean = emit("cross_entropy", [logits, labels], [Value((), logits.dtype), lse], **attrs)[0]
    emit("scalar", [mean], [loss.out], kind="mul", value=float(rows))
    return emit.nodes


def rewrite_cross_entropy(graph: Graph, kept: tuple[Value, ...] = ()) -> Graph:
    """The forward `graph` with each hand-written cross-entropy (module docstring) as one
    cross_entropy node; kept: values the caller still reads beyond graph.outputs (the loss,
    which may be the chain's result itself). The graph given is not changed."""
    if not enabled() or not any(n.op == "log_softmax" for n in graph.nodes):
        return graph
    matcher = _Matcher(graph, set(kept))
    replaced: dict[Node, list[Node]] = {}      # the chain's last node -> what runs instead
    dropped: set[Node] = set()
    for ls in [n for n in graph.nodes if n.op == "log_softmax"]:
        found = matcher.chain(ls)
        if found is None or dropped & set(found.nodes):
            continue
        replaced[found.nodes[-1]] = _fused(found)
        dropped |= set(found.nodes)
    return splice(graph, replaced, dropped) if replaced else graph
