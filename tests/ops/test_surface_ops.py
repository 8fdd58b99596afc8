"""The torch names model code meets beyond the op families' own: arithmetic and products by
name, in-place forms, prod / median / norm, scatter / scatter_add, einsum, F.normalize and
F.pad, the torch.* functions of them, and new_* factories (ir/tensor_*.py,
functions/tensors.py, nn/functional.py) against torch.

Each case is one function applied to both sides, with T the stepgraph or the torch module
and F its nn.functional: the forward and every float input's gradient (through the real
autodiff; loss = mse against a random target for non-scalar outputs) must match torch
autograd in float64 and float32, unfused and through the fusion passes. Integer inputs are
indices and are not differentiated.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import stepgraph
from stepgraph import nn
from stepgraph.errors import ShapeError, TypePromotionError, UnsupportedOpError
from stepgraph.ir.trace import Tracer, tensor_of
from stepgraph.nn import functional as F
from tests.ops.helpers import assert_matches_torch, case_arrays, randn, run_graph, seeded

DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
FUSED = pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
RTOL = {np.float64: 1e-10, np.float32: 2e-5}


def x3(g, t):
    return {"x": randn(g, 3, 4, 5, dtype=t)}


def two(*shapes):
    return lambda g, t: {k: randn(g, *s, dtype=t) for k, s in zip("ab", shapes)}


def with_zeros(g, t):
    """x with exact zeros: one in a row of its own, two in another (prod's gradient)."""
    x = randn(g, 3, 5, dtype=t)
    x[0, 2] = x[1, 1] = x[1, 3] = 0
    return {"x": x}


def permutation_rows(g, n_rows, n):
    """An int64 (n_rows, n) index whose rows are permutations: distinct places per row."""
    return np.stack([g.permutation(n) for _ in range(n_rows)]).astype(np.int64)


def inplace_chain(T, F, a, b):
    y = a.clone()
    y += b
    y.mul_(2.0)
    y.sub_(b, alpha=0.5)
    y.masked_fill_(a > 1.0, -1.0)
    y.clamp_(max=2.5)
    y.relu_()           # last: torch's relu backward reads its output
    return y


# name -> (fn(T, F, **tensors) -> float tensor, inputs(gen, dtype) -> arrays)
CASES = {
    # arithmetic and products by name
    "add-alpha": (lambda T, F, a, b: a.add(b, alpha=0.5) + T.add(a, 2.0), two((3, 4), (4,))),
    "sub-alpha": (lambda T, F, a, b: T.sub(a, b, alpha=2) - a.subtract(b), two((3, 4), (3, 4))),
    "mul-div": (lambda T, F, a, b: T.mul(a, b) + a.div(b.abs() + 1.0) + T.true_divide(a, 3.0),
                two((3, 4), (3, 4))),
    "remainder-floordiv": (lambda T, F, a, b: a % (b.abs() + 0.5) + T.remainder(a, -1.5) +
                           (a.detach() // 0.75) * b + a.div(b, rounding_mode="trunc") * a,
                           two((3, 4), (3, 4))),
    "mm": (lambda T, F, a, b: T.mm(a, b) + a.mm(b), two((3, 4), (4, 5))),
    "bmm": (lambda T, F, a, b: T.bmm(a, b), two((2, 3, 4), (2, 4, 5))),
    "mv": (lambda T, F, a, b: a.mv(b) + T.mv(a, b), two((3, 4), (4,))),
    "dot": (lambda T, F, a, b: T.dot(a, b) * a.dot(b), two((6,), (6,))),
    "outer": (lambda T, F, a, b: T.outer(a, b) + a.outer(b), two((3,), (4,))),
    "addmm": (lambda T, F, x, a, b: T.addmm(x, a, b, beta=0.5, alpha=2.0),
              lambda g, t: {"x": randn(g, 5, dtype=t), **two((3, 4), (4, 5))(g, t)}),
    "baddbmm": (lambda T, F, x, a, b: x.baddbmm(a, b, alpha=0.5),
                lambda g, t: {"x": randn(g, 2, 3, 5, dtype=t),
                              **two((2, 3, 4), (2, 4, 5))(g, t)}),
    "t": (lambda T, F, a: a.t() * 2.0 + T.t(a), lambda g, t: {"a": randn(g, 3, 4, dtype=t)}),
    "torch-functions": (lambda T, F, x: T.sum(T.softmax(x, -1) * T.log_softmax(x, 1), 0) +
                        T.mean(T.reshape(T.permute(x, (0, 2, 1)), (3, 5, 4)), (0, 2)) +
                        T.transpose(T.narrow(x, 2, 1, 3), 1, 2).sum((1, 2)).sum(), x3),
    "split-chunk": (lambda T, F, x: T.split(x, [1, 3], dim=1)[1][:, 1:] * 2.0 +
                    T.chunk(x, 2, 1)[0] + T.split(x, 2, -1)[2].sum(), x3),
    # in-place forms
    "inplace-chain": (inplace_chain, two((3, 4), (4,))),
    "iadd-keeps-names": (lambda T, F, a, b: _residual(F, a, b), two((3, 4), (3, 4))),
    # reductions
    "prod-all": (lambda T, F, x: x.prod(), lambda g, t: {"x": randn(g, 2, 3, dtype=t)}),
    "prod-dim-odd": (lambda T, F, x: T.prod(x, -1), x3),
    "prod-dim-keepdim": (lambda T, F, x: x.prod(1, keepdim=True), x3),
    "prod-zeros": (lambda T, F, x: x.prod(1), with_zeros),
    "median-all-even": (lambda T, F, x: x.median(), lambda g, t: {"x": randn(g, 4, 6, dtype=t)}),
    "median-dim": (lambda T, F, x: T.median(x, 1).values, x3),
    "median-keepdim": (lambda T, F, x: x.median(-1, keepdim=True)[0], x3),
    "norm-2": (lambda T, F, x: x.norm(), x3),
    "norm-1-dim": (lambda T, F, x: T.norm(x, 1, -1), x3),
    "norm-3-keepdim": (lambda T, F, x: x.norm(3, (0, 2), keepdim=True), x3),
    "norm-inf": (lambda T, F, x: x.norm(float("inf"), 1), x3),
    "norm-fro-neg-zero": (lambda T, F, x: x.norm("fro", (0, 2)) + T.norm(x, -1.5, 1).sum() +
                          x.norm(float("-inf"), 2).sum() * x.norm(0), x3),
    # scatter
    "scatter_add": (lambda T, F, x, i, s: x.scatter_add(1, i, s) + T.scatter_add(x, 1, i, s),
                    lambda g, t: {"x": randn(g, 3, 5, dtype=t),
                                  "i": g.integers(0, 5, (3, 4)).astype(np.int64),
                                  "s": randn(g, 3, 4, dtype=t)}),
    "scatter_add-dim0": (lambda T, F, x, i, s: T.scatter_add(x, 0, i, s),
                         lambda g, t: {"x": randn(g, 3, 5, dtype=t),
                                       "i": g.integers(0, 3, (2, 5)).astype(np.int64),
                                       "s": randn(g, 2, 5, dtype=t)}),
    "scatter_add-short-index": (lambda T, F, x, i, s: x.scatter_add(1, i, s) * x,
                                lambda g, t: {"x": randn(g, 4, 5, dtype=t),
                                              "i": g.integers(0, 5, (2, 3)).astype(np.int64),
                                              "s": randn(g, 2, 3, dtype=t)}),
    "scatter-src": (lambda T, F, x, i, s: x.scatter(1, i, s),
                    lambda g, t: {"x": randn(g, 3, 5, dtype=t), "i": permutation_rows(g, 3, 5),
                                  "s": randn(g, 3, 5, dtype=t)}),
    "scatter-value": (lambda T, F, x, i: T.scatter(x, 1, i, 0.5) * x,
                      lambda g, t: {"x": randn(g, 3, 5, dtype=t),
                                    "i": g.integers(0, 5, (3, 2)).astype(np.int64)}),
    # einsum
    "einsum-attention": (lambda T, F, a, b: T.einsum("bhqd,bhkd->bhqk", a, b),
                         two((2, 3, 4, 5), (2, 3, 6, 5))),
    "einsum-matmul": (lambda T, F, a, b: T.einsum("ij,jk", a, b), two((3, 4), (4, 5))),
    "einsum-outer": (lambda T, F, a, b: T.einsum("i,j->ij", a, b), two((3,), (4,))),
    "einsum-ellipsis": (lambda T, F, a, b: T.einsum("...ij,...jk->...ik", a, b),
                        two((2, 3, 4), (2, 4, 5))),
    "einsum-rowdot": (lambda T, F, a, b: T.einsum("bi,bi->b", a, b), two((3, 4), (3, 4))),
    "einsum-permuted": (lambda T, F, a, b: T.einsum("abc,cd->dba", a, b),
                        two((2, 3, 4), (4, 5))),
    "einsum-summed-first": (lambda T, F, a, b: T.einsum("ijk,jl->il", a, b),
                            two((2, 3, 4), (3, 5))),
    "einsum-list": (lambda T, F, a, b: T.einsum("bn,nd->bd", [a, b]), two((3, 4), (4, 5))),
    "einsum-one": (lambda T, F, a: T.einsum("ijk->ki", a),
                   lambda g, t: {"a": randn(g, 2, 3, 4, dtype=t)}),
    # flips, rolls and repeats
    "flip": (lambda T, F, x: x.flip(0, 2) * 2.0 + T.flip(x, (1,)), x3),
    "roll": (lambda T, F, x: x.roll(2, 1) + T.roll(x, (1, -3), (0, 2)) + x.roll(7), x3),
    "repeat_interleave": (lambda T, F, x: x.repeat_interleave(2, dim=1).sum(0) +
                          T.repeat_interleave(x, 3).reshape(9, 20)[:8, :5], x3),
    # more nn.functional and nn layers
    "softmin": (lambda T, F, x: F.softmin(x, dim=1) + T.nn.Softmax(dim=-1)(x), x3),
    "cosine_similarity": (lambda T, F, a, b: F.cosine_similarity(a, b, dim=-1) +
                          T.nn.CosineSimilarity(dim=1)(a, b).sum(),
                          two((3, 4, 5), (4, 5))),
    "pairwise_distance": (lambda T, F, a, b: F.pairwise_distance(a, b) +
                          T.nn.PairwiseDistance(p=1.0, keepdim=True)(a, b).sum(),
                          two((3, 5), (3, 5))),
    "pixel_shuffle": (lambda T, F, x: F.pixel_unshuffle(F.pixel_shuffle(x, 2) * x.sum(), 2) +
                      T.nn.PixelShuffle(2)(x).sum((1, 2, 3))[:, None, None, None],
                      lambda g, t: {"x": randn(g, 2, 8, 3, 4, dtype=t)}),
    "pad-modules": (lambda T, F, x: T.nn.ReflectionPad2d(1)(x) + T.nn.ZeroPad2d((0, 2, 2, 0))(x) +
                    T.nn.ReplicationPad2d(1)(x) * T.nn.ConstantPad2d(1, 0.5)(x),
                    lambda g, t: {"x": randn(g, 2, 3, 4, 5, dtype=t)}),
    # F.normalize, F.pad
    "normalize": (lambda T, F, x: F.normalize(x), x3),
    "normalize-p1-last": (lambda T, F, x: F.normalize(x, p=1.0, dim=-1), x3),
    "pad-constant": (lambda T, F, x: F.pad(x, (1, 2, 0, 3), value=0.5), x3),
    "pad-crop": (lambda T, F, x: F.pad(x, (-1, 2, 2, -1)), x3),
    "pad-reflect": (lambda T, F, x: F.pad(x, (2, 3), mode="reflect"), x3),
    "pad-replicate": (lambda T, F, x: F.pad(x[None], (2, 1, 1, 3), mode="replicate"), x3),
    "pad-circular": (lambda T, F, x: F.pad(x[None], (2, 5, 1, 3), mode="circular"), x3),
    # a crop of the whole last axis: replicate reads its last element (the uncropped axis')
    "pad-replicate-crop": (lambda T, F, x: F.pad(x[None], (-5, 3, 1, -2), mode="replicate"),
                           x3),
}


def _residual(F, a, b):
    """`out += shortcut` with a second name bound to out: both see the sum, as in torch."""
    out = F.relu(a) * 1.0
    alias = out
    out += b
    F.relu(alias, inplace=True)
    return out * alias


@pytest.mark.parametrize("case", CASES)
@FUSED
@DTYPES
def test_matches_torch(case, fused, dtype):
    fn, make = CASES[case]
    on_torch = lambda **ts: fn(torch, TF, **ts)  # noqa: E731
    arrays = case_arrays(case, on_torch, make, dtype)
    wrt = tuple(k for k, v in arrays.items() if v.dtype.kind == "f" and k != "target")
    body = lambda t, ins: fn(stepgraph, F, **{k: v for k, v in ins.items()  # noqa: E731
                                              if k != "target"})
    assert_matches_torch(case, body, on_torch, arrays, wrt, fused, dtype, RTOL[dtype])


def _traced_run(fn, **arrays):
    tracer = Tracer()
    ins = {k: tracer.input(a.shape, str(a.dtype), k) for k, a in arrays.items()}
    out = fn(**ins)
    tracer.graph.outputs = {"out": out.value}
    return run_graph(tracer.graph, arrays)["out"]


@DTYPES
def test_median_indices_match_torch(dtype):
    x = randn(seeded("median-indices"), 4, 5, 6, dtype=dtype)   # distinct values: no ties
    for dim in (0, 1, -1):
        got = _traced_run(lambda x: x.median(dim).indices, x=x)
        want = torch.tensor(x).median(dim).indices.numpy()
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fn", [
    lambda T, a, b: a // b, lambda T, a, b: a % b, lambda T, a, b: a // -3,
    lambda T, a, b: 17 // b, lambda T, a, b: 10 % b, lambda T, a, b: T.remainder(a, 4),
    lambda T, a, b: a.div(b, rounding_mode="trunc"), lambda T, a, b: T.floor_divide(a, b),
])
def test_integer_floor_division_and_remainder_are_exact(fn):
    """Integer operands give integer results, torch's values for either sign."""
    gen = seeded("int-floordiv")
    a = gen.integers(-10**6, 10**6, 40)
    b = gen.integers(1, 50, 40) * gen.choice([-1, 1], 40)
    got = _traced_run(lambda a, b: fn(stepgraph, a, b), a=a, b=b)
    want = fn(torch, torch.tensor(a), torch.tensor(b)).numpy()
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)


