"""Random draws: on eager tensors from the host generator (`manual_seed`: ViT's
`torch.empty(...).normal_(std=0.02)`, nn.init on tensors), inside a train forward from the
step's Philox stream (`random` op: torch.rand / randn / randint / *_like, bernoulli(_),
uniform_ / normal_ / exponential_), exactly the values rng.py defines, fresh every step; and
torchvision's stochastic depth trained against torch (float64) given the same noise."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch as real

import stepgraph as torch
from stepgraph import nn, optim, rng
from stepgraph.errors import UnsupportedOpError
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import run_graph


def stochastic_depth(input, p: float, mode: str, training: bool = True, torch=torch):
    """torchvision.ops.stochastic_depth as torchvision writes it (`torch` the framework, so
    that the test can run it on both)."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if mode not in ["batch", "row"]:
        raise ValueError(f"mode has to be either 'batch' or 'row', but got {mode}")
    if not training or p == 0.0:
        return input
    survival_rate = 1.0 - p
    if mode == "row":
        size = [input.shape[0]] + [1] * (input.ndim - 1)
    else:
        size = [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return input * noise


# ---- the draws themselves ------------------------------------------------------------------

def test_uniform_and_normal_draws():
    u = rng.uniform(200_000, seed=11, site=2, step=7)
    assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
    np.testing.assert_array_equal(u * 2.0**24, np.floor(u * 2.0**24))   # 24-bit steps
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / u.size)
    # u >= p is exactly dropout's keep decision at the same counter
    np.testing.assert_array_equal(u >= np.float32(0.3),
                                  rng.dropout_keep_mask(u.size, 0.3, 11, 2, 7).astype(bool))
    z = rng.normal(200_000, seed=11, site=2, step=7)
    assert z.dtype == np.float32 and np.isfinite(z).all()
    assert abs(z.mean()) < 5 / math.sqrt(z.size) and abs(z.std() - 1) < 5 / math.sqrt(z.size)
    assert abs(np.mean(z ** 4) - 3) < 0.1                                 # Gaussian tails
    assert not np.array_equal(u, rng.uniform(u.size, 11, 2, 8))            # a new step


def _traced(body, step: int = 5, seed: int = 7):
    """Run body(x) traced in a train trace (seed) at step counter `step`; its outputs."""
    tracer = Tracer(seed=seed)
    x = tracer.input((64, 32), "float32", "x")
    with tracer.module_scope("model", "m"):
        outs = body(x)
    tracer.graph.outputs = {f"out{i}": t.value for i, t in enumerate(outs)}
    arrays = {"x": np.ones((64, 32), np.float32)}
    got = run_graph(tracer.graph, arrays, {"optimizer.step": np.array(step, np.int64)})
    return [got[f"out{i}"] for i in range(len(outs))]


def test_traced_draws_are_the_step_philox_values():
    shape, n = (64, 32), 64 * 32
    rand, randn, ints, uni, nor, ber, ber_t, rl, rnl = _traced(lambda x: (
        torch.rand(64, 32), torch.randn(64, 32, dtype=torch.float64),
        torch.randint(3, 10, (64, 32)), x.new_empty(64, 32).uniform_(-2, 3),
        torch.empty(64, 32).normal_(1.5, 0.5), torch.empty(64, 32).bernoulli_(0.25),
        torch.bernoulli(x * 0.75), torch.rand_like(x), torch.randn_like(x)))
    u = [rng.uniform(n, 7, site, 5).reshape(shape) for site in range(9)]
    z = [rng.normal(n, 7, site, 5).reshape(shape) for site in range(9)]
    np.testing.assert_array_equal(rand, u[0])
    assert randn.dtype == np.float64
    np.testing.assert_array_equal(randn, z[1].astype(np.float64))
    assert ints.dtype == np.int64 and ints.min() == 3 and ints.max() == 9
    np.testing.assert_array_equal(ints, np.floor(u[2].astype(np.float64) * 7) + 3)
    np.testing.assert_array_equal(uni, u[3] * np.float32(5) + np.float32(-2))
    np.testing.assert_array_equal(nor, z[4] * np.float32(0.5) + np.float32(1.5))
    np.testing.assert_array_equal(ber, (u[5] < 0.25).astype(np.float32))
    np.testing.assert_array_equal(ber_t, (u[6] < 0.75).astype(np.float32))
    np.testing.assert_array_equal(rl, u[7])
    np.testing.assert_array_equal(rnl, z[8])
    assert abs(ber.mean() - 0.25) < 5 * math.sqrt(0.25 * 0.75 / n)


def test_exponential_and_fresh_draws_every_step():
    first, = _traced(lambda x: (torch.empty(200, 500).exponential_(4.0),), step=1)
    again, = _traced(lambda x: (torch.empty(200, 500).exponential_(4.0),), step=1)
    later, = _traced(lambda x: (torch.empty(200, 500).exponential_(4.0),), step=2)
    np.testing.assert_array_equal(first, again)
    assert first.min() >= 0 and abs(first.mean() - 0.25) < 5 * 0.25 / math.sqrt(first.size)
    assert not np.array_equal(first, later)


def test_draws_in_a_predict_forward_draw_at_every_call():
    """From the predictor's counter, advanced at each call (tests/unit/test_predict_random.py)."""
    class Noisy(nn.Module):
        def forward(self, x):
            return x + torch.randn(x.shape[0], x.shape[1])
    x = np.ones((2, 3), np.float32)
    predict = torch.compile_predict(Noisy(), (x,), seed=7)
    first, second = np.asarray(predict(x)), np.asarray(predict(x))
    np.testing.assert_array_equal(first.ravel(), 1 + rng.normal(6, 7, 0, 1))
    np.testing.assert_array_equal(second.ravel(), 1 + rng.normal(6, 7, 0, 2))


