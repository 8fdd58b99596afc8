"""Channels-last (attrs layout "NHWC", compile/layout.py) on the GPU.

Ops against the numpy reference (float64, the NHWC reference transposes views and runs the
NCHW one) on fresh inputs with poisoned outputs: every cuDNN plan of the NHWC conv forward
(plain, bias, bias + ReLU, grouped, dilated, the stem's 3 channels, 1x1 stride 2), input and
weight gradients (with db), at fp32 and tf32, each plan run twice for the same bits; the
nondeterministic plans a context opts into; BatchNorm's columns layout (forward with running
statistics, backward, fused ReLU); max and average pooling and their gradients (gathers and the
tiling scatter). Whole steps: a channels-last ResNet's captured graph replays bit for bit what
eager steps compute (node count asserted), follows the numpy backend over steps, predicts what
the NCHW CPU twin predicts; "auto" by its rule picks channels-last at tf32 only, and by timing
(compile/layout_choice.py) keeps the faster layout without a trace in the trajectory."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import cache, models, optim
from stepgraph.errors import NonFiniteError
from stepgraph.ops.guard import FIRST_BAD

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda
cp = require_gpu("nvmath")

from stepgraph.backends.cuda import elementwise, loss, norm, pool, reduce  # noqa: E402
from stepgraph.backends.cuda import optim as cuda_optim  # noqa: E402
from stepgraph.backends.cuda.conv import conv, conv_cudnn  # noqa: E402
from stepgraph.ir.ops import IMPLS as NUMPY_IMPLS  # noqa: E402
from stepgraph.ops.conv import conv_out  # noqa: E402
from tests.cuda import helpers  # noqa: E402
from tests.cuda.helpers import (  # noqa: E402
    assert_close, make_node, poisoned, pool_input, random, rel_err, to_device, to_host)
from tests.cuda.helpers import ce_smooth, image_batches as batches  # noqa: E402
from tests.cuda.test_step_cuda import kernels_of_ops  # noqa: E402
from tests.ops.helpers import relative_error as rel  # noqa: E402

if not conv_cudnn.available():
    pytest.skip(f"cuDNN is not usable: {conv_cudnn.unavailable_reason()}",
                allow_module_level=True)

NHWC = (0, 2, 3, 1)
TOL = {"fp32": 1e-5, "tf32": 3e-3}
CUDA_IMPLS = {**elementwise.IMPLS, **reduce.IMPLS, **loss.IMPLS, **cuda_optim.IMPLS,
              **norm.IMPLS, **pool.IMPLS}
run_both = functools.partial(helpers.run_both, impls=CUDA_IMPLS)


def nhwc(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.transpose(NHWC)) if a.ndim == 4 else a


@pytest.fixture(scope="module", params=["fp32", "tf32"])
def ctx(request, backend):
    return backend.make_context(request.param)


# ---- convolutions: every cuDNN plan ------------------------------------------------------------

# (N, C, H, W, O, kh, kw, stride, padding, dilation, groups), in NCHW terms
CONVS = [
    (2, 3, 9, 7, 8, 3, 3, (1, 1), (1, 1), (1, 1), 1),        # a stem: 3 input channels
    (3, 8, 11, 10, 16, 3, 3, (2, 2), (1, 1), (1, 1), 1),     # a stage's strided first conv
    (2, 8, 6, 5, 16, 1, 1, (2, 2), (0, 0), (1, 1), 1),       # the 1x1 stride-2 downsample
    (4, 16, 8, 8, 16, 3, 3, (1, 1), (1, 1), (1, 1), 1),
    (2, 6, 9, 8, 4, 3, 3, (1, 1), (2, 2), (2, 2), 2),        # groups 2, dilation 2
    (2, 8, 10, 9, 8, 3, 3, (2, 2), (1, 1), (1, 1), 8),       # depthwise
    # odd channel counts that memory_format "auto" now leaves channels-last (a FLOP share
    # decides, layout.channels_last_pays): a U-Net's output conv, a classifier conv, a
    # 7x7 depthwise conv of 12 channels
    (2, 16, 8, 8, 2, 1, 1, (1, 1), (0, 0), (1, 1), 1),
    (2, 24, 5, 5, 10, 1, 1, (1, 1), (0, 0), (1, 1), 1),
    (2, 12, 9, 9, 12, 7, 7, (1, 1), (3, 3), (1, 1), 12),
]
IDS = [f"{n}x{c}x{h}x{w}-o{o}-k{kh}{kw}-s{s[0]}p{p[0]}d{d[0]}g{grp}"
       for n, c, h, w, o, kh, kw, s, p, d, grp in CONVS]
# The plain 3x3 convs of the ResNet's stages: cuDNN has NHWC plans for them at fp32 and tf32
# (docs/perf-notes.md, conv layout); the others may run through NCHW.
PLAIN = [CONVS[1], CONVS[3]]


def conv_shapes(cfg):
    """x, w, y shapes of one config as stored channels-last."""
    n, c, h, w, o, kh, kw, (sh, sw), (ph, pw), (dh, dw), groups = cfg
    ho, wo = conv_out(h, kh, sh, ph, dh), conv_out(w, kw, sw, pw, dw)
    return (n, h, w, c), (o, kh, kw, c // groups), (n, ho, wo, o)


def conv_attrs(cfg) -> dict:
    return {"stride": cfg[7], "padding": cfg[8], "dilation": cfg[9], "groups": cfg[10],
            "layout": "NHWC"}


def reference64(node, arrays, relu=False):
    """The node's numpy outputs in float64 (ReLU applied for a fused conv forward)."""
    outs = [np.full(v.shape, np.nan) for v in node.outputs]
    NUMPY_IMPLS[node.op](node, [a.astype(np.float64) for a in arrays], outs, None)
    return [np.maximum(outs[0], 0)] if relu else outs


