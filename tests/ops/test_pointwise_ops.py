"""Elementwise math, comparisons, masks, selection, casts and the composed activations
(ops/unary.py, ops/compare.py, ops/elementwise.py, ops/cast.py, nn/functional.py).

Each case is one function applied to stepgraph's traced tensors and to torch tensors: the
forward and every input gradient (loss = mse against a random target) must match torch
autograd in float64 and float32, unfused and through the fusion passes. Inputs named `k_*`
only feed masks (no gradient). Then: fused programs holding the new instructions give the
unfused graph's bits on NumPy, and the tensor methods record the documented ops.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import stepgraph
from stepgraph import nn
from stepgraph.errors import ShapeError, UnsupportedOpError
from stepgraph.ir.trace import Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import (assert_close, assert_matches_torch, build_train_graph, case_arrays,
                               randn, run_graph, seeded, trace_inputs)

DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
FUSED = pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
RTOL = {np.float64: 1e-10, np.float32: 2e-5}
# PyTorch's celu and hardsigmoid backward multiply by float32 constants (1 / alpha, 1 / 6) even
# in float64, so its gradients there are float32-accurate (our VJPs: test_ops_fd.py).
TORCH_FLOAT_CONSTANTS = {"F.selu-celu", "F.hardswish-hardsigmoid"}

# What a case's function sees as `M`: the functional module (M.F) and the torch namespace
# (M.T) of either side, and dtype names the two spell differently.
SG = SimpleNamespace(F=F, T=stepgraph, float64="float64", float32="float32", device="cuda")
TORCH = SimpleNamespace(F=TF, T=torch, float64=torch.float64, float32=torch.float32,
                        device="cpu")


def pos(gen, *shape, dtype):
    """Values in [0.5, ...): logs, roots and bases of powers."""
    return (0.5 + randn(gen, *shape, dtype=np.float64) ** 2).astype(dtype)


def x34(g, t):
    return {"x": randn(g, 3, 4, dtype=t)}


def x345(g, t, scale=1.0):
    return {"x": (scale * randn(g, 3, 4, 5, dtype=np.float64)).astype(t)}


CASES = {
    # unary math (methods and torch functions)
    "exp": (lambda M, x: x.exp(), x34),
    "log": (lambda M, x: x.log(), lambda g, t: {"x": pos(g, 3, 4, dtype=t)}),
    "log1p": (lambda M, x: M.T.log1p(x), lambda g, t: {"x": pos(g, 3, 4, dtype=t) - 0.4}),
    "expm1": (lambda M, x: M.T.expm1(x * 0.01), x34),
    "sqrt": (lambda M, x: x.sqrt(), lambda g, t: {"x": pos(g, 3, 4, dtype=t)}),
    "rsqrt": (lambda M, x: M.T.rsqrt(x), lambda g, t: {"x": pos(g, 3, 4, dtype=t)}),
    "abs": (lambda M, x: abs(x) + M.T.abs(x) * x.abs(), x34),
    "sign-times-x": (lambda M, x: x.sign() * x + M.T.sign(x), x34),
    "neg-reciprocal": (lambda M, x: M.T.neg(x) + x.reciprocal() + M.T.reciprocal(x).neg(),
                       lambda g, t: {"x": pos(g, 3, 4, dtype=t)}),
    "sin-cos": (lambda M, x: x.sin() * M.T.cos(x) + M.T.sin(x * 3.0), x34),
    "erf": (lambda M, x: M.T.erf(x * 1.5) + x.erf(), x34),
    "square": (lambda M, x: x.square() + M.T.square(x) * 0.5, x34),
    "floor-ceil-round-trunc": (lambda M, x: x.floor() * x + M.T.ceil(x) + M.T.round(x * 3.0) * x
                               + x.trunc() + M.T.trunc(x * 2.0), lambda g, t: x345(g, t, 3.0)),
    "torch-sigmoid-tanh-relu": (lambda M, x: M.T.sigmoid(x) + M.T.tanh(x) * M.T.relu(x), x34),
    # pow with tensor exponents, broadcasting, and a number base
    "pow-tensor": (lambda M, a, b: a ** b,
                   lambda g, t: {"a": pos(g, 3, 1, 5, dtype=t), "b": randn(g, 4, 5, dtype=t)}),
    "torch-pow-tensor": (lambda M, a, b: M.T.pow(a, b),
                         lambda g, t: {"a": pos(g, 4, 5, dtype=t), "b": randn(g, 5, dtype=t)}),
    "rpow": (lambda M, x: 2.0 ** x + 0.5 ** x + M.T.pow(3.0, x), x34),
    # clamp with numbers and tensors, maximum, minimum
    "clamp-both": (lambda M, x: x.clamp(-0.5, 0.7), x34),
    "clamp-min-max-clip": (lambda M, x: x.clamp(min=0.1) + x.clip(max=0.2) + M.T.clamp(x, 0.3)
                           + x.clamp_min(-0.2) * x.clamp_max(0.4), x34),
    "clamp-tensors": (lambda M, x, lo, hi: x.clamp(lo, hi),
                      lambda g, t: {"x": randn(g, 3, 4, dtype=t), "lo": randn(g, 4, dtype=t) - 0.5,
                                    "hi": randn(g, 3, 1, dtype=t) + 0.5}),
    "maximum-minimum": (lambda M, a, b: M.T.maximum(a, b) + a.minimum(b) * 2.0,
                        lambda g, t: {"a": randn(g, 2, 3, 4, dtype=t),
                                      "b": randn(g, 3, 1, dtype=t)}),
    # comparisons, masks, where, masked_fill
    "where-compare": (lambda M, x, y: M.T.where(x > y, x, y * 2.0),
                      lambda g, t: {"x": randn(g, 3, 4, dtype=t), "y": randn(g, 4, dtype=t)}),
    "where-method-broadcast-cond": (lambda M, x, y, k_c: x.where(k_c <= 0.2, y),
                                    lambda g, t: {"x": randn(g, 3, 1, dtype=t),
                                                  "y": randn(g, 3, 4, dtype=t),
                                                  "k_c": randn(g, 4, dtype=t)}),
    "where-scalars": (lambda M, x: M.T.where(x > 0, x, 0.0) + M.T.where(x < 0.5, 1.0, x)
                      + M.T.where(x >= 0.1, 2.0, -1.0).type_as(x) * x, x34),
    "all-comparisons": (lambda M, a, b: (a < b).type_as(a) * a + (a <= 0.3).to(a) * b
                        + (a > b).type_as(b) * 2.0 + (b >= a).to(a) * a * b
                        + (a.sign() == b.sign()).type_as(a) * a
                        + (a.sign() != 1.0).to(b) * b + (0.2 < a).type_as(a) * a, lambda g, t: {
                            "a": randn(g, 3, 4, dtype=t), "b": randn(g, 3, 4, dtype=t)}),
    "torch-comparisons": (lambda M, a, b: M.T.where(M.T.lt(a, b) | M.T.ge(a, 1.0), a, b)
                          + M.T.where(M.T.gt(a, 0.0) ^ M.T.le(b, 0.0), a, b * 3.0)
                          + M.T.where(M.T.eq(a.sign(), b.sign()), a, b)
                          + M.T.where(M.T.ne(a.sign(), 1.0), b, a), lambda g, t: {
                              "a": randn(g, 3, 4, dtype=t), "b": randn(g, 4, dtype=t)}),
    "logical": (lambda M, x, y: M.T.where(((x > 0) & (y < 0.5)) | ~(x > 1.0), x, y)
                + M.T.where(M.T.logical_xor(x > 0, y > 0), x, 2.0 * y)
                + M.T.where(M.T.logical_and(x > -1.0, M.T.logical_not(y > 1.0)), y, x)
                + M.T.where(M.T.logical_or(x > 1.0, M.T.logical_not(x)), x, y * 0.5)
                + M.T.where((x > 0).logical_not(), x, 0.0), lambda g, t: {
                    "x": randn(g, 3, 4, dtype=t), "y": randn(g, 3, 4, dtype=t)}),
    "masked_fill-softmax": (lambda M, s, k_m: s.masked_fill(k_m > 0.5, float("-inf"))
                            .softmax(-1),
                            lambda g, t: {"s": randn(g, 2, 3, 5, dtype=t),
                                          "k_m": np.array([0, 1, 0, 1, 1], dtype=t)}),
    "masked_fill-broadcast": (lambda M, x, k_m: M.T.masked_fill(x, k_m < 0.0, 1.5) * x,
                              lambda g, t: {"x": randn(g, 3, 4, dtype=t),
                                            "k_m": randn(g, 3, 1, dtype=t)}),
    # casts
    "cast-int-bool": (lambda M, x: (x * 3.0).long().type_as(x) * x + (x * 2.0).int().to(x)
                      + (x * 0.0).bool().type_as(x) + x.bool().to(x) * x, x34),
    "cast-float-roundtrip": (lambda M, x: x.float().type_as(x) * x.to(M.float32).to(x)
                             + x.double().to(x) + x.to(M.device) + x.to(x), x34),
    # activations
    "F.elu": (lambda M, x: M.F.elu(x) + M.F.elu(x, alpha=0.7), lambda g, t: x345(g, t, 2.0)),
    "F.selu-celu": (lambda M, x: M.F.selu(x) + M.F.celu(x, 1.3), lambda g, t: x345(g, t, 2.0)),
    "F.softplus": (lambda M, x: M.F.softplus(x), lambda g, t: x345(g, t, 3.0)),
    "F.softplus-beta-threshold": (lambda M, x: M.F.softplus(x, beta=2.0, threshold=3.0),
                                  lambda g, t: x345(g, t, 2.0)),
    "F.softplus-large": (lambda M, x: M.F.softplus(x * 60.0), x34),
    "F.mish": (lambda M, x: M.F.mish(x), lambda g, t: x345(g, t, 2.0)),
    "F.hardswish-hardsigmoid": (lambda M, x: M.F.hardswish(x) + M.F.hardsigmoid(x) * 2.0,
                                lambda g, t: x345(g, t, 4.0)),
    "F.relu6-hardtanh": (lambda M, x: M.F.relu6(x) + M.F.hardtanh(x, -0.5, 0.8),
                         lambda g, t: x345(g, t, 4.0)),
    "F.logsigmoid": (lambda M, x: M.F.logsigmoid(x), lambda g, t: x345(g, t, 3.0)),
    "F.glu": (lambda M, x: M.F.glu(x, dim=1) * 2.0 + M.F.glu(x).sum(),
              lambda g, t: {"x": randn(g, 3, 4, 6, dtype=t)}),
}


@pytest.mark.parametrize("case", CASES)
@FUSED
@DTYPES
def test_matches_torch(case, fused, dtype):
    fn, make = CASES[case]
    on_torch = functools.partial(fn, TORCH)
    arrays = case_arrays(case, on_torch, make, dtype)
    wrt = tuple(k for k in arrays if not k.startswith("k_") and k != "target")
    body = lambda t, ins: fn(SG, **{k: v for k, v in ins.items() if k != "target"})  # noqa: E731
    grad_rtol = 3e-7 if case in TORCH_FLOAT_CONSTANTS and dtype == np.float64 else RTOL[dtype]
    assert_matches_torch(case, body, on_torch, arrays, wrt, fused, dtype, RTOL[dtype], grad_rtol)


# ---- fusion: programs holding the new instructions give the unfused graph's bits -----------

# (op, kind) of the new instructions; None: any kind
NEW_INSTRUCTIONS = {("unary", None), ("compare", None), ("compare_scalar", None),
                    ("logical", None), ("logical_not", None), ("where", None),
                    ("masked_fill", None), ("cast", None), ("binary", "pow"),
                    ("binary", "maximum"), ("binary", "minimum"), ("scalar", "rpow"),
                    ("scalar", "maximum"), ("scalar", "minimum")}
FUSION_CASES = ("abs", "sin-cos", "erf", "pow-tensor", "rpow", "clamp-tensors",
                "maximum-minimum", "where-compare", "all-comparisons", "logical",
                "masked_fill-broadcast", "cast-int-bool", "F.softplus-beta-threshold", "F.mish",
                "F.hardswish-hardsigmoid", "F.elu")


@pytest.mark.parametrize("case", FUSION_CASES)
@DTYPES
def test_fused_programs_equal_the_unfused_graph(case, dtype):
    fn, make = CASES[case]
    gen = seeded("fusion" + case)
    arrays = make(gen, dtype)
    wrt = tuple(k for k in arrays if not k.startswith("k_"))
    probe = fn(TORCH, **{k: torch.tensor(v) for k, v in arrays.items()})
    arrays["target"] = randn(gen, *probe.shape, dtype=dtype)
    body = lambda t, ins: fn(SG, **{k: v for k, v in ins.items() if k != "target"})  # noqa: E731
    fused = build_train_graph(body, arrays, wrt, fused=True)
    held = {(i.op, kind) for n in fused.nodes if n.op == "pointwise"
            for i in n.attrs["program"] for kind in (None, i.attr.get("kind"))}
    assert held & NEW_INSTRUCTIONS, f"{case}: no program holds a new instruction ({held})"
    want = run_graph(build_train_graph(body, arrays, wrt, fused=False), arrays)
    got = run_graph(fused, arrays)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{case} {name}")


def test_a_lone_masked_fill_program_reads_a_bool_mask():
    """compare -> logical_not -> masked_fill fuse into one program whose register dtypes are
    bool for the masks and the float dtype for the result."""
    t = Tracer()
    ins = trace_inputs(t, {"x": np.ones((2, 3), np.float32), "m": np.ones((2, 3), np.float32)})
    y = ins["x"].masked_fill(~(ins["m"] > 0), -1.0)
    t.graph.outputs = {"y": y.value}
    from stepgraph.compile.pointwise import fuse_pointwise
    from stepgraph.ops.pointwise import register_dtypes
    (node,) = fuse_pointwise(t.graph).nodes
    assert [i.op for i in node.attrs["program"]] == ["compare_scalar", "logical_not",
                                                     "masked_fill"]
    assert register_dtypes(node.attrs["program"], ("float32", "float32")) == \
        ["float32", "float32", "bool", "bool", "float32"]


# ---- what the methods record, and errors ---------------------------------------------------

def traced(**shapes):
    tracer = Tracer()
    arrays = {k: np.ones(s, np.float32) for k, s in shapes.items()}
    return tracer, trace_inputs(tracer, arrays)


def test_methods_record_the_documented_ops():
    tracer, t = traced(x=(2, 3), y=(3,))
    x, y = t["x"], t["y"]
    mask = x > y
    assert mask.dtype == "bool" and mask.shape == (2, 3)
    _ = (x.exp(), x < 0.5, mask & (x > 0), ~mask, x.where(mask, 0.0), x.masked_fill(mask, 2.0),
         x.long(), x ** y, 2 ** x, x.clamp(0.0, 1.0))
    ops = [(n.op, n.attrs.get("kind")) for n in tracer.graph.nodes]
    assert ops == [("compare", "gt"), ("unary", "exp"), ("compare_scalar", "lt"),
                   ("compare_scalar", "gt"), ("logical", "and"), ("logical_not", None),
                   ("logical_not", None), ("masked_fill", None), ("masked_fill", None),
                   ("cast", None), ("binary", "pow"), ("scalar", "rpow"),
                   ("scalar", "maximum"), ("scalar", "minimum")]
    assert x.long().dtype == "int64" and x.int().dtype == "int32" and x.bool().dtype == "bool"
    assert x.to("cpu") is x and x.float() is x and x.to(dtype="float32") is x
    assert x.double().dtype == "float64" and x.bfloat16().dtype == "bfloat16"
    assert {x: 1}[x] == 1                       # __eq__ records an op; hashing is by identity


def test_errors_say_what_mismatched():
    _, t = traced(x=(2, 3), y=(4,))
    with pytest.raises(ShapeError, match="do not broadcast"):
        _ = t["x"] > t["y"]
    with pytest.raises(UnsupportedOpError, match="bool masks only"):
        _ = t["x"] & t["x"]
    with pytest.raises(UnsupportedOpError, match="bool masks only"):
        _ = ~t["x"]
    with pytest.raises(ShapeError, match="condition must be bool"):
        t["x"].tracer.op("where", [t["x"], t["x"], t["x"]])
    with pytest.raises(ShapeError, match="mask must be bool"):
        t["x"].masked_fill(t["x"], 0.0)
    with pytest.raises(ShapeError, match="odd size 3"):
        F.glu(t["x"])
    with pytest.raises(UnsupportedOpError, match="not supported"):
        t["x"].to("complex64")


@pytest.mark.parametrize("module, fn", [
    (nn.ELU(0.5), lambda x: F.elu(x, 0.5)), (nn.CELU(1.3), lambda x: F.celu(x, 1.3)),
    (nn.SELU(), F.selu), (nn.Softplus(2.0, 3.0), lambda x: F.softplus(x, 2.0, 3.0)),
    (nn.Mish(), F.mish), (nn.Hardswish(), F.hardswish), (nn.Hardsigmoid(), F.hardsigmoid),
    (nn.ReLU6(), F.relu6), (nn.Hardtanh(-2.0, 0.5), lambda x: F.hardtanh(x, -2.0, 0.5)),
    (nn.LogSigmoid(), F.logsigmoid), (nn.GLU(1), lambda x: F.glu(x, 1)),
], ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "")
def test_modules_compute_their_functional(module, fn):
    gen = seeded(type(module).__name__)
    arrays = {"x": randn(gen, 3, 4, 6, dtype=np.float64) * 3}
    outs = {}
    for name, f in (("module", module), ("functional", fn)):
        t = Tracer()
        y = f(trace_inputs(t, arrays)["x"])
        t.graph.outputs = {"y": y.value}
        outs[name] = run_graph(t.graph, arrays)["y"]
    np.testing.assert_array_equal(outs["module"], outs["functional"])
    want = {"ELU": lambda x: TF.elu(x, 0.5), "CELU": lambda x: TF.celu(x, 1.3), "SELU": TF.selu,
            "Softplus": lambda x: TF.softplus(x, 2.0, 3.0), "Mish": TF.mish,
            "Hardswish": TF.hardswish, "Hardsigmoid": TF.hardsigmoid, "ReLU6": TF.relu6,
            "Hardtanh": lambda x: TF.hardtanh(x, -2.0, 0.5), "LogSigmoid": TF.logsigmoid,
            "GLU": lambda x: TF.glu(x, 1)}[type(module).__name__]
    assert_close(outs["module"], want(torch.tensor(arrays["x"])).numpy(), 1e-12)


# ---- a compiled train step of a model using them, against torch -----------------------------

def _masked_forward(T, F, fc1, fc2, x):
    """The same forward for both frameworks (T: the torch namespace, F: functional)."""
    h = F.softplus(fc1(x), beta=2.0)
    h = h.masked_fill(h > 1.5, 0.0)
    h = T.where(h < 0.1, h * 2.0, h.sqrt())
    return fc2(F.mish(h.clamp(max=1.2)))


class MaskedNet(nn.Module):
    """Two Linear layers around softplus, masked_fill, where, sqrt, clamp and mish
    (tests/cuda/test_pointwise_ops_cuda.py trains it too)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return _masked_forward(stepgraph, F, self.fc1, self.fc2, x)


