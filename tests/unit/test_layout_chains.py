"""compile/layout_chains.py and compile/concat_slices.py: chains of slices, reshapes and
permutes become one layout_copy, a concat of such chains one layout_concat; slices of a concat that give back one of its inputs read
that input. Both move bits only, so the rewritten graph equals the one without the passes bit
for bit on the NumPy backend; the graphs are a hand-written attention head split with a
normalisation between it and the attention (forward and backward), and `stack(...).prod(-1)`."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import stepgraph
import stepgraph.nn.functional as F
from stepgraph.autodiff import append_backward
from stepgraph.compile.concat_slices import read_concat_inputs
from stepgraph.compile.fuse import PASSES, eliminate_dead_code, fuse
from stepgraph.compile.elementwise_reshapes import move_elementwise_before_reshapes
from stepgraph.compile.layout_chains import collapse_layout_chains
from stepgraph.compile.pointwise_joins import join_pointwise_results
from stepgraph.compile.pointwise_views import read_pointwise_views
from stepgraph.compile.plan import make_plan
from stepgraph.errors import ShapeError
from stepgraph.ir.ops import infer_outputs
from stepgraph.ir.graph import Value
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import op_forward, randn, run_graph, seeded
from tests.unit.compat_training import torch_state, train_steps

# The passes after these that remove more copies are tested on their own
# (test_pointwise_views.py, test_elementwise_reshapes.py, test_pointwise_joins.py).
LATER = (read_pointwise_views, move_elementwise_before_reshapes, join_pointwise_results)
WITH = tuple(p for p in PASSES if p not in LATER)
WITHOUT = tuple(p for p in WITH if p not in (collapse_layout_chains, read_concat_inputs))
B, T, H, D = 2, 5, 3, 4
C = H * D


def head_split(x, w):
    """A qk-normalised attention block's head split, as model files write it."""
    q, k, v = (x @ w).split(C, dim=2)
    q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    y = ((q @ k.transpose(-2, -1)).softmax(-1) @ v).transpose(1, 2).reshape(B, T, C)
    return (y * y.tanh()).sum()


def stack_prod(x, w):
    """A product gate written as a stack's product (the mixer compat file's)."""
    a, b = (x @ w).chunk(2, dim=-1)
    return (x.tanh() * stepgraph.stack([a.sigmoid(), b.tanh()], -1).prod(-1)).sum()


def traced(loss_fn, wide: int):
    tracer = Tracer()
    x = tracer.input((B, T, C), "float32", "x")
    w = tracer.input((C, wide), "float32", "w")
    loss = loss_fn(x, w)
    dx, dw = append_backward(tracer, loss.value, [x.value, w.value])
    tracer.graph.outputs = {"loss": loss.value, "dx": dx, "dw": dw}
    return tracer.graph


def arrays(request, wide: int):
    rng = seeded(request.node.name)
    return {"x": randn(rng, B, T, C), "w": randn(rng, C, wide)}


def test_the_head_split_is_one_copy_per_head_and_the_same_bits(request):
    graph = traced(head_split, 3 * C)
    before = Counter(n.op for n in make_plan(fuse(graph, WITHOUT)).steps)
    after = Counter(n.op for n in make_plan(fuse(graph, WITH)).steps)
    # forward: q, k, v a slice and a permute each, now one strided copy each; backward: their
    # gradients permuted back and joined, now read by one layout_concat at (B, T, 3H, D)
    assert after["layout_copy"] == 3 and after["layout_concat"] == 1
    assert after["slice"] == before["slice"] - 3 and after["permute"] == before["permute"] - 6
    assert after["concat"] == before["concat"] - 1
    a = arrays(request, 3 * C)
    want, got = run_graph(fuse(graph, WITHOUT), a), run_graph(fuse(graph, WITH), a)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_stack_then_prod_reads_the_stacked_values(request):
    graph = traced(stack_prod, 2 * C)
    before = Counter(n.op for n in make_plan(fuse(graph, WITHOUT)).steps)
    after = Counter(n.op for n in make_plan(fuse(graph, WITH)).steps)
    # the forward's stack and its two slices, and the backward's, are gone
    assert before["concat"] - after["concat"] == 2
    assert before["slice"] - after["slice"] == 4
    a = arrays(request, 2 * C)
    want, got = run_graph(fuse(graph, WITHOUT), a), run_graph(fuse(graph, WITH), a)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def chain(shape, *steps):
    """A graph x -> steps (op, attrs) -> sin, and the rewritten one's ops."""
    tracer = Tracer()
    x = tracer.input(shape, "float32", "x")
    v = x.value
    for op, attrs in steps:
        (v,) = tracer.emit(op, [v], **attrs)
    (y,) = tracer.emit("unary", [v], kind="sin")
    tracer.graph.outputs = {"y": y}
    return tracer.graph, Counter(n.op for n in collapse_layout_chains(tracer.graph).nodes)


SLICE = ("slice", dict(dim=1, start=1, stop=3))
PERMUTE = ("permute", dict(dims=(0, 2, 1)))