def paths_of(monkeypatch, ctx, node, dev_in, dev_out) -> tuple[dict, bool]:
    """({name: launch} of every path conv.py offers for the node, without running any;
    whether it went through its NCHW twin instead, having no NHWC plan). No choice is known
    (none in memory, the disk cache off): a known one is offered alone."""
    offered, through = {}, []
    real = conv._through_nchw
    with monkeypatch.context() as m:
        m.setattr(conv, "_run_faster", lambda node, ctx, g, dtype, paths: offered.update(paths))
        m.setattr(conv, "_through_nchw", lambda *a: through.append(True) or real(*a))
        m.setenv(cache.SWITCH_ENV, "0")
        m.setattr(ctx, "paths", {})
        conv.IMPLS[node.op](node, dev_in, dev_out, ctx)
    return offered, bool(through)


def check_every_plan(monkeypatch, backend, ctx, node, arrays, want, what, repeatable=True,
                     plans_required=False):
    """Every cuDNN NHWC plan offered for the node against `want`; where cuDNN offers none,
    conv.py runs the NCHW twin between permutes (_through_nchw): that run is checked instead
    (not allowed with plans_required)."""
    with ctx.stream:
        dev_in = [cp.asarray(a) for a in arrays]
        dev_out = [cp.empty(v.shape, np.float32) for v in node.outputs]
    paths, through = paths_of(monkeypatch, ctx, node, dev_in, dev_out)
    tol = TOL[ctx.precision]
    if through:
        assert not plans_required, f"{what}: cuDNN offers no NHWC plan"
        print(f"{what}: no NHWC plan, through NCHW ({ctx.precision})")
        with ctx.stream:
            for o in dev_out:
                o.fill(np.nan)
        conv.IMPLS[node.op](node, dev_in, dev_out, ctx)
        for i, (got, ref) in enumerate(zip(dev_out, want)):
            err = rel_err(backend.to_numpy(got), ref)
            assert err < tol, f"{what} through NCHW output {i}: rel err {err:.2e} >= {tol}"
        return {}
    assert paths and all(name.startswith(("cudnn", "depthwise")) for name in paths), sorted(paths)
    for name, run in paths.items():
        runs = []
        for _ in range(2 if repeatable else 1):
            with ctx.stream:
                for o in dev_out:
                    o.fill(np.nan)
            run()
            runs.append([backend.to_numpy(o) for o in dev_out])
        for i, (got, ref) in enumerate(zip(runs[0], want)):
            assert got.shape == ref.shape, (what, name, got.shape, ref.shape)
            assert np.isfinite(got).all(), f"{what} {name} output {i}: not every element written"
            err = rel_err(got, ref)
            assert err < tol, f"{what} {name} output {i}: rel err {err:.2e} >= {tol}"
            if repeatable:
                np.testing.assert_array_equal(got, runs[1][i], err_msg=f"{what} {name}")
    return paths


