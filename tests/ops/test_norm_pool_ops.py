"""BatchNorm, average/max pooling with padding, grouped and dilated convolution, and label
smoothing: forward and gradients against PyTorch (float32 and float64, unfused and through the
fusion passes), finite-difference VJP checks in float64, and the modules (BatchNorm1d/2d,
Conv2d, pools) with their running statistics against torch.nn's."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF
from torch import nn as tnn

from stepgraph import nn
from stepgraph.autodiff import append_backward
from stepgraph.errors import ShapeError, UnsupportedOpError
from stepgraph.ir.trace import Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import (assert_close, forward_and_grads, op_forward, op_vjp, randn,
                               run_graph, seeded, torch_forward_and_grads, trace_inputs)
from tests.ops.test_ops_fd import directional_fd

FUSED = pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
DTYPES = pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
# float32: the harness's 1e-5 (rounding of sums over a few hundred terms, relative to the
# largest element); float64: both sides agree to rounding, so much tighter.
RTOL = {np.float32: 1e-5, np.float64: 1e-10}
FD_RTOL = 1e-6   # central differences in float64, as test_ops_fd.py


@pytest.fixture
def gen(request) -> np.random.Generator:
    return seeded(request.node.name)


def check_against_torch(body, torch_fn, arrays, wrt, fused, rtol):
    out, grads = forward_and_grads(body, arrays, wrt, fused)
    t_out, t_grads = torch_forward_and_grads(torch_fn, arrays, wrt)
    assert out.dtype == t_out.dtype
    assert_close(out, t_out, rtol, "forward")
    for name in wrt:
        assert grads[name].dtype == arrays[name].dtype
        assert_close(grads[name], t_grads[name], rtol, f"grad of {name}")


def with_target(arrays, torch_fn, gen):
    """arrays plus a random mse target of the torch output's shape and dtype."""
    out = torch_fn(**{k: torch.tensor(v) for k, v in arrays.items()})
    return {**arrays, "target": randn(gen, *out.shape, dtype=arrays["x"].dtype)}


def fd_check(op, attrs, arrays, wrt, gen):
    """<J^T v, u> from the op's VJP rule against central differences, float64."""
    y = op_forward(op, arrays, **attrs)[0]
    v = randn(gen, *y.shape, dtype=np.float64)
    grads = op_vjp(op, arrays, v, wrt, **attrs)
    for name in wrt:
        u = randn(gen, *arrays[name].shape, dtype=np.float64)
        analytic = float(np.sum(grads[name] * u))
        numeric = directional_fd(op, attrs, arrays, name, u, v)
        assert abs(analytic - numeric) <= FD_RTOL * max(abs(numeric), 1.0), \
            f"{op} d/d{name}: <J^T v, u> = {analytic!r}, finite difference {numeric!r}"


# ---- convolution: groups and dilation ------------------------------------------------------

CONV_CASES = {   # x shape, w shape, stride, padding, dilation, groups
    "groups2": ((2, 4, 7, 6), (6, 2, 3, 3), (1, 1), (1, 1), (1, 1), 2),
    "depthwise-stride2": ((2, 3, 8, 7), (3, 1, 3, 3), (2, 2), (1, 1), (1, 1), 3),
    "depthwise-multiplier2": ((2, 2, 6, 6), (4, 1, 3, 2), (1, 1), (0, 1), (1, 1), 2),
    "dilation2-pad2": ((2, 3, 9, 8), (4, 3, 3, 3), (1, 1), (2, 2), (2, 2), 1),
    "dilation21-stride12": ((2, 2, 9, 9), (3, 2, 2, 3), (1, 2), (1, 0), (2, 1), 1),
    "groups3-dilation2-stride2": ((2, 6, 10, 9), (6, 2, 3, 3), (2, 2), (2, 1), (2, 2), 3),
}


