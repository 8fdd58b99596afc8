"""The cuDNN conv paths (conv_cudnn.py) vs the numpy reference: every plan of the forward (with
bias, with the fused ReLU, and plain plans followed by the epilogue kernel), of the input
gradient and of the weight gradient (with db), outputs poisoned first and each plan run twice
(same bits), over stride 1 and 2, padding, dilation 2, groups 2 and 3, depthwise, 1x1 / 3x3 /
5x3 / 7x7 kernels and odd sizes; the own kernels decline grouped and dilated convolutions; a
chosen plan built alone (a warm cache's) is the engine of that name among every plan; and a
captured replay of a cuDNN conv sees new input data.

The reference for groups and dilation is the numpy backend's conv ops run per group on the
dilated kernel (zeros between the taps), in float64."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu("nvmath")

from stepgraph import cache  # noqa: E402
from stepgraph.backends.cuda.conv import conv, conv_cudnn  # noqa: E402
from stepgraph.ir.graph import Node, Value  # noqa: E402
from stepgraph.ir.ops import IMPLS as NUMPY_IMPLS  # noqa: E402
from stepgraph.ops.conv import conv_out  # noqa: E402
from tests.cuda.helpers import check_replays, random, rel_err  # noqa: E402
from tests.ops.helpers import assert_close  # noqa: E402

if not conv_cudnn.available():
    pytest.skip(f"cuDNN is not usable: {conv_cudnn.unavailable_reason()}",
                allow_module_level=True)

TOL = {"fp32": 1e-5, "tf32": 3e-3}

# (N, C, H, W, O, kh, kw, stride, padding, dilation, groups)
CONVS = [
    (2, 3, 9, 7, 5, 3, 3, (1, 1), (1, 1), (1, 1), 1),       # 3x3, odd sizes
    (3, 4, 11, 10, 6, 3, 3, (2, 2), (1, 2), (1, 1), 1),     # stride 2, uneven padding
    (2, 5, 6, 5, 7, 1, 1, (1, 1), (0, 0), (1, 1), 1),       # 1x1
    (2, 3, 17, 15, 4, 7, 7, (2, 2), (3, 3), (1, 1), 1),     # 7x7 stride 2 (a ResNet stem)
    (2, 4, 12, 11, 6, 3, 3, (1, 1), (2, 2), (2, 2), 1),     # dilation 2
    (2, 6, 9, 8, 4, 3, 3, (1, 1), (1, 1), (1, 1), 2),       # groups 2
    (2, 8, 10, 9, 8, 3, 3, (2, 2), (1, 1), (1, 1), 8),      # depthwise, stride 2
    (1, 5, 7, 9, 10, 3, 3, (1, 1), (1, 1), (1, 1), 5),      # depthwise, 2 outputs a channel
    (3, 6, 13, 7, 12, 5, 3, (1, 2), (2, 1), (2, 1), 3),     # groups 3, dilation (2, 1), 5x3
    (2, 4, 9, 9, 4, 1, 1, (2, 2), (0, 0), (1, 1), 2),       # grouped 1x1 stride 2
]
IDS = [f"{n}x{c}x{h}x{w}-o{o}-k{kh}{kw}-s{s[0]}{s[1]}p{p[0]}{p[1]}d{d[0]}{d[1]}g{grp}"
       for n, c, h, w, o, kh, kw, s, p, d, grp in CONVS]


@pytest.fixture(scope="module", params=["fp32", "tf32"])
def ctx(request, backend):
    return backend.make_context(request.param)


def attrs_of(cfg) -> dict:
    return {"stride": cfg[7], "padding": cfg[8], "dilation": cfg[9], "groups": cfg[10]}


def shapes(cfg):
    """x, w and y shapes of one config."""
    n, c, h, w, o, kh, kw, (sh, sw), (ph, pw), (dh, dw), groups = cfg
    ho, wo = conv_out(h, dh * (kh - 1) + 1, sh, ph), conv_out(w, dw * (kw - 1) + 1, sw, pw)
    return (n, c, h, w), (o, c // groups, kh, kw), (n, o, ho, wo)


def node_of(op: str, ins, outs, **attrs) -> Node:
    return Node(op, [Value(a.shape, str(a.dtype)) for a in ins],
                [Value(s, "float32") for s in outs], attrs)


# ---- the reference: numpy's ops per group, on the dilated kernel -------------------------

def _dilated(w, dil):
    o, c, kh, kw = w.shape
    out = np.zeros((o, c, (kh - 1) * dil[0] + 1, (kw - 1) * dil[1] + 1), w.dtype)
    out[:, :, ::dil[0], ::dil[1]] = w
    return out


def _numpy(op, ins, out_shapes, **attrs):
    node = node_of(op, ins, out_shapes, **attrs)
    outs = [np.full(s, np.nan) for s in out_shapes]
    NUMPY_IMPLS[op](node, ins, outs, None)
    return outs


def reference(op, cfg, arrays, bias=False, relu=False):
    """Float64 outputs of `op` for one config from the numpy backend's plain conv ops."""
    xs, ws, ys = shapes(cfg)
    groups, dil, plain = cfg[10], cfg[9], {"stride": cfg[7], "padding": cfg[8]}
    cg, og = xs[1] // groups, ys[1] // groups
    arrays = [a.astype(np.float64) for a in arrays]
    parts = []
    for k in range(groups):
        cs, os = slice(k * cg, (k + 1) * cg), slice(k * og, (k + 1) * og)
        if op == "conv2d":
            x, w = arrays[0][:, cs], _dilated(arrays[1][os], dil)
            parts += _numpy(op, [x, w], [(xs[0], og) + ys[2:]], **plain)
        elif op == "conv2d_grad_input":
            dy, w = arrays[0][:, os], _dilated(arrays[1][os], dil)
            xg = (xs[0], cg) + xs[2:]
            parts += _numpy(op, [dy, w], [xg], input_shape=xg, **plain)
        else:
            dy, x = arrays[0][:, os], arrays[1][:, cs]
            wd = _dilated(np.zeros((og,) + ws[1:]), dil).shape
            dwd = _numpy(op, [dy, x], [wd], weight_shape=wd, **plain)[0]
            parts.append(dwd[:, :, ::dil[0], ::dil[1]])
    out = np.concatenate(parts, axis=1 if op != "conv2d_grad_weight" else 0)
    if op == "conv2d":
        if bias:
            out = out + arrays[2][None, :, None, None]
        if relu:
            out = np.maximum(out, 0)
    if op == "conv2d_grad_weight" and bias:
        return [out, arrays[0].sum(axis=(0, 2, 3))]
    return [out]


