"""Channels-last execution (compile/layout.py) on the numpy backend: the rewritten ResNet
computes what the NCHW graph computes (forward, every gradient, running statistics, a 5-step
trajectory) in float64 and float32, with one activation conversion (the input) and the
conv weights permuted per conv; the state_dict keeps PyTorch's layouts; other image ops
(pools, broadcasts, means, a flatten of a spatial map) convert where they must.

float64 graphs: stepgraph's parameters are float32, so the float64 runs retype a traced
graph's float32 values (the ops are dtype-generic) and bind float64 copies of the
parameters; the NHWC references transpose views and run the NCHW ones, so both layouts do
the same arithmetic up to summation order."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import models, nn, optim
from stepgraph.autodiff import append_backward
from stepgraph.compile.layout import LayoutReport, channels_last_pays, resolve_memory_format, \
    to_channels_last
from stepgraph.errors import ShapeError
from stepgraph.ir.ops import infer_outputs
from stepgraph.ir.trace import Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import run_graph, seeded

WIDTHS = (8, 16, 32)
BATCH, SIZE = 4, 16
RTOL = {"float64": 1e-11, "float32": 2e-5}


def ce(logits, y):
    return F.cross_entropy(logits, y, label_smoothing=0.2)


def resnet():
    sg.nn.manual_seed(0)
    return models.resnet(widths=WIDTHS)


def batch(seed, n=BATCH, size=SIZE):
    gen = seeded(f"layout{seed}")
    return (gen.standard_normal((n, 3, size, size)).astype(np.float32),
            gen.integers(0, 10, n).astype(np.int64))


# ---- the traced graph: forward, loss and gradients ---------------------------------------------

def traced(model, x_shape, n, channels_last, dtype="float32", loss=ce):
    """(graph with outputs loss, logits and grad:<param>, layout report)."""
    model.name_parameters()
    model.train()
    tracer = Tracer(seed=0)
    x, y = tracer.input(x_shape, "float32", "x"), tracer.input((n,), "int64", "y")
    out = model(x)
    lv = loss(out, y)
    report = LayoutReport()
    if channels_last:
        tracer.graph, report = to_channels_last(tracer.graph)
    params = list(tracer.graph.params)
    grads = append_backward(tracer, lv.value, params)
    tracer.graph.outputs = {"loss": lv.value, "logits": out.value} | {
        f"grad:{p.name}": g for p, g in zip(params, grads)}
    if dtype == "float64":
        for v in _values(tracer.graph):
            if v.dtype == "float32":
                v.dtype = "float64"
    return tracer.graph, report


def _values(graph):
    seen = {}
    for v in graph.externals + [v for n in graph.nodes for v in n.inputs + n.outputs]:
        seen[id(v)] = v
    return list(seen.values())


def bound_state(model, dtype):
    """The model's parameters and buffers as fresh arrays (float ones in `dtype`)."""
    return {k: np.array(v, dtype=dtype if np.asarray(v).dtype == np.float32 else None)
            for k, v in model.state_dict().items()}


def run(graph, x, y, state, dtype):
    return run_graph(graph, {"x": x.astype(dtype), "y": y}, state)


def assert_same(got: dict, want: dict, rtol: float, what=""):
    assert got.keys() == want.keys()
    for k in want:
        g, w = np.asarray(got[k], np.float64), np.asarray(want[k], np.float64)
        assert g.shape == w.shape, (what, k, g.shape, w.shape)
        # a floor for values that are zero up to rounding (a conv bias feeding BatchNorm)
        err = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-3)
        assert err <= rtol, f"{what} {k}: relative error {err:.2e} > {rtol}"


# ---- the pass on the ResNet -------------------------------------------------------------------

def test_resnet_rewrite_converts_the_input_once():
    model = resnet()
    graph, report = traced(model, (BATCH, 3, SIZE, SIZE), BATCH, channels_last=True)
    forward = [n for n in graph.nodes if n.label == "layout" or "bwd" not in n.label]
    # 9 convs: 7 with 3x3 weights (permuted), 2 downsample 1x1 (views); the pooled (N, 1, 1, C)
    # features go back to NCHW as a view; nothing else converts.
    assert report == LayoutReport(to_nhwc=1, to_nchw=0, weights=7, views=3, nhwc_nodes=29)
    assert report.copies == 1
    convs = [n for n in graph.nodes if n.op == "conv2d"]
    assert len(convs) == 9 and all(n.attrs["layout"] == "NHWC" for n in convs)
    for op in ("batch_norm_train", "avgpool2d", "conv2d_grad_input", "conv2d_grad_weight",
               "batch_norm_grad", "avgpool2d_grad"):
        nodes = [n for n in graph.nodes if n.op == op]
        assert nodes and all(n.attrs.get("layout") == "NHWC" for n in nodes), op
    permutes = [n for n in graph.nodes if n.op == "permute"]
    # forward: the input and 7 weights; backward: the 7 weight gradients back to (O, C, kh, kw)
    assert len(permutes) == 15
    assert sum(1 for n in permutes if n.inputs[0] in graph.params) == 7
    assert len([n for n in forward if n.op == "permute"]) == 8


