"""The composed torch functions (lerp, addcmul, xlogy, fmod, nan_to_num, heaviside, sinc, ...;
var_mean, aminmax, diff, renorm, ...; tile, rot90, vstack, tensor_split, diagonal, diag,
block_diag, kron, ...) where OpInfo's random samples do not reach: the edge values
(NaN, +-inf, zeros, signs), the Tensor-method and in-place forms, the arguments torch takes
beside tensors (lists, eager index tensors, negative indices), torch's errors, and a small
model whose forward uses several of them, trained in a compiled step against torch float64
by the tolerance policy (tests/reference.py)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import nn as snn
from stepgraph import optim
from stepgraph.errors import ShapeError, TypePromotionError, UnsupportedOpError
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import run_graph
from tests.reference import assert_close_to_reference, assert_state_changes_close

NAN, INF = float("nan"), float("inf")


def traced(fn, *arrays):
    """fn of the arrays as graph inputs of one trace, run on the NumPy backend."""
    tracer = Tracer()
    ins = [tracer.input(a.shape, str(a.dtype), f"in{i}") for i, a in enumerate(arrays)]
    out = fn(*ins)
    tracer.graph.outputs = {"out": out.value}
    return run_graph(tracer.graph, {f"in{i}": a for i, a in enumerate(arrays)})["out"]


def check(name, fn, *arrays):
    """fn(T, *tensors) with T = torch and T = stepgraph, the latter eager and traced: the same
    values (NaN where torch has NaN), dtype and shape."""
    want = fn(torch, *(torch.from_numpy(a) for a in arrays)).numpy()
    for how, got in (("eager", fn(sg, *(sg.from_numpy(a) for a in arrays)).numpy()),
                     ("traced", traced(lambda *t: fn(sg, *t), *arrays))):
        assert got.dtype == want.dtype and got.shape == want.shape, \
            f"{name} {how}: {got.dtype}{got.shape}, torch {want.dtype}{want.shape}"
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=f"{name} ({how})")


# ---- elementwise edge values ----------------------------------------------------------------

X = np.array([0.0, -0.0, 1.5, -1.5, 2.0, -7.25, NAN, INF, -INF, 1e-30], np.float32)
Y = np.array([0.0, 2.0, -0.5, 3.0, -2.0, 2.5, 1.0, 0.0, INF, -1.0], np.float32)

EDGES = {
    "nan_to_num": lambda T, x, y: T.nan_to_num(x),
    "nan_to_num-values": lambda T, x, y: x.nan_to_num(nan=-1.0, posinf=9.0, neginf=-9.0),
    "xlogy": lambda T, x, y: T.xlogy(x, y),
    "xlogy-method": lambda T, x, y: y.xlogy(x),
    "xlogy-scalar-other": lambda T, x, y: T.xlogy(x, 0.0) + T.xlogy(x, 2.0),
    "xlogy-scalar-self": lambda T, x, y: T.xlogy(0.0, y) + T.xlogy(3, y.abs()),
    "fmod": lambda T, x, y: T.fmod(x, y),
    "fmod-scalar": lambda T, x, y: x.fmod(-1.25) + T.fmod(x, 0.75),
    "heaviside": lambda T, x, y: T.heaviside(x, y),
    "heaviside-method": lambda T, x, y: x.heaviside(T.tensor([0.5])),
    "sinc": lambda T, x, y: T.sinc(x),
    "frac": lambda T, x, y: x.frac() + T.frac(y),
    "logaddexp": lambda T, x, y: T.logaddexp(x, y) + x.logaddexp(x),
    "hypot": lambda T, x, y: T.hypot(x, y),
    "lerp": lambda T, x, y: T.lerp(x, y, 0.25) + x.lerp(y, 1.0) + x.lerp(y, T.ones_like(x)),
    "addcmul-addcdiv": lambda T, x, y: T.addcmul(x, y, y, value=0.5) +
    x.addcdiv(y, y + 4.0, value=-2),
}


@pytest.mark.parametrize("name", list(EDGES))
def test_edge_values_are_torchs(name):
    check(name, EDGES[name], X, Y)


def test_fmod_takes_the_dividends_sign_and_remainder_the_divisors():
    a = np.array([-5.0, 5.0, -5.0, 5.0, 4.5, -4.5], np.float32)
    b = np.array([3.0, -3.0, -3.0, 3.0, 2.0, 2.0], np.float32)
    got = sg.fmod(sg.from_numpy(a), sg.from_numpy(b)).numpy()
    np.testing.assert_array_equal(got, [-2.0, 2.0, -2.0, 2.0, 0.5, -0.5])
    np.testing.assert_array_equal(got, np.fmod(a, b))
    ints = sg.fmod(sg.tensor([-7, 7, -7]), sg.tensor([2, -2, 3]))
    assert ints.dtype == sg.int64 and ints.tolist() == [-1, 1, -1]
    assert sg.fmod(sg.tensor([1.0]), 0.0).isnan().all()


def test_xlogy_is_zero_where_x_is_zero_unless_y_is_nan():
    x = sg.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 2.0])
    y = sg.tensor([0.0, -1.0, INF, NAN, 3.0, 0.0])
    got = sg.xlogy(x, y).numpy()
    np.testing.assert_array_equal(got[:3], 0.0)
    assert np.isnan(got[3]) and got[4] == 0.0 and got[5] == -INF
    assert sg.xlogy(sg.tensor([0, 1]), 3).dtype == sg.float32     # integers: the default float


def test_nan_to_num_defaults_are_the_dtypes_extremes_and_integers_pass():
    got = sg.tensor([NAN, INF, -INF], dtype=sg.float64).nan_to_num().numpy()
    np.testing.assert_array_equal(got, [0.0, np.finfo(np.float64).max, np.finfo(np.float64).min])
    ints = sg.tensor([1, 2])
    assert sg.nan_to_num(ints).tolist() == [1, 2] and sg.nan_to_num(ints).dtype == sg.int64


def test_heaviside_of_zero_and_nan():
    x = sg.tensor([-0.0, 0.0, NAN, -1e-38, 3.0])
    np.testing.assert_array_equal(sg.heaviside(x, sg.tensor([0.25])).numpy(),
                                  [0.25, 0.25, 0.0, 0.0, 1.0])


def test_float_power_is_float64_as_torchs():
    y = sg.float_power(sg.tensor([2, 3]), 2)
    assert y.dtype == sg.float64 and y.tolist() == [4.0, 9.0]
    np.testing.assert_array_equal(sg.float_power(2, sg.tensor([0.5, 3.0])).numpy(),
                                  torch.float_power(2, torch.tensor([0.5, 3.0])).numpy())


def test_lerp_takes_torchs_form_past_half():
    """weight >= 0.5 is computed end - (end - start) * (1 - w): exact at w = 1 where the
    other form is not (start 1e8, end 1: 1e8 + (1 - 1e8) rounds in float32)."""
    start, end = sg.tensor([1e8]), sg.tensor([1.0])
    assert sg.lerp(start, end, 1.0).item() == 1.0
    assert sg.lerp(start, end, sg.tensor([1.0])).item() == 1.0


def test_in_place_forms_rebind_and_write():
    a = sg.tensor([1.0, 2.0, 3.0])
    a.lerp_(sg.tensor([3.0, 2.0, 1.0]), 0.5)
    a.addcmul_(sg.tensor([1.0, 1.0, 1.0]), sg.tensor([2.0, 0.0, -2.0]), value=0.5)
    a.addcdiv_(sg.tensor([1.0, 2.0, 3.0]), sg.tensor([2.0, 2.0, 2.0]))
    t = torch.tensor([1.0, 2.0, 3.0])
    t.lerp_(torch.tensor([3.0, 2.0, 1.0]), 0.5)
    t.addcmul_(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([2.0, 0.0, -2.0]), value=0.5)
    t.addcdiv_(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 2.0, 2.0]))
    np.testing.assert_array_equal(a.numpy(), t.numpy())

    def body(x, y):
        alias = x
        x.fmod_(1.5)
        x.nan_to_num_()
        x.lerp_(y, 0.75)
        return alias                # the same object holds the result
    arrays = (np.array([4.0, -2.5, NAN], np.float32), np.array([1.0, 2.0, 3.0], np.float32))
    want = torch.from_numpy(arrays[0].copy())
    want.fmod_(1.5).nan_to_num_().lerp_(torch.from_numpy(arrays[1]), 0.75)
    np.testing.assert_allclose(traced(body, *arrays), want.numpy(), rtol=1e-6)


# ---- reductions, shapes and joins -----------------------------------------------------------

M = np.arange(24, dtype=np.float32).reshape(2, 3, 4) * 0.5 - 3.0
IDX = np.array([[[0, -1, 2, 1]], [[-4, 3, 0, 0]]], np.int64)          # negative: from the end

SHAPES = {
    "var_mean": lambda T, m: T.stack(T.var_mean(m, 1)) + T.stack(T.var_mean(m, (0, 2),
                                                                        correction=0)).sum(),
    "std_mean": lambda T, m: T.cat([T.std_mean(m, -1, keepdim=True)[0].reshape(-1),
                                    T.std_mean(m)[1].reshape(1)]),
    "count_nonzero": lambda T, m: T.count_nonzero(m, 1) + m.count_nonzero((0, 2)).sum(),
    "aminmax": lambda T, m: T.stack(list(T.aminmax(m, dim=1))) + m.aminmax().max,
    "aminmax-keepdim": lambda T, m: T.aminmax(m, keepdim=True).min + m.aminmax(dim=-1,
                                                                               keepdim=True)[1],
    "dist": lambda T, m: T.dist(m, m.flip(0), 3) + m.dist(T.zeros(4)) + T.dist(m, m * 2, 0),
    "renorm": lambda T, m: T.renorm(m, 2, 1, 3.0) + m.renorm(1, -1, 5.0),
    "diff": lambda T, m: T.diff(m, 2, 1, prepend=m[:, :1] * 2, append=m[:, -2:]),
    "diff-method": lambda T, m: m.diff(dim=0).sum() + m.diff(n=3).sum(-1, keepdim=True),
    "diff-bool": lambda T, m: T.diff(m > 0, dim=-1),
    "tile": lambda T, m: T.cat([T.tile(m, (2,)).reshape(-1), m.tile(1, 2, 1, 1).reshape(-1),
                                m.tile((3, 1)).reshape(-1)]),
    "broadcast": lambda T, m: m[:, :1].broadcast_to(2, 3, 4) * T.broadcast_to(m[0, 0], (3, 4)),
    "broadcast_tensors": lambda T, m: T.stack(T.broadcast_tensors(m[:, :1, :1], m[0], m)),
    "flips": lambda T, m: T.flipud(m) + m.fliplr() + T.fliplr(m).flipud(),
    "rot90": lambda T, m: T.cat([T.rot90(m, k, (1, 2)).reshape(-1) for k in range(-2, 6)] +
                                [m.rot90().reshape(-1), m.rot90(1, [-1, 0]).reshape(-1)]),
    "stacks": lambda T, m: T.cat([T.vstack([m[0], m[1]]).reshape(-1),
                                  T.row_stack((m[0, 0], m[1, 0])).reshape(-1),
                                  T.hstack([m[0], m[1]]).reshape(-1),
                                  T.hstack([m[0, 0], m[1, 1]]),
                                  T.dstack([m[0], m[1]]).reshape(-1),
                                  T.column_stack([m[0, :, 0], m[0], m[1, :, 1]]).reshape(-1),
                                  T.column_stack((m[0, 0, 0], m[1, 1, 1])).reshape(-1)]),
    "atleast": lambda T, m: T.cat([T.atleast_3d(m[0, 0, 0]).reshape(-1),
                                   T.atleast_3d(m[0, 0]).reshape(-1),
                                   T.atleast_3d(m[0]).reshape(-1), T.atleast_2d(m[0, 0])[0],
                                   T.atleast_1d(m[0, 0, 1]), T.atleast_1d(m[1, 1]),
                                   *(t.reshape(-1) for t in T.atleast_2d(m[0, 0], m[1])),
                                   *(t.reshape(-1) for t in T.atleast_1d([m[0, 0, 0], m[1]]))]),
    "select": lambda T, m: T.cat([T.select(m, 1, -1).reshape(-1), m.select(0, 1).reshape(-1),
                                  m.select(-1, 2).reshape(-1), m[0, 0].select(0, -4)[None]]),
    "take_along_dim": lambda T, m, i: T.take_along_dim(m, i, 2) + m.take_along_dim(i[:1], -1),
    "take_along_dim-flat": lambda T, m, i: T.take_along_dim(m, (i.reshape(-1) + 4) * 2),
    "tensor_split": lambda T, m: T.cat([p.reshape(-1) for p in (
        *T.tensor_split(m, 3, dim=2), *m.tensor_split([1, 9, 3], -1),
        *m.tensor_split(T.tensor([0, 2]), 1), *T.tensor_split(m, T.tensor(2)))]),
    "diagonal": lambda T, m: T.cat([T.diagonal(m, o, 1, 2).reshape(-1)
                                    for o in (-3, -1, 0, 2, 5)] +
                                   [m.diagonal(1, 2, 0).reshape(-1), m.diagonal().reshape(-1),
                                    m.diagonal(dim1=-1, dim2=0).reshape(-1)]),
    "diag": lambda T, m: T.cat([T.diag(m[0, 0], k).reshape(-1) for k in (-2, 0, 1, 3)] +
                               [m[0].diag(), T.diag(m[1], -1), m[0, :1].diag()]),
    "cartesian_prod": lambda T, m: T.cartesian_prod(m[0, 0], m[1, :, 0], m[0, 1, :2]) +
    T.cartesian_prod(m[1, 2]).sum(),
    "block_diag": lambda T, m: T.block_diag(m[0], m[1, 0], m[0, 0, 0], m[1, :2, :1]),
    "kron": lambda T, m: T.kron(m, m[0]) + m.kron(m[1, 0, :2].reshape(1, 1, 2)).sum() +
    T.kron(m[0, 0], m[1, 1]).sum(),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_reductions_shapes_and_joins_are_torchs(name):
    fn = SHAPES[name]
    check(name, fn, M, IDX) if fn.__code__.co_argcount == 3 else check(name, fn, M)


def test_aminmax_is_a_named_pair_and_the_means_plain_tuples():
    r = sg.aminmax(sg.tensor([[1.0, -2.0], [3.0, 0.5]]), dim=0)
    assert type(r).__name__ == "aminmax" and r.min.tolist() == [1.0, -2.0] and \
        r.max.tolist() == [3.0, 0.5]
    assert type(sg.var_mean(sg.tensor([1.0, 2.0]))) is tuple


def test_torchs_errors():
    x = sg.tensor([[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(TypePromotionError, match="expected dtype float32 for `end`"):
        sg.lerp(x, x.double(), 0.5)
    with pytest.raises(TypePromotionError, match="different dtypes"):
        sg.heaviside(x, sg.tensor([1.0], dtype=sg.float64))
    with pytest.raises(TypePromotionError, match="Integer division with addcdiv"):
        sg.addcdiv(x, sg.tensor([1]), sg.tensor([2]))
    with pytest.raises(IndexError, match=r"select\(\): index 2 out of range"):
        x.select(1, 2)
    with pytest.raises(ShapeError, match="rotation dims to be different"):
        sg.rot90(x, 1, (0, -2))
    with pytest.raises(ShapeError, match="at least one-dimensional"):
        sg.diff(sg.tensor(1.0))
    with pytest.raises(ShapeError, match="must be >= 2-d"):
        sg.fliplr(sg.tensor([1.0]))
    with pytest.raises(ShapeError, match="must match the existing size"):
        x.broadcast_to(3, 3)
    with pytest.raises(ShapeError, match="Expect a 1D vector"):
        sg.cartesian_prod(x, x)
    with pytest.raises(ShapeError, match="diagonal dimensions cannot be identical"):
        x.diagonal(0, 1, -1)


def test_a_traced_index_tensor_for_tensor_split_is_refused():
    tracer = Tracer()
    x, cuts = tracer.input((6,), "float32", "x"), tracer.input((2,), "int64", "cuts")
    with pytest.raises(UnsupportedOpError, match="a traced tensor of indices_or_sections"):
        x.tensor_split(cuts)


# ---- traced in a compiled step and trained ---------------------------------------------------

def make(T, nn):
    class Mixer(nn.Module):
        """A forward through lerp, addcmul, addcdiv, hypot, logaddexp, xlogy, sinc, frac,
        fmod, nan_to_num, renorm, diff, tile, rot90, take_along_dim, diagonal, kron,
        block_diag and var_mean."""

        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.gate = nn.Parameter(T.full((4,), 0.3))
            self.mix = nn.Parameter(T.linspace(-1.0, 1.0, 4))

        def forward(self, x):
            h = self.proj(x)                                         # (B, 4)
            g = T.lerp(h, h.tanh(), 0.3) + h.lerp(x, T.sigmoid(self.gate))
            g = T.addcmul(g, h, self.mix, value=0.5).addcdiv(x, self.gate.exp() + 1.0)
            g = g + T.hypot(h, x) * 0.1 + T.logaddexp(h, -x) + T.xlogy(h.sigmoid(), x.abs() + 1)
            g = g + T.sinc(h) + (h * 3.0).frac() * 0.1 + T.fmod(h * 2.0, 0.7)
            # -inf where |x| <= 0.1 (the log of a mask: no gradient to the mask itself)
            g = T.nan_to_num(g + (x.abs() > 0.1).float().log(), neginf=-0.5)
            g = T.renorm(g, 2, 0, 2.5)
            d = T.diff(g, dim=1, prepend=g[:, -1:])                  # (B, 4)
            square = T.tile(d[:, :2], (1, 2)).reshape(-1, 2, 2)       # (B, 2, 2)
            turned = T.rot90(square, 1, (1, 2)) + square.diagonal(0, 1, 2)[:, None, :]
            picked = T.take_along_dim(d, T.tensor([[3, 0, -1, 1]]), 1)
            k = T.kron(square[0], T.block_diag(self.mix[:1], self.mix[1:2]))     # (4, 4)
            var, mean = T.var_mean(picked + turned.reshape(-1, 4), 1, keepdim=True)
            return (picked @ k) * 0.1 + var.sqrt() * mean

    return Mixer()


def batches(steps: int):
    rng = np.random.default_rng(3)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((6, 4)).astype(np.float32)
        x[0, 1] = 0.05                      # below the mask's threshold: nan_to_num's infs
        out.append((x, rng.standard_normal((6, 4)).astype(np.float32)))
    return out


def torch_run(ref, data, dtype):
    ref = copy.deepcopy(ref).to(dtype)
    opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(torch.from_numpy(x).to(dtype)),
                                            torch.from_numpy(y).to(dtype))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.double().numpy() for k, v in ref.state_dict().items()}


def test_a_model_of_the_composed_functions_trains_like_torch():
    """Three SGD steps with momentum: losses and parameter changes against torch float64,
    bounded by a small multiple of torch float32's own error."""
    torch.manual_seed(0)
    ref = make(torch, torch.nn)
    data = batches(3)
    losses64, after64 = torch_run(ref, data, torch.float64)
    losses32, after32 = torch_run(ref, data, torch.float32)
    model = make(sg, snn)
    model.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = sg.compile_train_step(model, sg.nn.functional.mse_loss,
                                 optim.SGD(lr=0.01, momentum=0.9), example_inputs=data[0],
                                 device="cpu")
    got = [float(step(x, y)) for x, y in data]
    assert_close_to_reference(got, losses64, losses32, "losses")
    assert_state_changes_close(before, model.state_dict(), after64, after32)