# ---- stochastic depth, trained against torch ------------------------------------------------

class Block(nn.Module):
    """A residual block with stochastic depth, as torchvision's MBConv / CNBlock use it."""

    def __init__(self, p: float):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.p = p

    def forward(self, x):
        return x + stochastic_depth(self.fc2(self.fc1(x).relu()), self.p, "row", self.training)


def test_stochastic_depth_trains_as_torch_given_the_same_noise():
    torch.manual_seed(0)
    ours, seed, p, steps = Block(0.4), 9, 0.4, 4
    rs = np.random.default_rng(0)
    xs = rs.standard_normal((steps, 32, 8)).astype(np.float32)
    ts = rs.standard_normal((steps, 32, 8)).astype(np.float32)
    before = {k: v.numpy() for k, v in ours.state_dict().items()}
    step = torch.compile_train_step(ours, torch.nn.functional.mse_loss,
                                    optim.SGD(ours.parameters(), lr=0.1), (xs[0], ts[0]),
                                    seed=seed)
    losses = [float(step(x, t)) for x, t in zip(xs, ts)]
    # torch in float64 with the noise the step drew: site 0, counter k at call k + 1
    fc1, fc2 = real.nn.Linear(8, 16).double(), real.nn.Linear(16, 8).double()
    theirs = real.nn.ModuleDict({"fc1": fc1, "fc2": fc2})
    theirs.load_state_dict({k: real.tensor(v, dtype=real.float64) for k, v in before.items()})
    opt = real.optim.SGD(theirs.parameters(), lr=0.1)
    want = []
    for k, (x, t) in enumerate(zip(xs, ts)):
        keep = real.tensor(rng.uniform(32, seed, 0, k) < 1 - p, dtype=real.float64)
        x = real.tensor(x, dtype=real.float64)
        y = x + stochastic_depth(fc2(fc1(x).relu()), p, "row", torch=_Noise(keep))
        loss = real.nn.functional.mse_loss(y, real.tensor(t, dtype=real.float64))
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())
    np.testing.assert_allclose(losses, want, rtol=2e-6)
    for k, v in theirs.state_dict().items():
        change, want_change = ours.state_dict()[k].numpy() - before[k], v.numpy() - before[k]
        np.testing.assert_allclose(change, want_change, rtol=1e-4, atol=1e-6)


class _Noise:
    """A stand-in for the torch module inside stochastic_depth under torch: torch.empty(...)
    whose bernoulli_ writes the given keep decisions (the stepgraph step's)."""

    def __init__(self, keep):
        self.keep = keep

    def empty(self, size, dtype=None, device=None):
        keep = self.keep

        class Empty:
            def bernoulli_(self, p):
                return keep.reshape(size).clone()
        return Empty()


# ---- eager in-place initialisation ---------------------------------------------------------

def test_eager_initialisers_draw_from_the_seeded_host_generator():
    torch.manual_seed(3)
    a = torch.empty(1, 197, 64).normal_(std=0.02)
    torch.manual_seed(3)
    b = torch.empty(1, 197, 64).normal_(0.0, 0.02)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert abs(a.numpy().std() - 0.02) < 0.001 and a.dtype == torch.float32
    pos = nn.Parameter(torch.empty(1, 5, 4).normal_(std=0.02))     # ViT's pos_embedding
    assert pos.shape == (1, 5, 4) and 0 < np.abs(pos.numpy()).max() < 0.2
    u = torch.zeros(10_000).uniform_(-2, 3)
    assert -2 <= u.numpy().min() and u.numpy().max() < 3 and abs(u.numpy().mean() - 0.5) < 0.1
    e = torch.zeros(10_000, dtype=torch.float64).exponential_(2.0)
    assert e.dtype == torch.float64 and abs(e.numpy().mean() - 0.5) < 0.05
    bern = torch.zeros(10_000).bernoulli_(0.3)
    assert set(np.unique(bern.numpy())) == {0.0, 1.0} and abs(bern.numpy().mean() - 0.3) < 0.03
    probs = torch.tensor([0.0, 1.0, 0.0, 1.0])
    np.testing.assert_array_equal(probs.bernoulli().numpy(), [0, 1, 0, 1])
    np.testing.assert_array_equal(torch.bernoulli(probs, 1.0).numpy(), [1, 1, 1, 1])
    t = torch.empty(300, 40)
    assert nn.init.trunc_normal_(t, std=0.5, a=-0.3, b=0.4) is t
    assert t.numpy().min() >= -0.3 and t.numpy().max() <= 0.4
    nn.init.zeros_(t)
    assert not t.numpy().any()
    assert t.fill_(2.5).numpy().min() == 2.5 and not t.zero_().numpy().any()
    np.testing.assert_array_equal(t.copy_(torch.arange(40.0)).numpy()[7], np.arange(40.0))


def test_draws_on_eager_tensors_inside_a_forward_are_refused():
    class Init(nn.Module):
        def __init__(self, how):
            super().__init__()
            self.fc, self.how, self.noise = nn.Linear(3, 3), how, torch.zeros(3)

        def forward(self, x):
            if self.how == "method":
                self.noise.normal_()
            elif self.how == "init":
                nn.init.normal_(x)
            return self.fc(x) + self.noise

    x = np.ones((2, 3), np.float32)
    for how, match in (("method", "Tensor.normal_ of an eager tensor inside a traced forward"),
                       ("init", "nn.init's random initialisers on a tensor inside a traced")):
        model = Init(how)
        with pytest.raises(UnsupportedOpError, match=match):
            torch.compile_train_step(model, lambda y, t: (y * t).sum(),
                                     optim.SGD(model.parameters(), lr=0.1), (x, x))
