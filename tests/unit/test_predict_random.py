"""Random draws in a compile_predict forward: Monte-Carlo dropout (F.dropout(x, p,
training=True) with the modules in eval mode) and torch.rand / randn / bernoulli_ draw from
the predictor's own device counter, which its graph advances first at every call: fresh
masks every call, the same sequence from a fresh predictor with the same seed, exactly the
masks rng.py defines, torch's keep rate and 1/(1-p) scale. nn.Dropout in eval mode still
does not drop, and a forward that draws nothing compiles to the graph it always did."""
from __future__ import annotations

import math

import numpy as np
import torch as real

import stepgraph as torch
from stepgraph import nn, rng
from stepgraph.compile.build import PREDICT_RNG_KEY, build_predict_graph
from stepgraph.ir.trace import Tracer
from stepgraph.loop.predict import TreePredictor
from stepgraph.nn import functional as F


class MCDropout(nn.Module):
    """x -> F.dropout(x + 1, p, training=True): the mask reads off the output exactly."""

    def __init__(self, p: float, per_channel: bool = False):
        super().__init__()
        self.p, self.per_channel = p, per_channel

    def forward(self, x):
        drop = F.dropout2d if self.per_channel else F.dropout
        return drop(x + 1.0, self.p, training=True)


class EvalNet(nn.Module):
    """Linear, BatchNorm1d, ReLU and nn.Dropout: in eval mode nothing draws."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn, self.drop = nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(F.relu(self.bn(self.fc(x))))


def _x(shape, seed: int = 0) -> np.ndarray:
    """Positive inputs, so that x + 1 is never 0 and a 0 in the output is a dropped element."""
    return np.random.default_rng(seed).uniform(0.5, 2.0, shape).astype(np.float32)


def _masks(predict, x, calls: int) -> list[np.ndarray]:
    return [(np.asarray(predict(x)) != 0).astype(np.uint8) for _ in range(calls)]


def test_mc_dropout_draws_fresh_masks_every_call_as_rng_defines():
    x, p, seed = _x((40, 50)), 0.3, 11
    predict = torch.compile_predict(MCDropout(p), (x,), seed=seed)
    masks = _masks(predict, x, 4)
    for k, mask in enumerate(masks, start=1):   # call k reads the counter after its increment
        np.testing.assert_array_equal(mask.ravel(), rng.dropout_keep_mask(x.size, p, seed, 0, k))
    for a, b in zip(masks, masks[1:]):
        assert not np.array_equal(a, b)
        # independent draws agree where both keep or both drop: p^2 + (1 - p)^2 of them
        agree, want = (a == b).mean(), p * p + (1 - p) ** 2
        assert abs(agree - want) < 5 * math.sqrt(want * (1 - want) / x.size)


def test_same_seed_repeats_from_a_fresh_predictor_another_seed_does_not():
    x = _x((30, 20), seed=1)
    first = _masks(torch.compile_predict(MCDropout(0.5), (x,), seed=3), x, 3)
    again = _masks(torch.compile_predict(MCDropout(0.5), (x,), seed=3), x, 3)
    other = _masks(torch.compile_predict(MCDropout(0.5), (x,), seed=4), x, 3)
    for a, b, c in zip(first, again, other):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)


def test_keep_rate_and_scale_as_torch():
    """The kept fraction is 1 - p (within 5 sigma) and a kept element is x / (1 - p), judged
    in float64 against a bound of torch float32's own error on the same inputs."""
    x, p = _x((200, 500), seed=2), 0.3
    got = np.asarray(torch.compile_predict(MCDropout(p), (x,))(x))
    ref = real.nn.functional.dropout(real.tensor(x) + 1.0, p, training=True).numpy()
    want = (x.astype(np.float64) + 1.0) / (1.0 - p)
    kept, kept_ref = got != 0, ref != 0
    sigma = math.sqrt(p * (1 - p) / x.size)
    assert abs(kept.mean() - (1 - p)) < 5 * sigma and abs(kept_ref.mean() - (1 - p)) < 5 * sigma
    torch_err = np.max(np.abs(ref[kept_ref] - want[kept_ref]) / want[kept_ref])
    err = np.max(np.abs(got[kept] - want[kept]) / want[kept])
    assert err <= 2 * max(torch_err, np.finfo(np.float32).eps)
    # unbiased: the output's mean is the input's
    assert abs(got.mean() / (x.astype(np.float64) + 1).mean() - 1) < 5 * math.sqrt(p / (1 - p)
                                                                            / x.size)


def test_dropout2d_drops_whole_channels_in_a_predictor():
    x, p = _x((16, 12, 3, 3), seed=3), 0.4
    predict = torch.compile_predict(MCDropout(p, per_channel=True), (x,), seed=5)
    a, b = _masks(predict, x, 2)
    planes = a.reshape(16, 12, 9)
    assert (planes == planes[:, :, :1]).all()           # one decision per (N, C) plane
    np.testing.assert_array_equal(planes[:, :, 0].ravel(),
                                  rng.dropout_keep_mask(16 * 12, p, 5, 0, 1))
    assert not np.array_equal(a, b)


