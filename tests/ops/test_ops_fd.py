"""Finite-difference checks of every VJP rule (DESIGN.md Style 9, second of three ways).

In float64, along a random direction u and a random cotangent v:
    <v, J u>  ==  (<v, f(x + eps u)> - <v, f(x - eps u)>) / (2 eps)
where the left side is <J^T v, u> from the gradient nodes the op's VJP rule emits, and f is
the op's numpy kernel. Both sides run through the planner and the numpy backend.
"""
from __future__ import annotations

import numpy as np
import pytest

from stepgraph.distributed import DistEnv, rendezvous
from stepgraph.ir.ops import VJPS
from stepgraph.ops.activation import ACTIVATIONS
from stepgraph.ops.unary import UNARY_KINDS
from tests.ops.helpers import op_forward, op_vjp, randn, seeded

EPS = 1e-6
RTOL = 1e-6      # central differences in float64: truncation ~eps^2, rounding ~1e-16/eps


POSITIVE = ("log", "log1p", "sqrt", "rsqrt")      # unary kinds defined for x > 0


def f64(gen, *shape) -> np.ndarray:
    return randn(gen, *shape, dtype=np.float64)


def labels(gen, n, classes) -> np.ndarray:
    return gen.integers(0, classes, n).astype(np.int64)


# all_reduce_sum's group: a world of one (no store; two ranks: tests/unit/test_ddp_buffers.py),
# held here because groups are looked up by id through a weak table
ONE_RANK = rendezvous(DistEnv(0, 1, 0, "127.0.0.1", 1, "single", "none"))