@FUSED
@DTYPES
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv2d_groups_dilation(case, bias, dtype, fused, gen):
    xs, ws, stride, padding, dilation, groups = CONV_CASES[case]
    arrays = {"x": randn(gen, *xs, dtype=dtype), "w": randn(gen, *ws, dtype=dtype) / 3,
              "b": randn(gen, ws[0], dtype=dtype)}
    if not bias:
        del arrays["b"]
    wrt = tuple(arrays)

    def torch_fn(x, w, b=None):
        return TF.conv2d(x, w, b, stride, padding, dilation, groups)

    check_against_torch(
        lambda t, i: F.conv2d(i["x"], i["w"], i.get("b"), stride, padding, dilation, groups),
        torch_fn, with_target(arrays, torch_fn, gen), wrt, fused, RTOL[dtype])


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv2d_groups_dilation_finite_differences(case, gen):
    xs, ws, stride, padding, dilation, groups = CONV_CASES[case]
    arrays = {"x": randn(gen, *xs, dtype=np.float64), "w": randn(gen, *ws, dtype=np.float64),
              "b": randn(gen, ws[0], dtype=np.float64)}
    fd_check("conv2d", dict(stride=stride, padding=padding, dilation=dilation, groups=groups),
             arrays, ("x", "w", "b"), gen)


def test_conv2d_node_without_the_new_attrs_is_a_plain_conv(gen):
    """Graphs recorded before dilation and groups existed still run: (1, 1) and 1."""
    x, w = randn(gen, 2, 3, 6, 6), randn(gen, 4, 3, 3, 3)
    (old,) = op_forward("conv2d", {"x": x, "w": w}, stride=(1, 1), padding=(1, 1))
    (new,) = op_forward("conv2d", {"x": x, "w": w}, stride=(1, 1), padding=(1, 1),
                        dilation=(1, 1), groups=1)
    np.testing.assert_array_equal(old, new)
    dy = randn(gen, *old.shape)
    grads = op_vjp("conv2d", {"x": x, "w": w}, dy, ("x", "w"), stride=(1, 1), padding=(1, 1))
    t_x, t_w = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    TF.conv2d(t_x, t_w, None, 1, 1).backward(torch.tensor(dy))
    assert_close(grads["x"], t_x.grad.numpy())
    assert_close(grads["w"], t_w.grad.numpy())


@pytest.mark.parametrize("ws,groups,what", [((4, 2, 3, 3), 2, "groups=2 must divide"),
                                            ((4, 2, 3, 3), 1, "weight expects 2 x 1"),
                                            ((4, 3, 3, 3), 1, "larger than padded")])
def test_conv2d_shape_errors(ws, groups, what):
    t = Tracer()
    x, w = t.input((1, 3, 4, 4), "float32", "x"), t.input(ws, "float32", "w")
    with pytest.raises(ShapeError, match=what):
        t.op("conv2d", [x, w], stride=(1, 1), padding=(0, 0), dilation=(2, 2), groups=groups)


def test_conv2d_same_padding(gen):
    x, w = randn(gen, 2, 2, 7, 7), randn(gen, 3, 2, 3, 3)
    arrays = {"x": x, "w": w}
    t = Tracer()
    i = trace_inputs(t, arrays)
    t.graph.outputs = {"y": F.conv2d(i["x"], i["w"], padding="same", dilation=2).value}
    want = TF.conv2d(torch.tensor(x), torch.tensor(w), padding="same", dilation=2)
    assert_close(run_graph(t.graph, arrays)["y"], want.numpy())
    with pytest.raises(UnsupportedOpError, match="same"):
        F.conv2d(i["x"], i["w"], padding="same", stride=2)


def test_conv2d_module_init_and_shapes_match_torch():
    """PyTorch's init with groups: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = C/groups*kh*kw."""
    m = nn.Conv2d(6, 9, 3, stride=2, padding=1, dilation=2, groups=3)
    tm = tnn.Conv2d(6, 9, 3, stride=2, padding=1, dilation=2, groups=3)
    sd, want = m.state_dict(), tm.state_dict()
    assert list(sd) == list(want)
    bound = 1 / np.sqrt(2 * 3 * 3)
    for k in want:
        assert sd[k].shape == tuple(want[k].shape)
        assert bound / 2 < np.abs(sd[k]).max() <= bound, k


# ---- pooling -------------------------------------------------------------------------------