@pytest.mark.parametrize("cfg", CONVS, ids=IDS)
@pytest.mark.parametrize("bias,relu", [(False, False), (True, False), (True, True)],
                         ids=["plain", "bias", "bias_relu"])
def test_nhwc_conv2d_every_plan(monkeypatch, backend, ctx, cfg, bias, relu):
    xs, ws, ys = conv_shapes(cfg)
    rng = np.random.default_rng(11)
    arrays = [random(rng, *xs), random(rng, *ws)] + ([random(rng, ys[-1])] if bias else [])
    node = make_node("conv2d", arrays, **conv_attrs(cfg), **({"act": "relu"} if relu else {}))
    assert node.outputs[0].shape == ys
    want = reference64(make_node("conv2d", arrays, **conv_attrs(cfg)), arrays, relu)
    paths = check_every_plan(monkeypatch, backend, ctx, node, arrays, want,
                             f"conv2d NHWC {cfg} bias={bias} relu={relu}",
                             plans_required=cfg in PLAIN)
    if paths and (bias or relu):
        assert any(name.endswith("+epilogue") for name in paths), sorted(paths)


@pytest.mark.parametrize("cfg", CONVS, ids=IDS)
def test_nhwc_conv2d_grad_input_every_plan(monkeypatch, backend, ctx, cfg):
    xs, ws, ys = conv_shapes(cfg)
    rng = np.random.default_rng(12)
    arrays = [random(rng, *ys), random(rng, *ws)]
    node = make_node("conv2d_grad_input", arrays, input_shape=xs, **conv_attrs(cfg))
    check_every_plan(monkeypatch, backend, ctx, node, arrays, reference64(node, arrays),
                     f"conv2d_grad_input NHWC {cfg}", plans_required=cfg in PLAIN)


@pytest.mark.parametrize("cfg", CONVS, ids=IDS)
@pytest.mark.parametrize("bias", [False, True], ids=["", "db"])
def test_nhwc_conv2d_grad_weight_every_plan(monkeypatch, backend, ctx, cfg, bias):
    xs, ws, ys = conv_shapes(cfg)
    rng = np.random.default_rng(13)
    arrays = [random(rng, *ys), random(rng, *xs)]
    node = make_node("conv2d_grad_weight", arrays, weight_shape=ws, bias=bias,
                     **conv_attrs(cfg))
    check_every_plan(monkeypatch, backend, ctx, node, arrays, reference64(node, arrays),
                     f"conv2d_grad_weight NHWC {cfg} db={bias}", plans_required=cfg in PLAIN)


@pytest.mark.parametrize("cfg", CONVS[1:4], ids=IDS[1:4])
def test_nondeterministic_plans_when_opted_in(monkeypatch, backend, cfg):
    """A context with deterministic=False builds its own plan lists (nondeterministic engines
    admitted): every plan still computes the weight gradient."""
    ctx = backend.make_context("tf32", deterministic=False)
    xs, ws, ys = conv_shapes(cfg)
    rng = np.random.default_rng(14)
    arrays = [random(rng, *ys), random(rng, *xs)]
    node = make_node("conv2d_grad_weight", arrays, weight_shape=ws, **conv_attrs(cfg))
    paths = check_every_plan(monkeypatch, backend, ctx, node, arrays, reference64(node, arrays),
                             f"conv2d_grad_weight NHWC nondeterministic {cfg}",
                             repeatable=False)
    problems = [p for p in conv_cudnn._PLANS if p.op == "conv2d_grad_weight"
                and p.layout == "NHWC" and p.precision == "tf32"]
    assert {p.deterministic for p in problems} >= {False}
    print(f"{cfg}: {sorted(paths)}")