# name -> (op, attrs, inputs(gen), differentiable input names[, outputs whose cotangents are
# set together: (0,) when absent])
CASES = {
    "all_reduce_sum": ("all_reduce_sum", dict(group=ONE_RANK.id, world_size=1),
                       lambda g: {"x": f64(g, 5, 3)}, ("x",)),
    "linear": ("linear", dict(act=None),
               lambda g: {"x": f64(g, 6, 5), "w": f64(g, 4, 5), "b": f64(g, 4)}, ("x", "w", "b")),
    "linear-nobias": ("linear", dict(act=None),
                      lambda g: {"x": f64(g, 6, 5), "w": f64(g, 4, 5)}, ("x", "w")),
    **{f"act-{kind}": ("act", dict(kind=kind, slope=0.2), lambda g: {"x": 2 * f64(g, 5, 7)},
                       ("x",)) for kind in ACTIVATIONS},
    "conv2d-pad-stride": ("conv2d", dict(stride=(2, 1), padding=(1, 2)),
                          lambda g: {"x": f64(g, 2, 3, 7, 6), "w": f64(g, 4, 3, 3, 2),
                                     "b": f64(g, 4)}, ("x", "w", "b")),
    # conv_transpose2d's node: x (N, O, Ho, Wo) spread back onto input_shape through w
    "conv2d_grad_input": ("conv2d_grad_input",
                          dict(stride=(2, 2), padding=(1, 0), input_shape=(2, 3, 6, 5)),
                          lambda g: {"x": f64(g, 2, 4, 3, 2), "w": f64(g, 4, 3, 3, 2)},
                          ("x", "w")),
    "conv2d_grad_input-groups-dilation": (
        "conv2d_grad_input", dict(stride=(1, 2), padding=(0, 1), dilation=(2, 1), groups=2,
                                  input_shape=(1, 4, 7, 6)),
        lambda g: {"x": f64(g, 1, 2, 3, 3), "w": f64(g, 2, 2, 3, 3)}, ("x", "w")),
    "conv2d-nobias": ("conv2d", dict(stride=(1, 1), padding=(0, 0)),
                      lambda g: {"x": f64(g, 2, 2, 6, 6), "w": f64(g, 3, 2, 3, 3)}, ("x", "w")),
    "maxpool2d-k2s2": ("maxpool2d", dict(kernel=(2, 2), stride=(2, 2)),
                       lambda g: {"x": f64(g, 2, 3, 6, 7)}, ("x",)),
    "maxpool2d-k3s1": ("maxpool2d", dict(kernel=(3, 3), stride=(1, 1)),
                       lambda g: {"x": f64(g, 2, 2, 6, 6)}, ("x",)),
    "maxpool2d-k3s2": ("maxpool2d", dict(kernel=(3, 3), stride=(2, 2)),
                       lambda g: {"x": f64(g, 2, 2, 7, 7)}, ("x",)),
    "reshape": ("reshape", dict(shape=(4, 15)), lambda g: {"x": f64(g, 4, 3, 5)}, ("x",)),
    # float64 -> float64 (a copy): finite differences need float64; the bf16 casts' rounding
    # is tested bit for bit in tests/unit/test_bf16.py.
    "cast": ("cast", dict(dtype="float64"), lambda g: {"x": f64(g, 4, 3)}, ("x",)),
    "dropout": ("dropout", dict(p=0.4, seed=3, site=1, per_channel=False),
                lambda g: {"x": f64(g, 6, 9), "step": np.array(7, np.int64)}, ("x",)),
    "dropout2d": ("dropout", dict(p=0.4, seed=3, site=1, per_channel=True),
                  lambda g: {"x": f64(g, 6, 4, 3, 3), "step": np.array(7, np.int64)}, ("x",)),
    "log_softmax": ("log_softmax", {}, lambda g: {"x": 3 * f64(g, 5, 6)}, ("x",)),
    "cross_entropy": ("cross_entropy", {}, lambda g: {"x": 3 * f64(g, 5, 6), "y": labels(g, 5, 6)},
                      ("x",)),
    "nll_loss": ("nll_loss", {}, lambda g: {"x": f64(g, 5, 6), "y": labels(g, 5, 6)}, ("x",)),
    "mse": ("mse", {}, lambda g: {"p": f64(g, 4, 5), "q": f64(g, 4, 5)}, ("p", "q")),
    "add": ("add", {}, lambda g: {"a": f64(g, 3, 4), "b": f64(g, 3, 4)}, ("a", "b")),
    **{f"matmul-{ta:d}{tb:d}": ("matmul", dict(trans_a=ta, trans_b=tb),
                                lambda g, ta=ta, tb=tb: {"a": f64(g, *((4, 3) if ta else (3, 4))),
                                                         "b": f64(g, *((5, 4) if tb else (4, 5)))},
                                ("a", "b")) for ta in (False, True) for tb in (False, True)},
    # elementwise and shape families (more broadcasting cases in test_tensor_ops.py)
    **{f"binary-{kind}": ("binary", dict(kind=kind),
                          lambda g: {"a": f64(g, 3, 1, 5), "b": 2 + f64(g, 4, 5) ** 2},
                          ("a", "b")) for kind in ("add", "sub", "mul", "div")},
    **{f"scalar-{kind}": ("scalar", dict(kind=kind, value=1.7),
                          lambda g: {"x": 1 + f64(g, 3, 4) ** 2}, ("x",))
       for kind in ("add", "sub", "rsub", "mul", "div", "rdiv", "pow")},
    "expand": ("expand", dict(shape=(2, 3, 4)), lambda g: {"x": f64(g, 3, 1)}, ("x",)),
    "permute": ("permute", dict(dims=(2, 0, 1)), lambda g: {"x": f64(g, 2, 3, 4)}, ("x",)),
    "permute_group": ("permute_group", dict(dims=((2, 0, 1), (1, 0))),
                      lambda g: {"a": f64(g, 2, 3, 4), "b": f64(g, 3, 5)}, ("a", "b"),
                      (0, 1)),
    "reduce_sum": ("reduce_sum", dict(axes=(0, 2)), lambda g: {"x": f64(g, 2, 3, 4)}, ("x",)),
    "softmax": ("softmax", {}, lambda g: {"x": 3 * f64(g, 2, 3, 5)}, ("x",)),
    "log_softmax-3d": ("log_softmax", {}, lambda g: {"x": 3 * f64(g, 2, 3, 5)}, ("x",)),
    # norm and pool families (more cases in test_norm_pool_ops.py)
    "batch_norm_train": ("batch_norm_train", dict(eps=1e-5, momentum=0.1, affine=True,
                                                  track=False, act="none"),
                         lambda g: {"x": f64(g, 4, 3, 2, 3), "w": f64(g, 3), "b": f64(g, 3)},
                         ("x", "w", "b")),
    "avgpool2d": ("avgpool2d", dict(kernel=(3, 3), stride=(2, 2), padding=(1, 1),
                                    count_include_pad=False),
                  lambda g: {"x": f64(g, 2, 3, 7, 6)}, ("x",)),
    # the 3-d family (more cases in test_3d_ops.py)
    "conv3d": ("conv3d", dict(stride=(2, 1, 1), padding=(1, 0, 1), dilation=(1, 1, 2),
                              groups=1),
               lambda g: {"x": f64(g, 2, 2, 5, 4, 6), "w": f64(g, 3, 2, 3, 2, 2),
                          "b": f64(g, 3)}, ("x", "w", "b")),
    "maxpool3d": ("maxpool3d", dict(kernel=(3, 2, 2), stride=(2, 2, 1), padding=(1, 0, 1),
                                    dilation=(1, 1, 2), ceil_mode=True),
                  lambda g: {"x": f64(g, 2, 2, 6, 5, 5)}, ("x",)),
    "avgpool3d": ("avgpool3d", dict(kernel=(3, 3, 2), stride=(2, 2, 1), padding=(1, 1, 0),
                                    ceil_mode=True, count_include_pad=False,
                                    divisor_override=None),
                  lambda g: {"x": f64(g, 2, 2, 6, 5, 5)}, ("x",)),
    # transformer ops (more cases in test_transformer_ops.py)
    "embedding": ("embedding", {},
                  lambda g: {"w": f64(g, 7, 5), "i": np.array([[3, 1, 3], [0, 6, 3]])}, ("w",)),
    "layer_norm": ("layer_norm", dict(eps=1e-5, weight=True, bias=True),
                   lambda g: {"x": f64(g, 2, 3, 6), "w": f64(g, 6), "b": f64(g, 6)},
                   ("x", "w", "b")),
    "layer_norm-nobias": ("layer_norm", dict(eps=1e-5, weight=True, bias=False),
                          lambda g: {"x": f64(g, 4, 5), "w": f64(g, 5)}, ("x", "w")),
    "layer_norm-plain": ("layer_norm", dict(eps=1e-5, weight=False, bias=False),
                         lambda g: {"x": f64(g, 4, 5)}, ("x",)),
    "add_layer_norm": ("add_layer_norm", dict(eps=1e-5, weight=True, bias=True),
                       lambda g: {"a": f64(g, 2, 3, 6), "b": f64(g, 2, 3, 6), "w": f64(g, 6),
                                  "bias": f64(g, 6)}, ("a", "b", "w", "bias")),
    # y and the residual stream s (output 3) both read downstream, as in a pre-norm block
    "add_layer_norm-y-and-s": ("add_layer_norm", dict(eps=1e-5, weight=True, bias=True),
                               lambda g: {"a": f64(g, 2, 3, 6), "b": f64(g, 2, 3, 6),
                                          "w": f64(g, 6), "bias": f64(g, 6)},
                               ("a", "b", "w", "bias"), (0, 3)),
    "add_layer_norm-s-only": ("add_layer_norm", dict(eps=1e-5, weight=False, bias=False),
                              lambda g: {"a": f64(g, 4, 5), "b": f64(g, 4, 5)}, ("a", "b"), (3,)),
    "add_layer_norm-plain": ("add_layer_norm", dict(eps=1e-5, weight=False, bias=False),
                             lambda g: {"a": f64(g, 4, 5), "b": f64(g, 4, 5)}, ("a", "b")),
    "rms_norm": ("rms_norm", dict(eps=1e-6, weight=True),
                 lambda g: {"x": f64(g, 2, 3, 6), "w": f64(g, 6)}, ("x", "w")),
    "rms_norm-plain": ("rms_norm", dict(eps=1e-6, weight=False),
                       lambda g: {"x": f64(g, 4, 5)}, ("x",)),
    "add_rms_norm": ("add_rms_norm", dict(eps=1e-6, weight=True),
                     lambda g: {"a": f64(g, 2, 3, 6), "b": f64(g, 2, 3, 6), "w": f64(g, 6)},
                     ("a", "b", "w")),
    # y and the residual stream s (output 2) both read downstream
    "add_rms_norm-y-and-s": ("add_rms_norm", dict(eps=1e-6, weight=True),
                             lambda g: {"a": f64(g, 2, 3, 6), "b": f64(g, 2, 3, 6),
                                        "w": f64(g, 6)}, ("a", "b", "w"), (0, 2)),
    "add_rms_norm-s-only": ("add_rms_norm", dict(eps=1e-6, weight=False),
                            lambda g: {"a": f64(g, 4, 5), "b": f64(g, 4, 5)}, ("a", "b"), (2,)),
    **{f"bmm-{ta:d}{tb:d}": ("bmm", dict(trans_a=ta, trans_b=tb),
                             lambda g, ta=ta, tb=tb: {"a": f64(g, 2, *((4, 3) if ta else (3, 4))),
                                                      "b": f64(g, 2, *((5, 4) if tb else (4, 5)))},
                             ("a", "b")) for ta in (False, True) for tb in (False, True)},
    "softmax-scale-causal": ("softmax", dict(scale=0.7, causal=True),
                             lambda g: {"x": 3 * f64(g, 2, 3, 5)}, ("x",)),
    "slice": ("slice", dict(dim=1, start=1, stop=3), lambda g: {"x": f64(g, 2, 4, 3)}, ("x",)),
    # the cotangent on the first output (time step); the others' VJP rows add zero
    "unstack": ("unstack", dict(dim=1), lambda g: {"x": f64(g, 2, 3, 4)}, ("x",)),
    "unstack-reverse": ("unstack", dict(dim=1, reverse=True),
                        lambda g: {"x": f64(g, 2, 3, 4)}, ("x",)),
    # attention family (more cases in test_attention_ops.py)
    "sdpa-causal": ("sdpa", dict(scale=0.6, causal=True, dropout_p=0.0),
                    lambda g: {"q": f64(g, 2, 3, 5, 4), "k": f64(g, 2, 3, 5, 4),
                               "v": f64(g, 2, 3, 5, 3)}, ("q", "k", "v")),
    "sdpa-full-L!=S": ("sdpa", dict(scale=0.4, causal=False, dropout_p=0.0),
                       lambda g: {"q": f64(g, 3, 4, 5), "k": f64(g, 3, 6, 5),
                                  "v": f64(g, 3, 6, 2)}, ("q", "k", "v")),
    "sdpa-dropout-causal": ("sdpa", dict(scale=0.5, causal=True, dropout_p=0.3, seed=4, site=2),
                            lambda g: {"q": f64(g, 2, 6, 3), "k": f64(g, 2, 7, 3),
                                       "v": f64(g, 2, 7, 4), "step": np.array(5, np.int64)},
                            ("q", "k", "v")),
    "sdpa-grouped-masked": ("sdpa", dict(scale=0.5, causal=False, dropout_p=0.2, seed=7,
                                         site=1, mask=True),
                            lambda g: {"q": f64(g, 2, 4, 5, 3), "k": f64(g, 2, 2, 6, 3),
                                       "v": f64(g, 2, 2, 6, 4),
                                       "mask": np.where(np.arange(6) < 4, 0.0, -np.inf)
                                       + 0.3 * f64(g, 2, 1, 5, 6),
                                       "step": np.array(3, np.int64)}, ("q", "k", "v")),
    # elementwise math, selection and the new binary and scalar kinds (test_pointwise_ops.py
    # tests them against torch)
    **{f"unary-{kind}": ("unary", dict(kind=kind),
                         lambda g, kind=kind: {"x": (1 + f64(g, 3, 4) ** 2 if kind in POSITIVE
                                                     else f64(g, 3, 4))}, ("x",))
       for kind in UNARY_KINDS},
    **{f"binary-{kind}": ("binary", dict(kind=kind),
                          lambda g: {"a": 1 + f64(g, 3, 1, 5) ** 2, "b": f64(g, 4, 5)},
                          ("a", "b")) for kind in ("pow", "maximum", "minimum")},
    **{f"scalar-{kind}": ("scalar", dict(kind=kind, value=0.3), lambda g: {"x": f64(g, 3, 4)},
                          ("x",)) for kind in ("rpow", "maximum", "minimum")},
    "where": ("where", {}, lambda g: {"c": f64(g, 4, 1) > 0, "a": f64(g, 3, 4, 5),
                                      "b": f64(g, 5)}, ("a", "b")),
    "masked_fill": ("masked_fill", dict(value=-2.5),
                    lambda g: {"x": f64(g, 3, 1, 5), "m": f64(g, 4, 5) > 0}, ("x",)),
    # index and reduce families (forward and gradient against torch in test_index_ops.py)
    "slice-step": ("slice", dict(dim=2, start=1, stop=7, step=3),
                   lambda g: {"x": f64(g, 2, 3, 8)}, ("x",)),
    "concat": ("concat", dict(dim=1), lambda g: {"a": f64(g, 2, 3, 2), "b": f64(g, 2, 1, 2),
                                                 "c": f64(g, 2, 4, 2)}, ("a", "b", "c")),
    "gather": ("gather", dict(dim=1), lambda g: {"x": f64(g, 3, 5, 2),
                                                 "i": g.integers(0, 5, (3, 7, 2))}, ("x",)),
    "gather_grad": ("gather_grad", dict(input_shape=(3, 5, 2), dim=1),
                    lambda g: {"dy": f64(g, 3, 7, 2), "i": g.integers(0, 5, (3, 7, 2))},
                    ("dy",)),
    "triangle-lower": ("triangle", dict(diagonal=1, upper=False),
                       lambda g: {"x": f64(g, 2, 4, 5)}, ("x",)),
    "triangle-upper": ("triangle", dict(diagonal=-1, upper=True),
                       lambda g: {"x": f64(g, 5, 3)}, ("x",)),
    "reduce_max": ("reduce_max", dict(dim=1, kind="max"), lambda g: {"x": f64(g, 3, 6, 2)},
                   ("x",)),
    "reduce_max-min": ("reduce_max", dict(dim=0, kind="min"), lambda g: {"x": f64(g, 6, 4)},
                       ("x",)),
    "topk": ("topk", dict(dim=1, k=3, largest=True), lambda g: {"x": f64(g, 2, 6, 3)}, ("x",)),
    "topk-smallest": ("topk", dict(dim=0, k=2, largest=False), lambda g: {"x": f64(g, 5, 3)},
                      ("x",)),
    "cumsum": ("cumsum", dict(dim=1, reverse=False), lambda g: {"x": f64(g, 3, 5, 2)}, ("x",)),
    "cumsum-reverse": ("cumsum", dict(dim=0, reverse=True), lambda g: {"x": f64(g, 5, 3)},
                       ("x",)),
    "lstm_cell": ("lstm_cell", {}, lambda g: {"gates": f64(g, 3, 8), "c": f64(g, 3, 2)},
                  ("gates", "c")),
    "lstm_cell-two-addends": ("lstm_cell", {}, lambda g: {"xp": f64(g, 3, 8), "hp": f64(g, 3, 8),
                                                          "c": f64(g, 3, 2)}, ("xp", "hp", "c")),
    "cross_entropy-ignore-smooth": ("cross_entropy", dict(ignore_index=-1, label_smoothing=0.1),
                                    lambda g: {"x": 3 * f64(g, 5, 6),
                                               "y": np.array([2, -1, 0, 5, -1])}, ("x",)),
}