AVG_CASES = {   # x shape, kernel, stride, padding
    "k2s2": ((2, 3, 8, 8), (2, 2), (2, 2), (0, 0)),
    "k3s2-pad1": ((2, 3, 9, 8), (3, 3), (2, 2), (1, 1)),
    "k3s1-pad1": ((2, 2, 6, 7), (3, 3), (1, 1), (1, 1)),
    "k23s12-pad10": ((2, 2, 7, 9), (2, 3), (1, 2), (1, 0)),
    "k4s3-pad2-floor": ((1, 2, 10, 11), (4, 4), (3, 3), (2, 2)),
}


@FUSED
@DTYPES
@pytest.mark.parametrize("count_include_pad", [True, False], ids=["count-pad", "real-only"])
@pytest.mark.parametrize("case", AVG_CASES)
def test_avg_pool2d(case, count_include_pad, dtype, fused, gen):
    xs, kernel, stride, padding = AVG_CASES[case]

    def torch_fn(x):
        return TF.avg_pool2d(x, kernel, stride, padding, count_include_pad=count_include_pad)

    arrays = with_target({"x": randn(gen, *xs, dtype=dtype)}, torch_fn, gen)
    check_against_torch(
        lambda t, i: F.avg_pool2d(i["x"], kernel, stride, padding,
                                  count_include_pad=count_include_pad),
        torch_fn, arrays, ("x",), fused, RTOL[dtype])


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("case", AVG_CASES)
def test_avg_pool2d_finite_differences(case, count_include_pad, gen):
    xs, kernel, stride, padding = AVG_CASES[case]
    fd_check("avgpool2d", dict(kernel=kernel, stride=stride, padding=padding,
                               count_include_pad=count_include_pad),
             {"x": randn(gen, *xs, dtype=np.float64)}, ("x",), gen)


@DTYPES
@pytest.mark.parametrize("out_size,in_hw", [(1, (5, 7)), ((2, 3), (4, 9)), ((4, None), (8, 6))])
def test_adaptive_avg_pool2d(out_size, in_hw, dtype, gen):
    def torch_fn(x):
        return TF.adaptive_avg_pool2d(x, out_size)

    arrays = with_target({"x": randn(gen, 2, 3, *in_hw, dtype=dtype)}, torch_fn, gen)
    check_against_torch(lambda t, i: F.adaptive_avg_pool2d(i["x"], out_size), torch_fn,
                        arrays, ("x",), True, RTOL[dtype])


MAX_CASES = {   # x shape, kernel, stride, padding
    "k3s2-pad1": ((2, 3, 9, 8), (3, 3), (2, 2), (1, 1)),
    "k3s1-pad1": ((2, 2, 6, 7), (3, 3), (1, 1), (1, 1)),
    "k2s2-pad1": ((2, 2, 7, 7), (2, 2), (2, 2), (1, 1)),
    "k23s12-pad01": ((2, 2, 7, 9), (2, 3), (1, 2), (0, 1)),
}


@FUSED
@DTYPES
@pytest.mark.parametrize("case", MAX_CASES)
def test_max_pool2d_padding(case, dtype, fused, gen):
    xs, kernel, stride, padding = MAX_CASES[case]

    def torch_fn(x):
        return TF.max_pool2d(x, kernel, stride, padding)

    arrays = with_target({"x": randn(gen, *xs, dtype=dtype)}, torch_fn, gen)
    check_against_torch(lambda t, i: F.relu(F.max_pool2d(i["x"], kernel, stride, padding)),
                        lambda x: TF.relu(torch_fn(x)), arrays, ("x",), fused, RTOL[dtype])


@pytest.mark.parametrize("case", MAX_CASES)
def test_max_pool2d_padding_indices_and_finite_differences(case, gen):
    xs, kernel, stride, padding = MAX_CASES[case]
    x = randn(gen, *xs, dtype=np.float64)
    attrs = dict(kernel=kernel, stride=stride, padding=padding)
    y, idx = op_forward("maxpool2d", {"x": x}, **attrs)
    t_y, t_idx = TF.max_pool2d(torch.tensor(x), kernel, stride, padding, return_indices=True)
    np.testing.assert_array_equal(y, t_y.numpy())
    np.testing.assert_array_equal(idx, t_idx.numpy())
    fd_check("maxpool2d", attrs, {"x": x}, ("x",), gen)


