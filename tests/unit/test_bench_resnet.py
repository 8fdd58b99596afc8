"""The vision workloads of `stepgraph bench` (`resnet`, `convnet`) without a GPU: their
definitions against BENCHMARKS.md and stepgraph.models, argument handling, the kernel census,
the per-peer time limit, torch.compile's mode search and the memory-format choice, and every
installed peer trained a few steps on the CPU at tiny sizes (skipped when a library is
missing)."""
from __future__ import annotations

import importlib
import math
import signal
import threading
import time

import numpy as np
import pytest

from stepgraph.bench import census, harness
from stepgraph.bench import workloads as wl
from stepgraph.bench.peers import (FAIR_COMPILE_MODES, KernelCensus, PeerInfo, PreparedStep,
                                    select_peers)
from tests.unit.bench_support import bench_config, can_run, have, peer_or_skip

VISION = ("resnet", "convnet")


# ---------------------------------------------------------------- definitions


def test_vision_workloads_match_benchmarks_md():
    resnet, convnet = wl.get_workload("resnet"), wl.get_workload("convnet")
    assert (resnet.batch, resnet.sample_shape) == (512, (3, 32, 32))
    assert resnet.model == wl.ResNet(widths=(64, 128, 256), blocks_per_stage=1, classes=10)
    assert resnet.loss == "cross_entropy" and resnet.label_smoothing == 0.2
    assert resnet.optimizer == wl.OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=5e-4,
                                                nesterov=True)
    assert (convnet.batch, convnet.sample_shape) == (128, (3, 32, 32))
    assert convnet.model.stages == ((32, 32), (64, 64))
    assert convnet.loss == "cross_entropy" and convnet.label_smoothing == 0.0
    assert convnet.optimizer == wl.OptimizerSpec("sgd", lr=0.01, momentum=0.9)
    assert set(VISION) <= set(wl.WORKLOAD_NAMES) and not set(VISION) & set(wl.DEFAULT_WORKLOADS)


def test_vision_parameter_counts_and_flops():
    resnet, convnet = wl.get_workload("resnet"), wl.get_workload("convnet")
    convs = 3 * 64 * 9 + 2 * 64 * 64 * 9 + (64 + 128) * 128 * 9 + 64 * 128 \
        + (128 + 256) * 256 * 9 + 128 * 256
    batch_norms = 2 * (64 + 2 * 64 + 3 * 128 + 3 * 256)
    assert wl.parameter_count(resnet) == convs + batch_norms + 256 * 10 + 10 == 1227594
    assert wl.parameter_count(convnet) == (3 * 32 * 9 + 32 + 32 * 32 * 9 + 32 + 32 * 64 * 9 + 64
                                           + 64 * 64 * 9 + 64 + 64 * 64 * 10 + 10)
    macs = (1024 * 64 * 27 + 2 * 1024 * 64 * 576 + 256 * 128 * (576 + 1152 + 64)
            + 64 * 256 * (1152 + 2304 + 128) + 2560)
    assert wl.flops_per_step(resnet) == 6 * 512 * macs
    conv_macs = 1024 * (32 * 27 + 32 * 288) + 256 * (64 * 288 + 64 * 576)
    assert wl.flops_per_step(convnet) == 6 * 128 * (conv_macs + 4096 * 10)


def test_shared_parameters_are_named_like_pytorch():
    params = wl.initial_parameters(wl.get_workload("resnet", tiny=True), seed=0)
    named = wl.named_parameters(params)
    assert list(named)[:4] == ["conv1.weight", "bn1.weight", "bn1.bias", "layer1.0.conv1.weight"]
    assert "layer2.0.downsample.0.weight" in named and "layer1.0.downsample.0.weight" not in named
    assert "conv1.bias" not in named  # bias-free convs
    assert np.all(named["bn1.weight"] == 1) and np.all(named["bn1.bias"] == 0)
    bound = 1 / math.sqrt(3 * 9)
    assert np.abs(named["conv1.weight"]).max() <= bound
    again = wl.named_parameters(wl.initial_parameters(wl.get_workload("resnet", tiny=True), 0))
    assert all(np.array_equal(named[k], again[k]) for k in named)
    with pytest.raises(ValueError, match="no layer names"):
        wl.named_parameters(wl.initial_parameters(wl.get_workload("mlp", tiny=True)))


