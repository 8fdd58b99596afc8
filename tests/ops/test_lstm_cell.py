"""The lstm_cell family (ops/lstm_cell.py) against torch's LSTM cell: h', c' and the
gradients of a weighted sum of them with respect to both gate addends and c, in float64
(to 1e-12) and float32 (within 8 times torch float32's own error against torch float64), with
dh' only, dc' only (autodiff differentiates the node through its second output) and one
addend; a finite-difference check of the VJP along a random direction; the layers built on it
(a loss of c_n alone, one cell node forward and one gradient node backward per step)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stepgraph import nn
from stepgraph.autodiff import append_backward
from stepgraph.errors import ShapeError
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import op_forward, randn, relative_error, run_graph, seeded

F32_EPS = float(np.finfo(np.float32).eps)
B, H = 5, 6
CASES = {"h_and_c": ("wh", "wc"), "h_only": ("wh",), "c_only": ("wc",)}


def arrays(case: str, dtype, addends: int = 2) -> dict[str, np.ndarray]:
    gen = seeded(f"lstm_cell {case} {addends} {np.dtype(dtype)}")
    out = {"xg": randn(gen, B, 4 * H, dtype=dtype)}
    if addends == 2:
        out["hg"] = randn(gen, B, 4 * H, dtype=dtype)
    out["c"] = randn(gen, B, H, dtype=dtype)
    out.update({w: randn(gen, B, H, dtype=dtype) for w in ("wh", "wc")})
    return out


def inputs_of(a: dict) -> list[str]:
    return [k for k in ("xg", "hg", "c") if k in a]


def stepgraph_run(a: dict, weights: tuple[str, ...]):
    """(h', c') and the gradients of sum(h' * wh) [+ sum(c' * wc)] by input, numpy backend."""
    tracer = Tracer()
    ins = {k: tracer.input(v.shape, str(v.dtype), k) for k, v in a.items()}
    h, c, _ = tracer.op_all("lstm_cell", [ins[k] for k in inputs_of(a)])
    terms = {"wh": h, "wc": c}
    loss = None
    for w in weights:
        term = (terms[w] * ins[w]).sum()
        loss = term if loss is None else loss + term
    wrt = inputs_of(a)
    grads = append_backward(tracer, loss.value, [ins[k].value for k in wrt])
    tracer.graph.outputs = {"h": h.value, "c": c.value,
                            **{f"d{k}": g for k, g in zip(wrt, grads)}}
    out = run_graph(tracer.graph, a)
    return out, tracer.graph


def torch_run(a: dict, weights: tuple[str, ...], dtype):
    """The same on torch.lstm_cell: input [xg, hg] through w_ih = [I I], so the gates are
    xg + hg, and a zero hidden product."""
    t = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in a.items()}
    parts = [t[k] for k in ("xg", "hg") if k in t]
    eye = torch.eye(4 * H, dtype=dtype)
    w_ih = torch.cat([eye] * len(parts), 1)
    zeros_h = torch.zeros(B, H, dtype=dtype)
    h, c = torch.lstm_cell(torch.cat(parts, 1), (zeros_h, t["c"]), w_ih,
                           torch.zeros(4 * H, H, dtype=dtype))
    terms = {"wh": h, "wc": c}
    loss = sum((terms[w] * t[w]).sum() for w in weights)
    wrt = inputs_of(a)
    grads = torch.autograd.grad(loss, [t[k] for k in wrt])
    return {"h": h.detach().numpy(), "c": c.detach().numpy(),
            **{f"d{k}": g.numpy() for k, g in zip(wrt, grads)}}


def assert_matches_torch(a: dict, weights: tuple[str, ...]) -> None:
    got, graph = stepgraph_run(a, weights)
    ops = [n.op for n in graph.nodes]
    assert ops.count("lstm_cell") == 1 and ops.count("lstm_cell_grad") == 1, ops
    want = torch_run(a, weights, torch.float64)
    t32 = torch_run({k: v.astype(np.float32) for k, v in a.items()}, weights, torch.float32)
    for name, w in want.items():
        assert got[name].shape == w.shape and got[name].dtype == a["xg"].dtype, name
        assert np.abs(w).max() > 0, name
        err = relative_error(got[name], w)
        if a["xg"].dtype == np.float64:
            assert err <= 1e-12, (name, err)
        else:
            bound = 8 * max(relative_error(t32[name], w), 4 * F32_EPS)
            assert err <= bound, (name, err, bound)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(CASES))
def test_cell_matches_torch(case, dtype):
    assert_matches_torch(arrays(case, dtype), CASES[case])


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
def test_one_addend_matches_torch(dtype):
    assert_matches_torch(arrays("one", dtype, addends=1), CASES["h_and_c"])


def test_vjp_matches_finite_differences():
    """<grad, v> against (f(x + e v) - f(x - e v)) / 2e along a random direction v of every
    input at once, float64."""
    a = arrays("fd", np.float64)
    weights = CASES["h_and_c"]
    got, _ = stepgraph_run(a, weights)
    gen = seeded("lstm_cell fd direction")
    names = inputs_of(a)
    v = {k: randn(gen, *a[k].shape, dtype=np.float64) for k in names}

    def f(shift: float) -> float:
        moved = [a[k] + shift * v[k] for k in names]
        h, c, _ = op_forward("lstm_cell", dict(zip(names, moved)))
        return float((h * a["wh"]).sum() + (c * a["wc"]).sum())

    eps = 1e-6
    numeric = (f(eps) - f(-eps)) / (2 * eps)
    analytic = sum(float((got[f"d{k}"] * v[k]).sum()) for k in names)
    assert abs(numeric - analytic) <= 1e-7 * max(1.0, abs(analytic)), (numeric, analytic)


def test_shape_rule_says_what_mismatched():
    tracer = Tracer()
    xg = tracer.input((B, 4 * H), "float32", "xg")
    with pytest.raises(ShapeError, match=r"gate pre-activations 1 must be \(5, 24\)"):
        tracer.emit("lstm_cell", [xg, tracer.input((B, 3 * H), "float32", "hg"),
                                  tracer.input((B, H), "float32", "c")])
    with pytest.raises(ShapeError, match="cell state must be"):
        tracer.emit("lstm_cell", [xg, tracer.input((B * H,), "float32", "c1")])
    with pytest.raises(ShapeError, match="needs dh or dc"):
        tracer.emit("lstm_cell_grad", [xg, tracer.input((B, H), "float32", "c2"),
                                       tracer.input((B, H), "float32", "c3")])


# ---- the layers built on it ----------------------------------------------------------------

def test_lstm_loss_of_the_final_cell_state_alone_matches_torch():
    """loss = sum(c_n * w): the last step's h' has no gradient, its c' has; every
    gradient as torch float64 (the layer in float64)."""
    nn.manual_seed(7)
    model = nn.LSTM(3, 4, num_layers=2)
    model.name_parameters()
    params = dict(model.named_parameters())
    gen = seeded("lstm c_n")
    x, w = randn(gen, 6, 2, 3, dtype=np.float64), randn(gen, 2, 2, 4, dtype=np.float64)
    tracer = Tracer()
    tx, tw = tracer.input(x.shape, "float64", "x"), tracer.input(w.shape, "float64", "w")
    for p in params.values():
        p.storage = p.storage.astype(np.float64)
    _, (_, c) = model(tx)
    loss = (c * tw).sum()
    wrt = [tx.value] + list(tracer.graph.params)
    grads = append_backward(tracer, loss.value, wrt)
    names = ["x"] + [v.name for v in tracer.graph.params]
    tracer.graph.outputs = {n: g for n, g in zip(names, grads)}
    got = run_graph(tracer.graph, {"x": x, "w": w}, {n: p.storage for n, p in params.items()})
    for p in params.values():
        p.storage = p.storage.astype(np.float32)

    twin = torch.nn.LSTM(3, 4, num_layers=2).double()
    twin.load_state_dict({k: torch.from_numpy(v.numpy().astype(np.float64))
                          for k, v in model.state_dict().items()})
    tx = torch.tensor(x, requires_grad=True)
    _, (_, tc) = twin(tx)
    tgrads = torch.autograd.grad((tc * torch.from_numpy(w)).sum(),
                                 [tx] + list(twin.parameters()))
    for name, g in zip(["x"] + [n for n, _ in twin.named_parameters()], tgrads):
        assert np.abs(g.numpy()).max() > 0, name
        assert relative_error(got[name], g.numpy()) <= 1e-12, name


def test_each_lstm_step_is_one_cell_node_and_one_gradient_node():
    model = nn.LSTM(3, 4, bidirectional=True)
    tracer = Tracer()
    out, (h, c) = model(tracer.input((7, 2, 3), "float32", "x"))
    loss = out.sum() + h.sum() + c.sum()
    model.name_parameters()
    append_backward(tracer, loss.value, list(tracer.graph.params))
    ops = [n.op for n in tracer.graph.nodes]
    assert ops.count("lstm_cell") == 2 * 7 and ops.count("lstm_cell_grad") == 2 * 7
    assert "act" not in ops and "act_grad" not in ops