def test_max_pool2d_padding_beyond_half_the_kernel_is_rejected():
    t = Tracer()
    x = t.input((1, 1, 6, 6), "float32", "x")
    with pytest.raises(ShapeError, match="half the kernel"):
        F.max_pool2d(x, 2, 2, padding=2)


def test_pool_modules_match_torch(gen):
    x = randn(gen, 2, 3, 8, 8)
    modules = [(nn.MaxPool2d(3, 2, 1), tnn.MaxPool2d(3, 2, 1)),
               (nn.AvgPool2d(3, 2, 1, count_include_pad=False),
                tnn.AvgPool2d(3, 2, 1, count_include_pad=False)),
               (nn.AvgPool2d(2), tnn.AvgPool2d(2)),
               (nn.AdaptiveAvgPool2d(1), tnn.AdaptiveAvgPool2d(1)),
               (nn.AdaptiveAvgPool2d((2, 4)), tnn.AdaptiveAvgPool2d((2, 4)))]
    for m, tm in modules:
        t = Tracer()
        t.graph.outputs = {"y": m(t.input(x.shape, "float32", "x")).value}
        assert_close(run_graph(t.graph, {"x": x})["y"], tm(torch.tensor(x)).numpy(),
                     what=repr(m))


# ---- cross-entropy with label smoothing ----------------------------------------------------

@FUSED
@DTYPES
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.35, 1.0])
def test_cross_entropy_label_smoothing(eps, dtype, fused, gen):
    arrays = {"x": 3 * randn(gen, 9, 7, dtype=dtype),
              "y": gen.integers(0, 7, 9).astype(np.int64)}
    check_against_torch(lambda t, i: F.cross_entropy(i["x"], i["y"], label_smoothing=eps),
                        lambda x, y: TF.cross_entropy(x, y, label_smoothing=eps),
                        arrays, ("x",), fused, RTOL[dtype])


@pytest.mark.parametrize("eps", [0.1, 0.6])
def test_cross_entropy_label_smoothing_finite_differences(eps, gen):
    arrays = {"x": 3 * randn(gen, 5, 6, dtype=np.float64),
              "y": gen.integers(0, 6, 5).astype(np.int64)}
    fd_check("cross_entropy", dict(label_smoothing=eps), arrays, ("x",), gen)
    # the fused kernel: loss and dlogits = d loss in one op
    loss, dlogits = op_forward("cross_entropy_train", arrays, label_smoothing=eps)
    np.testing.assert_allclose(loss, op_forward("cross_entropy", arrays,
                                                label_smoothing=eps)[0], rtol=1e-14)
    u = randn(gen, 5, 6, dtype=np.float64)
    numeric = directional_fd("cross_entropy_train", dict(label_smoothing=eps), arrays, "x", u,
                             np.float64(1.0))
    assert abs(float(np.sum(dlogits * u)) - numeric) <= FD_RTOL * max(abs(numeric), 1.0)


def test_cross_entropy_fusion_keeps_label_smoothing(gen):
    from tests.ops.helpers import build_train_graph
    arrays = {"x": randn(gen, 4, 5), "y": gen.integers(0, 5, 4).astype(np.int64)}
    graph = build_train_graph(lambda t, i: F.cross_entropy(i["x"], i["y"], label_smoothing=0.3),
                              arrays, ("x",), fused=True)
    (ce,) = [n for n in graph.nodes if n.op.startswith("cross_entropy")]
    assert ce.op == "cross_entropy_train" and ce.attrs["label_smoothing"] == 0.3


# ---- batch norm: the ops -------------------------------------------------------------------

def bn_arrays(gen, shape, dtype, affine: bool):
    c = shape[1]
    arrays = {"x": 2 * randn(gen, *shape, dtype=dtype) + 0.5}
    if affine:
        arrays["w"] = 1 + randn(gen, c, dtype=dtype) / 2
        arrays["b"] = randn(gen, c, dtype=dtype)
    return arrays