def test_compiled_train_step_matches_torch():
    gen = seeded("compiled-step")
    x = randn(gen, 16, 6)
    y = gen.integers(0, 3, 16).astype(np.int64)
    model = MaskedNet()
    ref = torch.nn.ModuleDict({"fc1": torch.nn.Linear(6, 8), "fc2": torch.nn.Linear(8, 3)})
    ref.load_state_dict({k: torch.tensor(v.numpy()) for k, v in model.state_dict().items()})
    step = stepgraph.compile_train_step(model, loss=stepgraph.losses.cross_entropy,
                                        optimizer=stepgraph.optim.SGD(lr=0.5),
                                        example_inputs=(x, y), device="cpu")
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    initial = {k: np.array(v, copy=True) for k, v in model.state_dict().items()}
    for _ in range(3):
        loss = float(step(x, y))
        opt.zero_grad()
        want = TF.cross_entropy(_masked_forward(torch, TF, ref.fc1, ref.fc2, torch.tensor(x)),
                                torch.tensor(y))
        want.backward()
        opt.step()
        assert abs(loss - want.item()) <= 1e-5 * abs(want.item())
    for k, v in model.state_dict().items():         # parameter changes, not only values
        assert_close(v.numpy() - initial[k], ref.state_dict()[k].numpy() - initial[k], 1e-4, k)


