"""The depthwise conv kernels without a GPU: supported()'s refusals, conv.py offering the
"depthwise" path only for depthwise geometries (groups == C == O) in both layouts, the
launchers' grids and splits, and every launch's arguments against its kernel's PTX parameters
(NVRTC, no device). The numbers are tests/cuda/test_conv_depthwise_cuda.py's."""
from __future__ import annotations

import types

import numpy as np
import pytest

pytest.importorskip("cupy")      # the launchers import CuPy (no GPU needed)

from stepgraph.backends.cuda.conv import conv, conv_depthwise as dw  # noqa: E402
from stepgraph.backends.cuda.conv.geometry import Geometry  # noqa: E402
from stepgraph.ir.graph import BF16, Node, Value  # noqa: E402
from stepgraph.ops.layout import stored_shape  # noqa: E402
from tests.unit.test_nvrtc_compile import (Fake, _assert_launches_match,  # noqa: E402
                                           _nvrtc_usable, _record_launches)


def depthwise(n=2, c=8, h=9, w=7, k=(3, 3), stride=(1, 1), pad=(1, 1), dil=(1, 1)) -> Geometry:
    return Geometry(n, c, h, w, c, *k, *stride, *pad, *dil, groups=c)


# ---- supported() ---------------------------------------------------------------------------

def test_depthwise_geometries_in_every_storage_and_layout_are_supported():
    for g in (depthwise(), depthwise(k=(1, 3), pad=(0, 0)), depthwise(k=(7, 7), pad=(3, 3)),
              depthwise(stride=(2, 2), dil=(2, 2)), depthwise(c=1)):
        for layout in dw.LAYOUTS:
            for dtype in ("float32", "uint16", "float16"):
                assert dw.supported(g, layout, dtype) is None, (g, layout, dtype)


@pytest.mark.parametrize("g,layout,dtype,why", [
    (depthwise(), "NCHW", "float64", "dtype float64"),
    (depthwise(), "NCDHW", "float32", "layout"),
    (Geometry(2, 8, 9, 7, 16, 3, 3, 1, 1, 1, 1, groups=8), "NCHW", "float32", "not depthwise"),
    (Geometry(2, 8, 9, 7, 8, 3, 3, 1, 1, 1, 1, groups=4), "NCHW", "float32", "not depthwise"),
    (Geometry(2, 8, 9, 7, 8, 3, 3, 1, 1, 1, 1), "NHWC", "float32", "not depthwise"),
    (depthwise(k=(9, 9), pad=(4, 4)), "NHWC", "float32", "more than 64 taps"),
    (depthwise(n=1 << 12, c=1 << 10, h=256, w=256), "NCHW", "float32", "32-bit offsets"),
])
def test_supported_names_what_the_kernels_refuse(g, layout, dtype, why):
    assert why in dw.supported(g, layout, dtype)


def test_large_filters_run_channels_first():
    """Only the NHWC kernels stage the filters in shared memory (MAX_TAPS)."""
    assert dw.supported(depthwise(k=(9, 9), pad=(4, 4)), "NCHW", "float32") is None


# ---- conv.py's offers ----------------------------------------------------------------------

def fake_array(shape, dtype="float32"):
    return types.SimpleNamespace(shape=tuple(shape), dtype=np.dtype(dtype),
                                 flags=types.SimpleNamespace(c_contiguous=True),
                                 data=types.SimpleNamespace(ptr=0x7000))


def fake_ctx():
    return types.SimpleNamespace(stream=None, paths={}, precision="fp32", deterministic=True,
                                 extras={})


def offers(x_nchw, w_nchw, layout, storage="float32", **attrs) -> dict[str, list[str]]:
    """{op: the own paths conv.py offers} for the three conv ops of one geometry (cuDNN's
    candidates are built apart, by the offer's cudnn(only): not asked for here)."""
    attrs = {"stride": (1, 1), "padding": (1, 1), **attrs}
    if layout == "NHWC":
        attrs["layout"] = "NHWC"
    g = conv._geometry(x_nchw, w_nchw, attrs)
    xs, ws = stored_shape(x_nchw, layout), stored_shape(w_nchw, layout)
    ys = stored_shape((g.n, g.o, g.ho, g.wo), layout)
    ir = BF16 if storage == "uint16" else storage
    arr = lambda s: fake_array(s, storage)         # noqa: E731
    got = {}
    fwd = Node("conv2d", [Value(xs, ir), Value(ws, ir), Value((g.o,), ir)], [Value(ys, ir)],
               dict(attrs))
    got["conv2d"] = conv._forward_offer(fwd, [arr(xs), arr(ws), arr((g.o,))], [arr(ys)],
                                        fake_ctx()).own
    dgrad = Node("conv2d_grad_input", [Value(ys, ir), Value(ws, ir)], [Value(xs, ir)],
                 {**attrs, "input_shape": xs})
    got["conv2d_grad_input"] = conv._grad_input_offer(dgrad, [arr(ys), arr(ws)], [arr(xs)],
                                                      fake_ctx()).own
    wgrad = Node("conv2d_grad_weight", [Value(ys, ir), Value(xs, ir)],
                 [Value(ws, ir), Value((g.o,), ir)], {**attrs, "weight_shape": ws, "bias": True})
    got["conv2d_grad_weight"] = conv._grad_weight_offer(
        wgrad, [arr(ys), arr(xs)], [arr(ws), arr((g.o,))], fake_ctx()).own
    return {op: sorted(paths) for op, paths in got.items()}


