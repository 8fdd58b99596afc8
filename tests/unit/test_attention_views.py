"""Attention reads its operands where they lie and writes its results where they are read
(compile/attention_views.py): the head split's and merge's copies around sdpa and sdpa_grad
go, with the same bits on the NumPy backend; near-misses keep their copies."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import stepgraph.nn.functional as F
from stepgraph.autodiff import append_backward
from stepgraph.compile.attention_views import attention_views
from stepgraph.compile.fuse import PASSES, eliminate_dead_code, fuse
from stepgraph.compile.plan import make_plan
from stepgraph.errors import ShapeError
from stepgraph.ir.ops import infer_outputs
from stepgraph.ir.graph import Value
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import op_forward, randn, run_graph, seeded

WITHOUT = tuple(p for p in PASSES if p is not attention_views)
B, T, H, D = 2, 5, 3, 4
C = H * D


def heads(t):
    return t.view(B, T, H, D).transpose(1, 2)


def separate_projections(x, wq, wk, wv):
    """Attention as model files write it with a Linear each for q, k and v."""
    q, k, v = heads(x @ wq), heads(x @ wk), heads(x @ wv)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (y.transpose(1, 2).reshape(B, T, C).tanh() * x).sum()


def packed_normalised(x, wq):
    """One packed projection split, q and k normalised (the mixer compat file's form)."""
    q, k, v = (x @ wq).split(C, dim=2)
    q, k, v = heads(q), heads(k), heads(v)
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (y.transpose(1, 2).reshape(B, T, C).tanh() * x).sum()


def traced(loss_fn, packed: bool = False):
    """loss_fn's graph and its gradients: x and wq, wk, wv (C, C) each, or one packed wq
    (C, 3C)."""
    tracer = Tracer()
    x = tracer.input((B, T, C), "float32", "x")
    ws = [tracer.input((C, w), "float32", name)
          for name, w in ((("wq", 3 * C),) if packed else (("wq", C), ("wk", C), ("wv", C)))]
    loss = loss_fn(x, *ws)
    grads = append_backward(tracer, loss.value, [x.value] + [w.value for w in ws])
    tracer.graph.outputs = {"loss": loss.value, **{f"d{i}": g for i, g in enumerate(grads)}}
    return tracer.graph


def steps(graph) -> Counter:
    plan = make_plan(graph)
    return Counter(n.op for i, n in enumerate(plan.steps) if plan.runs(i))


def same_bits(request, graph) -> None:
    rng = seeded(request.node.name)
    a = {v.name: randn(rng, *v.shape) for v in graph.inputs}
    want, got = run_graph(fuse(graph, WITHOUT), a), run_graph(fuse(graph), a)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_separate_projections_copy_nothing_around_the_attention(request):
    graph = traced(separate_projections)
    before, after = steps(fuse(graph, WITHOUT)), steps(fuse(graph))
    # forward: q, k, v split into heads and the output merged; backward: the output's
    # gradient split and q's, k's and v's gradients merged: eight transposes, none left
    assert before["permute"] == 8 and after["permute"] == 0
    nodes = {n.op: n for n in fuse(graph).nodes}
    assert nodes["sdpa"].attrs["out_perms"] == ((0, 2, 1, 3),)
    assert nodes["sdpa_grad"].attrs["out_perms"] == ((0, 2, 1, 3),) * 3
    # sdpa_grad reads dout and out through their views of the merged (B, T, H, D) values
    # (the NumPy reference recomputes the probabilities and never reads out: its view is
    # checked here, its values by the CUDA tests)
    merged = ((B, H, T, D), (T * H * D, D, H * D, 1), 0)
    assert nodes["sdpa_grad"].attrs["views"][0] == merged
    assert nodes["sdpa_grad"].attrs["views"][4] == merged
    assert nodes["sdpa_grad"].inputs[4] is nodes["sdpa"].outputs[0]
    same_bits(request, graph)


def test_a_packed_split_reads_v_in_place(request):
    graph = traced(packed_normalised, packed=True)
    before, after = steps(fuse(graph, WITHOUT)), steps(fuse(graph))
    # v's strided copy out of the projection goes, and so do the output's merge and its
    # gradient's split; q and k are the normalisation's outputs, their gradients its inputs
    assert before["layout_copy"] - after["layout_copy"] == 1
    assert before["permute"] - after["permute"] == 2
    same_bits(request, graph)


def attention_graph(*, extra=None, output=False, mutate=False, perm=(0, 2, 1, 3)):
    """x (B, T, H, D) -> permute -> sdpa(q, q, q) -> out -> permute back -> y; `extra`
    another reader of the split q, `output` the split q a graph output too, `mutate` a node
    that writes x in place, perm the split's permutation."""
    tracer = Tracer()
    x = tracer.input((B, T, H, D), "float32", "x")
    (q,) = tracer.emit("permute", [x.value], dims=perm)
    out, _ = tracer.emit("sdpa", [q, q, q], scale=0.5, causal=False, dropout_p=0.0)
    (y,) = tracer.emit("permute", [out], dims=(0, 2, 1, 3))
    tracer.graph.outputs = {"y": y}
    if extra:
        (z,) = tracer.emit("unary", [q], kind="sin")
        tracer.graph.outputs["z"] = z
    if output:
        tracer.graph.outputs["q"] = q
    if mutate:
        tracer.graph.nodes[0].mutates = (0,)
    return tracer.graph


def rewritten(graph):
    return fuse(graph, (attention_views, eliminate_dead_code))


def test_a_split_and_a_merge_around_sdpa_go(request):
    graph = attention_graph()
    assert Counter(n.op for n in rewritten(graph).nodes) == {"sdpa": 1}
    a = {"x": randn(seeded(request.node.name), B, T, H, D)}
    np.testing.assert_array_equal(run_graph(rewritten(graph), a)["y"], run_graph(graph, a)["y"])


@pytest.mark.parametrize("case", ["other reader", "graph output", "root written",
                                  "last axis moved"])
def test_near_misses_keep_their_copies(case):
    graph = attention_graph(extra=case == "other reader", output=case == "graph output",
                            mutate=case == "root written",
                            perm=(0, 2, 3, 1) if case == "last axis moved" else (0, 2, 1, 3))
    ops = Counter(n.op for n in rewritten(graph).nodes)
    # the split stays a copy; the merge of the output still goes where nothing else blocks it
    assert ops["permute"] >= 1
    sdpa = next(n for n in rewritten(graph).nodes if n.op == "sdpa")
    assert not any(sdpa.attrs.get("views") or ())


@pytest.mark.parametrize("case", ["other reader", "graph output"])
def test_an_output_read_elsewhere_is_written_in_its_own_layout(case):
    tracer = Tracer()
    x = tracer.input((B, H, T, D), "float32", "x")
    out, _ = tracer.emit("sdpa", [x.value] * 3, scale=0.5, causal=False, dropout_p=0.0)
    (y,) = tracer.emit("permute", [out], dims=(0, 2, 1, 3))
    tracer.graph.outputs = {"y": y}
    if case == "other reader":
        tracer.graph.outputs["z"] = tracer.emit("unary", [out], kind="sin")[0]
    else:
        tracer.graph.outputs["out"] = out
    ops = Counter(n.op for n in rewritten(tracer.graph).nodes)
    assert ops["permute"] == 1
    assert not any(n.attrs.get("out_perms") for n in rewritten(tracer.graph).nodes)


def test_the_shape_rule_checks_views_and_permutations():
    x = Value((B * T, 3 * C), "float32")
    view = ((B, H, T, D), (T * 3 * C, D, 3 * C, 1), 2 * C)
    specs = infer_outputs("sdpa", [x, x, x], dict(scale=1.0, views=(view,) * 3,
                                                  out_perms=((0, 2, 1, 3),)))
    assert specs[0][0] == (B, T, H, D) and specs[1][0] == (B, H, T)
    past = ((B, H, T, D), (T * 3 * C, D, 3 * C, 1), 3 * C)
    with pytest.raises(ShapeError, match="cannot be read through the view"):
        infer_outputs("sdpa", [x, x, x], dict(scale=1.0, views=(past, view, view)))
    with pytest.raises(ShapeError, match="keeping the last"):
        infer_outputs("sdpa", [x, x, x], dict(scale=1.0, views=(view,) * 3,
                                              out_perms=((0, 1, 3, 2),)))


def test_the_reference_reads_views_and_writes_permuted(request):
    rng = seeded(request.node.name)
    packed = randn(rng, B, T, 3 * C)
    q, k, v = (packed[..., i * C:(i + 1) * C].reshape(B, T, H, D).transpose(0, 2, 1, 3)
               for i in range(3))
    want = op_forward("sdpa", {"q": np.ascontiguousarray(q), "k": np.ascontiguousarray(k),
                               "v": np.ascontiguousarray(v)}, scale=0.5, causal=True)[0]
    views = tuple(((B, H, T, D), (T * 3 * C, D, 3 * C, 1), i * C) for i in range(3))
    got = op_forward("sdpa", {"q": packed, "k": packed, "v": packed}, scale=0.5, causal=True,
                     views=views, out_perms=((0, 2, 1, 3),))[0]
    np.testing.assert_array_equal(got, want.transpose(0, 2, 1, 3))


def test_the_gradient_reference_reads_views_and_writes_permuted(request):
    rng = seeded(request.node.name)
    packed, dout = randn(rng, B, T, 3 * C), randn(rng, B, T, C)
    split = [np.ascontiguousarray(packed[..., i * C:(i + 1) * C].reshape(B, T, H, D)
                                  .transpose(0, 2, 1, 3)) for i in range(3)]
    attrs = dict(scale=0.5, causal=True)
    out, lse = op_forward("sdpa", dict(zip("qkv", split)), **attrs)
    heads_first = np.ascontiguousarray(dout.reshape(B, T, H, D).transpose(0, 2, 1, 3))
    want = op_forward("sdpa_grad", {"dout": heads_first, "q": split[0], "k": split[1],
                                    "v": split[2], "out": out, "lse": lse}, **attrs)
    merged = ((B, H, T, D), (T * C, D, C, 1), 0)
    views = (merged,) + tuple(((B, H, T, D), (T * 3 * C, D, 3 * C, 1), i * C)
                              for i in range(3)) + (merged, None)
    got = op_forward("sdpa_grad", {"dout": dout, "q": packed, "k": packed, "v": packed,
                                   "out": np.ascontiguousarray(out.transpose(0, 2, 1, 3)),
                                   "lse": lse}, **attrs, views=views,
                     out_perms=((0, 2, 1, 3),) * 3)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w.transpose(0, 2, 1, 3))
