"""Channels-last (compile/layout.py) beyond the ResNet: which models "auto" lays out NHWC
(channels_last_pays, weighted by the convs' FLOPs), and user permutes between the layouts
(ConvNeXt's x.permute(0, 2, 3, 1) ... x.permute(0, 3, 1, 2)) seen through as twins and views.
Values are compared with the NCHW graph on the numpy backend in float64 (test_layout.py's
harness): layout changes must keep every number."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import models, nn
from stepgraph.bench import workloads
from stepgraph.bench.peers.stepgraph_runner import build_model
from stepgraph.compile.build import build_predict_graph
from stepgraph.compile.feed import signature_of
from stepgraph.compile.layout import LayoutReport, PAYING_SHARE, channels_last_pays, \
    paying_share
from stepgraph.nn import functional as F
from tests.compat import loader
from stepgraph.autodiff import append_backward
from stepgraph.compile.layout import to_channels_last
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import run_graph
from tests.unit.test_layout import RTOL, _values, assert_same, batch, bound_state, run, traced


def forward_graph(model, shape):
    sig = signature_of(("x",), [np.zeros(shape, np.float32)])
    return build_predict_graph(model, sig, "contiguous")


def compat(name, cls, **kwargs):
    return lambda: getattr(loader.load(name, "stepgraph"), cls)(**kwargs)


def workload(name):
    return lambda: build_model(workloads.WORKLOADS[name])


# (model, input shape, the decision before the FLOP-weighted rule, the decision now). The
# compat files at scripts/compat-bench's measured sizes: one odd conv (unet's 32 -> 2 output
# conv, squeezenet's 512 -> 10 classifier) sent them to NCHW; the MNIST cnn has no conv that
# pays and stays NCHW (measured NHWC 161 µs vs NCHW 109 µs).
DECISIONS = {
    "bench cnn": (workload("cnn"), (2, 1, 28, 28), False, False),
    "bench resnet": (workload("resnet"), (2, 3, 32, 32), True, True),
    "bench convnet": (workload("convnet"), (2, 3, 32, 32), True, True),
    "models.cnn": (models.cnn, (2, 1, 28, 28), False, False),
    "unet": (compat("unet", "UNet", base=32), (2, 3, 64, 64), False, True),
    "squeezenet": (compat("squeezenet", "SqueezeNet", version="1_0", num_classes=10,
                          dropout=0.0), (2, 3, 64, 64), False, True),
    "mobilenet": (compat("mobilenet", "MobileNet", width_mult=2.0, last_channel=256,
                         dropout=0.0, stochastic_depth_prob=1e-9), (2, 3, 64, 64), True, True),
    "convnext": (compat("convnext", "ConvNeXt", dims=(96, 192, 384), depths=(3, 3, 9),
                        drop_path_rate=1e-9), (2, 3, 64, 64), True, True),
    "resnet": (compat("resnet", "ResNet", num_blocks=(2, 2), width=64), (2, 3, 32, 32), True,
               True),
}


@pytest.mark.parametrize("name", list(DECISIONS))
def test_auto_decision_per_model(name):
    build, shape, _, pays = DECISIONS[name]
    graph = forward_graph(build(), shape)
    assert channels_last_pays(graph) == pays, (name, paying_share(graph))


def test_odd_convs_carrying_most_flops_keep_nchw():
    """The share, not any one conv, decides: a net whose 8-multiple conv is a small 1x1 and
    whose odd 3x3 convs carry the FLOPs stays NCHW; make the odd convs 8-multiples and it
    goes NHWC."""
    def net(odd):
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 1),
                             nn.Conv2d(16, odd, 3, padding=1),
                             nn.Conv2d(odd, odd, 3, padding=1), nn.Conv2d(odd, 8, 1))
    share = paying_share(forward_graph(net(12), (1, 3, 16, 16)))
    assert 0 < share < PAYING_SHARE
    assert not channels_last_pays(forward_graph(net(12), (1, 3, 16, 16)))
    assert paying_share(forward_graph(net(24), (1, 3, 16, 16))) == 1.0


def test_depthwise_and_grouped_channel_rules():
    """A depthwise conv pays on its channel count; a grouped conv on its per-group counts."""
    def share(conv):
        return paying_share(forward_graph(nn.Sequential(conv), (1, 48, 8, 8)))
    assert share(nn.Conv2d(48, 48, 3, padding=1, groups=48)) == 1.0       # depthwise
    assert share(nn.Conv2d(48, 96, 3, padding=1, groups=48)) == 1.0       # multiplier 2
    assert share(nn.Conv2d(48, 48, 3, padding=1, groups=3)) == 1.0        # 16 per group
    assert share(nn.Conv2d(48, 48, 3, padding=1, groups=12)) == 0.0       # 4 per group
    assert share(nn.Conv2d(48, 10, 1)) == 0.0


# ---- user permutes between the layouts ---------------------------------------------------------

STYLES = {   # (NCHW -> NHWC, NHWC -> NCHW) as users write them
    "permute": (lambda x: x.permute(0, 2, 3, 1), lambda x: x.permute(0, 3, 1, 2)),
    "negative": (lambda x: x.permute(0, -2, -1, -3), lambda x: x.permute(0, -1, -3, -2)),
    "movedim": (lambda x: sg.movedim(x, 1, -1), lambda x: x.movedim(-1, 1)),
    "transposes": (lambda x: x.transpose(1, 2).transpose(2, 3),
                   lambda x: x.transpose(1, 3).transpose(2, 3)),
}


class ConvNeXtish(nn.Module):
    """A stem, a ConvNeXt block (depthwise conv, to NHWC, LayerNorm, Linear, GELU, layer
    scale, back to NCHW, residual add), then a conv reading a permuted-back value directly."""

    def __init__(self, style: str, dim: int = 8):
        super().__init__()
        self.to_last, self.to_first = STYLES[style]
        self.stem = nn.Conv2d(3, dim, 2, stride=2)
        self.dwconv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv = nn.Linear(dim, dim)
        self.gamma = nn.Parameter(np.linspace(0.5, 1.5, dim, dtype=np.float32))
        self.conv = nn.Conv2d(dim, dim, 1)
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        x = self.stem(x)
        y = self.to_last(self.dwconv(x))
        y = self.gamma * F.gelu(self.pwconv(self.norm(y)))
        x = x + self.to_first(y)
        z = self.to_last(x)
        x = self.conv(self.to_first(z * 2.0)) + x
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("style", list(STYLES))
def test_block_permutes_are_twins_and_views(style):
    sg.nn.manual_seed(2)
    model = ConvNeXtish(style)
    x, y = batch(6, size=8)
    graph, report = traced(model, x.shape, len(y), True, "float64")
    # only the input converts (one copy); both pairs of user permutes cost nothing
    assert (report.to_nhwc, report.to_nchw, report.absorbed) == (1, 0, 4), report
    permutes = [n for n in graph.nodes if n.op == "permute"]
    # the input, the stem's 2x2 weight and its gradient (the 3x3 depthwise and 1x1 weights
    # are views): no activation permute in the forward or the backward
    assert len(permutes) == 3, [(n.label, n.inputs[0].shape) for n in permutes]
    assert sum(n.inputs[0] in graph.params for n in permutes) == 1
    convs = [n for n in graph.nodes if n.op == "conv2d"]
    assert len(convs) == 3 and all(n.attrs["layout"] == "NHWC" for n in convs)
    results = []
    for channels_last in (False, True):
        g, _ = traced(model, x.shape, len(y), channels_last, "float64")
        results.append(run(g, x, y, bound_state(model, "float64"), "float64"))
    assert_same(results[1], results[0], RTOL["float64"], style)


class Shuffles(nn.Module):
    """Permutes that are not layout changes: a spatial transpose of a channels-last value
    read by a conv, and a permute chain read by a Linear and as the output."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = self.conv2(x.transpose(2, 3))            # (N, C, W, H)
        x = x.permute(0, 3, 2, 1).transpose(1, 2)    # (N, W, H, C) -> (N, H, W, C)
        return self.fc(x.mean((1, 2)))