def test_one_hot_and_type_match_torch():
    i = seeded("one-hot").integers(0, 5, (3, 4))
    got = _traced_run(lambda i: F.one_hot(i, 5), i=i)
    want = TF.one_hot(torch.tensor(i), 5).numpy()
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)
    with pytest.raises(UnsupportedOpError, match="num_classes"):
        F.one_hot(Tracer().input((3,), "int64", "i"))
    x = stepgraph.ones(2)
    assert (x.type(), x.long().type()) == ("torch.FloatTensor", "torch.LongTensor")
    assert x.type(stepgraph.float64).dtype == "float64"


def test_normalize_of_a_zero_row_has_torchs_gradient():
    """An all-zero slice divides by eps: the gradient is dy / eps there (no NaN from the
    root's derivative at zero), as torch's."""
    x = randn(seeded("normalize-zero"), 3, 4, dtype=np.float64)
    x[1] = 0
    dy = randn(seeded("normalize-zero-dy"), 3, 4, dtype=np.float64)
    tracer = Tracer()
    t = tracer.input(x.shape, "float64", "x")
    loss = (F.normalize(t, eps=1e-3) * tensor_of(dy)).sum()
    (grad,) = stepgraph.autodiff.append_backward(tracer, loss.value, [t.value])
    tracer.graph.outputs = {"grad": grad}
    got = run_graph(tracer.graph, {"x": x})["grad"]
    tx = torch.tensor(x, requires_grad=True)
    (TF.normalize(tx, eps=1e-3) * torch.tensor(dy)).sum().backward()
    np.testing.assert_allclose(got, tx.grad.numpy(), rtol=1e-12)
    assert np.all(np.isfinite(got)) and np.abs(got[1]).max() > 0