# ---- running every cuDNN plan ----------------------------------------------------------------

def paths_of(monkeypatch, ctx, node, dev_in, dev_out) -> dict:
    """{name: launch} of every path conv.py offers for the node, without running any. No
    choice is known (none in memory, the disk cache off): a known one is offered alone."""
    offered = {}
    with monkeypatch.context() as m:
        m.setattr(conv, "_run_faster", lambda node, ctx, g, dtype, paths: offered.update(paths))
        m.setenv(cache.SWITCH_ENV, "0")
        m.setattr(ctx, "paths", {})
        conv.IMPLS[node.op](node, dev_in, dev_out, ctx)
    return offered


def check_every_cudnn_plan(monkeypatch, backend, ctx, node, arrays, want, what):
    with ctx.stream:
        dev_in = [cp.asarray(a) for a in arrays]
        dev_out = [cp.empty(v.shape, np.float32) for v in node.outputs]
    paths = paths_of(monkeypatch, ctx, node, dev_in, dev_out)
    cudnn = {name: run for name, run in paths.items() if name.startswith("cudnn")}
    assert cudnn, f"{what}: no cuDNN plan offered (paths {sorted(paths)})"
    tol = TOL[ctx.precision]
    for name, run in cudnn.items():
        runs = []
        for _ in range(2):
            with ctx.stream:
                for o in dev_out:
                    o.fill(np.nan)
            run()
            runs.append([backend.to_numpy(o) for o in dev_out])
        for i, (got, ref) in enumerate(zip(runs[0], want)):
            assert np.isfinite(got).all(), f"{what} {name} output {i}: not every element written"
            err = rel_err(got, ref)
            assert err < tol, f"{what} {name} output {i}: rel err {err:.2e} >= {tol}"
            np.testing.assert_array_equal(got, runs[1][i], err_msg=f"{what} {name}: not "
                                                                   "deterministic")
    return paths