def test_other_permutes_compose_to_one_copy_and_keep_values():
    sg.nn.manual_seed(3)
    model = Shuffles()
    x, y = batch(7, size=6)
    graph, report = traced(model, x.shape, len(y), True, "float64")
    forward = [n for n in graph.nodes if n.op == "permute" and "bwd" not in n.label
               and n.inputs[0] not in graph.params]
    # the input; the spatial transpose made from conv1's twin in one copy; the chain
    # (0, 3, 2, 1) then (0, 2, 1, 3) is conv2's twin itself: a view, no permute
    assert [(n.label, n.attrs["dims"]) for n in forward] == [
        ("layout", (0, 2, 3, 1)), ("layout", (0, 2, 1, 3))]
    assert (report.to_nhwc, report.to_nchw, report.absorbed) == (2, 0, 1), report
    results = []
    for channels_last in (False, True):
        g, _ = traced(model, x.shape, len(y), channels_last, "float64")
        results.append(run(g, x, y, bound_state(model, "float64"), "float64"))
    assert_same(results[1], results[0], RTOL["float64"])


# ---- the compatibility suite's ConvNeXt --------------------------------------------------------

def test_compat_convnext_converts_only_its_input():
    """tests/compat/models/convnext.py: "auto" lays it out NHWC and its 8 user permutes (4
    blocks, there and back) are twins and views: the stem's input is the one activation copy
    (before: 5 to NHWC and 4 back, and each user permute a copy of its own), and forward and
    every gradient equal the NCHW graph's."""
    sg.nn.manual_seed(0)
    model = compat("convnext", "ConvNeXt", drop_path_rate=1e-9)()
    x, y = batch(8, n=2, size=32)
    assert channels_last_pays(forward_graph(model, x.shape))
    graph, report = traced(model, x.shape, len(y), True, "float64", loss=F.cross_entropy)
    assert report == LayoutReport(to_nhwc=1, to_nchw=0, weights=3, views=19, absorbed=8,
                                  nhwc_nodes=42)
    permutes = [n for n in graph.nodes if n.op == "permute"]
    # the input, the stem's and two downsample convs' weights and their gradients
    assert len(permutes) == 7 and sum(n.inputs[0] in graph.params for n in permutes) == 3
    results = []
    for channels_last in (False, True):
        g, _ = traced(model, x.shape, len(y), channels_last, "float64", loss=F.cross_entropy)
        state = bound_state(model, "float64") | {"optimizer.step": np.array(3, np.int64)}
        results.append(run(g, x, y, state, "float64"))
    assert_same(results[1], results[0], RTOL["float64"], "convnext")


