"""Every op's forward and gradient against PyTorch (DESIGN.md Style 9, first of three ways).

Each test traces a small graph on symbolic inputs, appends its backward with the real autodiff
(loss = mse against a random target for non-scalar outputs), runs it on the numpy backend —
unfused and through the fusion passes — and compares the output and every input gradient with
torch autograd on the same fresh random float32 inputs.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch import nn as tnn

import stepgraph as sg
from stepgraph import losses, nn, rng
from stepgraph.ops.activation import ACTIVATIONS
from stepgraph.ir.trace import Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import (assert_close, build_train_graph, forward_and_grads, op_forward,
                               op_vjp, randn, run_graph, seeded, torch_forward_and_grads)

FUSED = pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
LEAKY_SLOPE = 0.2     # not torch's default 0.01, so a dropped slope attribute shows


@pytest.fixture
def gen(request) -> np.random.Generator:
    return seeded(request.node.name)


def check_against_torch(body, torch_fn, arrays, wrt, fused, rtol=1e-5):
    out, grads = forward_and_grads(body, arrays, wrt, fused)
    t_out, t_grads = torch_forward_and_grads(torch_fn, arrays, wrt)
    assert_close(out, t_out, rtol, "forward")
    for name in wrt:
        assert grads[name].dtype == arrays[name].dtype
        assert_close(grads[name], t_grads[name], rtol, f"grad of {name}")


def op_names(body, arrays, wrt, fused) -> list[str]:
    return [n.op for n in build_train_graph(body, arrays, wrt, fused).nodes]


def torch_act(kind: str):
    return {"relu": TF.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
            "leaky_relu": lambda z: TF.leaky_relu(z, LEAKY_SLOPE),
            "gelu": TF.gelu, "gelu_tanh": lambda z: TF.gelu(z, approximate="tanh"),
            "silu": TF.silu}[kind]


# ---- activations ---------------------------------------------------------------------------

@FUSED
@pytest.mark.parametrize("kind", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(7, 33), (3, 4, 5, 6)], ids=["2d", "4d"])
def test_activation(kind, shape, fused, gen):
    arrays = {"x": 2 * randn(gen, *shape), "target": randn(gen, *shape)}
    check_against_torch(lambda t, i: F.activation(i["x"], kind, LEAKY_SLOPE),
                        lambda x: torch_act(kind)(x), arrays, ("x",), fused)


# ---- linear, alone and with a fused activation ---------------------------------------------

@FUSED
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kind", (None,) + ACTIVATIONS)
def test_linear(kind, bias, fused, gen):
    arrays = {"x": randn(gen, 16, 24), "w": randn(gen, 12, 24) / 4, "b": randn(gen, 12),
              "target": randn(gen, 16, 12)}
    if not bias:
        del arrays["b"]
    wrt = tuple(k for k in arrays if k != "target")

    def body(t, i):
        z = t.op("linear", [i[k] for k in wrt], act=None)
        return z if kind is None else F.activation(z, kind, LEAKY_SLOPE)

    def torch_fn(x, w, b=None):
        z = TF.linear(x, w, b)
        return z if kind is None else torch_act(kind)(z)

    if fused and kind is not None:   # the fused kernel, not the unfused one, is under test
        ops = op_names(body, arrays, wrt, fused)
        assert "act" not in ops and ("act_bias_grad" in ops) == bias, ops
    check_against_torch(body, torch_fn, arrays, wrt, fused)


# ---- matmul, the backward GEMM (every transpose combination) -------------------------------

@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_matmul(trans_a, trans_b, gen):
    a = randn(gen, *((9, 5) if trans_a else (5, 9)))
    b = randn(gen, *((7, 9) if trans_b else (9, 7)))
    (c,) = op_forward("matmul", {"a": a, "b": b}, trans_a=trans_a, trans_b=trans_b)
    ta, tb = torch.tensor(a), torch.tensor(b)
    want = (ta.T if trans_a else ta) @ (tb.T if trans_b else tb)
    assert_close(c, want.numpy())


# ---- convolution ---------------------------------------------------------------------------

CONV_CASES = {   # x shape, w shape, stride, padding
    "3x3-pad1": ((2, 3, 8, 8), (4, 3, 3, 3), (1, 1), (1, 1)),
    "nonsquare-stride21-pad10": ((2, 3, 9, 7), (5, 3, 3, 2), (2, 1), (1, 0)),
    "5x5-stride2-pad2": ((3, 2, 10, 11), (4, 2, 5, 5), (2, 2), (2, 2)),
    "stride2-last-row-unused": ((2, 1, 8, 8), (3, 1, 3, 3), (2, 2), (0, 0)),
    "2x3-stride12-pad01": ((2, 2, 6, 7), (3, 2, 2, 3), (1, 2), (0, 1)),
    "stride-beyond-kernel": ((2, 2, 9, 8), (3, 2, 2, 2), (3, 3), (1, 0)),
    "mnist-first-layer": ((4, 1, 28, 28), (10, 1, 5, 5), (1, 1), (0, 0)),
}


@FUSED
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv2d(case, bias, fused, gen):
    xs, ws, stride, padding = CONV_CASES[case]
    arrays = {"x": randn(gen, *xs), "w": randn(gen, *ws) / 3, "b": randn(gen, ws[0])}
    if not bias:
        del arrays["b"]
    wrt = tuple(arrays)
    t_out = TF.conv2d(torch.tensor(arrays["x"]), torch.tensor(arrays["w"]),
                      torch.tensor(arrays["b"]) if bias else None, stride, padding)
    arrays["target"] = randn(gen, *t_out.shape)
    check_against_torch(
        lambda t, i: t.op("conv2d", [i[k] for k in wrt], stride=stride, padding=padding),
        lambda x, w, b=None: TF.conv2d(x, w, b, stride, padding), arrays, wrt, fused)


# ---- pooling -------------------------------------------------------------------------------

POOL_CASES = {   # x shape, kernel, stride
    "k2s2": ((2, 3, 8, 8), (2, 2), (2, 2)),
    "k2s2-odd-floor": ((2, 3, 7, 9), (2, 2), (2, 2)),
    "k2s1-overlap": ((2, 2, 7, 8), (2, 2), (1, 1)),
    "k3s1-overlap": ((2, 3, 8, 8), (3, 3), (1, 1)),
    "k3s2-overlap": ((2, 3, 9, 10), (3, 3), (2, 2)),
    "k23s12": ((2, 2, 8, 9), (2, 3), (1, 2)),
}


@FUSED
@pytest.mark.parametrize("case", POOL_CASES)
def test_maxpool2d(case, fused, gen):
    xs, kernel, stride = POOL_CASES[case]
    x = randn(gen, *xs)
    t_out = TF.max_pool2d(torch.tensor(x), kernel, stride)
    arrays = {"x": x, "target": randn(gen, *t_out.shape)}
    check_against_torch(lambda t, i: F.max_pool2d(i["x"], kernel, stride),
                        lambda x: TF.max_pool2d(x, kernel, stride), arrays, ("x",), fused)


def test_maxpool2d_indices_point_at_the_maximum(gen):
    x = randn(gen, 2, 3, 9, 10)
    y, idx = op_forward("maxpool2d", {"x": x}, kernel=(3, 3), stride=(2, 2))
    _, t_idx = TF.max_pool2d(torch.tensor(x), 3, 2, return_indices=True)
    assert idx.dtype == np.int32
    np.testing.assert_array_equal(idx, t_idx.numpy())
    planes = x.reshape(2, 3, -1)
    np.testing.assert_array_equal(np.take_along_axis(planes, idx.reshape(2, 3, -1), -1),
                                  y.reshape(2, 3, -1))


# ---- views ---------------------------------------------------------------------------------

@FUSED
@pytest.mark.parametrize("shape", [(4, 30), (4, 5, 6), (120,), (-1, 10)])
def test_flatten_and_reshape(shape, fused, gen):
    want_shape = torch.empty(4, 3, 5, 2).reshape(shape).shape
    arrays = {"x": randn(gen, 4, 3, 5, 2), "target": randn(gen, *want_shape)}
    body = (lambda t, i: F.flatten(i["x"])) if shape == (4, 30) else \
        (lambda t, i: i["x"].reshape(*shape))
    check_against_torch(body, lambda x: x.reshape(shape), arrays, ("x",), fused)


# ---- softmax and losses --------------------------------------------------------------------

def labels_for(gen, n: int, classes: int, dtype=np.int64) -> np.ndarray:
    return gen.integers(0, classes, n).astype(dtype)


@FUSED
def test_log_softmax(fused, gen):
    arrays = {"x": 3 * randn(gen, 16, 10), "target": randn(gen, 16, 10)}
    check_against_torch(lambda t, i: F.log_softmax(i["x"]), lambda x: TF.log_softmax(x, 1),
                        arrays, ("x",), fused)


@FUSED
@pytest.mark.parametrize("scale", [1.0, 40.0], ids=["logits", "large-logits"])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_cross_entropy(dtype, scale, fused, gen):
    arrays = {"x": scale * randn(gen, 16, 10), "y": labels_for(gen, 16, 10, dtype)}
    body = lambda t, i: losses.cross_entropy(i["x"], i["y"])   # noqa: E731
    if fused:
        assert "cross_entropy_train" in op_names(body, arrays, ("x",), fused)
    check_against_torch(body, lambda x, y: TF.cross_entropy(x, y.long()), arrays, ("x",), fused)


@FUSED
def test_log_softmax_then_nll_loss(fused, gen):
    arrays = {"x": 3 * randn(gen, 16, 10), "y": labels_for(gen, 16, 10)}
    body = lambda t, i: losses.nll_loss(F.log_softmax(i["x"]), i["y"])   # noqa: E731
    if fused:   # rewritten into the fused softmax cross-entropy kernel
        assert op_names(body, arrays, ("x",), fused) == ["cross_entropy_train"]
    check_against_torch(body, lambda x, y: TF.nll_loss(TF.log_softmax(x, 1), y),
                        arrays, ("x",), fused)


@FUSED
def test_nll_loss(fused, gen):
    arrays = {"x": randn(gen, 16, 10), "y": labels_for(gen, 16, 10)}
    check_against_torch(lambda t, i: losses.nll_loss(i["x"], i["y"]),
                        lambda x, y: TF.nll_loss(x, y), arrays,
                        ("x",), fused)


@FUSED
@pytest.mark.parametrize("shape", [(16, 10), (4, 3, 5, 5)])
def test_mse(shape, fused, gen):
    arrays = {"p": randn(gen, *shape), "q": randn(gen, *shape)}
    check_against_torch(lambda t, i: losses.mse(i["p"], i["q"]),
                        lambda p, q: TF.mse_loss(p, q), arrays,
                        ("p", "q"), fused)


# ---- dropout: Philox masks (no torch twin: torch's generator differs) ------------------------

def run_dropout(x, p, step, site=3, seed=11, per_channel=False):
    arrays = {"x": x, "step": np.array(step, np.int64)}
    return op_forward("dropout", arrays, p=p, seed=seed, site=site, per_channel=per_channel)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_forward_matches_rng(p, gen):
    x = randn(gen, 64, 100)
    y, mask = run_dropout(x, p, step=5)
    want = rng.dropout_keep_mask(x.size, p, seed=11, site=3, step=5).reshape(x.shape)
    assert mask.dtype == np.uint8
    np.testing.assert_array_equal(mask, want)
    np.testing.assert_array_equal(y, x * mask * np.float32(1 / (1 - p)))
    keep = mask.mean()
    assert abs(keep - (1 - p)) < 4 * np.sqrt(p * (1 - p) / x.size), keep


@pytest.mark.parametrize("per_channel", [False, True], ids=["elementwise", "per-channel"])
def test_dropout_grad_is_mask_times_scale(per_channel, gen):
    x, dy = randn(gen, 8, 6, 5, 5), randn(gen, 8, 6, 5, 5)
    _, mask = run_dropout(x, 0.3, step=2, per_channel=per_channel)
    grads = op_vjp("dropout", {"x": x, "step": np.array(2, np.int64)}, dy, ("x",), p=0.3,
                   seed=11, site=3, per_channel=per_channel)
    full = mask[:, :, None, None] if per_channel else mask
    np.testing.assert_array_equal(grads["x"], dy * full * np.float32(1 / 0.7))


def test_dropout2d_zeroes_whole_planes(gen):
    x = randn(gen, 16, 8, 4, 4)
    y, mask = run_dropout(x, 0.5, step=0, per_channel=True)
    assert mask.shape == (16, 8)
    np.testing.assert_array_equal(
        mask, rng.dropout_keep_mask(16 * 8, 0.5, 11, 3, 0).reshape(16, 8))
    dropped = y[mask == 0]
    assert dropped.size and not dropped.any()
    assert 0 < mask.mean() < 1


def test_dropout_masks_differ_across_steps_sites_and_seeds(gen):
    x = randn(gen, 32, 64)
    base = run_dropout(x, 0.5, step=1)[1]
    for other in (run_dropout(x, 0.5, step=2)[1], run_dropout(x, 0.5, step=1, site=4)[1],
                  run_dropout(x, 0.5, step=1, seed=12)[1], run_dropout(x, 0.5, step=1 + 2**32)[1]):
        assert 0.3 < (other != base).mean() < 0.7   # independent masks disagree about half


def test_dropout_sites_in_a_traced_model_are_distinct():
    tracer = Tracer(seed=5)
    x = tracer.input((4, 8), "float32", "x")
    model = nn.Sequential(nn.Dropout(0.2), nn.Linear(8, 8), nn.Dropout(0.2), nn.Dropout(0.3))
    model(x)
    drops = [n for n in tracer.graph.nodes if n.op == "dropout"]
    assert [n.attrs["site"] for n in drops] == [0, 1, 2]
    assert {n.attrs["seed"] for n in drops} == {5}
    assert all(n.inputs[1] is tracer.rng_step() for n in drops)


def _train_dropout(fn, x: np.ndarray, step: int = 3) -> np.ndarray:
    """fn(x) traced for training and run on the numpy backend at dropout step `step`."""
    tracer = Tracer(seed=5, training=True)
    y = fn(tracer.input(x.shape, str(x.dtype), "x"))
    tracer.graph.outputs = {"y": y.value}
    bound = {v.name: np.array(step, np.int64) for v in tracer.graph.state}
    return run_graph(tracer.graph, {"x": x}, bound)["y"]


def test_dropout_p1_gives_zeros_as_torch(gen):
    x = randn(gen, 4, 6)
    x[0, 0] = np.inf
    want = TF.dropout(torch.from_numpy(x), 1.0, training=True).numpy()   # inf * 0 is NaN
    for fn in (lambda t: F.dropout(t, 1.0), lambda t: nn.Dropout(1.0)(t),
               lambda t: F.dropout2d(t.reshape(2, 2, 3, 2), 1.0).reshape(4, 6)):
        np.testing.assert_array_equal(_train_dropout(fn, x), want)
    with pytest.raises(ValueError, match="between 0 and 1"):
        nn.Dropout(1.5)


def test_dropout2d_of_a_3d_input_drops_rows_as_torch(gen):
    """torch reads a 3-d dropout2d input as (N, C, L): each (n, c) row kept whole (scaled by
    1 / (1 - p)) or zeroed, with probability p."""
    x = randn(gen, 64, 32, 5)
    p = 0.25
    y = _train_dropout(lambda t: F.dropout2d(t, p), x)
    kept = (y != 0).all(axis=2)
    assert ((y == 0).all(axis=2) | kept).all()          # whole rows only
    np.testing.assert_array_equal(y[kept], x[kept] * np.float32(1 / (1 - p)))
    n = kept.size
    assert abs(kept.mean() - (1 - p)) < 4 * np.sqrt(p * (1 - p) / n), kept.mean()
    torch_kept = (TF.dropout2d(torch.ones(64, 32, 5), p, training=True) != 0).all(dim=2)
    assert abs(torch_kept.float().mean().item() - (1 - p)) < 4 * np.sqrt(p * (1 - p) / n)


# ---- layers with their default arguments, as torch.nn builds them ---------------------------

def layer_pairs():
    return {
        "ReLU": (nn.ReLU(), tnn.ReLU(), (6, 5)),
        "LeakyReLU": (nn.LeakyReLU(), tnn.LeakyReLU(), (6, 5)),
        "Sigmoid": (nn.Sigmoid(), tnn.Sigmoid(), (6, 5)),
        "Tanh": (nn.Tanh(), tnn.Tanh(), (6, 5)),
        "GELU": (nn.GELU(), tnn.GELU(), (6, 5)),
        "GELU-tanh": (nn.GELU("tanh"), tnn.GELU("tanh"), (6, 5)),
        "LogSoftmax": (nn.LogSoftmax(dim=1), tnn.LogSoftmax(dim=1), (6, 5)),
        "Flatten": (nn.Flatten(), tnn.Flatten(), (6, 2, 3, 4)),
        "MaxPool2d": (nn.MaxPool2d(3, 2), tnn.MaxPool2d(3, 2), (2, 3, 9, 8)),
        "Linear-nobias": (nn.Linear(5, 4, bias=False), tnn.Linear(5, 4, bias=False), (6, 5)),
        "Conv2d": (nn.Conv2d(3, 4, (3, 2), stride=2, padding=1),
                   tnn.Conv2d(3, 4, (3, 2), stride=2, padding=1), (2, 3, 9, 8)),
        "Dropout-eval": (nn.Dropout(0.5), tnn.Dropout(0.5), (6, 5)),
        "Dropout2d-eval": (nn.Dropout2d(0.5), tnn.Dropout2d(0.5), (2, 3, 4, 4)),
    }


@pytest.mark.parametrize("layer", layer_pairs())
def test_layer_defaults_match_torch_nn(layer, gen):
    ours, theirs, shape = layer_pairs()[layer]
    model = nn.Sequential(ours)
    theirs.eval()
    torch_state = {f"0.{k}": v.detach().numpy() for k, v in theirs.state_dict().items()}
    assert list(model.state_dict()) == list(torch_state)
    model.load_state_dict(torch_state)
    x = 2 * randn(gen, *shape)
    with torch.no_grad():
        assert_close(sg.compile_predict(model, (x,))(x), theirs(torch.tensor(x)).numpy())