@pytest.mark.parametrize("cfg", CONVS, ids=IDS)
@pytest.mark.parametrize("bias,relu", [(False, False), (True, False), (True, True)],
                         ids=["plain", "bias", "bias_relu"])
def test_conv2d_every_cudnn_plan(monkeypatch, backend, ctx, cfg, bias, relu):
    xs, ws, ys = shapes(cfg)
    rng = np.random.default_rng(1)
    arrays = [random(rng, *xs), random(rng, *ws)] + ([random(rng, ys[1])] if bias else [])
    attrs = attrs_of(cfg) | ({"act": "relu"} if relu else {})
    node = node_of("conv2d", arrays, [ys], **attrs)
    want = reference("conv2d", cfg, arrays, bias, relu)
    paths = check_every_cudnn_plan(monkeypatch, backend, ctx, node, arrays, want,
                                   f"conv2d {cfg} bias={bias} relu={relu}")
    if cfg[9:] != ((1, 1), 1):
        assert all(name.startswith(("cudnn", "depthwise")) for name in paths), sorted(paths)
    if bias or relu:
        assert any(name.endswith("+epilogue") for name in paths), sorted(paths)


@pytest.mark.parametrize("cfg", CONVS, ids=IDS)
def test_conv2d_grad_input_every_cudnn_plan(monkeypatch, backend, ctx, cfg):
    xs, ws, ys = shapes(cfg)
    rng = np.random.default_rng(2)
    arrays = [random(rng, *ys), random(rng, *ws)]
    node = node_of("conv2d_grad_input", arrays, [xs], input_shape=xs, **attrs_of(cfg))
    want = reference("conv2d_grad_input", cfg, arrays)
    paths = check_every_cudnn_plan(monkeypatch, backend, ctx, node, arrays, want,
                                   f"conv2d_grad_input {cfg}")
    if cfg[9:] != ((1, 1), 1):
        assert all(name.startswith(("cudnn", "depthwise")) for name in paths), sorted(paths)


@pytest.mark.parametrize("cfg", CONVS, ids=IDS)
@pytest.mark.parametrize("bias", [False, True], ids=["", "db"])
def test_conv2d_grad_weight_every_cudnn_plan(monkeypatch, backend, ctx, cfg, bias):
    xs, ws, ys = shapes(cfg)
    rng = np.random.default_rng(3)
    arrays = [random(rng, *ys), random(rng, *xs)]
    outs = [ws] + ([(ws[0],)] if bias else [])
    node = node_of("conv2d_grad_weight", arrays, outs, weight_shape=ws, bias=bias,
                   **attrs_of(cfg))
    want = reference("conv2d_grad_weight", cfg, arrays, bias)
    paths = check_every_cudnn_plan(monkeypatch, backend, ctx, node, arrays, want,
                                   f"conv2d_grad_weight {cfg} db={bias}")
    if cfg[9:] != ((1, 1), 1):
        assert all(name.startswith(("cudnn", "depthwise")) for name in paths), sorted(paths)


def test_reference_matches_numpy_on_plain_convs():
    """The grouped / dilated reference is the numpy backend's ops for groups 1, dilation 1."""
    cfg = CONVS[1]
    xs, ws, ys = shapes(cfg)
    rng = np.random.default_rng(4)
    x, w, dy = random(rng, *xs), random(rng, *ws), random(rng, *ys)
    plain = {"stride": cfg[7], "padding": cfg[8]}
    # float64 against the float32 ops, relative to the output's scale (assert_close's floor):
    # one output of -0.009, among outputs up to 4, came out 5.9e-5 apart relatively with one
    # host's BLAS
    assert_close(_numpy("conv2d", [x, w], [ys], **plain)[0],
                 reference("conv2d", cfg, [x, w])[0], rtol=1e-5, what="conv2d")
    assert_close(_numpy("conv2d_grad_weight", [dy, x], [ws], weight_shape=ws, **plain)[0],
                 reference("conv2d_grad_weight", cfg, [dy, x])[0], rtol=1e-4,
                 what="conv2d_grad_weight")


