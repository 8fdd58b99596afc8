"""conv_cudnn imports without a GPU and without the cuDNN frontend, and then reports itself
unavailable cleanly: its paths are absent for convolutions the own kernels run, and an op only
cuDNN runs (groups > 1, dilation) raises BackendUnavailableError naming the cuda extra."""
from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("cupy")    # conv.py's launchers import CuPy (no GPU needed)

from stepgraph.backends.cuda.conv import conv, conv_cudnn  # noqa: E402
from stepgraph.errors import BackendUnavailableError, ShapeError  # noqa: E402
from stepgraph.ir.graph import Node, Value  # noqa: E402


@pytest.fixture
def no_cudnn(monkeypatch):
    """`import cudnn` fails (as on a machine without the frontend), whatever is installed."""
    monkeypatch.setitem(sys.modules, "cudnn", None)
    conv_cudnn._load.cache_clear()
    yield
    conv_cudnn._load.cache_clear()


def arrays(*shapes):
    return [np.ones(s, np.float32) for s in shapes]


def test_unavailable_without_the_frontend(no_cudnn):
    assert not conv_cudnn.available()
    assert "cudnn" in conv_cudnn.unavailable_reason()
    plain = conv.Geometry(2, 4, 8, 8, 6, 3, 3, 1, 1, 1, 1)
    x, w, y = arrays((2, 4, 8, 8), (6, 4, 3, 3), (2, 6, 8, 8))
    assert conv_cudnn.conv2d_paths(None, plain, x, w, y) == {}
    assert conv_cudnn.grad_input_paths(None, plain, y, w, x) == {}
    assert conv_cudnn.grad_weight_paths(None, plain, y, x, w) == {}


@pytest.mark.parametrize("attrs", [{"groups": 2}, {"dilation": (2, 2)}], ids=["groups", "dil"])
def test_ops_only_cudnn_runs_say_to_install_the_cuda_extra(no_cudnn, attrs):
    groups = attrs.get("groups", 1)
    x, w = arrays((2, 4, 9, 9), (6, 4 // groups, 3, 3))
    ho = 9 if "dilation" not in attrs else 7
    node = Node("conv2d", [Value(x.shape, "float32"), Value(w.shape, "float32")],
                [Value((2, 6, ho, ho), "float32")],
                {"stride": (1, 1), "padding": (1, 1)} | attrs)
    with pytest.raises(BackendUnavailableError, match=r"cuDNN.*\.\[cuda\]"):
        conv.IMPLS["conv2d"](node, [x, w], arrays((2, 6, ho, ho)), None)


def test_geometry_of_grouped_dilated_convs():
    g = conv._geometry((2, 6, 13, 7), (12, 2, 5, 3),
                       {"stride": (1, 2), "padding": (2, 1), "dilation": (2, 1), "groups": 3})
    assert (g.ho, g.wo, g.w_shape, g.plain) == (9, 4, (12, 2, 5, 3), False)
    assert conv._geometry((1, 4, 5, 5), (3, 4, 3, 3), {"stride": (1, 1),
                                                       "padding": (0, 0)}).plain
    with pytest.raises(ShapeError):
        conv._geometry((1, 6, 5, 5), (4, 2, 3, 3), {"stride": (1, 1), "padding": (0, 0),
                                                    "groups": 2})
