"""Reverse-mode autodiff as a graph transform (autodiff/vjp.py): gradient accumulation,
no work for values that need no gradient, and clear errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from stepgraph import losses, models, optim
from stepgraph.autodiff import append_backward
from stepgraph.compile.build import build_train_graph
from stepgraph.compile.feed import signature_of
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import assert_close, forward_and_grads, randn, seeded


def torch_grads(fn, arrays, wrt):
    ts = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in arrays.items()}
    loss = fn(**ts)
    return dict(zip(wrt, (g.numpy() for g in torch.autograd.grad(loss, [ts[k] for k in wrt]))))


def test_value_used_twice_accumulates_through_add():
    """h feeds both inputs of an add and a later linear: three uses, one summed gradient."""
    gen = seeded("twice")
    arrays = {"x": randn(gen, 6, 5), "w": randn(gen, 4, 5), "v": randn(gen, 4, 4),
              "target": randn(gen, 6, 4)}

    def body(t, i):
        h = t.op("linear", [i["x"], i["w"]], act=None)
        s = t.op("add", [h, h])
        return t.op("add", [s, t.op("linear", [h, i["v"]], act=None)])

    def torch_fn(x, w, v, target):
        h = x @ w.T
        return TF.mse_loss(h + h + h @ v.T, target)

    for fused in (False, True):
        _, grads = forward_and_grads(body, arrays, ("x", "w", "v"), fused)
        want = torch_grads(torch_fn, arrays, ("x", "w", "v"))
        for k in want:
            assert_close(grads[k], want[k], what=k)


def test_shared_weight_gets_the_sum_of_both_gradients():
    gen = seeded("shared")
    arrays = {"x": randn(gen, 6, 5), "w": randn(gen, 5, 5) / 2, "target": randn(gen, 6, 5)}

    def body(t, i):
        h = t.op("act", [t.op("linear", [i["x"], i["w"]], act=None)], kind="tanh", slope=0.0)
        return t.op("linear", [h, i["w"]], act=None)

    _, grads = forward_and_grads(body, arrays, ("w",), fused=True)
    want = torch_grads(lambda x, w, target: TF.mse_loss(torch.tanh(x @ w.T) @ w.T, target),
                       arrays, ("w",))
    assert_close(grads["w"], want["w"])


@pytest.mark.parametrize("workload", ["mlp", "cnn"])
def test_no_gradient_nodes_for_the_data_input(workload):
    model, loss, shape = {"mlp": (models.mlp(), losses.cross_entropy, (784,)),
                          "cnn": (models.cnn(), losses.nll_loss, (1, 28, 28))}[workload]
    x, y = np.ones((4, *shape), np.float32), np.zeros(4, np.int64)
    graph = build_train_graph(model, loss, optim.SGD(lr=0.1), signature_of(("x", "y"), (x, y)),
                              seed=0)
    first_weight = graph.params[0]
    readers = [n.op for n in graph.nodes if first_weight in n.inputs]
    assert readers == [graph.nodes[0].op, "sgd_update"], readers
    assert not any(n.op == "conv2d_grad_input" and n.inputs[1] is first_weight
                   for n in graph.nodes)
    x_value = graph.inputs[0]
    x_shaped = [n.op for n in graph.nodes for v in n.outputs if v.shape == x_value.shape]
    assert x_shaped == [], f"gradient-shaped values of x are computed by {x_shaped}"


def test_only_values_depending_on_wrt_get_gradients():
    """A branch that no wrt value reaches costs no backward nodes."""
    t = Tracer()
    x, c = t.input((3, 4), "float32", "x"), t.input((3, 4), "float32", "c")
    w = t.input((4, 4), "float32", "w")
    frozen = t.op("act", [c], kind="tanh", slope=0.0)      # constant branch
    y = t.op("add", [t.op("linear", [x, w], act=None), frozen])
    loss = losses.mse(y, c)
    n_forward = len(t.graph.nodes)
    (dw,) = append_backward(t, loss.value, [w.value])
    backward = [n.op for n in t.graph.nodes[n_forward:]]
    assert "act_grad" not in backward           # nothing flows into the frozen tanh
    assert backward.count("mse_grad") == 1      # d/dtarget is not wanted
    assert backward.count("matmul") == 1        # dw only; no dx for the input x
    assert dw.shape == (4, 4)


def test_loss_must_be_a_scalar():
    t = Tracer()
    x = t.input((3,), "float32", "x")
    with pytest.raises(ValueError, match="scalar"):
        append_backward(t, t.op("act", [x], kind="relu", slope=0.0).value, [x.value])


def test_loss_that_does_not_depend_on_a_wrt_value_is_an_error():
    t = Tracer()
    x, unused = t.input((3, 2), "float32", "x"), t.input((3, 2), "float32", "unused")
    loss = losses.mse(x, x)
    with pytest.raises(ValueError, match="does not depend"):
        append_backward(t, loss.value, [unused.value])


def test_op_without_a_vjp_rule_is_reported():
    t = Tracer()
    a = t.input((3, 4), "float32", "a")
    loss = t.op("global_norm", [a])      # an optimizer-side op: never differentiated
    with pytest.raises(NotImplementedError, match="global_norm"):
        append_backward(t, loss.value, [a.value])


def test_backward_is_ordinary_graph_nodes():
    """Autodiff appends nodes to the same graph; no closures or Python callbacks."""
    t = Tracer()
    x, w = t.input((3, 4), "float32", "x"), t.input((2, 4), "float32", "w")
    loss = losses.mse(t.op("linear", [x, w], act=None), t.input((3, 2), "float32", "target"))
    before = list(t.graph.nodes)
    (dw,) = append_backward(t, loss.value, [w.value])
    assert t.graph.nodes[:len(before)] == before
    added = t.graph.nodes[len(before):]
    assert [n.op for n in added] == ["fill", "mse_grad", "matmul"]
    assert added[-1].outputs == [dw]
    assert all(n.label.endswith("bwd") for n in added[1:])
