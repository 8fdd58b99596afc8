"""nn.init against torch.nn.init: fan rules and gains exactly, each distribution's bounds
and moments, exact constructions (eye_, dirac_, orthogonal_), in-place writes, and the
layers' default initialisation through reset_parameters."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stepgraph import nn
from stepgraph.nn import init

SHAPES = [(5, 3), (4, 3, 2), (8, 4, 3, 3), (2, 6, 1, 2, 3)]
# Enough draws that a sample moment lands within a few standard errors of the true one.
BIG = (400, 500)


@pytest.mark.parametrize("shape", SHAPES)
def test_fan_in_and_fan_out_match_torch(shape):
    want = torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(shape))
    assert init._calculate_fan_in_and_fan_out(nn.Parameter(np.zeros(shape))) == want


def test_fan_of_a_vector_is_refused_as_torch():
    with pytest.raises(ValueError, match="fewer than 2 dimensions"):
        init._calculate_fan_in_and_fan_out(nn.Parameter(np.zeros(5)))


@pytest.mark.parametrize("nonlinearity,param", [
    ("linear", None), ("conv2d", None), ("sigmoid", None), ("tanh", None), ("relu", None),
    ("leaky_relu", None), ("leaky_relu", 0.2), ("leaky_relu", math.sqrt(5)), ("selu", None)])
def test_calculate_gain_matches_torch(nonlinearity, param):
    assert init.calculate_gain(nonlinearity, param) == pytest.approx(
        torch.nn.init.calculate_gain(nonlinearity, param), rel=1e-15)


def test_unknown_nonlinearity_is_refused():
    with pytest.raises(ValueError, match="unsupported nonlinearity swish"):
        init.calculate_gain("swish")


def torch_uniform_bound(fn, shape, bound: float, **kwargs) -> float:
    """`bound`, the half-width a formula gives from torch's fans and gains, after checking
    that torch's own initialiser draws span exactly that range on a large tensor."""
    t = fn(torch.empty(shape, dtype=torch.float64), **kwargs)
    assert bound * 0.999 <= float(t.abs().max()) <= bound
    return bound


def check_uniform(values: np.ndarray, bound: float) -> None:
    assert np.abs(values).max() <= bound * (1 + 1e-6)
    assert np.abs(values).max() >= bound * 0.999         # the whole range is used
    n = values.size
    assert abs(values.mean()) < 5 * bound / math.sqrt(3 * n)
    assert values.var() == pytest.approx(bound ** 2 / 3, rel=5 * math.sqrt(0.8 / n))


def check_normal(values: np.ndarray, mean: float, std: float) -> None:
    n = values.size
    assert abs(values.mean() - mean) < 5 * std / math.sqrt(n)
    assert values.std() == pytest.approx(std, rel=5 / math.sqrt(2 * n))


@pytest.mark.parametrize("kwargs", [{}, {"a": math.sqrt(5)}, {"mode": "fan_out"},
                                    {"nonlinearity": "relu"}, {"a": 0.2, "mode": "fan_out"}])