def test_inplace_rebinds_the_object_and_leaves_clones():
    tracer = Tracer()
    x = tracer.input((3, 4), "float32", "x")
    first = x.value
    y = x.clone()
    same = x.add_(1.0)
    assert same is x and x.value is not first
    assert y.value is first                         # the clone still holds the old value
    x += y
    x.relu_()
    assert [n.op for n in tracer.graph.nodes][-2:] == ["binary", "act"]
    with pytest.raises(ShapeError, match="in place"):
        y.add_(tracer.input((2, 3, 4), "float32", "z"))      # would broadcast y itself
    with pytest.raises(TypePromotionError, match="can't be cast"):   # torch's error
        tracer.input((3,), "int64", "i").mul_(0.5)            # would need a float result


def test_fill_zero_and_copy_on_traced_tensors():
    tracer = Tracer()
    x = tracer.input((2, 3), "float32", "x")
    a, b, c = x.clone().fill_(2.5), x.clone().zero_(), x.clone()
    c.copy_(tracer.input((3,), "int64", "i"))          # broadcast and cast, as torch
    y = x.clone()
    y.copy_([[1.0], [2.0]])
    tracer.graph.outputs = {"a": a.value, "b": b.value, "c": c.value, "y": y.value}
    out = run_graph(tracer.graph, {"x": np.ones((2, 3), np.float32),
                                   "i": np.array([4, 5, 6])})
    np.testing.assert_array_equal(out["a"], np.full((2, 3), 2.5))
    np.testing.assert_array_equal(out["b"], np.zeros((2, 3)))
    np.testing.assert_array_equal(out["c"], [[4, 5, 6], [4, 5, 6]])
    np.testing.assert_array_equal(out["y"], [[1, 1, 1], [2, 2, 2]])
    assert out["c"].dtype == np.float32


