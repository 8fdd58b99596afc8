"""compile/slice_sums.py: the gradient of a value cut into disjoint slices (split, chunk,
unbind, slicing with gaps) is one concat of the slices' gradients, not one zero-filled
slice_grad per slice summed by adds; overlapping slices keep their sum. The rewritten sum is
the old one bit for bit on the NumPy backend, and the compiled step's gradient is judged
against torch (tests/reference.py)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from stepgraph.autodiff import append_backward
from stepgraph.compile.fuse import fuse
from stepgraph.compile.plan import make_plan
from stepgraph.compile.slice_sums import _place, concat_slice_gradients
from stepgraph.ir.trace import Tracer
from stepgraph.ops.pointwise import Joined
from tests.ops.helpers import randn, run_graph, seeded
from tests.reference import assert_close_to_reference

# name: (input shape, the cut (stepgraph and torch tensors alike), the expected rewrite:
# number of zero fills, or None where the sum must stay)
CUTS = {
    "split_last_3": ((4, 5, 9), lambda x: x.split(3, dim=-1), 0),
    "chunk_last_2": ((4, 5, 8), lambda x: x.chunk(2, dim=-1), 0),
    "split_middle": ((4, 5, 6), lambda x: x.split([2, 3], dim=1), 0),
    "unbind_last": ((3, 4, 3), lambda x: x.unbind(-1), 0),
    "gaps": ((4, 5, 9), lambda x: (x[..., 1:3], x[..., 5:7]), 3),
    "overlap": ((4, 5, 9), lambda x: (x[..., 0:5], x[..., 3:9]), None),
}


def loss_of(cut, x, others: int):
    """sum_k (k + 1) * sum(tanh(piece_k)), a different, data-dependent gradient per slice
    (swapping two slices' gradients changes it), [+ sum(sigmoid(x)) (others >= 1)]
    [+ sum(cos(x)) computed before the cut (others 2): x's gradient is then the chain of adds
    sigmoid', slices, cos' (autodiff runs backwards), and the concat must follow the first
    of them, not the last, to add what it added]."""
    early = x.cos().sum() if others >= 2 else None
    loss = None
    for k, p in enumerate(cut(x)):
        term = (p.tanh() * float(k + 1)).sum()
        loss = term if loss is None else loss + term
    if others >= 1:
        loss = loss + x.sigmoid().sum()
    return loss if early is None else loss + early


def traced(name: str, others: int):
    shape, cut, _ = CUTS[name]
    tracer = Tracer()
    x = tracer.input(shape, "float32", "x")
    loss = loss_of(cut, x, others)
    (dx,) = append_backward(tracer, loss.value, [x.value])
    tracer.graph.outputs = {"loss": loss.value, "dx": dx}
    return tracer.graph


def torch_dx(name: str, a: np.ndarray, dtype, others: int) -> np.ndarray:
    x = torch.tensor(a, dtype=dtype, requires_grad=True)
    loss = loss_of(CUTS[name][1], x, others)
    return torch.autograd.grad(loss, x)[0].double().numpy()


def full_size(graph, op: str, shape) -> int:
    return sum(1 for n in graph.nodes if n.op == op and n.outputs[0].shape == shape)


@pytest.mark.parametrize("others", [0, 1, 2])
@pytest.mark.parametrize("name", list(CUTS))
def test_slice_gradients_become_one_concat(name, others, request):
    shape, _, fills = CUTS[name]
    graph = traced(name, others)
    pieces = Counter(n.op for n in graph.nodes)["slice"]
    assert Counter(n.op for n in graph.nodes)["slice_grad"] == pieces
    rewritten = concat_slice_gradients(graph)
    ops = Counter(n.op for n in rewritten.nodes)
    if fills is None:                        # overlapping: the sum stays as it was
        assert ops["slice_grad"] == pieces and ops["concat"] == 0
        assert full_size(rewritten, "add", shape) == full_size(graph, "add", shape)
    else:
        assert ops["slice_grad"] == 0 and ops["concat"] == 1 and ops["fill"] == fills + 1
        assert full_size(rewritten, "add", shape) == others
        concat = next(n for n in rewritten.nodes if n.op == "concat")
        assert len(concat.inputs) == pieces + fills
    assert Counter(n.op for n in graph.nodes)["slice_grad"] == pieces   # input untouched

    a = {"x": randn(seeded(request.node.name), *shape)}
    before, after = run_graph(graph, a), run_graph(rewritten, a)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)

    plan = make_plan(fuse(graph))
    steps = Counter(n.op for n in plan.steps)
    assert steps["slice_grad"] == (0 if fills is not None else pieces)
    # the concat, or the program that stores it (compile/pointwise_joins.py)
    joined = sum(isinstance(r, Joined) for n in plan.steps if n.op == "pointwise"
                 for r in n.attrs["results"])
    assert steps["concat"] + joined == (1 if fills is not None else 0)
    got = run_graph(plan.graph, a)["dx"]
    assert_close_to_reference(got, torch_dx(name, a["x"], torch.float64, others),
                              torch_dx(name, a["x"], torch.float32, others), "dx")


def test_a_single_slice_and_strided_slices_are_left_alone():
    for cut in (lambda x: (x[..., 2:5],), lambda x: (x[..., 0::2], x[..., 1::2])):
        tracer = Tracer()
        x = tracer.input((3, 8), "float32", "x")
        loss = loss_of(cut, x, 0)
        (dx,) = append_backward(tracer, loss.value, [x.value])
        tracer.graph.outputs = {"dx": dx}
        ops = Counter(n.op for n in concat_slice_gradients(tracer.graph).nodes)
        assert ops["concat"] == 0 and ops["slice_grad"] >= 1


def test_the_concat_keeps_each_slice_after_the_terms_it_followed():
    """_place: how many other terms precede the concat, so each position's adds run in the
    order they did; None where the slices sat at different depths of the chain."""
    g1, g2, o1, o2, o3 = "g1", "g2", "o1", "o2", "o3"
    mine = {g1, g2}
    assert _place([g1, g2], mine) == 0
    assert _place([g1, o1, g2], mine) == 0              # g + o1 = o1 + g
    assert _place([o1, g1, g2, o2], mine) == 0
    assert _place([o1, o2, g1, g2, o3], mine) == 2
    assert _place([g1, o1, o2, g2], mine) is None
    assert _place([o1, o2, g1, o3, g2], mine) is None


def test_a_negative_zero_gradient_stays_as_torch_keeps_it():
    """The documented difference: -0.0 entries of a slice gradient were +0.0 after the
    zero-padded adds; the concat keeps -0.0, as torch's split backward does."""
    tracer = Tracer()
    x = tracer.input((2, 6), "float32", "x")
    z = tracer.input((2, 3), "float32", "z")
    q, k = x.split(3, dim=-1)
    loss = (q * z).sum() + (k * z).sum()
    (dx,) = append_backward(tracer, loss.value, [x.value])
    tracer.graph.outputs = {"dx": dx}
    a = {"x": np.ones((2, 6), np.float32), "z": np.array([[-0.0, 1, 2], [3, -0.0, 4]],
                                                          np.float32)}
    got = run_graph(concat_slice_gradients(tracer.graph), a)["dx"]
    tx = torch.tensor(a["x"], requires_grad=True)
    tq, tk = tx.split(3, dim=-1)
    tz = torch.tensor(a["z"])
    want = torch.autograd.grad((tq * tz).sum() + (tk * tz).sum(), tx)[0].numpy()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    assert np.signbit(got).sum() == 4