@pytest.mark.parametrize("steps, copies", [
    ((SLICE, PERMUTE), 1),                                        # two copies: one now
    ((PERMUTE, ("slice", dict(dim=1, start=0, stop=4, step=2)), PERMUTE), 1),
    ((SLICE,), 0),                                                # one copy: left alone
    ((PERMUTE,), 0),
    ((("slice", dict(dim=0, start=1, stop=2)), PERMUTE), 0),      # an in-place slice: a view
    # a reshape that needs a copy ends the chain: permute, then view(-1) of it
    ((PERMUTE, ("reshape", dict(shape=(24,))), ("slice", dict(dim=0, start=2, stop=9))), 0),
])
def test_which_chains_collapse(steps, copies, request):
    graph, ops = chain((2, 3, 4), *steps)
    assert ops["layout_copy"] == copies
    a = {"x": randn(seeded(request.node.name), 2, 3, 4)}
    np.testing.assert_array_equal(run_graph(collapse_layout_chains(graph), a)["y"],
                                  run_graph(graph, a)["y"])


def test_permutes_that_cancel_are_a_view(request):
    """A (B, T, C) value transposed to (B, C, T), viewed as (B, C, 1, T), permuted to NHWC and
    flattened (the mixer's convolution output on its way to a Linear at channels-last): the
    chain ends in the root's own bytes, a reshape, no copy at all."""
    graph, _ = chain((2, 3, 4), PERMUTE, ("reshape", dict(shape=(2, 4, 1, 3))),
                     ("permute", dict(dims=(0, 2, 3, 1))), ("reshape", dict(shape=(6, 4))))
    rewritten = fuse(graph, (collapse_layout_chains, eliminate_dead_code))
    assert [n.op for n in rewritten.nodes] == ["reshape", "unary"]
    a = {"x": randn(seeded(request.node.name), 2, 3, 4)}
    np.testing.assert_array_equal(run_graph(rewritten, a)["y"], run_graph(graph, a)["y"])


def test_a_root_written_in_place_keeps_its_chain():
    tracer = Tracer()
    x = tracer.input((2, 3, 4), "float32", "x")
    v = x.value
    for op, attrs in (SLICE, PERMUTE):
        (v,) = tracer.emit(op, [v], **attrs)
    (y,) = tracer.emit("unary", [v], kind="sin")
    graph = tracer.graph
    graph.outputs = {"y": y}
    graph.nodes[-1].mutates = (0,)           # as if the reader wrote its input's root
    graph.nodes[0].mutates = (0,)
    assert "layout_copy" not in {n.op for n in collapse_layout_chains(graph).nodes}


def test_layout_copy_reads_its_strided_view(request):
    x = randn(seeded(request.node.name), 6, 10)
    (got,) = op_forward("layout_copy", {"x": x}, shape=(2, 3, 4), strides=(20, 1, 3),
                        offset=5)
    want = np.lib.stride_tricks.as_strided(x.reshape(-1)[5:], (2, 3, 4), (80, 4, 12))
    np.testing.assert_array_equal(got, want)
    assert got[1, 2, 3] == x.reshape(-1)[5 + 20 + 2 + 9]


def test_layout_copy_refuses_a_view_past_its_input():
    x = Value((6, 10), "float32")
    with pytest.raises(ShapeError, match="reads past 60 elements"):
        infer_outputs("layout_copy", [x], dict(shape=(2, 3, 4), strides=(50, 1, 3), offset=5))


def test_a_padded_permute_is_read_by_the_concat(request):
    """F.pad(h.transpose(1, 2), (2, 0)) as the mixer file writes it: zeros and a permute
    joined; the concat reads the permute's input through its view."""
    tracer = Tracer()
    x = tracer.input((2, 5, 3), "float32", "x")
    (t,) = tracer.emit("permute", [x.value], dims=(0, 2, 1))
    (z,) = tracer.emit("fill", [], value=0.0, shape=(2, 3, 2), dtype="float32")
    (c,) = tracer.emit("concat", [z, t], dim=2)
    (y,) = tracer.emit("unary", [c], kind="sin")
    graph = tracer.graph
    graph.outputs = {"y": y}
    rewritten = fuse(graph, (collapse_layout_chains, eliminate_dead_code))
    ops = Counter(n.op for n in rewritten.nodes)
    assert ops["layout_concat"] == 1 and ops["permute"] == 0 and ops["concat"] == 0
    a = {"x": randn(seeded(request.node.name), 2, 5, 3)}
    np.testing.assert_array_equal(run_graph(rewritten, a)["y"], run_graph(graph, a)["y"])


