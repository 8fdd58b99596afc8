"""cuDNN conv plans built ahead (runtime/ahead.py, conv.py `start_plans`, conv_cudnn.plans_for):
CudaBackend.prepare queues, on the one ahead thread, the plan builds each conv node's first
launch will ask for (every candidate's while the choice is unknown, the chosen one's alone,
none for a chosen own path) and builds nothing itself; a launch waits for its own build only
(running it itself if the lane has not reached it); a build that failed is raised at the
launch that needs it; and the autotuner chooses what it chooses without ahead-building. cuDNN
is faked at its ranked plan lists as in test_conv_choice.py: no GPU, frontend or libcudnn."""
from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("cupy")    # conv.py's launchers import CuPy (no GPU needed)

from stepgraph import cache  # noqa: E402
from stepgraph.backends.cuda import backend  # noqa: E402
from stepgraph.backends.cuda.conv import conv, conv_cudnn  # noqa: E402
from stepgraph.backends.cuda.runtime import ahead, compiler  # noqa: E402
from stepgraph.errors import CaptureError  # noqa: E402
from stepgraph.ir.graph import BF16, Node, Value  # noqa: E402
from tests.unit.test_conv_choice import (  # noqa: E402, F401  (fake: the fixture)
    ATTRS, BUILT_ON_A_MISS, X, W, Y, fake, fake_array, fake_ctx, fresh)

B = (6,)                                   # the bias
PLAIN_W = (6, 4, 3, 3)                     # groups 1: the own kernels compete too
PLAIN_ATTRS = {"stride": (1, 1), "padding": (1, 1)}


def conv_calls(dtype="float32", storage=np.float32):
    """(node, inputs, outputs) of a grouped conv2d with bias and its two gradients (cuDNN
    runs them alone), as an executable holds them, in the order a step launches them."""
    def call(op, ins, outs, attrs):
        return (Node(op, [Value(s, dtype) for s in ins], [Value(s, dtype) for s in outs],
                     dict(attrs)),
                [fake_array(s, storage) for s in ins], [fake_array(s, storage) for s in outs])

    return [call("conv2d", (X, W, B), (Y,), ATTRS),
            call("conv2d_grad_input", (Y, W), (X,), {**ATTRS, "input_shape": X}),
            call("conv2d_grad_weight", (Y, X), (W,), {**ATTRS, "weight_shape": W})]


def problem(op, dtype="float32", bias=False):
    g = conv._geometry(X, W, ATTRS)
    return conv_cudnn.Problem(op, g, dtype, "fp32", bias=bias, device=0)


def cuda_backend():
    """A CudaBackend as prepare() sees it (no GPU): the families' BUILDS_AHEAD hooks, no
    kernels to compile."""
    cuda = backend.CudaBackend.__new__(backend.CudaBackend)
    cuda.kernel_files, cuda.generated_kernels, cuda.kernels_ahead = {}, {}, {}
    cuda.builds_ahead = {}
    for family in backend._families():
        cuda.builds_ahead.update(getattr(family, "BUILDS_AHEAD", {}))
    assert set(cuda.builds_ahead) == set(conv.IMPLS) | {"conv3d", "conv3d_grad_input",
                                                         "conv3d_grad_weight"}
    return cuda


@pytest.fixture
def lane(monkeypatch, fake):
    """The ahead lane, held: the jobs prepare() queues are kept in `lane` (in order) until the
    test runs them; the compiles prepare() would start are skipped."""
    queued: list[ahead.Job] = []
    monkeypatch.setattr(ahead, "start", lambda job: queued.append(job) or job)
    monkeypatch.setattr(compiler, "prefetch", lambda *args, **kwargs: None)
    return queued


@pytest.fixture
def real_lane(monkeypatch, fake):
    """The real ahead thread, with no device to make current (no GPU here)."""
    monkeypatch.setattr(ahead, "on_device", lambda device, run: run())
    monkeypatch.setattr(compiler, "prefetch", lambda *args, **kwargs: None)


def launch(calls, ctx):
    for node, ins, outs in calls:
        conv.IMPLS[node.op](node, ins, outs, ctx)