def test_graph_without_convs_is_untouched():
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 10))
    tracer = Tracer()
    model.name_parameters()
    out = model(tracer.input((2, 3, 2, 2), "float32", "x"))
    tracer.graph.outputs = {"out": out.value}
    graph, report = to_channels_last(tracer.graph)
    assert graph is tracer.graph and report == LayoutReport()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_resnet_forward_and_gradients_equal_nchw(dtype):
    model = resnet()
    x, y = batch(1)
    results, states = [], []
    for channels_last in (False, True):
        graph, _ = traced(model, x.shape, BATCH, channels_last, dtype)
        state = bound_state(model, dtype)
        results.append(run(graph, x, y, state, dtype))
        states.append(state)
    nchw, nhwc = results
    assert_same(nhwc, nchw, RTOL[dtype], "outputs")
    assert all(k in nchw for k in ("grad:conv1.weight", "grad:layer3.0.downsample.0.weight",
                                   "grad:fc.weight", "grad:layer2.0.bn2.bias"))
    assert_same(states[1], states[0], RTOL[dtype], "running statistics")   # updated in place
    assert all(int(v) == 1 for k, v in states[1].items() if k.endswith("num_batches_tracked"))


def test_resnet_float64_trajectory_equals_nchw():
    """Five SGD steps on gradients of the float64 graphs (the update in numpy, the running
    statistics moved by the graphs): the two layouts stay together."""
    model = resnet()
    graphs = [traced(model, (BATCH, 3, SIZE, SIZE), BATCH, cl, "float64")[0]
              for cl in (False, True)]
    states = [bound_state(model, "float64") for _ in graphs]
    names = [k for k, _ in model.named_parameters()]
    for step in range(5):
        x, y = batch(10 + step)
        outs = [run(g, x, y, s, "float64") for g, s in zip(graphs, states)]
        assert_same(outs[1], outs[0], RTOL["float64"], f"step {step}")
        for out, state in zip(outs, states):
            for k in names:
                state[k] -= 0.1 * out[f"grad:{k}"]
    assert_same(states[1], states[0], RTOL["float64"], "final state")


def test_resnet_float32_steps_equal_nchw():
    """The whole pipeline (fusion, plan, the SGD update op) on the numpy backend, five steps:
    losses and the final state_dict agree; the state_dict has PyTorch's keys and shapes."""
    base = resnet()
    steps = []
    for memory_format in ("contiguous", "channels_last"):
        model = resnet()
        model.load_state_dict(base.state_dict())
        opt = optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
        steps.append(sg.compile_train_step(model, loss=ce, optimizer=opt,
                                           example_inputs=batch(0), device="cpu",
                                           memory_format=memory_format))
    assert [s.memory_format for s in steps] == ["contiguous", "channels_last"]
    for i in range(5):
        x, y = batch(20 + i)
        lc, ll = (float(s(x, y)) for s in steps)
        assert abs(ll - lc) <= RTOL["float32"] * abs(lc), (i, lc, ll)
    want, got = (s.model.state_dict() for s in steps)
    assert list(got) == list(want) == list(base.state_dict())
    assert all(got[k].shape == base.state_dict()[k].shape for k in got)
    assert_same(got, want, 1e-4, "state_dict")
    ops = [n for n, _, _ in steps[1].executable(steps[1].signature).calls]
    fused = [n for n in ops if n.op == "batch_norm_train" and n.attrs.get("act") == "relu"]
    assert fused and all(n.attrs["layout"] == "NHWC" for n in fused)    # BN + ReLU still fuse
    # the input's permute alone: the 7 conv weights are float32 copies the update writes
    # transposed (compile/weight_permutes.py), their gradients read by the update as they are
    # (compile/update_permutes.py)
    assert sum(n.op == "permute" for n in ops) == 1
    assert not any(n.op == "permute_group" for n in ops)
    update = next(n for n in ops if n.op == "sgd_update")
    assert sum(d is not None for d in update.attrs["grad_dims"]) == 7
    assert len(update.attrs["copy_dims"]) == 7


def test_resnet_predictions_equal_nchw():
    """Eval mode: BatchNorm is a scale and shift broadcast along the channels (binary ops with
    (1, C, 1, 1) operands), re-laid as (1, 1, 1, C) views."""
    model = resnet()
    x, _ = batch(3)
    preds = [sg.compile_predict(model, (x,), device="cpu", memory_format=f)
             for f in ("contiguous", "channels_last")]
    want, got = preds[0](x), preds[1](x)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    nodes = [n for n, _, _ in preds[1].executable(preds[1].signature).calls]
    assert sum(n.op == "permute" for n in nodes) == 1    # the input's
    assert [len(n.inputs) for n in nodes if n.op == "permute_group"] == [7]    # the weights'