@pytest.mark.parametrize("storage", ["float32", "uint16", "float16"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_conv_offers_depthwise_for_depthwise_geometries(layout, storage):
    for attrs in ({}, {"stride": (2, 2)}, {"dilation": (2, 2), "padding": (2, 2)}):
        got = offers((2, 16, 9, 9), (16, 1, 3, 3), layout, storage, groups=16, **attrs)
        # grouped: no other own path; NCHW at stride 1 and dilation 1 the plane kernel too,
        # for the forward and dx
        plane = layout == "NCHW" and not attrs
        for op, paths in got.items():
            extra = ["depthwise_plane"] * (plane and op != "conv2d_grad_weight")
            assert paths == ["depthwise"] + extra, (op, attrs, paths)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_conv_offers_no_depthwise_path_for_other_geometries(layout):
    cases = [((2, 16, 9, 9), (16, 16, 3, 3), {}),                 # plain
             ((2, 16, 9, 9), (32, 1, 3, 3), {"groups": 16}),      # channel multiplier 2
             ((2, 16, 9, 9), (16, 4, 3, 3), {"groups": 4})]       # grouped
    for x, w, attrs in cases:
        for op, paths in offers(x, w, layout, **attrs).items():
            assert "depthwise" not in paths, (x, w, attrs, op, paths)
    # float64 depthwise: cuDNN's alone
    got = offers((2, 16, 9, 9), (16, 1, 3, 3), layout, "float64", groups=16)
    assert all(paths == [] for paths in got.values()), got


def test_depthwise_is_a_path_tests_can_force():
    assert "depthwise" in conv.PATHS and "depthwise_plane" in conv.PATHS


@pytest.mark.parametrize("g, layout, why", [
    (depthwise(stride=(2, 2)), "NCHW", "stride"),
    (depthwise(dil=(2, 2), pad=(2, 2)), "NCHW", "dilation"),
    (depthwise(), "NHWC", "channels-last"),
    (depthwise(h=200, w=200), "NCHW", "shared memory")])
def test_the_plane_kernels_refuse(g, layout, why):
    assert why in dw.plane_supported(g, layout, "float32")
    assert dw.plane_supported(depthwise(), "NCHW", "float32") is None


def test_an_untimed_capture_defaults_to_the_depthwise_path(monkeypatch):
    """_run_faster's default (what a capture with no timing yet runs) is the depthwise path
    wherever it is offered."""
    chosen = {}
    monkeypatch.setattr(conv, "PATH", "auto")
    monkeypatch.setattr(conv.autotune, "run_fastest",
                        lambda ctx, key, paths, default: chosen.update(default=default))
    monkeypatch.setattr(conv, "_remember_kernels", lambda *args: None)
    node = Node("conv2d", [Value((2, 16, 9, 9), "float32"), Value((16, 1, 3, 3), "float32")],
                [Value((2, 16, 9, 9), "float32")],
                {"stride": (1, 1), "padding": (1, 1), "groups": 16})
    g = conv._geometry((2, 16, 9, 9), (16, 1, 3, 3), node.attrs)
    paths = {"cudnn:0": lambda: None, "depthwise": lambda: None}
    conv._run_faster(node, fake_ctx(), g, "float32", paths)
    assert chosen["default"] == "depthwise"


def test_conv_declares_the_depthwise_kernels():
    assert dw.kernel_names()[dw.SOURCE] <= conv.kernel_names()[dw.SOURCE]


# ---- launches ------------------------------------------------------------------------------

def test_grad_weight_splits_fill_the_gpu_and_keep_rows_per_split():
    pencil = depthwise(n=32, c=256, h=1, w=130, k=(1, 3), pad=(0, 0))  # 4096 pixels a channel
    assert dw.grad_weight_splits(pencil, "NCHW", True) == 4              # 1024 blocks
    assert dw.grad_weight_scratch(pencil, "NCHW", True) == 4 * 256 * 4
    tiny = depthwise(n=2, c=8, h=5, w=5)                                 # 50 pixels
    assert dw.grad_weight_splits(tiny, "NHWC", False) == 1
    assert dw.grad_weight_scratch(tiny, "NHWC", False) == 0
    for g in (pencil, tiny, depthwise(n=64, c=4, h=64, w=64, k=(7, 7), pad=(3, 3))):
        for layout in dw.LAYOUTS:
            assert 1 <= dw.grad_weight_splits(g, layout, True) <= dw.MAX_SPLITS


CASES = [depthwise(n=32, c=256, h=1, w=130, k=(1, 3), pad=(0, 0)),
         depthwise(n=8, c=64, h=32, w=32, stride=(2, 2)),
         depthwise(n=4, c=96, h=16, w=16, k=(7, 7), pad=(3, 3)),
         depthwise(n=3, c=5, h=7, w=9, dil=(2, 2), pad=(2, 2))]


@pytest.mark.skipif(not _nvrtc_usable(), reason="libnvrtc is not loadable")
@pytest.mark.parametrize("storage", ["float32", "uint16", "float16"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_depthwise_launch_arguments_match_the_kernels(monkeypatch, layout, storage):
    """Each launcher names a declared kernel with arguments of its parameters' types, valid
    grids and blocks; grad_weight with several splits adds the sum kernel."""
    launched = _record_launches(monkeypatch, dw)
    for g in CASES:
        x = Fake(stored_shape((g.n, g.c, g.h, g.w), layout), storage)
        y = Fake(stored_shape((g.n, g.o, g.ho, g.wo), layout), storage)
        w = Fake(stored_shape(g.w_shape, layout), storage)
        b = Fake((g.o,), storage)
        dw.conv2d_depthwise_forward(None, g, layout, x, w, b, y, True)
        dw.conv2d_depthwise_forward(None, g, layout, x, w, None, y, False)
        dw.conv2d_depthwise_grad_input(None, g, layout, y, w, x)
        for db in (b, None):
            scratch = dw.grad_weight_scratch(g, layout, db is not None)
            partial = Fake((scratch,), "float32") if scratch else None
            dw.conv2d_depthwise_grad_weight(None, g, layout, y, x, w, db, partial)
    names = [name for _, name, _, _, _ in launched]
    assert set(names) <= dw.kernel_names()[dw.SOURCE]
    assert dw.sum_kernel_name(storage) in names
    _assert_launches_match(launched)


@pytest.mark.skipif(not _nvrtc_usable(), reason="libnvrtc is not loadable")
@pytest.mark.parametrize("storage", ["float32", "uint16", "float16"])
def test_plane_launch_arguments_match_the_kernels(monkeypatch, storage):
    """The plane kernel's launches (forward with bias and ReLU, dx): declared names, their
    parameters' types, blocks of at most 256 threads."""
    launched = _record_launches(monkeypatch, dw)
    for g in (CASES[0], CASES[2]):
        x, y = Fake((g.n, g.c, g.h, g.w), storage), Fake((g.n, g.o, g.ho, g.wo), storage)
        w, b = Fake(g.w_shape, storage), Fake((g.o,), storage)
        dw.conv2d_depthwise_plane_forward(None, g, x, w, b, y, True)
        dw.conv2d_depthwise_plane_grad_input(None, g, y, w, x)
    assert {name for _, name, _, _, _ in launched} == {dw.plane_kernel_name(storage)}
    assert all(np.prod(block) <= 256 for _, _, _, block, _ in launched)
    _assert_launches_match(launched)


def test_grad_weight_refuses_missing_partial_sums():
    from stepgraph.errors import ShapeError

    g = CASES[0]
    x, y, w = Fake((g.n, g.c, g.h, g.w)), Fake((g.n, g.c, g.ho, g.wo)), Fake(g.w_shape)
    with pytest.raises(ShapeError, match="partial sums"):
        dw.conv2d_depthwise_grad_weight(None, g, "NCHW", y, x, w, None, None)


def test_launchers_refuse_a_geometry_the_kernels_cannot_run():
    from stepgraph.errors import ShapeError

    g = Geometry(2, 8, 9, 7, 16, 3, 3, 1, 1, 1, 1, groups=8)
    with pytest.raises(ShapeError, match="not depthwise"):
        dw.conv2d_depthwise_forward(None, g, "NCHW", Fake((2, 8, 9, 7)), Fake(g.w_shape), None,
                                    Fake((2, 16, 9, 7)), False)