@pytest.mark.parametrize("name", VISION)
@pytest.mark.parametrize("tiny", [False, True])
def test_stepgraph_and_torch_models_have_the_same_parameters(name, tiny):
    pytest.importorskip("torch")
    from stepgraph.bench.peers import stepgraph_runner, torch_models
    workload = wl.get_workload(name, tiny)
    ours = stepgraph_runner.build_model(workload)
    theirs = torch_models.vision_model(workload, wl.initial_parameters(workload))
    ours_count = sum(p.numpy().size for p in ours.parameters())
    assert ours_count == sum(p.numel() for p in theirs.parameters()) \
        == wl.parameter_count(workload)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]


@pytest.mark.parametrize("name", VISION)
def test_torch_peer_state_dict_loads_into_stepgraph(name):
    pytest.importorskip("torch")
    from stepgraph.bench.peers import stepgraph_runner, torch_models
    workload = wl.get_workload(name, tiny=True)
    torch_model = torch_models.vision_model(workload, wl.initial_parameters(workload, seed=3))
    state = {k: v.detach().numpy().copy() for k, v in torch_model.state_dict().items()}
    model = stepgraph_runner.build_model(workload)
    assert set(model.state_dict()) == set(state)  # buffers (running stats) included
    model.load_state_dict(state)
    loaded = model.state_dict()
    for key, value in state.items():
        np.testing.assert_array_equal(np.asarray(loaded[key]), value, err_msg=key)


# ---------------------------------------------------------------- command line


def test_vision_workloads_and_options_parse():
    config = harness.parse_config(["--workloads", "resnet,convnet", "--precision", "fp32,tf32",
                                   "--compile-modes", "default,max-autotune-no-cudagraphs",
                                   "--peer-timeout", "90"])
    assert config.workloads == ["resnet", "convnet"] and config.precisions == ["fp32", "tf32"]
    assert config.compile_modes == ("default", "max-autotune-no-cudagraphs")
    assert config.peer_timeout_s == 90.0
    spec = harness.make_spec(wl.get_workload("convnet", tiny=True), "fp32",
                             bench_config(compile_modes=config.compile_modes))
    assert spec.compile_modes == config.compile_modes
    default = harness.parse_config([])
    assert default.workloads == list(wl.DEFAULT_WORKLOADS)
    assert default.compile_modes == ("reduce-overhead",)
    assert harness.parse_config(["--fair"]).compile_modes == (
        "reduce-overhead", "default", "max-autotune", "max-autotune-no-cudagraphs",
        "reduce-overhead+compiled-autograd")
    assert harness.output_stem(config) == "bench_resnet-convnet_fp32-tf32"


@pytest.mark.parametrize("argv, message", [
    (["--compile-modes", "fastest"], "unknown torch.compile mode"),
    (["--peer-timeout", "-1"], "--peer-timeout"),
    (["--workloads", "resnet50"], "unknown workload"),
])
def test_bad_vision_arguments_exit_2(argv, message, capsys):
    assert harness.main(argv) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- census and time limit


