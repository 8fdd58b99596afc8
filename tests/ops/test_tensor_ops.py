"""Traced-tensor operators and the elementwise, shape and softmax op families.

Each case is one function applied to both sides: to stepgraph's traced tensors (and its
nn.functional) and to torch tensors (and torch.nn.functional). The graph's forward and every
input gradient (through the real autodiff; loss = mse against a random target for non-scalar
outputs) must match torch autograd in float64 and float32, unfused and through the fusion
passes. Finite-difference checks of the VJP rules on broadcasting shapes follow.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch.nn.functional as TF

from stepgraph.errors import ShapeError, UnsupportedOpError
from stepgraph.ir.trace import Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import (assert_matches_torch, build_train_graph, case_arrays, op_forward,
                               op_vjp, randn, seeded, trace_inputs)

DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
FUSED = pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
RTOL = {np.float64: 1e-10, np.float32: 2e-5}


def pos(gen, *shape, dtype):
    """Values in [1.5, ...): safe divisors, bases of fractional powers."""
    return (1.5 + randn(gen, *shape, dtype=np.float64) ** 2).astype(dtype)


# name -> (fn(F, **tensors) -> tensor, inputs(gen, dtype) -> arrays). Every input is
# differentiated; `fn` sees stepgraph's functional module or torch's as F.
CASES = {
    # broadcasting binary ops, tensor on both sides
    "add-3x1x5+4x5": (lambda F, a, b: a + b,
                      lambda g, t: {"a": randn(g, 3, 1, 5, dtype=t), "b": randn(g, 4, 5, dtype=t)}),
    "add-same-shape": (lambda F, a, b: a + b,
                       lambda g, t: {"a": randn(g, 3, 4, dtype=t), "b": randn(g, 3, 4, dtype=t)}),
    "sub-both-broadcast": (lambda F, a, b: a - b,
                           lambda g, t: {"a": randn(g, 2, 1, 4, dtype=t),
                                         "b": randn(g, 3, 1, dtype=t)}),
    "mul-nchw-channel": (lambda F, x, s: x * s,
                         lambda g, t: {"x": randn(g, 2, 3, 4, 5, dtype=t),
                                       "s": randn(g, 1, 3, 1, 1, dtype=t)}),
    "mul-self": (lambda F, x: x * x, lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "div-row-vector": (lambda F, a, b: a / b,
                       lambda g, t: {"a": randn(g, 4, 5, dtype=t), "b": pos(g, 5, dtype=t)}),
    "div-bigger-divisor": (lambda F, a, b: a / b,
                           lambda g, t: {"a": randn(g, 5, dtype=t), "b": pos(g, 3, 5, dtype=t)}),
    "mul-0d-tensor": (lambda F, x, s: x * s,
                      lambda g, t: {"x": randn(g, 3, 4, dtype=t),
                                    "s": np.asarray(randn(g, dtype=t))}),
    "chain": (lambda F, a, b: (a * b + 1.0) / (b * b + 2.0) - a,
              lambda g, t: {"a": randn(g, 2, 3, 4, dtype=t), "b": randn(g, 3, 4, dtype=t)}),
    # Python scalars on both sides
    "scalar-add": (lambda F, x: 2.5 + x + 1, lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "scalar-sub": (lambda F, x: x - 1.5, lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "scalar-rsub": (lambda F, x: 1.5 - x, lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "scalar-mul": (lambda F, x: 3 * x * 0.5, lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "scalar-div": (lambda F, x: x / 4.0, lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "scalar-rdiv": (lambda F, x: 4.0 / x, lambda g, t: {"x": pos(g, 3, 4, dtype=t)}),
    "scalar-pow2": (lambda F, x: x ** 2, lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "scalar-pow-half": (lambda F, x: x ** 0.5, lambda g, t: {"x": pos(g, 3, 4, dtype=t)}),
    "scalar-pow-neg": (lambda F, x: x.pow(-1.5), lambda g, t: {"x": pos(g, 3, 4, dtype=t)}),
    "neg": (lambda F, x: -x, lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    # matmul
    "matmul-2d": (lambda F, a, b: a @ b,
                  lambda g, t: {"a": randn(g, 3, 4, dtype=t), "b": randn(g, 4, 5, dtype=t)}),
    "matmul-3d-2d": (lambda F, a, b: a @ b,
                     lambda g, t: {"a": randn(g, 2, 3, 4, dtype=t), "b": randn(g, 4, 5, dtype=t)}),
    "matmul-1d-2d": (lambda F, a, b: a @ b,
                     lambda g, t: {"a": randn(g, 4, dtype=t), "b": randn(g, 4, 5, dtype=t)}),
    "matmul-2d-1d": (lambda F, a, b: a @ b,
                     lambda g, t: {"a": randn(g, 3, 4, dtype=t), "b": randn(g, 4, dtype=t)}),
    "matmul-transposed": (lambda F, a, w: a @ w.T,
                          lambda g, t: {"a": randn(g, 3, 4, dtype=t),
                                        "w": randn(g, 5, 4, dtype=t)}),
    # shapes
    "reshape-minus-one": (lambda F, x: x.reshape(-1, 6) * 2.0,
                          lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "view": (lambda F, x: x.view(4, 6) + 1.0, lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "flatten-all": (lambda F, x: x.flatten() * 3.0, lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "flatten-1": (lambda F, x: x.flatten(1) * 3.0, lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "flatten-0-1": (lambda F, x: x.flatten(0, 1) * 3.0,
                    lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "permute": (lambda F, x: x.permute(2, 0, 1), lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "permute-tuple-4d": (lambda F, x: x.permute((0, 2, 3, 1)),
                         lambda g, t: {"x": randn(g, 2, 3, 4, 5, dtype=t)}),
    "transpose": (lambda F, x: x.transpose(0, -1), lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "T": (lambda F, x: x.T, lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    # reductions
    "sum-all": (lambda F, x: x.sum(), lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "sum-dim": (lambda F, x: x.sum(1), lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "sum-dims": (lambda F, x: x.sum((0, 2)), lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "sum-keepdim": (lambda F, x: x.sum(-1, keepdim=True),
                    lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "sum-dims-keepdim": (lambda F, x: x.sum(dim=(0, 2), keepdim=True),
                         lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "mean-all": (lambda F, x: x.mean(), lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "mean-keepdim": (lambda F, x: x.mean(1, keepdim=True),
                     lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "mean-dims": (lambda F, x: x.mean((1, 2)), lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t)}),
    "center": (lambda F, x: x - x.mean(-1, keepdim=True),
               lambda g, t: {"x": randn(g, 3, 5, dtype=t)}),
    # softmax
    "softmax-last": (lambda F, x: x.softmax(-1),
                     lambda g, t: {"x": 3 * randn(g, 2, 3, 5, dtype=t)}),
    "softmax-middle": (lambda F, x: F.softmax(x, dim=1),
                       lambda g, t: {"x": 3 * randn(g, 2, 3, 5, dtype=t)}),
    "softmax-1d": (lambda F, x: F.softmax(x, 0), lambda g, t: {"x": 3 * randn(g, 7, dtype=t)}),
    "log_softmax-last-3d": (lambda F, x: F.log_softmax(x, -1),
                            lambda g, t: {"x": 3 * randn(g, 2, 3, 5, dtype=t)}),
    "log_softmax-first": (lambda F, x: x.log_softmax(0),
                          lambda g, t: {"x": 3 * randn(g, 4, 5, dtype=t)}),
    "log_softmax-channels-4d": (lambda F, x: F.log_softmax(x, dim=1),
                                lambda g, t: {"x": 3 * randn(g, 2, 3, 2, 2, dtype=t)}),
    # activations
    "relu": (lambda F, x: x.relu(), lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "sigmoid": (lambda F, x: x.sigmoid(), lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "tanh": (lambda F, x: x.tanh(), lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "F.relu": (lambda F, x: F.relu(x), lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "F.sigmoid-tanh": (lambda F, x: F.sigmoid(x) * F.tanh(x),
                       lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "F.silu": (lambda F, x: F.silu(x), lambda g, t: {"x": 3 * randn(g, 2, 3, 4, dtype=t)}),
    "F.leaky_relu": (lambda F, x: F.leaky_relu(x, 0.2),
                     lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "F.gelu": (lambda F, x: F.gelu(x), lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    "F.gelu-tanh": (lambda F, x: F.gelu(x, approximate="tanh"),
                    lambda g, t: {"x": randn(g, 3, 4, dtype=t)}),
    # linear and mse
    "F.linear-3d": (lambda F, x, w, b: F.linear(x, w, b),
                    lambda g, t: {"x": randn(g, 2, 3, 4, dtype=t), "w": randn(g, 5, 4, dtype=t),
                                  "b": randn(g, 5, dtype=t)}),
    "F.linear-1d-nobias": (lambda F, x, w: F.linear(x, w),
                           lambda g, t: {"x": randn(g, 4, dtype=t), "w": randn(g, 5, 4, dtype=t)}),
    "F.mse_loss": (lambda F, x, y: F.mse_loss(x, y),
                   lambda g, t: {"x": randn(g, 3, 4, dtype=t), "y": randn(g, 3, 4, dtype=t)}),
    "residual-mlp": (lambda F, x, w1, w2: F.relu(F.linear(F.relu(F.linear(x, w1)), w2) + x),
                     lambda g, t: {"x": randn(g, 4, 6, dtype=t), "w1": randn(g, 8, 6, dtype=t),
                                   "w2": randn(g, 6, 8, dtype=t)}),
}


@pytest.mark.parametrize("case", CASES)
@FUSED
@DTYPES
def test_matches_torch(case, fused, dtype):
    fn, make = CASES[case]
    on_torch = functools.partial(fn, TF)
    arrays = case_arrays(case, on_torch, make, dtype)
    wrt = tuple(k for k in arrays if k != "target")
    body = lambda t, ins: fn(F, **{k: v for k, v in ins.items() if k != "target"})  # noqa: E731
    assert_matches_torch(case, body, on_torch, arrays, wrt, fused, dtype, RTOL[dtype])


# ---- finite differences of the VJP rules on broadcasting shapes ------------------------------

EPS = 1e-6

FD_CASES = {
    "binary-add-0d": ("binary", dict(kind="add"), {"a": (3, 4), "b": ()}),
    "binary-sub-3x1x5-4x5": ("binary", dict(kind="sub"), {"a": (3, 1, 5), "b": (4, 5)}),
    "binary-mul-nchw": ("binary", dict(kind="mul"), {"a": (2, 3, 2, 2), "b": (1, 3, 1, 1)}),
    "binary-mul-both": ("binary", dict(kind="mul"), {"a": (2, 1, 4), "b": (3, 1)}),
    "binary-div-lead": ("binary", dict(kind="div"), {"a": (5,), "b": (3, 5)}),
    "expand-lead-and-ones": ("expand", dict(shape=(2, 3, 4)), {"x": (1, 4)}),
    "expand-0d": ("expand", dict(shape=(2, 3)), {"x": ()}),
    "permute-4d": ("permute", dict(dims=(0, 2, 3, 1)), {"x": (2, 3, 2, 4)}),
    "reduce_sum-all": ("reduce_sum", dict(axes=(0, 1, 2)), {"x": (2, 3, 4)}),
    "reduce_sum-last": ("reduce_sum", dict(axes=(2,)), {"x": (2, 3, 4)}),
    "reduce_sum-1d": ("reduce_sum", dict(axes=(0,)), {"x": (5,)}),
    "softmax-1d": ("softmax", {}, {"x": (6,)}),
    "log_softmax-4d": ("log_softmax", {}, {"x": (2, 2, 3, 4)}),
}


@pytest.mark.parametrize("case", FD_CASES)
def test_vjp_finite_differences(case):
    op, attrs, shapes = FD_CASES[case]
    gen = seeded(case)
    # positive inputs keep div away from its pole
    arrays = {k: np.asarray(1.5 + randn(gen, *s, dtype=np.float64) ** 2)
              for k, s in shapes.items()}
    y = op_forward(op, arrays, **attrs)[0]
    v = randn(gen, *y.shape, dtype=np.float64)
    grads = op_vjp(op, arrays, v, tuple(arrays), **attrs)
    for name, x in arrays.items():
        assert grads[name].shape == x.shape and grads[name].dtype == np.float64
        u = randn(gen, *x.shape, dtype=np.float64)
        plus = op_forward(op, {**arrays, name: np.asarray(x + EPS * u)}, **attrs)[0]
        minus = op_forward(op, {**arrays, name: np.asarray(x - EPS * u)}, **attrs)[0]
        numeric = float(np.sum(v * (plus - minus))) / (2 * EPS)
        analytic = float(np.sum(grads[name] * u))
        assert abs(analytic - numeric) <= 1e-6 * max(abs(numeric), 1.0), \
            f"{case} d/d{name}: {analytic!r} vs finite difference {numeric!r}"


# ---- graph structure and errors ------------------------------------------------------------

def traced(**shapes):
    tracer = Tracer()
    arrays = {k: np.ones(s, np.float32) for k, s in shapes.items()}
    return tracer, trace_inputs(tracer, arrays)


def test_ops_recorded():
    """Operators map to the documented ops; no-op shape changes record nothing."""
    tracer, t = traced(x=(2, 3, 4), b=(4,))
    x, b = t["x"], t["b"]
    _ = (x + b, 2.0 - x, x / 3, x.permute(0, 1, 2), x.reshape(2, 3, 4), x.sum(1))
    ops = [(n.op, n.attrs.get("kind")) for n in tracer.graph.nodes]
    assert ops == [("binary", "add"), ("scalar", "rsub"), ("scalar", "div"), ("reduce_sum", None)]
    assert x.size() == (2, 3, 4) and x.size(-1) == 4 and x.ndim == 3 and x.dtype == "float32"
    assert x.shape == (2, 3, 4) and len(x) == 2


def test_softmax_over_a_middle_dim_permutes_there_and_back():
    tracer, t = traced(x=(2, 3, 4))
    y = t["x"].softmax(1)
    assert y.shape == (2, 3, 4)
    assert [n.op for n in tracer.graph.nodes] == ["permute", "softmax", "permute"]


@pytest.mark.parametrize("expr, op", [
    (lambda x: x.nonzero(), "Tensor.nonzero"),
    (lambda x: x.unique(), "Tensor.unique"),
    (lambda x: x[[0, 1]], "indexing with a list"),
    (lambda x: x.masked_select(x > 0), "Tensor.masked_select"),
])
def test_unsupported_tensor_methods_raise(expr, op):
    _, t = traced(x=(3, 4))
    with pytest.raises(UnsupportedOpError, match=op.replace("(", r"\(")) as info:
        expr(t["x"])
    assert "no module" in str(info.value)


def test_shape_errors():
    tracer = Tracer()
    a = tracer.input((3, 4), "float32", "a")
    b = tracer.input((3, 5), "float32", "b")
    c = tracer.input((3, 4), "float64", "c")
    with pytest.raises(ShapeError, match="broadcast"):
        a + b
    assert (a * c).dtype == "float64"            # torch's promotion: a cast before the op
    with pytest.raises(ShapeError, match="dtypes differ"):    # the op itself takes one dtype
        tracer.op("binary", [a, c], kind="mul")
    with pytest.raises(ShapeError, match="permutation"):
        a.permute(0, 0)
    with pytest.raises(ShapeError, match="cannot view"):
        a.reshape(-1, 5)
    with pytest.raises(ShapeError, match="out of range"):
        a.sum(2)
    with pytest.raises(ShapeError):
        a @ b


def test_mean_is_sum_then_scalar_division():
    arrays = {"x": np.arange(24, dtype=np.float64).reshape(2, 3, 4)}
    graph = build_train_graph(lambda t, i: i["x"].mean((0, 2)).sum(), arrays, ("x",), False)
    assert [n.op for n in graph.nodes][:3] == ["reduce_sum", "scalar", "reduce_sum"]
    assert graph.nodes[1].attrs == dict(kind="div", value=8.0)