def directional_fd(op, attrs, arrays, name, u, v) -> float:
    """(<v, f(x + eps u)> - <v, f(x - eps u)>) / (2 eps), f = the op's first output; v may be
    {output index: cotangent}, the pairings summed."""
    vs = v if isinstance(v, dict) else {0: v}
    plus = op_forward(op, {**arrays, name: arrays[name] + EPS * u}, **attrs)
    minus = op_forward(op, {**arrays, name: arrays[name] - EPS * u}, **attrs)
    return sum(float(np.sum(w * (plus[i] - minus[i]))) for i, w in vs.items()) / (2 * EPS)


@pytest.mark.parametrize("case", CASES)
def test_vjp_matches_finite_differences(case):
    op, attrs, make_inputs, wrt, *outs = CASES[case]
    gen = seeded(case)
    arrays = make_inputs(gen)
    ys = op_forward(op, arrays, **attrs)
    assert ys[0].dtype == np.float64, f"{op} lost float64"
    v = {i: f64(gen, *ys[i].shape) for i in (outs[0] if outs else (0,))}
    grads = op_vjp(op, arrays, v, wrt, **attrs)
    for name in wrt:
        assert grads[name].dtype == np.float64 and grads[name].shape == arrays[name].shape
        u = f64(gen, *arrays[name].shape)
        analytic = float(np.sum(grads[name] * u))
        numeric = directional_fd(op, attrs, arrays, name, u, v)
        assert abs(analytic - numeric) <= RTOL * max(abs(numeric), 1.0), \
            f"{case} d/d{name}: <J^T v, u> = {analytic!r}, finite difference {numeric!r}"


