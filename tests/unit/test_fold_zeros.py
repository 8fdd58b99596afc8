"""fold_zeros (compile/zeros.py): products and sums with a constant-zero operand folded on the
forward graph, results unchanged bit for bit (NumPy backend), and an LSTM without a given
state skipping its first step's W_hh GEMM."""
from __future__ import annotations

import numpy as np
import pytest

from stepgraph import nn
from stepgraph.compile.zeros import fold_zeros
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import randn, run_graph, seeded


def traced(body, **shapes):
    """A graph of body(tracer, inputs) -> {name: output}, and arrays for its inputs."""
    t = Tracer()
    gen = seeded(str(sorted(shapes)))
    arrays = {k: randn(gen, *s) for k, s in shapes.items()}
    ins = {k: t.input(a.shape, "float32", k) for k, a in arrays.items()}
    t.graph.outputs = {k: v.value for k, v in body(t, ins).items()}
    return t.graph, arrays


def zeros(t, *shape):
    return t.op("fill", [], value=0.0, shape=shape, dtype="float32")


def folded_ops(graph, arrays) -> list[str]:
    """The ops left after folding, once the results are checked equal to the graph's own."""
    after = fold_zeros(graph)
    want, got = run_graph(graph, arrays), run_graph(after, arrays)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    return [n.op for n in after.nodes]


@pytest.mark.parametrize("zero_first", [True, False])
def test_a_product_with_zeros_is_a_fill(zero_first):
    def body(t, x):
        z = zeros(t, 3, 4)
        a, b = (z, x["w"]) if zero_first else (x["w"], z.reshape(4, 3))
        return {"mm": t.op("matmul", [a, b]), "lin": t.op("linear", [z, x["w"]])}
    ops = folded_ops(*traced(body, w=(4, 4)))
    assert "matmul" not in ops and "linear" not in ops


def test_a_linear_with_bias_or_activation_is_kept():
    def body(t, x):
        z = zeros(t, 3, 4)
        return {"bias": t.op("linear", [z, x["w"], x["b"]]),
                "act": t.op("linear", [z, x["w"]], act="relu")}
    assert folded_ops(*traced(body, w=(5, 4), b=(5,))).count("linear") == 2


def test_sums_with_zeros_are_their_other_operand():
    def body(t, x):
        z = zeros(t, 2, 3)
        return {"add": t.op("add", [z, x["a"]]) * 2.0,
                "binary": t.op("binary", [x["a"], z], kind="add") * 3.0,
                "broadcast": t.op("binary", [zeros(t, 4, 2, 3), x["a"]], kind="add")}
    ops = folded_ops(*traced(body, a=(2, 3)))
    assert "add" not in ops and ops.count("binary") == 1      # the broadcast stays


def test_a_step_output_or_kept_value_is_still_computed():
    def body(t, x):
        return {"out": t.op("add", [zeros(t, 2), x["a"]])}
    graph, arrays = traced(body, a=(2,))
    assert "add" in [n.op for n in fold_zeros(graph).nodes]
    kept = graph.outputs.pop("out")
    assert "add" in [n.op for n in fold_zeros(graph, (kept,)).nodes]


def test_an_lstm_cell_drops_a_zero_addend():
    def body(t, x):
        h, c, _ = t.op_all("lstm_cell", [x["xp"], zeros(t, 2, 12), x["c"]])
        return {"h": h, "c": c}
    graph, arrays = traced(body, xp=(2, 12), c=(2, 3))
    folded_ops(graph, arrays)
    cell = next(n for n in fold_zeros(graph).nodes if n.op == "lstm_cell")
    assert len(cell.inputs) == 2


@pytest.mark.parametrize("given_state", [False, True])
def test_lstm_first_step_skips_the_gemm_of_a_zero_state(given_state):
    steps, layers = 5, 2
    model = nn.LSTM(3, 4, num_layers=layers)
    model.name_parameters()
    t = Tracer()
    x = t.input((steps, 2, 3), "float32", "x")
    hx = None
    if given_state:
        hx = tuple(t.input((layers, 2, 4), "float32", k) for k in ("h0", "c0"))
    out, _ = model(x, hx)
    t.graph.outputs = {"out": out.value}
    hidden = [n for n in fold_zeros(t.graph).nodes if n.op == "linear" and len(n.inputs) == 2]
    assert len(hidden) == layers * (steps if given_state else steps - 1)