def test_kaiming_uniform_bound_and_moments_match_torch(kwargs):
    shape = (BIG[0], BIG[1] // 4, 2, 2)
    p = init.kaiming_uniform_(nn.Parameter(np.zeros(shape)), **kwargs)
    fan = torch.nn.init._calculate_correct_fan(torch.empty(shape), kwargs.get("mode", "fan_in"))
    gain = torch.nn.init.calculate_gain(kwargs.get("nonlinearity", "leaky_relu"),
                                        kwargs.get("a", 0))
    want = torch_uniform_bound(torch.nn.init.kaiming_uniform_, shape,
                               gain * math.sqrt(3.0 / fan), **kwargs)
    check_uniform(p.numpy().astype(np.float64), want)


@pytest.mark.parametrize("kwargs", [{}, {"mode": "fan_out", "nonlinearity": "relu"}])
def test_kaiming_normal_std_matches_torch(kwargs):
    t = torch.empty(BIG, dtype=torch.float64)
    torch.nn.init.kaiming_normal_(t, **kwargs)
    p = init.kaiming_normal_(nn.Parameter(np.zeros(BIG)), **kwargs)
    fan = BIG[1] if kwargs.get("mode", "fan_in") == "fan_in" else BIG[0]
    std = torch.nn.init.calculate_gain(kwargs.get("nonlinearity", "leaky_relu"), 0) / \
        math.sqrt(fan)
    check_normal(t.numpy(), 0.0, std)            # the std formula is torch's ...
    check_normal(p.numpy(), 0.0, std)            # ... and ours draws it


@pytest.mark.parametrize("gain", [1.0, 2.5])
def test_xavier_uniform_and_normal_match_torch(gain):
    fan_in, fan_out = torch.nn.init._calculate_fan_in_and_fan_out(torch.empty(BIG))
    bound = torch_uniform_bound(torch.nn.init.xavier_uniform_, BIG,
                                gain * math.sqrt(6.0 / (fan_in + fan_out)), gain=gain)
    check_uniform(init.xavier_uniform_(nn.Parameter(np.zeros(BIG)), gain=gain).numpy(), bound)
    std = gain * math.sqrt(2.0 / sum(BIG))
    t = torch.nn.init.xavier_normal_(torch.empty(BIG, dtype=torch.float64), gain=gain)
    check_normal(t.numpy(), 0.0, std)
    check_normal(init.xavier_normal_(nn.Parameter(np.zeros(BIG)), gain=gain).numpy(), 0.0, std)


def test_uniform_normal_constant_ones_zeros():
    check_uniform(init.uniform_(nn.Parameter(np.zeros(BIG)), -0.3, 0.3).numpy(), 0.3)
    values = init.uniform_(nn.Parameter(np.zeros(BIG)), 2.0, 3.0).numpy()
    assert values.min() >= 2.0 and values.max() <= 3.0 and values.mean() == pytest.approx(2.5,
                                                                                        abs=0.01)
    check_normal(init.normal_(nn.Parameter(np.zeros(BIG)), 1.5, 0.02).numpy(), 1.5, 0.02)
    assert np.all(init.constant_(nn.Parameter(np.zeros((2, 3))), 0.7).numpy() == np.float32(0.7))
    assert np.all(init.ones_(nn.Parameter(np.zeros(4))).numpy() == 1.0)
    assert np.all(init.zeros_(nn.Parameter(np.ones(4))).numpy() == 0.0)


def test_trunc_normal_lies_in_bounds_with_torch_moments():
    mean, std, a, b = 0.5, 1.0, -0.5, 1.0
    values = init.trunc_normal_(nn.Parameter(np.zeros(BIG)), mean, std, a, b).numpy()
    t = torch.nn.init.trunc_normal_(torch.empty(BIG, dtype=torch.float64), mean, std, a, b)
    assert values.min() >= a and values.max() <= b
    n = values.size
    assert values.mean() == pytest.approx(t.mean().item(), abs=10 * std / math.sqrt(n))
    assert values.std() == pytest.approx(t.std().item(), rel=10 / math.sqrt(n))


def test_eye_and_dirac_are_exact_as_torch():
    for shape in [(3, 5), (4, 4), (5, 2)]:
        want = torch.nn.init.eye_(torch.empty(shape)).numpy()
        assert np.array_equal(init.eye_(nn.Parameter(np.full(shape, 9.0))).numpy(), want)
    for shape, groups in [((4, 4, 3, 3), 1), ((6, 3, 3), 2), ((4, 2, 3, 3, 3), 2),
                          ((2, 5, 3, 3), 1)]:
        want = torch.nn.init.dirac_(torch.empty(shape), groups).numpy()
        got = init.dirac_(nn.Parameter(np.full(shape, 9.0)), groups).numpy()
        assert np.array_equal(got, want), (shape, groups)


@pytest.mark.parametrize("shape", [(4, 9), (9, 4), (3, 2, 2, 2), (6, 6)])
def test_orthogonal_has_orthonormal_rows_or_columns_times_gain(shape):
    gain = 1.7
    q = init.orthogonal_(nn.Parameter(np.zeros(shape)), gain).numpy().astype(np.float64)
    flat = q.reshape(shape[0], -1) / gain
    small = flat @ flat.T if flat.shape[0] <= flat.shape[1] else flat.T @ flat
    np.testing.assert_allclose(small, np.eye(len(small)), atol=1e-6)


def test_sparse_zeroes_the_same_count_per_column_as_torch():
    shape, sparsity = (10, 30), 0.25
    got = init.sparse_(nn.Parameter(np.zeros(shape)), sparsity, std=0.5).numpy()
    want = torch.nn.init.sparse_(torch.empty(shape), sparsity, std=0.5).numpy()
    assert ((got == 0).sum(axis=0) == (want == 0).sum(axis=0)).all()


def test_initialisers_write_in_place_and_return_their_argument():
    p = nn.Parameter(np.zeros((3, 4)))
    storage = p.storage
    assert init.xavier_uniform_(p) is p and p.storage is storage and p.numpy().any()
    b = nn.Module()
    b.register_buffer("table", np.zeros((2, 2), np.float64))
    assert init.eye_(b.table) is b.table and b.table.numpy().dtype == np.float64
    array = np.zeros((3, 3), np.float32)
    assert init.ones_(array) is array and array.sum() == 9


def test_generator_argument_and_manual_seed_reproduce_draws():
    a = init.normal_(nn.Parameter(np.zeros(6)), generator=np.random.default_rng(7)).numpy()
    b = init.normal_(nn.Parameter(np.zeros(6)), generator=np.random.default_rng(7)).numpy()
    assert np.array_equal(a, b)
    nn.init.manual_seed(3)
    first = nn.Linear(4, 3).state_dict()
    nn.init.manual_seed(3)
    assert all(np.array_equal(v, first[k]) for k, v in nn.Linear(4, 3).state_dict().items())
    with pytest.raises(TypeError, match="numpy.random.Generator, got Generator"):
        init.normal_(nn.Parameter(np.zeros(2)), generator=torch.Generator())


def test_parameter_data_idioms_fill_in_place():
    p = nn.Parameter(np.zeros((200, 100)))
    storage = p.storage
    p.data.normal_(mean=0.0, std=0.02)
    check_normal(p.numpy(), 0.0, 0.02)
    p.data.uniform_(-0.1, 0.1)
    assert np.abs(p.numpy()).max() <= 0.1 and p.numpy().std() > 0.05
    p.data.fill_(3.0)
    assert (p.numpy() == 3.0).all()
    p.data.zero_()
    assert not p.numpy().any()
    p.data.copy_(torch.ones(200, 100))
    assert (p.numpy() == 1.0).all()
    p.data = np.full((200, 100), 2.0)
    assert (p.numpy() == 2.0).all() and p.storage is storage


# ---- layers' default initialisation ----

def test_layers_initialise_with_torch_default_ranges():
    nn.init.manual_seed(0)
    lin = nn.Linear(300, 400)
    bound = 1 / math.sqrt(300)
    check_uniform(lin.weight.numpy().astype(np.float64), bound)
    assert np.abs(lin.bias.numpy()).max() <= bound
    conv = nn.Conv2d(16, 64, 5)
    check_uniform(conv.weight.numpy().astype(np.float64), 1 / math.sqrt(16 * 25))
    check_normal(nn.Embedding(300, 200).weight.numpy(), 0.0, 1.0)
    ln, bn = nn.LayerNorm(6), nn.BatchNorm2d(6)
    for m in (ln, bn):
        assert (m.weight.numpy() == 1).all() and (m.bias.numpy() == 0).all()


def test_reset_parameters_override_runs_in_the_constructor():
    class ZeroLinear(nn.Linear):
        def reset_parameters(self):
            init.zeros_(self.weight)
            init.constant_(self.bias, 0.5)

    m = ZeroLinear(3, 2)
    assert not m.weight.numpy().any() and (m.bias.numpy() == 0.5).all()
    m.weight.data.fill_(1.0)
    nn.Linear.reset_parameters(m)                 # the default redraws the weight
    assert np.abs(m.weight.numpy()).max() <= 1 / math.sqrt(3) and m.weight.numpy().any()


def test_batch_norm_reset_parameters_resets_running_statistics():
    bn = nn.BatchNorm1d(3)
    bn.running_mean.fill_(2.0)
    bn.num_batches_tracked.fill_(7)
    bn.weight.data.fill_(0.0)
    bn.reset_parameters()
    assert not bn.running_mean.numpy().any() and int(bn.num_batches_tracked.numpy()) == 0
    assert (bn.running_var.numpy() == 1).all() and (bn.weight.numpy() == 1).all()


def test_apply_based_initialisation_reaches_every_module():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
                          nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)))

    def init_weights(m):
        if isinstance(m, nn.Linear):
            init.normal_(m.weight, 0.0, 0.02)
            init.zeros_(m.bias)

    assert model.apply(init_weights) is model
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    assert len(biases) == 3 and not any(b.numpy().any() for b in biases)
    assert all(np.abs(p.numpy()).max() < 0.15 for p in model.parameters())