def test_every_vjp_rule_has_a_case():
    assert {c[0] for c in CASES.values()} == set(VJPS)


@pytest.mark.parametrize("classes", [2, 10])
def test_fused_cross_entropy_gradient_matches_finite_differences(classes):
    """cross_entropy_train returns (loss, dlogits) in one kernel: dlogits must be d loss."""
    gen = seeded(f"cet{classes}")
    arrays = {"x": 3 * f64(gen, 7, classes), "y": labels(gen, 7, classes)}
    loss, dlogits = op_forward("cross_entropy_train", arrays)
    assert loss.dtype == dlogits.dtype == np.float64
    (want_loss, _) = op_forward("cross_entropy", arrays)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-14)
    u = f64(gen, 7, classes)
    numeric = directional_fd("cross_entropy_train", {}, arrays, "x", u, np.float64(1.0))
    assert abs(float(np.sum(dlogits * u)) - numeric) <= RTOL * max(abs(numeric), 1.0)


@pytest.mark.parametrize("kind", ("none",) + ACTIVATIONS)
def test_fused_act_bias_grad_is_act_grad_and_its_row_sum(kind):
    gen = seeded(f"abg{kind}")
    dy, saved = f64(gen, 6, 5), f64(gen, 6, 5)
    dz, db = op_forward("act_bias_grad", {"dy": dy, "saved": saved}, kind=kind, slope=0.2)
    want = dy if kind == "none" else \
        op_forward("act_grad", {"dy": dy, "saved": saved}, kind=kind, slope=0.2)[0]
    np.testing.assert_allclose(dz, want, rtol=1e-14)
    np.testing.assert_allclose(db, want.sum(axis=0), rtol=1e-12)
