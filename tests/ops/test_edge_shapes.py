"""0-d and empty tensors, constant tensor arguments and dropout in a predictor: what the
OpInfo samples found crashing inside the tracer or NumPy, each against torch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import losses, nn, optim, rng
from stepgraph.errors import UnsupportedOpError
from stepgraph.ir.trace import Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import run_graph

SCALAR_OPS = {
    "softmax": (lambda x: x.softmax(0), lambda x: x.softmax(0)),
    "log_softmax": (lambda x: x.log_softmax(-1), lambda x: x.log_softmax(-1)),
    "transpose": (lambda x: x.transpose(0, -1), lambda x: x.transpose(0, -1)),
    "sum": (lambda x: x.sum(0, keepdim=True), lambda x: x.sum(0, keepdim=True)),
    "mean": (lambda x: x.mean(-1), lambda x: x.mean(-1)),
}


def run_traced(fn, *arrays):
    tracer = Tracer()
    ins = [tracer.input(a.shape, str(a.dtype), f"x{i}") for i, a in enumerate(arrays)]
    tracer.graph.outputs = {"out": fn(*ins).value}
    return run_graph(tracer.graph, {f"x{i}": a for i, a in enumerate(arrays)})["out"]


@pytest.mark.parametrize("name", list(SCALAR_OPS))
def test_reductions_and_softmax_of_a_0d_tensor_match_torch(name):
    ours, theirs = SCALAR_OPS[name]
    x = np.array(1.75, np.float32)
    got = run_traced(ours, x)
    want = theirs(torch.tensor(x)).numpy()
    assert got.shape == want.shape == ()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4)])
def test_softmax_of_an_empty_tensor_is_empty(shape):
    x = np.zeros(shape, np.float32)
    for dim in range(len(shape)):
        assert run_traced(lambda t: t.softmax(dim), x).shape == shape
        assert run_traced(lambda t: F.log_softmax(t, dim), x).shape == shape


def test_narrow_takes_a_constant_0d_int_tensor_and_refuses_a_traced_one():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for start in (torch.tensor(1), np.array(1, np.int64), np.int64(1)):
        got = run_traced(lambda t: t.narrow(1, start, torch.tensor(2)), x)
        np.testing.assert_array_equal(got, x[:, 1:3])
    tracer = Tracer()
    t = tracer.input(x.shape, "float32", "x")
    start = tracer.input((), "int64", "start")
    with pytest.raises(UnsupportedOpError, match="narrow with a traced tensor start"):
        t.narrow(1, start, 2)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss_reductions_match_torch(reduction):
    gen = np.random.default_rng(3)
    a, b = gen.standard_normal((2, 5, 3)).astype(np.float32), gen.standard_normal((2, 5, 3))
    b = b.astype(np.float32)
    got = run_traced(lambda x, y: F.mse_loss(x, y, reduction=reduction), a, b)
    want = torch.nn.functional.mse_loss(torch.tensor(a), torch.tensor(b), reduction=reduction)
    np.testing.assert_allclose(got, want.numpy(), rtol=2e-6)
    with pytest.raises(ValueError, match="reduction"):
        run_traced(lambda x, y: F.mse_loss(x, y, reduction="batchmean"), a, b)


class Scaled(nn.Module):
    """A linear layer times a 0-d scale, optionally after an explicit dropout (F.dropout's
    default training=True)."""

    def __init__(self, dropout: bool):
        super().__init__()
        self.scale = nn.Parameter(np.array(2.0, np.float32))
        self.lin = nn.Linear(3, 2)
        self.dropout = dropout

    def forward(self, x):
        y = self.lin(x)
        return (F.dropout(y, 0.5) if self.dropout else y) * self.scale


def test_0d_parameter_stays_0d_and_trains_like_torch():
    model = Scaled(dropout=False)
    assert model.scale.data.shape == () and model.state_dict()["scale"].shape == ()
    gen = np.random.default_rng(4)
    x, y = gen.standard_normal((4, 3)).astype(np.float32), np.zeros((4, 2), np.float32)
    lin = torch.nn.Linear(3, 2)
    lin.load_state_dict({k[4:]: torch.tensor(v.numpy()) for k, v in model.state_dict().items()
                         if k.startswith("lin.")})
    scale = torch.nn.Parameter(torch.tensor(2.0))
    torch.nn.functional.mse_loss(lin(torch.tensor(x)) * scale, torch.tensor(y)).backward()
    step = sg.compile_train_step(model, loss=losses.mse, optimizer=optim.SGD(lr=0.1),
                                 example_inputs=(x, y))
    step(x, y)
    after = model.state_dict()["scale"]
    assert after.shape == ()
    np.testing.assert_allclose(after - 2.0, -0.1 * scale.grad.numpy(), rtol=1e-5)


def test_dropout_with_training_true_drops_in_a_predictor():
    """compile_predict traces the model in eval mode; a dropout the model forces on
    (F.dropout's default training=True) drops there as in torch, with the mask the
    predictor's counter gives its first call (tests/unit/test_predict_random.py)."""
    model = Scaled(dropout=True)
    x = np.random.default_rng(5).standard_normal((6, 3)).astype(np.float32)
    got = sg.compile_predict(model, example_inputs=(x,))(x)
    sd = model.state_dict()
    keep = rng.dropout_keep_mask(12, 0.5, 0, 0, 1).reshape(6, 2)
    want = (x @ sd["lin.weight"].T + sd["lin.bias"]) * keep * 2.0 * sd["scale"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