@pytest.mark.parametrize("cfg", CONVS[1:5], ids=IDS[1:5])
def test_nhwc_without_a_cudnn_plan_runs_through_nchw(monkeypatch, backend, cfg):
    """With no cuDNN NHWC plan (here: none offered), each op runs its NCHW twin between
    permutes, with its own paths and buffers, and gives the NHWC results."""
    def without_nhwc(real):
        return lambda *a, layout="NCHW", **k: {} if layout == "NHWC" else \
            real(*a, layout=layout, **k)

    for name in ("conv2d_paths", "grad_input_paths", "grad_weight_paths"):
        monkeypatch.setattr(conv_cudnn, name, without_nhwc(getattr(conv_cudnn, name)))
    ctx = backend.make_context("fp32")
    xs, ws, ys = conv_shapes(cfg)
    rng = np.random.default_rng(16)
    x, w, b, dy = random(rng, *xs), random(rng, *ws), random(rng, ys[-1]), random(rng, *ys)
    attrs = conv_attrs(cfg)
    calls = [(make_node("conv2d", [x, w, b], act="relu", **attrs), [x, w, b], True),
             (make_node("conv2d_grad_input", [dy, w], input_shape=xs, **attrs), [dy, w], False),
             (make_node("conv2d_grad_weight", [dy, x], weight_shape=ws, bias=True, **attrs),
              [dy, x], False)]
    for node, arrays, relu in calls:
        plain = make_node(node.op, arrays, **{k: v for k, v in node.attrs.items() if k != "act"})
        got = helpers.run_cuda(ctx, node, arrays, conv.IMPLS)
        for g, ref in zip(got, reference64(plain, arrays, relu)):
            assert rel_err(g, ref) < TOL["fp32"], (node.op, cfg)


def test_conv_ops_through_the_backend_and_a_replay(backend):
    """run_node (the autotuner picks a cuDNN plan) on NHWC forward, dgrad and wgrad with db,
    eager once, then captured: every replay sees new x and dy."""
    ctx = backend.make_context("tf32")
    cfg = CONVS[1]
    xs, ws, ys = conv_shapes(cfg)
    rng = np.random.default_rng(15)
    x, w, b, dy = random(rng, *xs), random(rng, *ws), random(rng, ys[-1]), random(rng, *ys)
    attrs = conv_attrs(cfg)
    calls = [(make_node("conv2d", [x, w, b], **attrs), [x, w, b]),
             (make_node("conv2d_grad_input", [dy, w], input_shape=xs, **attrs), [dy, w]),
             (make_node("conv2d_grad_weight", [dy, x], weight_shape=ws, bias=True, **attrs),
              [dy, x])]

    def check(replay, node, host, outs):
        for got, ref in zip(outs, reference64(node, host)):
            err = rel_err(got, ref)
            assert err < TOL["tf32"], f"replay {replay} {node.op}: rel err {err:.2e}"

    helpers.check_replays(backend, ctx, calls, x, dy, rng, 3, check)


# ---- BatchNorm: the columns layout -------------------------------------------------------------

BN_SHAPES = [(2, 5, 5, 3), (8, 4, 4, 16), (4, 9, 7, 40), (64, 8, 8, 64), (3, 2, 2, 8)]
BN_VARIANTS = [(True, True, 0.1, "none"), (False, False, 0.1, "relu"),
               (True, True, None, "relu")]


@pytest.mark.parametrize("affine,track,momentum,act", BN_VARIANTS)
@pytest.mark.parametrize("shape", BN_SHAPES)
def test_nhwc_batch_norm_train_and_grad(ctx, shape, affine, track, momentum, act):
    rng = np.random.default_rng([201, *shape, affine, track])
    c = shape[-1]
    x = random(rng, *shape, scale=2.0, shift=3.0)
    ins = [x] + ([random(rng, c), random(rng, c)] if affine else []) + (
        [random(rng, c, scale=0.1), np.abs(random(rng, c)) + 0.5, np.array(3, np.int64)]
        if track else [])
    node = make_node("batch_norm_train", ins, eps=1e-5, momentum=momentum, affine=affine,
                     track=track, act=act, layout="NHWC")
    assert node.outputs[1].shape == (c,)
    ref_ins, dev_ins = [a.copy() for a in ins], to_device(ctx, ins)
    want = [np.full(v.shape, np.nan, v.dtype) for v in node.outputs]
    NUMPY_IMPLS[node.op](node, ref_ins, want, None)
    got = poisoned(ctx, node)
    CUDA_IMPLS[node.op](node, dev_ins, got, ctx)
    got = to_host(ctx, got)
    what = f"batch_norm_train NHWC {shape} affine={affine} track={track} {act}"
    assert_close(got[0], want[0], rtol=1e-5, atol=1e-5, what=f"{what} y", all_finite=True)
    assert_close(got[1], want[1], rtol=1e-6, atol=1e-6, what=f"{what} save_mean")
    assert_close(got[2], want[2], rtol=1e-6, atol=0, what=f"{what} save_invstd")
    for i, a in zip(node.mutates, to_host(ctx, [dev_ins[i] for i in node.mutates])):
        assert_close(a, ref_ins[i], rtol=2e-6, atol=1e-7, what=f"{what} running input {i}")
    # the backward, from the forward's saved statistics (and bias, for the fused ReLU's mask)
    dy = random(rng, *shape)
    gins = [dy, x] + ([ins[1]] if affine else []) + [want[1], want[2]] + (
        [ins[2]] if affine and act == "relu" else [])
    gnode = make_node("batch_norm_grad", gins, affine=affine, act=act, layout="NHWC")
    ref, out = run_both(ctx, gnode, gins)
    for i, (g, r) in enumerate(zip(out, ref)):
        assert_close(g, r, rtol=2e-5, atol=2e-5, what=f"batch_norm_grad NHWC {shape} out {i}",
                     all_finite=True)