@pytest.mark.parametrize("op", ["conv2d", "conv2d_grad_input", "conv2d_grad_weight"])
def test_a_chosen_plan_built_alone_is_that_candidate(ctx, op):
    """What a warm cache builds for a cuDNN choice (conv_cudnn._build_one: the plan at the
    path's index of its ranked list) is the engine that candidate was among every plan."""
    xs, ws, _ = shapes(CONVS[8])
    g = conv._geometry(xs, ws, attrs_of(CONVS[8]))
    p = conv_cudnn.Problem(op, g, "float32", ctx.precision, device=cp.cuda.runtime.getDevice())
    cudnn, handle = conv_cudnn._load()[0], conv_cudnn.handle(ctx)
    every = conv_cudnn._build(cudnn, p, handle)
    assert every.entries, every.reason
    for c in every.entries:
        alone = conv_cudnn._build_one(cudnn, p, handle, c.path)
        assert [(e.path, e.name, e.workspace) for e in alone.entries] == \
            [(c.path, c.name, c.workspace)], f"{op} {c.path}: {alone.reason}"


# ---- through the backend: auto choice, forced family, capture -----------------------------

@pytest.mark.parametrize("path", ["auto", "cudnn"])
def test_conv_ops_through_the_backend(monkeypatch, backend, path):
    """run_node with the autotuner (grouped and dilated: only cuDNN competes) and with the
    cuDNN family forced on a plain conv; fresh buffers poisoned first."""
    monkeypatch.setattr(conv, "PATH", path)
    ctx = backend.make_context("fp32")
    for cfg in (CONVS[0], CONVS[8]):
        xs, ws, ys = shapes(cfg)
        rng = np.random.default_rng(5)
        x, w, b, dy = random(rng, *xs), random(rng, *ws), random(rng, ys[1]), random(rng, *ys)
        calls = [("conv2d", [x, w, b], [ys], {}),
                 ("conv2d_grad_input", [dy, w], [xs], {"input_shape": xs}),
                 ("conv2d_grad_weight", [dy, x], [ws, (ws[0],)],
                  {"weight_shape": ws, "bias": True})]
        for op, arrays, outs, extra in calls:
            node = node_of(op, arrays, outs, **attrs_of(cfg), **extra)
            with ctx.stream:
                dev_in = [cp.asarray(a) for a in arrays]
                dev_out = [cp.full(s, np.nan, np.float32) for s in outs]
            backend.run_node(node, dev_in, dev_out, ctx)
            want = reference(op, cfg, arrays, bias=op != "conv2d_grad_input")
            for got, ref in zip(dev_out, want):
                assert rel_err(backend.to_numpy(got), ref) < TOL["fp32"], (op, cfg, path)


def test_cudnn_conv_replays_with_new_inputs(backend):
    """A grouped, dilated conv with bias and its two gradients (cuDNN only) captured after one
    eager warm-up: every replay sees the new x and dy copied into the same buffers."""
    ctx = backend.make_context("fp32")
    cfg = CONVS[8]
    xs, ws, ys = shapes(cfg)
    rng = np.random.default_rng(6)
    x, w, b, dy = random(rng, *xs), random(rng, *ws), random(rng, ys[1]), random(rng, *ys)
    attrs = attrs_of(cfg)
    calls = [(node_of("conv2d", [x, w, b], [ys], **attrs), [x, w, b]),
             (node_of("conv2d_grad_input", [dy, w], [xs], input_shape=xs, **attrs), [dy, w]),
             (node_of("conv2d_grad_weight", [dy, x], [ws, (ws[0],)], weight_shape=ws,
                      bias=True, **attrs), [dy, x])]

    def check(replay, node, host, outs):
        want = reference(node.op, cfg, host, bias=node.op != "conv2d_grad_input")
        for got, ref in zip(outs, want):
            err = rel_err(got, ref)
            assert err < TOL["fp32"], f"replay {replay} {node.op}: rel err {err:.2e}"

    captured = check_replays(backend, ctx, calls, x, dy, rng, 5, check)
    assert captured.node_count is None or captured.node_count >= 3