def test_prepare_queues_every_conv_problems_build_and_builds_nothing(fake, lane):
    ctx = fake_ctx()
    calls = conv_calls()
    relu = Node("relu", [Value(Y, "float32")], [Value(Y, "float32")])
    cuda_backend().prepare([c[0] for c in calls] + [relu], "fp32",
                           calls + [(relu, [fake_array(Y)], [fake_array(Y)])], ctx)
    # the forward's fused plans (bias in the graph), its plain ones (+ the epilogue kernel),
    # and each gradient's: in the order the step launches them, none built yet
    wanted = [problem("conv2d", bias=True), problem("conv2d"), problem("conv2d_grad_input"),
              problem("conv2d_grad_weight")]
    assert list(conv_cudnn._PLANS) == wanted and conv_cudnn._CHOSEN == {}
    assert lane == [conv_cudnn._PLANS[p] for p in wanted]
    assert fake.built == [] and not any(job.started() for job in lane)
    assert ctx.paths == {}

    for job in lane:                                   # the lane runs them, in order
        job.run()
    assert fake.built == ["fused-" + e for e in BUILT_ON_A_MISS] + BUILT_ON_A_MISS * 3
    launch(calls, ctx)                                 # the launches build nothing more
    assert len(fake.built) == 4 * len(BUILT_ON_A_MISS) and len(ctx.paths) == 3


def test_a_bf16_forward_with_bias_queues_its_fused_plans_alone(fake, lane):
    """bf16, groups 1: plain plans + the epilogue are offered only where no fused plan
    builds, so ahead of the builds only the fused ones are asked for."""
    node = Node("conv2d", [Value(s, BF16) for s in (X, PLAIN_W, B)], [Value(Y, BF16)],
                dict(PLAIN_ATTRS))
    call = (node, [fake_array(s, np.uint16) for s in (X, PLAIN_W, B)],
            [fake_array(Y, np.uint16)])
    cuda_backend().prepare([node], "bf16", [call], fake_ctx())
    g = conv._geometry(X, PLAIN_W, PLAIN_ATTRS)
    assert list(conv_cudnn._PLANS) == [conv_cudnn.Problem("conv2d", g, BF16, "fp32",
                                                          bias=True, device=0)]


def test_a_bf16_grouped_forward_with_bias_queues_its_plain_plans_too(fake, lane):
    """bf16, groups > 1: the plain plans + the epilogue always compete (cuDNN's fast
    depthwise engines fuse no bias), so both lists are asked for ahead."""
    forward = conv_calls(BF16, np.uint16)[:1]
    cuda_backend().prepare([forward[0][0]], "bf16", forward, fake_ctx())
    assert list(conv_cudnn._PLANS) == [problem("conv2d", BF16, bias=True),
                                       problem("conv2d", BF16)]


def test_a_known_choice_queues_its_plan_alone_and_an_own_choice_none(fake, lane, monkeypatch):
    fake.times["engB2"] = 1.0
    launch(conv_calls()[1:2], fake_ctx())              # an earlier process chose cudnn:B2
    plain = (Node("conv2d_grad_input", [Value(Y, "float32"), Value(PLAIN_W, "float32")],
                  [Value(X, "float32")], {**PLAIN_ATTRS, "input_shape": X}),
             [fake_array(Y), fake_array(PLAIN_W)], [fake_array(X)])
    ctx = fresh(fake, monkeypatch)
    offer = conv.OFFERS["conv2d_grad_input"](*plain, ctx)
    assert {"direct", "gemm"} <= set(offer.own)
    ctx.paths[conv._choice_key(plain[0], ctx, offer.g, offer.dtype, offer.own)] = "gemm"
    calls = conv_calls()[1:2] + [plain]
    cuda_backend().prepare([c[0] for c in calls], "fp32", calls, ctx)
    assert conv_cudnn._PLANS == {}
    assert list(conv_cudnn._CHOSEN) == [(problem("conv2d_grad_input"), "cudnn:B2")]
    assert len(lane) == 1 and fake.built == []
    assert list(ctx.paths.values()) == ["gemm"]        # prepare chose nothing