# ---- pooling -----------------------------------------------------------------------------------

# (NHWC shape, kernel, stride, padding)
POOLS = [((2, 7, 9, 3), (3, 3), (2, 2), (1, 1)), ((2, 5, 5, 4), (2, 3), (1, 2), (0, 1)),
         ((3, 8, 8, 16), (2, 2), (2, 2), (0, 0)),             # exact tiling
         ((2, 9, 6, 5), (3, 2), (3, 2), (0, 0)), ((4, 8, 8, 32), (8, 8), (8, 8), (0, 0)),
         # global: channels past a block's 32, an odd image of 3 channels
         ((3, 7, 7, 40), (7, 7), (7, 7), (0, 0)), ((5, 13, 11, 3), (13, 11), (13, 11), (0, 0))]


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("shape,kernel,stride,padding", POOLS)
def test_nhwc_maxpool2d_and_grad(ctx, shape, kernel, stride, padding, relu):
    x = pool_input(shape, 31)
    node = make_node("maxpool2d", [x], kernel=kernel, stride=stride, padding=padding,
                     relu=relu, layout="NHWC")
    ref, got = run_both(ctx, node, [x])
    np.testing.assert_array_equal(got[1], ref[1], err_msg=f"maxpool2d NHWC idx {shape}")
    np.testing.assert_array_equal(got[0], ref[0], err_msg=f"maxpool2d NHWC y {shape}")
    y, idx = ref
    dy = random(np.random.default_rng(37), *y.shape)
    ins = [dy, idx] + ([y] if relu else [])
    gnode = make_node("maxpool2d_grad", ins, kernel=kernel, stride=stride, padding=padding,
                      input_shape=shape, relu=relu, layout="NHWC")
    ref, got = run_both(ctx, gnode, ins)
    assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6, what=f"maxpool2d_grad NHWC {shape}",
                 all_finite=True)


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("shape,kernel,stride,padding", POOLS)
def test_nhwc_avgpool2d_and_grad(ctx, shape, kernel, stride, padding, count_include_pad):
    x = random(np.random.default_rng([41, *shape]), *shape)
    attrs = dict(kernel=kernel, stride=stride, padding=padding,
                 count_include_pad=count_include_pad, layout="NHWC")
    node = make_node("avgpool2d", [x], **attrs)
    ref, got = run_both(ctx, node, [x])
    assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6, what=f"avgpool2d NHWC {shape}",
                 all_finite=True)
    dy = random(np.random.default_rng(43), *ref[0].shape)
    gnode = make_node("avgpool2d_grad", [dy], input_shape=shape, **attrs)
    ref, got = run_both(ctx, gnode, [dy])
    assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6, what=f"avgpool2d_grad NHWC {shape}",
                 all_finite=True)


# ---- whole steps -------------------------------------------------------------------------------

WIDTHS = (8, 16, 32)


def twins(devices, graph=False, configs=None, **options):
    """Train steps of identically initialised small ResNets, one per device; `options` go to
    the CUDA steps (the CPU twin is NCHW fp32), or configs[i] to step i."""
    base = models.resnet(widths=WIDTHS)
    data = batches(1)
    steps = []
    for i, device in enumerate(devices):
        model = models.resnet(widths=WIDTHS)
        model.load_state_dict(base.state_dict())
        opt = optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
        kw = configs[i] if configs is not None else options if device == "cuda" else {}
        steps.append(sg.compile_train_step(
            model, loss=ce_smooth, optimizer=opt, example_inputs=data[0], device=device,
            graph=graph if device == "cuda" else False, **kw))
    return steps