BN_SHAPES = {"nc": (6, 4), "ncl": (3, 4, 5), "nchw": (3, 4, 3, 5)}


@FUSED
@DTYPES
@pytest.mark.parametrize("relu", [False, True], ids=["plain", "relu"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "noaffine"])
@pytest.mark.parametrize("shape", BN_SHAPES)
def test_batch_norm_training_forward_and_grads(shape, affine, relu, dtype, fused, gen):
    """Batch statistics (no running statistics); relu after it is fused when `fused`."""
    arrays = bn_arrays(gen, BN_SHAPES[shape], dtype, affine)

    def torch_fn(x, w=None, b=None):
        y = TF.batch_norm(x, None, None, w, b, training=True, eps=1e-5)
        return TF.relu(y) if relu else y

    def body(t, i):
        y = F.batch_norm(i["x"], None, None, i.get("w"), i.get("b"), training=True)
        return F.relu(y) if relu else y

    check_against_torch(body, torch_fn, with_target(arrays, torch_fn, gen), tuple(arrays),
                        fused, RTOL[dtype])


@pytest.mark.parametrize("relu", ["none", "relu"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "noaffine"])
@pytest.mark.parametrize("shape", BN_SHAPES)
def test_batch_norm_train_finite_differences(shape, affine, relu, gen):
    arrays = bn_arrays(gen, BN_SHAPES[shape], np.float64, affine)
    c = BN_SHAPES[shape][1]
    arrays.update(rm=randn(gen, c, dtype=np.float64), rv=1 + randn(gen, c, dtype=np.float64) ** 2,
                  count=np.array(3, np.int64))
    wrt = ("x", "w", "b") if affine else ("x",)
    fd_check("batch_norm_train", dict(eps=1e-5, momentum=0.1, affine=affine, track=True,
                                      act=relu), arrays, wrt, gen)


def run_bn_op(arrays, state, **attrs):
    """batch_norm_train on inputs `arrays` (x[, w, b]) and bound running statistics `state`
    (rm, rv, count; updated in place). Returns y, save_mean, save_invstd."""
    t = Tracer()
    ins = [v.value for v in trace_inputs(t, arrays).values()]
    running = [t.state(a.shape, str(a.dtype), k) for k, a in state.items()]
    outs = t.emit("batch_norm_train", ins + running, **attrs)
    t.graph.outputs = {f"out{i}": v for i, v in enumerate(outs)}
    result = run_graph(t.graph, arrays, state)
    return [result[f"out{i}"] for i in range(3)]


@DTYPES
@pytest.mark.parametrize("momentum", [0.1, 0.7, None])
@pytest.mark.parametrize("shape", BN_SHAPES)
def test_batch_norm_running_statistics_match_torch(shape, momentum, dtype, gen):
    """Three steps: y, the saved statistics and every running statistic, as torch's
    batch_norm (momentum None: torch's module computes 1/num_batches_tracked)."""
    c = BN_SHAPES[shape][1]
    state = {"rm": randn(gen, c, dtype=dtype), "rv": 1 + randn(gen, c, dtype=dtype) ** 2,
             "count": np.array(4, np.int64)}
    t_rm, t_rv = torch.tensor(state["rm"]), torch.tensor(state["rv"])
    for k in range(3):
        arrays = bn_arrays(gen, BN_SHAPES[shape], dtype, affine=True)
        y, mean, invstd = run_bn_op(arrays, state, eps=1e-3, momentum=momentum, affine=True,
                                    track=True, act="none")
        factor = momentum if momentum is not None else 1 / (5 + k)
        x = torch.tensor(arrays["x"])
        want = TF.batch_norm(x, t_rm, t_rv, torch.tensor(arrays["w"]), torch.tensor(arrays["b"]),
                             training=True, momentum=factor, eps=1e-3)
        axes = (0,) + tuple(range(2, x.ndim))
        assert int(state["count"]) == 5 + k
        assert_close(y, want.numpy(), RTOL[dtype], "y")
        assert_close(mean, x.mean(axes).numpy(), RTOL[dtype], "save_mean")
        assert_close(invstd, (x.var(axes, unbiased=False) + 1e-3).rsqrt().numpy(), RTOL[dtype],
                     "save_invstd")
        assert_close(state["rm"], t_rm.numpy(), RTOL[dtype], f"running_mean after {k + 1}")
        assert_close(state["rv"], t_rv.numpy(), RTOL[dtype], f"running_var after {k + 1}")


