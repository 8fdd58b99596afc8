"""conv3d's cuda path without a GPU: the cuDNN graphs conv_cudnn builds for a 3-D geometry
(5-D NCDHW tensors with row-major strides, per-axis padding, stride and dilation; fprop with
the bias in the graph, dgrad, wgrad), recorded through a stand-in for the cuDNN frontend, next
to a 2-D problem's graph (which must not change); the geometry's output sizes against the
shape rule; and without the frontend, conv3d and its gradients refuse with
BackendUnavailableError naming the cuda extra."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("cupy")    # the conv launchers import CuPy (no GPU needed)

from stepgraph.backends.cuda.conv import conv, conv3d, conv_cudnn  # noqa: E402
from stepgraph.errors import BackendUnavailableError, ShapeError  # noqa: E402
from stepgraph.ir.graph import Node, Value  # noqa: E402
from stepgraph.ir.ops import infer_outputs  # noqa: E402


class FakeTensor:
    def __init__(self, log: list, name: str, **info):
        self.log, self.name, self.info = log, name, dict(info)

    def set_data_type(self, t):
        self.info["data_type"] = t
        return self

    def set_output(self, flag):
        self.info["output"] = flag
        return self

    def set_dim(self, dim):
        self.info["dim"] = list(dim)
        return self

    def set_stride(self, stride):
        self.info["stride"] = list(stride)
        return self


class FakeGraph:
    """Records the frontend calls conv_cudnn._graph makes."""

    def __init__(self, **kw):
        self.log = [("pygraph", kw)]

    def tensor(self, name, dim, stride, data_type):
        t = FakeTensor(self.log, name, dim=list(dim), stride=list(stride), data_type=data_type)
        self.log.append(("tensor", name, t))
        return t

    def _op(self, kind, **kw):
        out = FakeTensor(self.log, kind)
        self.log.append((kind, kw, out))
        return out

    def conv_fprop(self, image, weight, **conv):
        return self._op("conv_fprop", image=image.name, weight=weight.name, **conv)

    def conv_dgrad(self, loss, filter, **conv):
        return self._op("conv_dgrad", loss=loss.name, filter=filter.name, **conv)

    def conv_wgrad(self, image, loss, **conv):
        return self._op("conv_wgrad", image=image.name, loss=loss.name, **conv)

    def bias(self, input, bias):
        return self._op("bias", input=input.name, bias=bias.name)

    def relu(self, input):
        return self._op("relu", input=input.name)

    def validate(self):
        self.log.append(("validate",))

    def build_operation_graph(self):
        self.log.append(("build",))


FAKE = SimpleNamespace(data_type=SimpleNamespace(FLOAT="f32", BFLOAT16="bf16", HALF="f16"),
                       pygraph=FakeGraph)


def row_major(dims):
    return [int(np.prod(dims[i + 1:])) for i in range(len(dims))]


G3 = conv3d.Geometry3d(2, 4, 7, 6, 9, 6, (3, 2, 3), (1, 2, 3), (2, 1, 0), (2, 1, 1), 2)


def test_geometry3d_matches_the_shape_rule():
    x, w = Value(G3.x_shape, "float32"), Value(G3.w_shape, "float32")
    (shape, _), = infer_outputs("conv3d", [x, w], G3.cudnn_conv() | {"groups": 2})
    assert G3.y_shape == shape == (2, 6, 7, 4, 3)
    assert conv3d.geometry(G3.x_shape, G3.w_shape, {"stride": (1, 2, 3), "padding": (2, 1, 0),
                                                    "dilation": (2, 1, 1), "groups": 2}) == G3
    with pytest.raises(ShapeError, match="group"):
        conv3d.geometry((1, 4, 3, 3, 3), (2, 3, 1, 1, 1), {"stride": (1,) * 3,
                                                           "padding": (0,) * 3, "groups": 2})


@pytest.mark.parametrize("op,kind", [("conv3d", "conv_fprop"),
                                     ("conv3d_grad_input", "conv_dgrad"),
                                     ("conv3d_grad_weight", "conv_wgrad")])
def test_conv3d_graphs_take_5d_tensors(op, kind):
    p = conv_cudnn.Problem(op, G3, "float32", "fp32", bias=op == "conv3d")
    graph, ops = conv_cudnn._graph(FAKE, p, handle=None)
    dims = {"x": list(G3.x_shape), "w": list(G3.w_shape), "y": list(G3.y_shape),
            "b": [1, 6, 1, 1, 1]}
    named = {"x": "x", "w": "w", "dy": "y", "b": "b"}
    for entry in graph.log:
        if entry[0] == "tensor":
            t = entry[2]
            assert t.info["dim"] == dims[named[entry[1]]], entry[1]
            assert t.info["stride"] == row_major(t.info["dim"]), entry[1]
    (conv_call,) = [e for e in graph.log if e[0] == kind]
    assert conv_call[1]["padding"] == [2, 1, 0] and conv_call[1]["stride"] == [1, 2, 3]
    assert conv_call[1]["dilation"] == [2, 1, 1]
    out_name = {"conv3d": "y", "conv3d_grad_input": "dx", "conv3d_grad_weight": "dw"}[op]
    out = ops[out_name].info
    want = dims[{"y": "y", "dx": "x", "dw": "w"}[out_name]]
    assert out["output"] and out["dim"] == want and out["stride"] == row_major(want)
    assert [e[0] for e in graph.log].count("bias") == (op == "conv3d")


def test_conv2d_graph_unchanged():
    """The generalised strides and geometry hooks give a 2-D problem its old graph."""
    g = conv.Geometry(2, 4, 9, 8, 6, 3, 3, 2, 1, 1, 0, 2, 1, 2)
    for layout, strides in [("NCHW", {"x": [288, 72, 8, 1]}), ("NHWC", {"x": [288, 1, 32, 4]})]:
        graph, ops = conv_cudnn._graph(FAKE, conv_cudnn.Problem("conv2d", g, "float32", "fp32",
                                                                 layout=layout), None)
        (x,) = [e[2] for e in graph.log if e[0] == "tensor" and e[1] == "x"]
        assert x.info["dim"] == [2, 4, 9, 8] and x.info["stride"] == strides["x"]
        (fprop,) = [e for e in graph.log if e[0] == "conv_fprop"]
        assert (fprop[1]["padding"], fprop[1]["stride"], fprop[1]["dilation"]) == \
            ([1, 0], [2, 1], [2, 1])
        assert ops["y"].info["dim"] == [2, 6, g.ho, g.wo]


@pytest.fixture
def no_cudnn(monkeypatch):
    """`import cudnn` fails (as on a machine without the frontend), whatever is installed."""
    monkeypatch.setitem(sys.modules, "cudnn", None)
    conv_cudnn._load.cache_clear()
    yield
    conv_cudnn._load.cache_clear()


@pytest.mark.parametrize("op", ["conv3d", "conv3d_grad_input", "conv3d_grad_weight"])
def test_conv3d_without_cudnn_says_to_install_the_cuda_extra(no_cudnn, op):
    attrs = {"stride": (1, 2, 3), "padding": (2, 1, 0), "dilation": (2, 1, 1), "groups": 2}
    x, w, y = (np.ones(s, np.float32) for s in (G3.x_shape, G3.w_shape, G3.y_shape))
    ins, outs = {"conv3d": ([x, w], [y]), "conv3d_grad_input": ([y, w], [x]),
                 "conv3d_grad_weight": ([y, x], [w])}[op]
    attrs |= {"conv3d_grad_input": {"input_shape": G3.x_shape},
              "conv3d_grad_weight": {"weight_shape": G3.w_shape}}.get(op, {})
    node = Node(op, [Value(a.shape, "float32") for a in ins],
                [Value(a.shape, "float32") for a in outs], attrs)
    with pytest.raises(BackendUnavailableError, match=r"cuDNN.*\.\[cuda\]"):
        conv3d.IMPLS[op](node, ins, outs, None)