HLO = """HloModule jit_train_step, is_scheduled=true

%fused_transpose (param_0: f32[8,3,4,4]) -> f32[8,4,4,3] {
  %param_0 = f32[8,3,4,4]{3,2,1,0} parameter(0)
  ROOT %transpose.1 = f32[8,4,4,3]{3,2,1,0} transpose(%param_0), dimensions={0,2,3,1}
}

%fused_relu (param_0.1: f32[8,4,4,16]) -> f32[8,4,4,16] {
  %param_0.1 = f32[8,4,4,16]{3,2,1,0} parameter(0)
  %constant.1 = f32[] constant(0)
  %broadcast.1 = f32[8,4,4,16]{3,2,1,0} broadcast(%constant.1), dimensions={}
  ROOT %maximum.1 = f32[8,4,4,16]{3,2,1,0} maximum(%param_0.1, %broadcast.1)
}

%region_add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.2 = f32[] add(%a, %b)
}

%command_buffer (p0: f32[8,4,4,16]) -> f32[8,4,4,16] {
  %p0 = f32[8,4,4,16]{3,2,1,0} parameter(0)
  ROOT %relu_fusion = f32[8,4,4,16]{3,2,1,0} fusion(%p0), kind=kLoop, calls=%fused_relu
}

ENTRY %main.9 (x: f32[8,3,4,4], w: f32[3,3,3,16]) -> (f32[], f32[8,4,4,16]) {
  %x = f32[8,3,4,4]{3,2,1,0} parameter(0)
  %w = f32[3,3,3,16]{3,2,1,0} parameter(1)
  %tf = f32[8,4,4,3]{3,2,1,0} fusion(%x), kind=kLoop, calls=%fused_transpose
  %conv = (f32[8,4,4,16]{3,2,1,0}, u8[0]{0}) custom-call(%tf, %w), custom_call_target="cudnn"
  %gte = f32[8,4,4,16]{3,2,1,0} get-tuple-element(%conv), index=0
  %relu = f32[8,4,4,16]{3,2,1,0} call(%gte), to_apply=%command_buffer
  %copy.3 = f32[8,4,4,16]{0,3,2,1} copy(%relu)
  %copy.4 = f32[8,4,4,16]{0,3,2,1} copy(%copy.3)
  %zero = f32[] constant(0)
  %sum = f32[] reduce(%copy.4, %zero), dimensions={0,1,2,3}, to_apply=%region_add
  ROOT %out = (f32[], f32[8,4,4,16]{3,2,1,0}) tuple(%sum, %relu)
}
"""


def test_hlo_census_counts_launches_and_layout_changes():
    counted = census.hlo_census(HLO)
    # transpose fusion, cuDNN call, relu fusion inside the called command buffer, 2 copies, reduce
    assert counted.kernels == 6
    # the fused NCHW->NHWC transpose and the copy into another layout; copy.4 keeps its layout
    assert counted.layout_conversions == 2
    assert "HLO" in counted.source


def test_kernel_name_census_recognises_layout_kernels():
    names = ["sm90_xmma_fprop_implicit_gemm_f32f32", "void cudnn::ops::nchwToNhwcKernel<float>",
             "void at::native::vectorized_elementwise_kernel", "nhwcToNchwKernel",
             "triton_poi_fused_convolution_backward_0"]
    assert census.kernel_name_census(names, "test") == KernelCensus(5, 2, "test")


def test_census_goes_into_the_row_and_the_table(monkeypatch):
    def prepare(spec):
        return PreparedStep(lambda i: 1.0, lambda: None, float,
                            census=lambda: KernelCensus(212, 6, "fake profiler"))

    monkeypatch.setattr(harness, "_load_prepare", lambda peer: prepare)
    spec = harness.make_spec(wl.get_workload("convnet", tiny=True), "fp32", bench_config())
    row = harness.measure_peer(PeerInfo("fake", "x", "prepare", "x"), spec, bench_config())
    assert (row.kernels_per_step, row.layout_conversions) == (212, 6)
    assert row.census_source == "fake profiler"
    report = harness.BenchReport("2026-01-01", "Fake GPU", "host", "3.12", {}, bench_config(), {},
                                 [row])
    table = harness.render_table(report)
    assert "kernels" in table.splitlines()[2] and " 212 " in table
    assert harness.report_to_json(report)["results"][0]["kernels_per_step"] == 212


def test_failing_census_is_a_note_not_a_failure(monkeypatch):
    def broken():
        raise RuntimeError("no CUPTI\nmore")

    def prepare(spec):
        return PreparedStep(lambda i: 1.0, lambda: None, float, census=broken)

    monkeypatch.setattr(harness, "_load_prepare", lambda peer: prepare)
    spec = harness.make_spec(wl.get_workload("resnet", tiny=True), "fp32", bench_config())
    row = harness.measure_peer(PeerInfo("fake", "x", "prepare", "x"), spec, bench_config())
    assert row.status == "ok" and row.kernels_per_step is None
    assert "kernel count failed: RuntimeError: no CUPTI" in row.notes