def test_compat_unet_with_its_odd_conv_equals_nchw():
    """unet.py now goes NHWC though its output conv is 8 -> 2: that conv runs channels-last
    too (numpy here; on CUDA cuDNN's plan or its NCHW twin, tests/cuda/test_layout_cuda.py),
    with the same forward and gradients."""
    model = compat("unet", "UNet")()
    gen = np.random.default_rng(9)
    x = gen.standard_normal((2, 3, 8, 8))
    target = gen.standard_normal((2, 2, 8, 8))
    assert channels_last_pays(forward_graph(model, x.shape))
    results = []
    for channels_last in (False, True):
        model.name_parameters()
        model.train()
        tracer = Tracer(seed=0)
        out = model(tracer.input(x.shape, "float32", "x"))
        loss = F.mse_loss(out, tracer.input(target.shape, "float32", "y"))
        tracer.graph.outputs = {"out": out.value}        # 4-D: produced back in NCHW
        if channels_last:
            tracer.graph, report = to_channels_last(tracer.graph)
            # the input in, the output back, nothing else: each ConvTranspose2d (one
            # conv2d_grad_input node) and the skip concats run on the twins
            assert (report.to_nhwc, report.to_nchw) == (1, 1), report
            assert sum(n.op == "conv2d_grad_input" and n.attrs["layout"] == "NHWC"
                       for n in tracer.graph.nodes) == 2
            assert all(n.attrs["dim"] == 3 for n in tracer.graph.nodes if n.op == "concat")
        params = list(tracer.graph.params)
        grads = append_backward(tracer, loss.value, params)
        tracer.graph.outputs |= {"loss": loss.value} | {
            f"grad:{p.name}": g for p, g in zip(params, grads)}
        for v in _values(tracer.graph):
            if v.dtype == "float32":
                v.dtype = "float64"
        results.append(run_graph(tracer.graph, {"x": x, "y": target},
                                 bound_state(model, "float64")))
    assert_same(results[1], results[0], RTOL["float64"], "unet")