def test_inplace_on_eager_tensors_writes_their_array():
    a = stepgraph.tensor([[1.0, -2.0], [3.0, -4.0]])
    view = a.reshape(4)
    a.mul_(2).relu_()
    np.testing.assert_array_equal(view.numpy(), [2.0, 0.0, 6.0, 0.0])
    a -= 1
    np.testing.assert_array_equal(a.numpy(), [[1.0, -1.0], [5.0, -1.0]])


def test_inplace_forms_on_parameters_write_through_assign():
    """p.add_(x), p.data.mul_(2) in initialisation code change the stored values (and bump
    the version compiled steps watch); inside a forward they are refused."""
    lin = nn.Linear(3, 2)
    w = lin.weight.numpy().copy()
    version = lin.weight.version
    lin.weight.data.mul_(2.0)
    lin.weight.add_(stepgraph.ones(2, 3), alpha=0.5)
    lin.weight.clamp_(max=0.25)
    np.testing.assert_array_equal(lin.weight.numpy(), np.minimum(w * 2 + 0.5, 0.25))
    assert lin.weight.version == version + 3

    class Clamp(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            self.lin.weight.clamp_(-1.0, 1.0)
            return self.lin(x)

    x = np.ones((2, 3), np.float32)
    with pytest.raises(UnsupportedOpError, match=r"Parameter.clamp_ on lin.weight .*model\b"):
        stepgraph.compile_predict(Clamp(), example_inputs=(x,), device="cpu")


def test_data_is_the_tensor_outside_the_backward():
    tracer = Tracer()
    x = tracer.input((2,), "float32", "x")
    assert x.data.shape == (2,) and tracer.graph.nodes[-1].op == "stop_gradient"
    eager = stepgraph.ones(2)
    eager.data.mul_(3.0)
    assert eager.tolist() == [3.0, 3.0]


def test_new_factories_take_the_tensors_dtype_and_trace():
    tracer = Tracer()
    x = tracer.input((3, 4), "float64", "x")
    z, o = x.new_zeros(2, 3), x.new_ones((5,), dtype=stepgraph.int64)
    f, e = x.new_full((2,), 7.5), x.new_empty(4)
    assert (z.shape, z.dtype, o.shape, o.dtype) == ((2, 3), "float64", (5,), "int64")
    assert all(t.tracer is tracer for t in (z, o, f, e))
    tracer.graph.outputs = {"f": f.value}
    np.testing.assert_array_equal(run_graph(tracer.graph, {"x": np.zeros((3, 4))})["f"],
                                  [7.5, 7.5])
    eager = stepgraph.ones(2, dtype=stepgraph.int32)
    t = eager.new_tensor([1, 2, 3])
    assert t.dtype == "int32" and t.tolist() == [1, 2, 3]
    assert eager.new_zeros(2).is_eager


@pytest.mark.parametrize("expr, match", [
    (lambda x: stepgraph.einsum("ij,jk,kl->il", x, x.T, x), "torch.einsum of 3 operands"),
    (lambda x: stepgraph.einsum("ii->i", x[:, :3]), "diagonal"),
    (lambda x: x.scatter(0, x.long(), 1.0, reduce="add"), "reduce='add'"),
    (lambda x: x.norm("nuc"), "norm with p='nuc'"),
    (lambda x: x.float(memory_format=torch.channels_last), "memory_format=torch.channels_last"),
    (lambda x: x.prod(dtype=stepgraph.float64), "prod with dtype"),
    (lambda x: x.kthvalue(2), "Tensor.kthvalue.*topk"),
    (lambda x: x.masked_select(x > 0), "Tensor.masked_select.*masked_fill"),
])
def test_refused_forms_say_what_and_the_alternative(expr, match):
    tracer = Tracer()
    with pytest.raises(UnsupportedOpError, match=match):
        expr(tracer.input((3, 4), "float32", "x"))


def test_casts_accept_the_layout_free_memory_formats():
    """preserve_format and contiguous_format change nothing on a traced tensor (the planner
    picks layouts); the casts still cast."""
    tracer = Tracer()
    x = tracer.input((2, 3), "float32", "x")
    assert x.double(memory_format=torch.preserve_format).dtype == "float64"
    assert x.to("cpu", torch.int64, False, True,
                memory_format=torch.contiguous_format).dtype == "int64"
    assert x.clone(memory_format=torch.preserve_format).value is x.value


@pytest.mark.parametrize("expr, error", [
    (lambda x: stepgraph.einsum("ij,jk->ik", x, x), "index 'j' is 4 in one operand and 3"),
    (lambda x: stepgraph.einsum("ijk->i", x), "does not index a tensor of shape"),
    (lambda x: stepgraph.einsum("ij->k", x), "must be distinct and appear"),
    (lambda x: x.mm(x[0]), "mm: needs two matrices"),
    (lambda x: x.dot(x), "dot: needs two 1-d tensors"),
    (lambda x: F.pad(x, (1, 2, 3)), "pair per padded axis"),
    (lambda x: x.scatter_add(1, x.repeat(2, 1).long(), x.repeat(2, 1)),
     "index torch.Size\\(\\[6, 4\\]\\) must have the rank of .* and fit in it off dim 1"),
    (lambda x: F.pad(x, (4, 0), mode="reflect"), "too large"),
])
def test_shape_errors_say_what_mismatched(expr, error):
    tracer = Tracer()
    with pytest.raises(ShapeError, match=error):
        expr(tracer.input((3, 4), "float32", "x"))


# ---- errors name the torch name, the module path and the alternative -----------------------

class Block(nn.Module):
    def __init__(self, use):
        super().__init__()
        self.fc, self.use = nn.Linear(4, 4), use

    def forward(self, x):
        return self.use(self.fc(x))


class Net(nn.Module):
    def __init__(self, use):
        super().__init__()
        self.layers = nn.Sequential(nn.ReLU(), Block(use))

    def forward(self, x):
        return self.layers(x)


def _compile(use):
    x = np.ones((2, 4), np.float32)
    return stepgraph.compile_predict(Net(use), example_inputs=(x,), device="cpu")


@pytest.mark.parametrize("use, names", [
    (lambda h: stepgraph.unknown_name(h), ["torch.unknown_name is not supported"]),
    (lambda h: F.unknown_name(h), ["torch.nn.functional.unknown_name"]),
    (lambda h: stepgraph.cuda.unknown_name(h), ["torch.cuda.unknown_name"]),
    (lambda h: h.nonzero(), ["Tensor.nonzero", "torch.where"]),
    (lambda h: nn.NoSuchLayer(4)(h), ["torch.nn.NoSuchLayer"]),
])
def test_errors_in_a_forward_name_the_module_path(use, names):
    with pytest.raises(UnsupportedOpError) as info:
        _compile(use)
    message = str(info.value)
    assert "model.layers.1" in message, message
    for name in names:
        assert name in message, message


def test_missing_names_outside_a_forward_name_the_torch_name_and_alternative():
    with pytest.raises(UnsupportedOpError) as info:
        nn.DataParallel(nn.Linear(2, 2))
    message = str(info.value)
    assert "torch.nn.DataParallel is not supported" in message
    assert "DistributedDataParallel" in message and "called in" not in message
    with pytest.raises(UnsupportedOpError, match="torch.nn.NoSuchLayer .*TORCH_COMPAT"):
        nn.NoSuchLayer