def test_feed_signatures_share_the_counter():
    """A second batch shape gets its own graph, drawing at the predictor's next counter."""
    p = 0.5
    predict = torch.compile_predict(MCDropout(p), (_x((8, 6)),))
    predict(_x((8, 6)))
    small = _x((3, 6), seed=4)
    mask = (np.asarray(predict(small)) != 0).astype(np.uint8)
    np.testing.assert_array_equal(mask.ravel(), rng.dropout_keep_mask(small.size, p, 0, 0, 2))


def test_nn_dropout_in_eval_does_not_drop_and_adds_nothing():
    """torch's eval-mode output; the graph has no counter and no increment: bound state is
    the BatchNorm buffers only, and the nodes are those of a plain eval trace."""
    model = EvalNet()
    x = np.random.default_rng(6).standard_normal((9, 5)).astype(np.float32)
    predict = torch.compile_predict(model, (x,))
    first, second = np.asarray(predict(x)), np.asarray(predict(x))
    np.testing.assert_array_equal(first, second)
    ref = real.nn.Sequential(real.nn.Linear(5, 7), real.nn.BatchNorm1d(7), real.nn.ReLU(),
                             real.nn.Dropout(0.5)).double().eval()
    ref.load_state_dict({k.replace("fc.", "0.").replace("bn.", "1."): real.tensor(v.numpy())
                         for k, v in model.state_dict().items()})
    want = ref(real.tensor(x, dtype=real.float64)).detach().numpy()
    ref32 = ref.float()(real.tensor(x)).detach().numpy()
    bound = 4 * max(np.max(np.abs(ref32 - want)), np.finfo(np.float32).eps)
    assert np.max(np.abs(first - want)) <= bound
    graph = build_predict_graph(model, predict.signature)
    assert {v.name for v in graph.state} == {"bn.running_mean", "bn.running_var"}
    plain = Tracer(training=False)
    with_eval = model.eval()
    with_eval(plain.input((9, 5), "float32", "x"))
    assert [n.op for n in graph.nodes] == [n.op for n in plain.graph.nodes]
    assert predict._rng_counter is None
    assert "step_increment" not in [n.op for n in predict.executable(predict.signature).plan.steps]


def test_the_increment_comes_first_and_only_once():
    x = _x((4, 6))
    predict = torch.compile_predict(MCDropout(0.5), (x,))
    graph = predict.executable(predict.signature).plan.graph
    ops = [n.op for n in graph.nodes]
    assert ops[0] == "step_increment" and ops.count("step_increment") == 1
    assert [v.name for v in graph.state] == [PREDICT_RNG_KEY]
    predict(x)
    predict(x)
    assert int(predict._rng_counter) == 2


class Noisy(nn.Module):
    """torch.rand_like, torch.randn and Tensor.bernoulli_ inside forward."""

    def forward(self, x):
        u = torch.rand_like(x)
        z = torch.randn(x.shape[0], x.shape[1])
        b = torch.empty(x.shape).bernoulli_(0.25)
        return torch.stack([x + u, z, b])


def test_random_draws_in_a_predict_forward():
    x = np.zeros((300, 200), np.float32)
    predict = torch.compile_predict(Noisy(), (x,), seed=9)
    u, z, b = np.asarray(predict(x))
    n = x.size
    np.testing.assert_array_equal(u.ravel(), rng.uniform(n, 9, 0, 1))
    np.testing.assert_array_equal(z.ravel(), rng.normal(n, 9, 1, 1))
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(z.mean()) < 5 / math.sqrt(n) and abs(z.std() - 1) < 5 / math.sqrt(n)
    assert set(np.unique(b)) <= {0.0, 1.0}
    assert abs(b.mean() - 0.25) < 5 * math.sqrt(0.25 * 0.75 / n)
    u2, z2, b2 = np.asarray(predict(x))
    assert not (np.array_equal(u, u2) or np.array_equal(z, z2) or np.array_equal(b, b2))
    again = np.asarray(torch.compile_predict(Noisy(), (x,), seed=9)(x))
    np.testing.assert_array_equal(again, np.stack([u, z, b]))


def test_a_script_eval_call_draws_too():
    """The predictor a training script's eval calls run through (loop/predict.py)."""
    x = _x((10, 10), seed=7)
    predict = TreePredictor(MCDropout(0.5), [x], device="cpu")
    first, second = (np.asarray(predict(x).numpy()) for _ in range(2))
    np.testing.assert_array_equal((first != 0).ravel(), rng.dropout_keep_mask(x.size, 0.5, 0, 0, 1))
    assert not np.array_equal(first, second)

