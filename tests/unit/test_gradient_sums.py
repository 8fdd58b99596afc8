"""compile/gradient_sums.py: the gradients of a weight used several times, summed by autodiff
from one matmul(g_k, x_k, trans_a) per use, become one matmul over the stacked rows, and
the step computes what it did (float64, to rounding; torch's gradient of the tied weight);
an LSTM cell gradient takes both terms of its dh' sum (tests/ops/test_recurrent.py's fused
graphs judge the numbers against torch)."""
from __future__ import annotations

import numpy as np
import torch

from stepgraph import nn
from stepgraph.autodiff import append_backward
from stepgraph.compile.fuse import fuse
from stepgraph.compile.gradient_sums import fuse_product_sums
from stepgraph.ir.trace import Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import randn, relative_error, run_graph, seeded


def weight_gradients(graph) -> list:
    return [n for n in graph.nodes if n.op == "matmul" and n.attrs.get("trans_a")]


def tied_graph(uses: int, extra_term: bool, rows: int = 2):
    """sum_k sum(tanh(x_k W^T) * v_k) [+ sum(W * W)]; the gradients of W and of x_0."""
    tracer = Tracer()
    w = tracer.input((12, 10), "float64", "w")
    loss = None
    for k in range(uses):
        x = tracer.input((rows + k, 10), "float64", f"x{k}")     # row counts differ
        v = tracer.input((rows + k, 12), "float64", f"v{k}")
        term = (F.linear(x, w).tanh() * v).sum()
        loss = term if loss is None else loss + term
    if extra_term:
        loss = loss + (w * w).sum()
    wrt = [w.value, tracer.graph.inputs[1]]
    gw, gx = append_backward(tracer, loss.value, wrt)
    tracer.graph.outputs = {"loss": loss.value, "dw": gw, "dx0": gx}
    return tracer.graph


def tied_arrays(uses: int) -> dict[str, np.ndarray]:
    gen = seeded(f"tied {uses}")
    out = {"w": randn(gen, 12, 10, dtype=np.float64)}
    for k in range(uses):
        out[f"x{k}"] = randn(gen, 2 + k, 10, dtype=np.float64)
        out[f"v{k}"] = randn(gen, 2 + k, 12, dtype=np.float64)
    return out


def torch_dw(a: dict, uses: int, extra_term: bool) -> np.ndarray:
    w = torch.tensor(a["w"], requires_grad=True)
    loss = sum((torch.tanh(torch.from_numpy(a[f"x{k}"]) @ w.T) * torch.from_numpy(a[f"v{k}"]))
               .sum() for k in range(uses))
    if extra_term:
        loss = loss + (w * w).sum()
    return torch.autograd.grad(loss, w)[0].numpy()


def test_tied_weight_gradients_become_one_product():
    for uses, extra in ((4, False), (3, True), (2, False)):
        graph, a = tied_graph(uses, extra), tied_arrays(uses)
        assert len(weight_gradients(graph)) == uses
        fused = fuse_product_sums(graph)
        products = weight_gradients(fused)
        assert len(products) == 1 and products[0].inputs[0].shape == (sum(
            2 + k for k in range(uses)), 12)
        assert [n.op for n in fused.nodes].count("concat") == 2
        assert len(weight_gradients(graph)) == uses           # the input graph is unchanged
        before, after = run_graph(graph, a), run_graph(fused, a)
        for name in before:
            assert relative_error(after[name], before[name]) <= 1e-14, name
        assert relative_error(after["dw"], torch_dw(a, uses, extra)) <= 1e-14


def test_a_single_product_and_long_products_are_left_alone():
    """One use; or uses whose operands outgrow the gradient (long inner dimensions: the
    stacked operands would hold more memory than the gradients they replace)."""
    for graph in (tied_graph(1, True), tied_graph(3, False, rows=20)):
        fused = fuse_product_sums(graph)
        assert [n.op for n in fused.nodes] == [n.op for n in graph.nodes]


def test_lstm_hidden_weight_gradient_is_one_product_per_layer_and_direction():
    """An LSTM of 2 layers, both directions, 6 steps: W_hh's 6 gradients per walk are one
    matmul each after fusion (4 walks), and W_ih's is one already (the hoisted projection)."""
    nn.manual_seed(0)
    model = nn.LSTM(3, 4, num_layers=2, bidirectional=True)
    model.name_parameters()
    tracer = Tracer()
    out, _ = model(tracer.input((6, 2, 3), "float32", "x"))
    params = list(tracer.graph.params)
    grads = append_backward(tracer, out.sum().value, params)
    tracer.graph.outputs = {v.name: g for v, g in zip(params, grads)}
    assert len(weight_gradients(tracer.graph)) == 4 * (6 + 1)
    fused = fuse(tracer.graph)
    assert len(weight_gradients(fused)) == 4 * 2
    cells = [n for n in fused.nodes if n.op == "lstm_cell_grad"]
    # the last step of each walk has the output's gradient alone; the others take two terms
    assert sorted(n.attrs["dh"] for n in cells) == [1] * 4 + [2] * 4 * 5
    assert all(len(n.inputs) == n.attrs["dh"] + n.attrs["dc"] + 3 for n in cells)


def test_stacked_rows_come_in_forward_order():
    """The stacked products come in the order their operands were written: an LSTM's h_t
    rows and its gate gradients in time order (autodiff sums them last step first), the
    order of the layer's own output and input gradient, so the planner reads the stacks
    as views of those (tests/unit/test_aliases.py)."""
    nn.manual_seed(0)
    model = nn.LSTM(3, 4)
    model.name_parameters()
    tracer = Tracer()
    out, _ = model(tracer.input((5, 2, 3), "float32", "x"))
    params = list(tracer.graph.params)
    grads = append_backward(tracer, out.sum().value, params)
    tracer.graph.outputs = {v.name: g for v, g in zip(params, grads)}
    fused = fuse_product_sums(tracer.graph)
    position = {v: i for i, n in enumerate(fused.nodes) for v in n.outputs}
    stacks = [n for n in fused.nodes if n.op == "concat" and n.attrs["dim"] == 0
              and n.outputs[0].shape[0] == 2 * 5]
    assert len(stacks) == 2
    hs, gates = sorted(stacks, key=lambda n: n.outputs[0].shape[1])
    assert [position[v] for v in hs.inputs] == sorted(position[v] for v in hs.inputs)
    assert [position[v] for v in gates.inputs] == sorted(
        (position[v] for v in gates.inputs), reverse=True)       # backward: last step first
