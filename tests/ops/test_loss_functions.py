"""Losses with reduction mean / sum / none, class weights, ignore_index, label smoothing,
pos_weight, beta / delta and log_target: forward and input gradients against PyTorch's
torch.nn.functional (float32 and float64), and the loss modules against torch.nn's."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch import nn as tnn

from stepgraph import nn
from stepgraph.errors import ShapeError
from stepgraph.nn import functional as F
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import check_with_torch, assert_close, forward_and_grads, randn, run_graph, seeded

DTYPES = pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
RTOL = {np.float32: 1e-5, np.float64: 1e-10}
REDUCTIONS = pytest.mark.parametrize("reduction", ["mean", "sum", "none"])


@pytest.fixture
def gen(request) -> np.random.Generator:
    return seeded(request.node.name)


check = check_with_torch


def labels(gen, n, classes, ignore=None):
    t = gen.integers(0, classes, n).astype(np.int64)
    if ignore is not None:
        t.reshape(-1)[::3] = ignore
    return t


@DTYPES
@REDUCTIONS
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy(gen, dtype, reduction, smoothing, weighted):
    arrays = {"x": randn(gen, 6, 5, dtype=dtype), "t": labels(gen, 6, 5, ignore=-100)}
    if weighted:
        arrays["w"] = gen.uniform(0.2, 2.0, 5).astype(dtype)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    check(lambda x, t, w=None: F.cross_entropy(x, t, w, **kw),
          lambda x, t, w=None: TF.cross_entropy(x, t, w, **kw),
          arrays, ("x",), RTOL[dtype])


@DTYPES
def test_cross_entropy_spatial_targets_and_ignore_index(gen, dtype):
    arrays = {"x": randn(gen, 2, 4, 3, 5, dtype=dtype), "t": labels(gen, (2, 3, 5), 4, 2),
              "w": gen.uniform(0.2, 2.0, 4).astype(dtype)}
    for reduction in ("mean", "none"):
        kw = dict(ignore_index=2, reduction=reduction, label_smoothing=0.1)
        check(lambda x, t, w: F.cross_entropy(x, t, w, **kw),
              lambda x, t, w: TF.cross_entropy(x, t, w, **kw), arrays, ("x",), RTOL[dtype])


@DTYPES
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_cross_entropy_probability_targets(gen, dtype, smoothing):
    p = np.random.default_rng(3).dirichlet(np.ones(5), 4).astype(dtype)
    arrays = {"x": randn(gen, 4, 5, dtype=dtype), "t": p, "w": gen.uniform(0.5, 2, 5)
              .astype(dtype)}
    check(lambda x, t, w: F.cross_entropy(x, t, w, label_smoothing=smoothing),
          lambda x, t, w: TF.cross_entropy(x, t, w, label_smoothing=smoothing),
          arrays, ("x", "t"), RTOL[dtype])


@DTYPES
@REDUCTIONS
def test_nll_loss(gen, dtype, reduction):
    arrays = {"x": randn(gen, 7, 4, dtype=dtype), "t": labels(gen, 7, 4, ignore=1),
              "w": gen.uniform(0.2, 2.0, 4).astype(dtype)}
    kw = dict(reduction=reduction, ignore_index=1)
    check(lambda x, t, w: F.nll_loss(x, t, w, **kw), lambda x, t, w: TF.nll_loss(x, t, w, **kw),
          arrays, ("x",), RTOL[dtype])


POINTWISE = {
    "mse": (F.mse_loss, TF.mse_loss, {}),
    "l1": (F.l1_loss, TF.l1_loss, {}),
    "smooth_l1": (F.smooth_l1_loss, TF.smooth_l1_loss, {"beta": 0.7}),
    "smooth_l1_beta0": (F.smooth_l1_loss, TF.smooth_l1_loss, {"beta": 0.0}),
    "huber": (F.huber_loss, TF.huber_loss, {"delta": 0.6}),
    "kl_div": (F.kl_div, TF.kl_div, {}),
    "kl_div_log_target": (F.kl_div, TF.kl_div, {"log_target": True}),
}


@DTYPES
@REDUCTIONS
@pytest.mark.parametrize("name", list(POINTWISE))
@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides")
def test_pointwise_losses(gen, dtype, reduction, name):
    ours, theirs, kw = POINTWISE[name]
    x, t = randn(gen, 3, 4, dtype=dtype), randn(gen, 3, 4, dtype=dtype)
    wrt = ("x", "t")
    if name == "kl_div":
        t = np.abs(t)
        t[0, 0] = 0.0     # y = 0 contributes 0, not NaN (torch's d/dy there is NaN: not compared)
        wrt = ("x",)
    check(lambda x, t: ours(x, t, reduction=reduction, **kw),
          lambda x, t: theirs(x, t, reduction=reduction, **kw),
          {"x": x, "t": t}, wrt, RTOL[dtype])


@DTYPES
def test_kl_div_batchmean(gen, dtype):
    arrays = {"x": randn(gen, 3, 4, dtype=dtype), "t": randn(gen, 3, 4, dtype=dtype)}
    check(lambda x, t: F.kl_div(x, t, reduction="batchmean", log_target=True),
          lambda x, t: TF.kl_div(x, t, reduction="batchmean", log_target=True),
          arrays, ("x", "t"), RTOL[dtype])


@DTYPES
@REDUCTIONS
def test_binary_cross_entropy_with_logits(gen, dtype, reduction):
    arrays = {"x": randn(gen, 4, 3, dtype=dtype) * 4, "t": gen.uniform(0, 1, (4, 3))
              .astype(dtype), "w": gen.uniform(0.5, 2, (4, 1)).astype(dtype),
              "pw": gen.uniform(0.5, 3, 3).astype(dtype)}
    kw = dict(reduction=reduction)
    check(lambda x, t, w, pw: F.binary_cross_entropy_with_logits(x, t, w, pos_weight=pw, **kw),
          lambda x, t, w, pw: TF.binary_cross_entropy_with_logits(x, t, w, pos_weight=pw, **kw),
          arrays, ("x", "t"), RTOL[dtype])


@DTYPES
@REDUCTIONS
def test_binary_cross_entropy(gen, dtype, reduction):
    arrays = {"x": gen.uniform(0.05, 0.95, (4, 3)).astype(dtype),
              "t": gen.uniform(0, 1, (4, 3)).astype(dtype),
              "w": gen.uniform(0.5, 2, (4, 3)).astype(dtype)}
    check(lambda x, t, w: F.binary_cross_entropy(x, t, w, reduction=reduction),
          lambda x, t, w: TF.binary_cross_entropy(x, t, w, reduction=reduction),
          arrays, ("x", "t"), RTOL[dtype])


def test_binary_cross_entropy_clamps_the_log_at_minus_100():
    x = np.array([0.0, 1.0, 0.5], np.float32)
    t = np.array([1.0, 0.0, 1.0], np.float32)
    arrays = {"x": x, "t": t}
    got, _ = forward_and_grads(lambda tr, ins: F.binary_cross_entropy(
        ins["x"], ins["t"], reduction="sum"), arrays, ("x",), fused=False)
    want = TF.binary_cross_entropy(torch.tensor(x), torch.tensor(t), reduction="sum")
    assert np.isfinite(got)
    assert_close(got, want.numpy(), 1e-6, "loss")


def test_mismatched_shapes_and_bad_reduction_raise():
    tr = Tracer()
    x, t = tr.input((3, 4), "float32", "x"), tr.input((3, 5), "float32", "t")
    with pytest.raises(ShapeError, match=r"3, 4.*3, 5"):
        F.l1_loss(x, t)
    with pytest.raises(ValueError, match="reduction"):
        F.mse_loss(x, x, reduction="avg")
    with pytest.raises(ShapeError, match="targets of shape"):
        F.cross_entropy(x, tr.input((4,), "int64", "y"), reduction="sum")


# ---- the loss modules ------------------------------------------------------------------------

MODULES = {   # name: constructor arguments, integer class targets
    "CrossEntropyLoss": (dict(weight=[0.5, 1.0, 2.0, 1.5], ignore_index=0,
                              label_smoothing=0.1), True),
    "NLLLoss": (dict(weight=[0.5, 1.0, 2.0, 1.5], reduction="sum"), True),
    "MSELoss": (dict(reduction="none"), False),
    "L1Loss": (dict(), False),
    "SmoothL1Loss": (dict(beta=0.5, reduction="sum"), False),
    "HuberLoss": (dict(delta=0.3), False),
    "KLDivLoss": (dict(reduction="batchmean", log_target=True), False),
    "BCELoss": (dict(weight=[1.0, 2.0, 0.5, 1.0]), False),
    "BCEWithLogitsLoss": (dict(weight=[1.0, 2.0, 0.5, 1.0], pos_weight=[2.0, 1.0, 0.5, 3.0],
                               reduction="sum"), False),
}


class _Scored(nn.Module):
    """A loss module under a root model, as a training script holds it (buffers get keys)."""

    def __init__(self, loss):
        super().__init__()
        self.loss = loss

    def forward(self, x, t):
        return self.loss(x, t)


@pytest.mark.parametrize("name", list(MODULES))
def test_loss_modules_match_torch(name, gen):
    kwargs, classes = MODULES[name]
    torch_kwargs = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    m, tm = _Scored(getattr(nn, name)(**kwargs)), getattr(tnn, name)(**torch_kwargs)
    m.name_parameters()
    assert list(m.state_dict()) == [f"loss.{k}" for k in tm.state_dict()]
    x = randn(gen, 5, 4)
    t = gen.integers(0, 4, 5).astype(np.int64) if classes else randn(gen, 5, 4)
    if name == "BCELoss":
        x, t = 1 / (1 + np.exp(-x)), np.abs(t) / (1 + np.abs(t))
    tr = Tracer()
    xs, ts = tr.input(x.shape, "float32", "x"), tr.input(t.shape, str(t.dtype), "t")
    tr.graph.outputs = {"y": m(xs, ts).value}
    bound = {k: v.numpy() for k, v in m.state_dict().items()}
    got = run_graph(tr.graph, {"x": x, "t": t}, bound)["y"]
    assert_close(got, tm(torch.tensor(x), torch.tensor(t)).numpy(), 1e-5, name)


def test_fused_cross_entropy_stays_for_the_default_case():
    """Mean, no weights, integer targets: the cross_entropy op (fused with the softmax);
    a weighted or summed loss: log_softmax and sums."""
    tr = Tracer()
    x, y = tr.input((4, 3), "float32", "x"), tr.input((4,), "int64", "y")
    F.cross_entropy(x, y, label_smoothing=0.1)
    assert [n.op for n in tr.graph.nodes] == ["cross_entropy"]
    F.cross_entropy(x, y, reduction="sum")
    assert "log_softmax" in [n.op for n in tr.graph.nodes[1:]]
    assert "cross_entropy" not in [n.op for n in tr.graph.nodes[1:]]


def test_weighted_loss_module_as_the_train_step_loss():
    """A criterion with a class-weight buffer, outside the model, trains like torch's."""
    import stepgraph as sg
    from stepgraph import optim
    rng = seeded("criterion")
    w = np.array([0.5, 2.0, 1.0], np.float32)
    model, ref = nn.Linear(4, 3), tnn.Linear(4, 3)
    model.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
    step = sg.compile_train_step(model, loss=nn.CrossEntropyLoss(weight=w, ignore_index=2),
                                 optimizer=optim.SGD(lr=0.1),
                                 example_inputs=(randn(rng, 8, 4), np.zeros(8, np.int64)))
    criterion = tnn.CrossEntropyLoss(weight=torch.tensor(w), ignore_index=2)
    topt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x, y = randn(rng, 8, 4), rng.integers(0, 3, 8).astype(np.int64)
        got = float(step(x, y))
        topt.zero_grad()
        want = criterion(ref(torch.tensor(x)), torch.tensor(y))
        want.backward()
        topt.step()
        assert abs(got - want.item()) < 1e-5 * max(1.0, abs(want.item()))
    assert_close(model.state_dict()["weight"], ref.weight.detach().numpy(), 1e-5, "weight")