def plan_ops(step):
    return [node for node, _, _ in step.executable(step.signature).calls]


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_channels_last_resnet_graph_replay_is_bit_identical_to_eager(monkeypatch, precision):
    fallbacks = []
    real = conv._through_nchw
    monkeypatch.setattr(conv, "_through_nchw",
                        lambda impl, node, *a: fallbacks.append(node) or real(impl, node, *a))
    eager, graph = twins(["cuda", "cuda"], memory_format="channels_last", precision=precision)
    graph.use_graph = True
    for x, y in batches(6, seed=2):
        x, y = cp.asarray(x), cp.asarray(y)
        assert float(eager(x, y)) == float(graph(x, y))
    want = eager.model.state_dict()
    for k, v in graph.model.state_dict().items():
        assert np.array_equal(v, want[k]), k
    ops = plan_ops(graph)
    convs = [n for n in ops if n.op.startswith("conv2d")]
    assert convs and all(n.attrs.get("layout") == "NHWC" for n in convs)
    # the input's permute alone: the 7 conv weights are float32 copies the update writes
    # transposed (compile/weight_permutes.py), their gradients read by the update as they are
    # (compile/update_permutes.py)
    assert sum(n.op == "permute" for n in ops) == 1
    assert not any(n.op == "permute_group" for n in ops)
    update = next(n for n in ops if n.op == "sgd_update")
    assert len(update.attrs["copy_dims"]) == 7
    (exe,) = graph.executables.values()
    assert exe.captured is not None and exe.captured.node_count == kernels_of_ops(exe)
    print(f"{precision}: {len({id(n) for n in fallbacks})} conv nodes ran through NCHW")
    assert precision != "tf32" or not fallbacks, [(n.op, n.inputs[0].shape) for n in fallbacks]


@pytest.mark.parametrize("precision,loss_rtol,param_rtol", [("fp32", 1e-4, 1e-3),
                                                             ("tf32", 2e-2, 5e-2)])
def test_channels_last_resnet_follows_numpy(precision, loss_rtol, param_rtol):
    """cuda channels-last against the numpy backend's NCHW fp32 step over five steps (the
    fp32 bounds are test_resnet_cuda.py's, tensor by tensor). tf32 rounds its conv inputs to
    10 bits; a BatchNorm bias's gradient is a channel sum of dy in which BN's backward cancels
    the mean, so after five steps a bias of ~3e-3 carries tf32's noise at tens of percent
    (measured 0.41 on an H100): in tf32 the bound holds for all tensors together."""
    cpu, gpu = twins(["cpu", "cuda"], memory_format="channels_last", precision=precision)
    assert gpu.memory_format == "channels_last" and cpu.memory_format == "contiguous"
    diffs = []
    for x, y in batches(5, seed=1):
        lc, lg = float(cpu(x, y)), float(gpu(cp.asarray(x), cp.asarray(y)))
        diffs.append(abs(lg - lc) / abs(lc))
    print(f"resnet channels_last {precision} vs numpy: largest loss difference {max(diffs):.2e}")
    assert max(diffs) <= loss_rtol, diffs
    ref, got = cpu.model.state_dict(), gpu.model.state_dict()
    assert list(ref) == list(got)
    for k in ref:
        assert got[k].shape == ref[k].shape, k
        if k.endswith("num_batches_tracked"):
            assert int(got[k]) == int(ref[k]) == 5, k
        elif precision == "fp32":
            assert rel(got[k], ref[k]) < param_rtol, k
    floats = [k for k in ref if not k.endswith("num_batches_tracked")]
    whole = rel(np.concatenate([got[k].numpy().ravel() for k in floats]),
                np.concatenate([ref[k].numpy().ravel() for k in floats]))
    assert whole < param_rtol, whole


def test_channels_last_predictions_equal_the_cpu():
    model = models.resnet(widths=WIDTHS)
    (gpu,) = twins(["cuda"], graph=True, memory_format="channels_last", precision="fp32")
    for x, y in batches(3, seed=3):
        gpu(cp.asarray(x), cp.asarray(y))
    model.load_state_dict(gpu.model.state_dict())
    x = batches(1, seed=4)[0][0]
    want = sg.compile_predict(model, example_inputs=(x,), device="cpu")(x)
    predict = sg.compile_predict(gpu.model, example_inputs=(x,), device="cuda", precision="fp32",
                                 memory_format="channels_last")
    assert any(n.attrs.get("layout") == "NHWC" for n in plan_ops(predict))
    assert rel(cp.asnumpy(predict(cp.asarray(x))), want) < 1e-5