@FUSED
@DTYPES
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "noaffine"])
@pytest.mark.parametrize("shape", BN_SHAPES)
def test_batch_norm_eval_forward_and_grads(shape, affine, dtype, fused, gen):
    """Eval mode: the running statistics, composed of binary/scalar ops (grads too)."""
    arrays = bn_arrays(gen, BN_SHAPES[shape], dtype, affine)
    c = BN_SHAPES[shape][1]
    arrays.update(rm=randn(gen, c, dtype=dtype), rv=1 + randn(gen, c, dtype=dtype) ** 2)

    def torch_fn(x, rm, rv, w=None, b=None):
        return TF.batch_norm(x, rm, rv, w, b, training=False, eps=1e-4)

    check_against_torch(
        lambda t, i: F.batch_norm(i["x"], i["rm"], i["rv"], i.get("w"), i.get("b"), eps=1e-4),
        torch_fn, with_target(arrays, torch_fn, gen),
        ("x", "w", "b") if affine else ("x",), fused, RTOL[dtype])


def test_batch_norm_train_shape_errors():
    t = Tracer()
    x = t.input((4, 3, 2), "float32", "x")
    with pytest.raises(ShapeError, match="3 inputs"):
        t.op_all("batch_norm_train", [x], eps=1e-5, momentum=0.1, affine=True, track=False)
    with pytest.raises(ShapeError, match="more than 1 value per channel"):
        F.batch_norm(t.input((1, 3), "float32", "one"), None, None, training=True)
    w = t.input((4,), "float32", "w")
    with pytest.raises(ShapeError, match="must be \\(3,\\)"):
        t.op_all("batch_norm_train", [x, w, w], eps=1e-5, momentum=0.1, affine=True,
                 track=False)


# ---- batch norm: the modules ---------------------------------------------------------------

def run_module(module, x: np.ndarray, target: np.ndarray):
    """One traced forward + mse backward of `module` on the numpy backend, its parameters
    and buffers bound to their own storage (buffers update in place, as in a train step).
    Returns the output and the gradients of x and of every parameter (by state_dict key)."""
    module.name_parameters()
    t = Tracer(training=module.training)
    xs, ts = t.input(x.shape, "float32", "x"), t.input(target.shape, "float32", "target")
    out = module(xs)
    loss = F.mse_loss(out, ts)
    params = list(t.graph.params)
    grads = append_backward(t, loss.value, [xs.value] + params)
    t.graph.outputs = {"out": out.value, "dx": grads[0],
                       **{f"grad:{p.name}": g for p, g in zip(params, grads[1:])}}
    bound = {name: s.storage for name, s in [*module.named_parameters(), *module.named_buffers()]}
    result = run_graph(t.graph, {"x": x, "target": target}, bound)
    return result["out"], {k[5:]: v for k, v in result.items() if k.startswith("grad:")}, \
        result["dx"]


def torch_module_step(tm, x: np.ndarray, target: np.ndarray):
    tx = torch.tensor(x, requires_grad=True)
    out = tm(tx)
    TF.mse_loss(out, torch.tensor(target)).backward()
    grads = {k: p.grad.numpy().copy() for k, p in tm.named_parameters()}
    tm.zero_grad()
    return out.detach().numpy(), grads, tx.grad.numpy()