def test_choices_are_those_made_without_building_ahead(fake, real_lane, monkeypatch, tmp_path):
    """A cold process and a warm one (the disk holding the cold one's choices), each without
    and with ahead-building: the same choices, the same plans built, the same timings."""
    fake.times |= {"fused-eng5": 0.5, "eng3": 1.0}      # each gradient's: eng3
    seen = {}
    for ahead_built in (False, True):
        monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / f"cache-{ahead_built}"))
        for run in ("cold", "warm"):
            ctx, calls = fresh(fake, monkeypatch), conv_calls()
            if ahead_built:
                cuda_backend().prepare([c[0] for c in calls], "fp32", calls, ctx)
            launch(calls, ctx)
            launch(calls, ctx)                         # a second step: nothing new
            seen[ahead_built, run] = (dict(ctx.paths), sorted(fake.built), list(fake.timed),
                                      list(fake.ran))
    assert seen[True, "cold"] == seen[False, "cold"]
    assert seen[True, "warm"] == seen[False, "warm"]
    paths, built, timed, _ = seen[True, "warm"]
    assert sorted(paths.values()) == ["cudnn:3", "cudnn:3", "cudnn:5"]
    assert built == ["eng3", "eng3", "fused-eng5"] and timed == []


def test_a_launch_waits_for_its_own_build_alone(fake, real_lane, monkeypatch):
    """The lane is held inside the grad_input build; the grad_weight launch, queued behind
    it, builds its own plans itself at once; the grad_input launch then takes the lane's."""
    entered, gate, threads = threading.Event(), threading.Event(), {}
    build = conv_cudnn._build

    def held(cudnn, p, handle):
        threads.setdefault(p.op, []).append(threading.current_thread().name)
        if p.op == "conv2d_grad_input":
            entered.set()
            assert gate.wait(10), "the test never opened the gate"
        return build(cudnn, p, handle)

    monkeypatch.setattr(conv_cudnn, "_build", held)
    ctx, calls = fake_ctx(), conv_calls()[1:]
    try:
        cuda_backend().prepare([c[0] for c in calls], "fp32", calls, ctx)
        assert entered.wait(10)
        launch(calls[1:], ctx)                         # grad_weight: not behind grad_input
        assert not conv_cudnn._PLANS[problem("conv2d_grad_input")].done()
        assert threads["conv2d_grad_weight"] == [threading.current_thread().name]
    finally:
        gate.set()
    launch(calls[:1], ctx)                             # waits for the lane's build
    assert [name.startswith("ahead") for name in threads["conv2d_grad_input"]] == [True]
    assert sorted(fake.built) == sorted(BUILT_ON_A_MISS * 2)    # each plan built once
    assert len(ctx.paths) == 2


def test_a_failed_build_is_raised_at_its_launch_not_before(fake, real_lane, monkeypatch):
    def broken(cudnn, p, handle):
        raise RuntimeError("libcudnn_engines_precompiled.so: cannot open shared object file")

    build = conv_cudnn._build
    monkeypatch.setattr(conv_cudnn, "_build", broken)
    ctx, calls = fake_ctx(), conv_calls()[1:2]
    cuda_backend().prepare([c[0] for c in calls], "fp32", calls, ctx)   # no error here
    job = conv_cudnn._PLANS[problem("conv2d_grad_input")]
    with pytest.raises(RuntimeError, match="engines_precompiled"):
        job.future.result(10)                          # the lane ran it, and kept the error
    with pytest.raises(RuntimeError, match="engines_precompiled"):
        launch(calls, ctx)                             # the launch that needs it says so
    monkeypatch.setattr(conv_cudnn, "_build", build)
    launch(calls, ctx)                                 # reported once; the next call builds
    assert fake.built == BUILT_ON_A_MISS and len(ctx.paths) == 1


def test_a_capture_never_runs_a_build(fake, lane):
    ctx, calls = fake_ctx(), conv_calls()[1:2]
    cuda_backend().prepare([c[0] for c in calls], "fp32", calls, ctx)
    ctx.stream.capturing = True
    with pytest.raises(CaptureError, match="eagerly"):
        launch(calls, ctx)
    assert fake.built == [] and not lane[0].started()


def test_a_job_runs_once_and_gives_its_failure_to_each_caller():
    ran = []
    job = ahead.Job(lambda: ran.append(threading.current_thread().name) or "plans")
    assert not job.started() and job.result() == "plans" and job.done()
    job.run()                                          # the lane, too late: nothing
    assert ran == [threading.current_thread().name]
    failing = ahead.Job(lambda: 1 / 0)
    for _ in range(2):
        with pytest.raises(ZeroDivisionError):
            failing.result()