def test_autocast_follows_torch_lists():
    """precision="bf16": sin and masks keep a bf16 value's dtype, exp (on torch's fp32 list)
    runs in float32, where of bf16 and float32 promotes, as torch's CUDA autocast."""
    from stepgraph.compile.autocast import autocast

    t = Tracer()
    x, w = (t.input(s, "float32", n) for s, n in (((4, 6), "x"), ((5, 6), "w")))
    z = F.linear(x, w)
    outs = {"sin": z.sin(), "exp": z.exp(), "mask": z > 0.0, "pow": 2.0 ** z,
            "filled": z.sin().masked_fill(z > 0.0, 0.0), "where": z.where(z > 0.0, z.exp())}
    t.graph.outputs = {k: v.value for k, v in outs.items()}
    autocast(t.graph)
    assert {k: v.value.dtype for k, v in outs.items()} == {
        "sin": "bfloat16", "exp": "float32", "mask": "bool", "pow": "float32",
        "filled": "bfloat16", "where": "float32"}


def test_torch_functions_take_a_parameter_inside_forward():
    """torch.exp(self.log_scale) in a forward: the Parameter is traced on use."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.log_scale = nn.Parameter(np.array([0.3, -0.2, 0.1], np.float32))

        def forward(self, x):
            return x * stepgraph.exp(self.log_scale) + stepgraph.pow(self.log_scale, 2.0)

    model = Scaled()
    x = randn(seeded("param-exp"), 4, 3)
    predict = stepgraph.compile_predict(model, example_inputs=(x,), device="cpu")
    scale = np.array([0.3, -0.2, 0.1], np.float32)
    assert_close(np.asarray(predict(x)), x * np.exp(scale) + scale ** 2, 1e-6)