BN_MODULES = {   # name -> (constructor kwargs, class name, input shape)
    "2d": ({}, "BatchNorm2d", (4, 3, 3, 5)),
    "2d-momentum-none": (dict(momentum=None), "BatchNorm2d", (4, 3, 3, 5)),
    "2d-no-affine": (dict(affine=False), "BatchNorm2d", (4, 3, 3, 5)),
    "2d-no-track": (dict(track_running_stats=False), "BatchNorm2d", (4, 3, 3, 5)),
    "2d-momentum-eps": (dict(momentum=0.3, eps=1e-2), "BatchNorm2d", (4, 3, 3, 5)),
    "1d-nc": ({}, "BatchNorm1d", (8, 5)),
    "1d-ncl": (dict(momentum=None, affine=False), "BatchNorm1d", (4, 5, 6)),
}


@pytest.mark.parametrize("name", BN_MODULES)
def test_batch_norm_modules_train_then_eval_like_torch(name, gen):
    """Three training steps (outputs, input and parameter grads, buffers), then eval mode."""
    kwargs, cls, shape = BN_MODULES[name]
    c = shape[1]
    m, tm = getattr(nn, cls)(c, **kwargs), getattr(tnn, cls)(c, **kwargs)
    if m.affine:   # not the init values, so a swapped weight/bias shows
        tm.weight.data, tm.bias.data = torch.rand(c) + 0.5, torch.randn(c)
    m.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})
    for step in range(4):
        training = step < 3
        m.train(training), tm.train(training)
        x, target = 2 * randn(gen, *shape) + 1, randn(gen, *shape)
        out, grads, dx = run_module(m, x, target)
        t_out, t_grads, t_dx = torch_module_step(tm, x, target)
        assert_close(out, t_out, what=f"{name} step {step}: output")
        assert_close(dx, t_dx, what=f"{name} step {step}: dx")
        assert set(grads) == set(t_grads)
        for k in grads:
            assert_close(grads[k], t_grads[k], what=f"{name} step {step}: grad {k}")
        sd, want = m.state_dict(), tm.state_dict()
        assert list(sd) == list(want)
        for k in want:
            assert_close(sd[k], want[k].numpy(), what=f"{name} step {step}: {k}")


def test_batch_norm_state_dict_keys_types_and_init_match_torch():
    m, tm = nn.BatchNorm2d(5), tnn.BatchNorm2d(5)
    sd, want = m.state_dict(), tm.state_dict()
    assert list(sd) == ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    assert list(sd) == list(want)
    for k in want:
        assert sd[k].dtype == want[k].numpy().dtype and sd[k].shape == tuple(want[k].shape), k
        np.testing.assert_array_equal(sd[k], want[k].numpy(), err_msg=k)
    assert list(nn.BatchNorm1d(3, affine=False, track_running_stats=False).state_dict()) == []
    assert [k for k, _ in m.named_buffers()] == [k for k, _ in tm.named_buffers()]


def test_batch_norm_module_rank_is_checked():
    t = Tracer()
    with pytest.raises(ShapeError, match="4-D"):
        nn.BatchNorm2d(3)(t.input((2, 3, 4), "float32", "x"))
    with pytest.raises(ShapeError, match="2 or 3-D"):
        nn.BatchNorm1d(3)(t.input((2, 3, 4, 4), "float32", "x"))


def test_functional_batch_norm_counts_into_a_scratch_counter_without_one(gen):
    """F.batch_norm with running statistics and a momentum, but no counter (as
    torch.nn.functional.batch_norm is called): the statistics update like torch's."""
    x, rm, rv = randn(gen, 6, 3), np.zeros(3, np.float32), np.ones(3, np.float32)
    t = Tracer()
    i = trace_inputs(t, {"x": x})
    m = nn.BatchNorm1d(3)
    m.name_parameters()
    y = F.batch_norm(i["x"], m.running_mean, m.running_var, training=True, momentum=0.2)
    t.graph.outputs = {"y": y.value}
    run_graph(t.graph, {"x": x}, {"running_mean": rm, "running_var": rv})
    t_rm, t_rv = torch.zeros(3), torch.ones(3)
    TF.batch_norm(torch.tensor(x), t_rm, t_rv, training=True, momentum=0.2)
    assert_close(rm, t_rm.numpy())
    assert_close(rv, t_rv.numpy())
    with pytest.raises(ValueError, match="num_batches_tracked"):
        F.batch_norm(i["x"], m.running_mean, m.running_var, training=True, momentum=None)