def test_auto_memory_format_by_rule_is_channels_last_at_tf32_only():
    """Without the timing (tests/conftest.py turns it off), the rule decides."""
    tf32, fp32 = (twins(["cuda"], precision=p)[0] for p in ("tf32", "fp32"))
    assert tf32.memory_format == "auto" and fp32.memory_format == "contiguous"
    assert tf32.layout_choice is None and fp32.layout_choice is None
    assert any(n.attrs.get("layout") == "NHWC" for n in plan_ops(tf32))
    assert all(n.attrs.get("layout", "NCHW") == "NCHW" for n in plan_ops(fp32))


@pytest.fixture
def timed_layouts(monkeypatch, tmp_path):
    """memory_format "auto" decided by timing both layouts, the decisions stored under
    tmp_path (not in the user's cache, where an earlier run's would be found)."""
    from stepgraph.backends.cuda.runtime import autotune
    from stepgraph.compile import layout_choice

    monkeypatch.setenv(layout_choice.MEASURE_ENV, "always")   # the ResNet's rule is sure
    disk = cache.ChoiceCache(layout_choice.NAMESPACE,
                             autotune.device_identity(cp.cuda.runtime.getDevice()), tmp_path)
    monkeypatch.setattr(layout_choice, "_disk", lambda compiled: disk)
    return disk


def seeded_twin(**options):
    sg.nn.manual_seed(0)
    return twins(["cuda"], graph=True, **options)[0]


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_auto_memory_format_keeps_the_faster_layout_and_leaves_no_trace(timed_layouts,
                                                                          precision):
    from stepgraph.compile.layout_choice import LayoutChoice

    step = seeded_twin(precision=precision)
    choice = step.layout_choice
    assert choice.source == "measured", choice
    assert set(choice.step_us) == {"channels_last", "contiguous"}
    assert all(0 < us < 1e5 for us in choice.step_us.values()), choice
    assert step.memory_format == min(choice.step_us, key=choice.step_us.get)
    nhwc = any(n.attrs.get("layout") == "NHWC" for n in plan_ops(step))
    assert nhwc == (step.memory_format == "channels_last")
    # the timed steps changed nothing: the trajectory, bit for bit, of a step built in the
    # chosen layout from the same initial weights
    same = seeded_twin(precision=precision, memory_format=step.memory_format)
    for x, y in batches(3, seed=6):
        x, y = cp.asarray(x), cp.asarray(y)
        assert float(step(x, y)) == float(same(x, y))
    want = same.model.state_dict()
    for k, v in step.model.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), want[k].numpy(), err_msg=k)
    # the graph it replays was captured after its setup: a bad step is posted to the guard's
    # mailbox (a capture made while timing would hold no mailbox) and raised at the next call
    x, y = batches(2, seed=7)
    poisoned = x[0].copy()
    poisoned[0, 0, 0, 0] = np.nan
    bad = step(cp.asarray(poisoned), cp.asarray(x[1]))
    step.backend.synchronize()
    assert step._guard.mirror[FIRST_BAD] == bad.step
    with pytest.raises(NonFiniteError):
        step(cp.asarray(y[0]), cp.asarray(y[1]))
    # a later step of the same model finds the decision stored and times nothing
    again = seeded_twin(precision=precision)
    assert again.layout_choice == LayoutChoice(step.memory_format, "cached")


def test_nondeterministic_step_trains():
    """deterministic=False: the step runs, and its losses follow the deterministic step's
    within tf32 rounding (atomics reorder sums; nothing else changes)."""
    det, loose = twins(["cuda", "cuda"], graph=True,
                       configs=[{"precision": "tf32"},
                                {"precision": "tf32", "deterministic": False}])
    assert loose.ctx.deterministic is False and det.ctx.deterministic is True
    for x, y in batches(4, seed=5):
        x, y = cp.asarray(x), cp.asarray(y)
        a, b = float(det(x, y)), float(loose(x, y))
        assert np.isfinite(b) and abs(a - b) <= 2e-2 * abs(a), (a, b)