# ---- other image ops and broadcasts -----------------------------------------------------------

class Zoo(nn.Module):
    """Every kind of node the pass handles: biased and grouped convs, max and average pools,
    a spatial mean (reduce_sum) gating the channels, a channel-vector parameter broadcast, a
    dropout (NCHW only: converted back, and forth again for the next conv), and a flatten of
    a spatial map (converted back)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
        self.scale = nn.Parameter(np.linspace(0.5, 1.5, 8, dtype=np.float32).reshape(8, 1, 1))
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 2 * 2, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.conv1(x)))
        x = F.max_pool2d(x, 3, 2, padding=1)
        gate = x.mean((2, 3), keepdim=True).sigmoid()
        x = self.conv2(x * gate) * self.scale
        x = F.dropout(x, 0.25, training=self.training) - 0.5
        x = F.avg_pool2d(self.conv3(x), 3, 2, padding=1, count_include_pad=False)
        return self.fc(x.flatten(1))


def test_zoo_rewrite_and_gradients_equal_nchw():
    sg.nn.manual_seed(1)
    model = Zoo()
    x, y = batch(4, size=8)
    graph, report = traced(model, x.shape, BATCH, True, "float64")
    # the input and after the dropout; back for the dropout and for the flatten
    assert (report.to_nhwc, report.to_nchw, report.weights, report.views) == (2, 2, 3, 2), \
        report
    ops = {n.op for n in graph.nodes if n.attrs.get("layout") == "NHWC"}
    assert {"conv2d", "maxpool2d", "avgpool2d", "batch_norm_train", "maxpool2d_grad",
            "avgpool2d_grad", "conv2d_grad_input", "conv2d_grad_weight"} <= ops
    means = [n for n in graph.nodes if n.op == "reduce_sum" and n.inputs[0].shape[-1] == 8
             and len(n.inputs[0].shape) == 4 and "bwd" not in n.label]
    assert [n.attrs["axes"] for n in means] == [(1, 2)]
    results = []
    for channels_last in (False, True):
        g, _ = traced(model, x.shape, BATCH, channels_last, "float64")
        state = bound_state(model, "float64") | {"optimizer.step": np.array(3, np.int64)}
        results.append(run(g, x, y, state, "float64"))
    assert_same(results[1], results[0], RTOL["float64"])


# ---- options -----------------------------------------------------------------------------------

def test_memory_format_resolution():
    assert resolve_memory_format("auto", "cpu", "fp32") == "contiguous"
    assert resolve_memory_format("channels_last", "cpu", "fp32") == "channels_last"
    assert resolve_memory_format("contiguous", "cuda", "tf32") == "contiguous"
    with pytest.raises(ValueError, match="memory_format"):
        resolve_memory_format("nhwc", "cpu", "fp32")


def test_auto_memory_format_follows_the_channel_counts():
    """"auto" lays out NHWC only models whose convs have tensor-core channel counts: the
    ResNet (3-channel stem, then multiples of 8), not the MNIST cnn (1 -> 10 -> 20)."""
    from stepgraph.compile.build import build_predict_graph
    from stepgraph.compile.feed import signature_of
    cases = [(resnet(), (2, 3, 16, 16), True), (models.cnn(), (2, 1, 28, 28), False)]
    for model, shape, pays in cases:
        sig = signature_of(("x",), [np.zeros(shape, np.float32)])
        graph = build_predict_graph(model, sig, "auto")
        assert any(n.attrs.get("layout") == "NHWC" for n in graph.nodes) == pays, shape
        assert channels_last_pays(build_predict_graph(model, sig, "contiguous")) == pays


def test_nhwc_shape_rules():
    from stepgraph.ir.graph import Value

    x, w = Value((2, 9, 7, 4), "float32"), Value((6, 3, 3, 2), "float32")
    (y,) = infer_outputs("conv2d", [x, w], dict(stride=(2, 1), padding=(1, 1), groups=2,
                                                layout="NHWC"))
    assert y == ((2, 5, 7, 6), "float32")
    (y, idx) = infer_outputs("maxpool2d", [x], dict(kernel=(2, 2), stride=(2, 2),
                                                    layout="NHWC"))
    assert y[0] == idx[0] == (2, 4, 3, 4)
    assert infer_outputs("batch_norm_train", [x], dict(eps=1e-5, momentum=0.1, affine=False,
                                                       track=False, layout="NHWC"))[1][0] == (4,)
    with pytest.raises(ShapeError, match="layout"):
        infer_outputs("avgpool2d", [x], dict(kernel=(2, 2), stride=(2, 2), padding=(0, 0),
                                             count_include_pad=True, layout="NCWH"))