def padded_then_permuted(dims=(0, 2, 3, 1), shape=(2, 3, 1, 7), more_readers=False):
    """The mixer file's causal convolution input at channels-last: F.pad(h.transpose(1, 2),
    (2, 0)) viewed as (B, C, 1, T + 2) and permuted to NHWC for the convolution."""
    tracer = Tracer()
    x = tracer.input((2, 5, 3), "float32", "x")
    (t,) = tracer.emit("permute", [x.value], dims=(0, 2, 1))
    (z,) = tracer.emit("fill", [], value=0.0, shape=(2, 3, 2), dtype="float32")
    (c,) = tracer.emit("concat", [z, t], dim=2)
    (r,) = tracer.emit("reshape", [c], shape=shape)
    (p,) = tracer.emit("permute", [r], dims=dims)
    (y,) = tracer.emit("unary", [p], kind="sin")
    graph = tracer.graph
    graph.outputs = {"y": y, **({"c": c} if more_readers else {})}
    return graph


@pytest.mark.parametrize("dims, shape, joined", [
    ((0, 2, 3, 1), (2, 3, 1, 7), True),       # to NHWC: the concat writes (B, 1, T + 2, C)
    ((0, 3, 2, 1), (2, 3, 1, 7), True),
    ((0, 2, 1), (2, 3, 7), True),             # back to (B, T + 2, C)
    ((1, 0, 2), (3, 2, 7), False),            # a reshape mixing B and C: left a copy
])
def test_a_permuted_concat_is_written_in_the_permuted_layout(dims, shape, joined, request):
    graph = padded_then_permuted(dims, shape)
    rewritten = fuse(graph, (collapse_layout_chains, eliminate_dead_code))
    ops = Counter(n.op for n in rewritten.nodes)
    assert ops["layout_concat"] == 1
    assert (ops["permute"] + ops["layout_copy"] == 0) == joined
    a = {"x": randn(seeded(request.node.name), 2, 5, 3)}
    np.testing.assert_array_equal(run_graph(rewritten, a)["y"], run_graph(graph, a)["y"])


def test_a_concat_read_elsewhere_keeps_its_layout_and_the_copy(request):
    graph = padded_then_permuted(more_readers=True)
    rewritten = fuse(graph, (collapse_layout_chains, eliminate_dead_code))
    ops = Counter(n.op for n in rewritten.nodes)
    assert ops["layout_concat"] == 1 and ops["permute"] == 1
    a = {"x": randn(seeded(request.node.name), 2, 5, 3)}
    want, got = run_graph(graph, a), run_graph(rewritten, a)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_layout_concat_joins_its_views(request):
    rng = seeded(request.node.name)
    a, b = randn(rng, 3, 4), randn(rng, 4, 2)
    (got,) = op_forward("layout_concat", {"a": a, "b": b}, dim=1,
                        views=(((4, 3), (1, 4), 0), ((4, 2), (2, 1), 0)))
    np.testing.assert_array_equal(got, np.concatenate([a.T, b], axis=1))
    with pytest.raises(ShapeError, match="do not concat along 1"):
        infer_outputs("layout_concat", [Value((3, 4), "float32"), Value((4, 2), "float32")],
                      dict(dim=1, views=(((3, 4), (4, 1), 0), ((4, 2), (2, 1), 0))))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_mixer_file_at_channels_last_copies_once_each_way(monkeypatch, precision):
    """tests/compat/models/mixer.py at channels-last (its causal convolution's input is
    h.transpose(1, 2) padded): each block's padded input is one layout_concat written NHWC
    from h as it is, the convolution's output reaches the gate's Linear as a view, and its
    output gradient reaches the convolution's backward as a view; the step trains three
    steps on NumPy to the same losses and parameters, bit for bit, as with those two rules
    off (each of those moves was a copy)."""
    import stepgraph.compile.layout_chains as chains

    kw = dict(vocab_size=32, dim=24, heads=3, layers=2, block_size=12)
    state = torch_state("mixer", "TokenMixer", kw)
    rng = np.random.default_rng(0)
    batches = [tuple(rng.integers(0, 32, (4, 12)) for _ in range(2)) for _ in range(3)]

    def train():
        plan, losses, params = train_steps("mixer", "TokenMixer", kw, state, batches,
                                           precision=precision, memory_format="channels_last")
        return Counter(n.op for i, n in enumerate(plan.steps) if plan.runs(i)), losses, params

    ops, losses, params = train()
    monkeypatch.setattr(chains, "_whole", lambda view: False)
    monkeypatch.setattr(chains, "_permuted_concats", lambda graph, usable: graph)
    old, want_losses, want = train()
    layers = kw["layers"]
    # per block, gone: the permute to NHWC after the padded input's layout_concat, and the
    # two layout_copies of a whole value (the output on its way to the Linear, the output
    # gradient on its way back); left: that layout_concat, and at fp32 the input gradient's
    # slice (a GEMM adds it as its C operand; at bf16 a program reads it through its view)
    assert ops["permute"] == 0 and old["permute"] == layers
    assert ops["layout_concat"] == old["layout_concat"] == layers
    assert old["layout_copy"] - ops["layout_copy"] == 2 * layers
    assert losses == want_losses
    for k in want:
        np.testing.assert_array_equal(params[k], want[k], err_msg=k)