@pytest.mark.skipif(not hasattr(signal, "setitimer")
                    or threading.current_thread() is not threading.main_thread(),
                    reason="the time limit is a SIGALRM in the main thread")
def test_a_peer_past_its_time_limit_fails_and_the_run_goes_on(monkeypatch):
    closed = []

    def slow_prepare(spec):
        try:  # a peer's own catch-all must not swallow the time limit
            time.sleep(5)
        except Exception:
            pass
        return PreparedStep(lambda i: 1.0, lambda: None, float)

    def fast_prepare(spec):
        return PreparedStep(lambda i: 1.0, lambda: None, float, close=lambda: closed.append(1))

    spec = harness.make_spec(wl.get_workload("convnet", tiny=True), "fp32", bench_config())
    monkeypatch.setattr(harness, "_load_prepare", lambda peer: slow_prepare)
    start = time.perf_counter()
    row = harness.measure_peer(PeerInfo("slow", "x", "prepare", "x"), spec,
                               bench_config(peer_timeout_s=0.2))
    assert time.perf_counter() - start < 3
    assert row.status == "failed" and row.reason.startswith("PeerTimeout: no result within 0.2")
    monkeypatch.setattr(harness, "_load_prepare", lambda peer: fast_prepare)
    row = harness.measure_peer(PeerInfo("fast", "x", "prepare", "x"), spec,
                               bench_config(peer_timeout_s=0.2))
    assert row.status == "ok" and closed == [1]
    time.sleep(0.3)  # the alarm of the first row must be gone: nothing is raised here


# ---------------------------------------------------------------- PyTorch configuration


def test_torch_compile_keeps_the_fastest_mode_and_reuses_it(monkeypatch):
    pytest.importorskip("torch")
    from stepgraph.bench.peers import torch_compile as tc
    times = {"reduce-overhead": 90.0, "default": 120.0, "max-autotune-no-cudagraphs": 0.0}
    closed = []

    def fake_compile(spec, mode, layout):
        if mode == "max-autotune-no-cudagraphs":
            raise RuntimeError("autotuning failed\ndetail")
        return tc._Candidate(mode, lambda i: 0.0, lambda: closed.append(mode))

    monkeypatch.setattr(tc, "_compile", fake_compile)
    monkeypatch.setattr(tc, "_probe", lambda candidate, n, sync, started: setattr(
        candidate, "us", times[candidate.mode]))
    monkeypatch.setattr(tc, "_chosen_modes", {})
    modes = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
    spec = harness.make_spec(wl.get_workload("resnet", tiny=True), "fp32",
                             bench_config(compile_modes=modes))
    spec.device = "cuda"  # the search runs on CUDA only; nothing here touches a device
    best, notes = tc._search(spec, "NCHW", lambda: None)
    assert best.mode == "reduce-overhead" and closed == ["default"]
    assert "default 120 µs/step" in notes[-1] and "max-autotune-no-cudagraphs failed" in notes[-1]
    again, notes = tc._search(spec, "NCHW", lambda: None)  # the next precision: one compile
    assert again.mode == "reduce-overhead" and "fastest on this workload" in notes[0]


def test_torch_compile_mode_past_its_budget_is_reported_and_the_others_kept(monkeypatch):
    pytest.importorskip("torch")
    from stepgraph.bench.peers import torch_compile as tc
    closed = []
    monkeypatch.setattr(tc, "_compile", lambda spec, mode, layout: tc._Candidate(
        mode, lambda i: 0.0, lambda: closed.append(mode)))

    def probe(candidate, n, sync, started):
        if candidate.mode == "max-autotune":
            time.sleep(5)  # the mode's deadline interrupts this
        candidate.us, candidate.compile_s = {"default": 20.0}.get(candidate.mode, 10.0), 2.0

    monkeypatch.setattr(tc, "_probe", probe)
    monkeypatch.setattr(tc, "_chosen_modes", {})
    monkeypatch.setattr(tc, "MODE_TIMEOUT_S", 0.2)
    spec = harness.make_spec(wl.get_workload("convnet", tiny=True), "fp32",
                             bench_config(compile_modes=FAIR_COMPILE_MODES))    # --fair's search
    spec.device = "cuda"
    start = time.perf_counter()
    best, notes = tc._search(spec, "NCHW", lambda: None)
    assert time.perf_counter() - start < 3
    assert best.mode == "reduce-overhead" and "max-autotune timed out (over 0.2 s)" in notes[-1]
    assert "max-autotune-no-cudagraphs 10 µs/step (compile 2 s)" in notes[-1]
    assert "compile 2 s; tried" in notes[-1] and "max-autotune" in closed


def test_torch_compile_mode_names_say_compiled_autograd():
    pytest.importorskip("torch")
    from stepgraph.bench.peers import torch_compile as tc
    assert tc._split_mode("reduce-overhead+compiled-autograd") == ("reduce-overhead", True)
    assert tc._split_mode("default") == ("default", False)
    assert tc._describe("default+compiled-autograd") == ('torch.compile(mode="default") '
                                                         "with compiled autograd")


def test_torch_compile_keeps_no_cuda_graph_output_across_steps(monkeypatch):
    """Under CUDA graphs each step opens with cudagraph_mark_step_begin(), which frees what the
    previous step's graphs output. Emulated on the CPU: the optimizer state the step creates
    counts as graph output and turns to NaN at the next mark. SGD makes its momentum buffers
    inside its first step: the runner must copy them out and then train exactly as eager."""
    torch = pytest.importorskip("torch")
    from stepgraph.bench.peers import torch_compile as tc
    from stepgraph.bench.peers import torch_eager as te
    spec = harness.make_spec(wl.get_workload("convnet", tiny=True), "fp32", bench_config())
    assert spec.workload.optimizer.momentum  # SGD with momentum buffers, no dropout
    graph_outputs, marks = [], []

    def mark_step_begin():
        marks.append(len(graph_outputs))
        for tensor in graph_outputs:
            tensor.fill_(float("nan"))
        graph_outputs.clear()

    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", mark_step_begin)
    training = te.build_training(spec, "NCHW")
    step_body = training.step_body(spec.precision, spec.device)

    def state_tensors() -> list:
        return [t for state in training.optimizer.state.values() for t in state.values()
                if isinstance(t, torch.Tensor)]

    def compiled_step(x, y):
        before = {id(t) for t in state_tensors()}
        loss = step_body(x, y)
        graph_outputs.extend(t for t in state_tensors() if id(t) not in before)
        return loss

    batches = te.device_batches(spec)
    run_step = tc._step_runner(compiled_step, training.optimizer, batches, cuda_graphs=True)
    losses = [float(run_step(i % len(batches)).detach()) for i in range(4)]
    eager = te.eager_step(te.build_training(spec, "NCHW"), spec.precision, spec.device)
    expected = [float(eager(*batches[i % len(batches)]).detach()) for i in range(4)]
    buffers = len(list(training.model.parameters()))  # one momentum buffer each, made in step 1
    assert marks == [0, buffers, 0, 0]  # one mark per step
    assert losses == expected


@pytest.mark.parametrize("workload", ["mlp", "cnn"])
def test_torch_compile_with_compiled_autograd_trains_like_eager(workload):
    """The "+compiled-autograd" mode on the CPU: the backward goes through compiled autograd
    (captured once, not per step), the losses are eager's (Inductor's dropout made eager's own
    with fallback_random), and compiled autograd is off again after the steps, for the other
    candidates and peers: a later eager backward is not captured."""
    torch = pytest.importorskip("torch")
    peer_or_skip("torch compile")
    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import counters

    from stepgraph.bench.peers import torch_compile as tc
    from stepgraph.bench.peers import torch_eager as te
    spec = harness.make_spec(wl.get_workload(workload, tiny=True), "fp32", bench_config())
    batches = te.device_batches(spec)
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch._inductor.config.patch(fallback_random=True):
            candidate = tc._compile(spec, "reduce-overhead+compiled-autograd", "NCHW")
            losses = [float(candidate.run_step(i % len(batches)).detach()) for i in range(3)]
    finally:
        torch._dynamo.reset()
    assert counters["compiled_autograd"]["captures"] == 1
    assert not compiled_autograd.compiled_autograd_enabled
    assert not torch._dynamo.config.compiled_autograd and torch._C._is_multithreading_enabled()
    eager = te.eager_step(te.build_training(spec, "NCHW"), spec.precision, spec.device)
    expected = [float(eager(*batches[i % len(batches)]).detach()) for i in range(3)]
    assert counters["compiled_autograd"]["captures"] == 1  # eager's backward was not captured
    np.testing.assert_allclose(losses, expected, rtol=1e-5)


def test_torch_memory_format_is_measured_once_and_shared(monkeypatch):
    pytest.importorskip("torch")
    from stepgraph.bench.peers import torch_eager as te
    monkeypatch.setattr(te, "_chosen_layouts", {})
    trials = {"NCHW": 900.0, "channels_last": 700.0}
    monkeypatch.setattr(te, "_layout_trial", lambda spec, layout: trials[layout])
    spec = harness.make_spec(wl.get_workload("resnet", tiny=True), "tf32", bench_config())
    assert te.layout_for(spec) == "NCHW"  # the CPU: no layout choice
    spec.device = "cuda"
    assert te.layout_for(spec) == "channels_last"  # not measured yet: tf32 wants NHWC
    layout, note = te.choose_layout(spec)
    assert layout == "channels_last" and "NCHW 900 µs" in note
    spec.precision = "fp32"
    assert te.layout_for(spec) == "NCHW"  # fp32 not measured: the strict-fp32 default
    spec.workload = wl.get_workload("mlp", tiny=True)
    assert te.choose_layout(spec) == ("NCHW", "")  # no convs, nothing to choose


# ---------------------------------------------------------------- the peers on the CPU


PEERS = ("stepgraph eager", "torch eager", "jax jit", "tinygrad jit")


@pytest.mark.parametrize("module", ["census", "peers.torch_models", "peers.torch_eager",
                                    "peers.torch_graph", "peers.torch_compile",
                                    "peers.stepgraph_runner", "peers.jax_vision",
                                    "peers.jax_jit", "peers.tinygrad_jit"])
def test_peer_modules_import_without_a_gpu(module):
    needs = {"peers.torch": "torch", "peers.jax": "jax", "peers.tinygrad": "tinygrad"}
    for prefix, library in needs.items():
        if module.startswith(prefix) and not have(library):
            pytest.skip(f"{library} not installed")
    importlib.import_module(f"stepgraph.bench.{module}")


def _curve(peer_name: str, workload: str, steps: int, batches: int = 1) -> list[float]:
    peer = peer_or_skip(peer_name)
    spec = harness.make_spec(wl.get_workload(workload, tiny=True), "fp32",
                             bench_config(batches=batches))
    return harness.loss_curve(peer, spec, steps)


@pytest.mark.parametrize("workload", VISION)
@pytest.mark.parametrize("peer_name", PEERS)
def test_vision_peer_trains_on_cpu(peer_name, workload):
    losses = _curve(peer_name, workload, steps=12)
    assert all(np.isfinite(losses)), losses
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.005, losses


@pytest.mark.parametrize("workload", VISION)
def test_vision_peers_agree_step_by_step(workload):
    """No dropout: same init, data, BatchNorm, label smoothing and Nesterov SGD must give the
    same losses in every library (JAX runs NHWC, the others NCHW)."""
    curves = {name: _curve(name, workload, steps=4, batches=2)
              for name in PEERS if can_run(name)}
    if len(curves) < 2:
        pytest.skip("needs two peers installed")
    reference_name, reference = next(iter(curves.items()))
    for name, losses in curves.items():
        np.testing.assert_allclose(losses, reference, rtol=2e-4,
                                   err_msg=f"{name} vs {reference_name}")


def test_stepgraph_row_counts_its_plan_on_cpu():
    spec = harness.make_spec(wl.get_workload("resnet", tiny=True), "fp32", bench_config())
    row = harness.measure_peer(select_peers(["stepgraph_eager"])[0], spec, bench_config())
    assert row.status == "ok", row.reason
    assert row.kernels_per_step > 20 and row.layout_conversions == 0
    assert "plan" in row.census_source
    assert "shared initial parameters (by state_dict key)" in row.notes
