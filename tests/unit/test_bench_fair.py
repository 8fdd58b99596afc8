"""What makes the benchmark's comparison fair, checked on the CPU without running a GPU: the
torch.compile modes searched and their budgets, the torch rows' optimizer and cuDNN settings,
JAX's PRNG, tinygrad's BEAM search, the labels of rows whose arithmetic is not their precision's,
and the step floor's arithmetic on small workloads with FLOPs counted by hand."""
from __future__ import annotations

import importlib
import signal
import sys
import time
from unittest import mock

import pytest

from stepgraph.bench import floor, harness
from stepgraph.bench import workloads as wl
from stepgraph.bench.peers import (
    COMPILE_MODE_TIMEOUT_S,
    COMPILE_MODES,
    DEFAULT_COMPILE_MODES,
    FAIR_COMPILE_MODES,
    PeerTimeout,
    deadline,
    stepgraph_runner,
)
from tests.unit.bench_support import bench_config

# ---------------------------------------------------------------- torch.compile's search


def test_the_fair_compile_search_includes_the_autotuning_modes():
    assert {"max-autotune", "max-autotune-no-cudagraphs"} <= set(FAIR_COMPILE_MODES)
    assert {"reduce-overhead", "default"} <= set(FAIR_COMPILE_MODES)
    assert set(FAIR_COMPILE_MODES) <= set(COMPILE_MODES)
    config = harness.parse_config(["--fair"])
    assert config.fair and config.compile_modes == FAIR_COMPILE_MODES


def test_a_default_run_compiles_one_mode_without_autotuning():
    config = harness.parse_config([])
    assert not config.fair and config.compile_modes == DEFAULT_COMPILE_MODES
    assert DEFAULT_COMPILE_MODES == ("reduce-overhead",)


def test_peer_timeout_leaves_every_fair_compile_mode_its_own_budget():
    config = harness.parse_config(["--fair"])
    assert COMPILE_MODE_TIMEOUT_S == 600.0
    assert config.peer_timeout_s == 3600.0  # five modes of 600 s, then the timing
    assert config.peer_timeout_s > len(FAIR_COMPILE_MODES) * COMPILE_MODE_TIMEOUT_S
    # a default run bounds each peer to a few minutes: one compile, no search
    assert harness.parse_config([]).peer_timeout_s == 180.0
    assert harness.parse_config(["--peer-timeout", "60"]).peer_timeout_s == 60.0
    assert harness.parse_config(["--fair", "--peer-timeout", "60"]).peer_timeout_s == 60.0


def test_an_inner_deadline_raises_its_own_error_and_rearms_the_outer_one():
    if not hasattr(signal, "setitimer"):
        pytest.skip("no interval timers on this platform")

    class Inner(PeerTimeout):
        pass

    with pytest.raises(PeerTimeout, match=r"0.4 s \(outer\)") as outer:
        with deadline(0.4, "outer"):
            with pytest.raises(Inner, match=r"0.1 s \(inner\)"):
                with deadline(0.1, "inner", Inner):
                    time.sleep(2)
            left, _ = signal.getitimer(signal.ITIMER_REAL)
            assert 0 < left < 0.4  # the outer deadline runs on, less the time spent inside
            time.sleep(2)
    assert type(outer.value) is PeerTimeout
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_an_inner_deadline_never_extends_an_outer_one():
    if not hasattr(signal, "setitimer"):
        pytest.skip("no interval timers on this platform")
    start = time.perf_counter()
    with pytest.raises(PeerTimeout, match=r"\(outer\)"):
        with deadline(0.2, "outer"):
            with deadline(30, "inner"):
                time.sleep(2)
    assert time.perf_counter() - start < 1


# ---------------------------------------------------------------- PyTorch rows


def test_torch_graph_captures_the_fused_capturable_optimizer():
    pytest.importorskip("torch")
    from stepgraph.bench.peers import torch_graph
    from stepgraph.bench.peers.torch_eager import build_training
    assert torch_graph.OPTIMIZER_IMPLEMENTATION == {"fused": True, "capturable": True}
    for name, kind in (("mlp", "adamw"), ("cnn", "sgd")):
        spec = harness.make_spec(wl.get_workload(name, tiny=True), "fp32", bench_config())
        training = build_training(spec, "NCHW", **torch_graph.OPTIMIZER_IMPLEMENTATION)
        assert spec.workload.optimizer.kind == kind
        for group in training.optimizer.param_groups:
            assert group["fused"] is True and group["foreach"] in (None, False)
            if kind == "adamw":  # SGD keeps no step counter and takes no capturable flag
                assert group["capturable"] is True


def test_torch_rows_time_every_cudnn_algorithm():
    torch = pytest.importorskip("torch")
    from stepgraph.bench.peers import torch_eager
    before = (torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit)
    try:
        torch.backends.cudnn.benchmark_limit = 10  # PyTorch's default
        notes = torch_eager.set_precision("fp32")
        assert torch.backends.cudnn.benchmark is True
        assert torch.backends.cudnn.benchmark_limit == 0
        assert "cudnn.benchmark_limit=0 (every algorithm timed)" in notes
        assert torch.backends.cuda.matmul.allow_tf32 is False  # fp32 rows: strict float32
        assert torch.backends.cudnn.allow_tf32 is False
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.benchmark_limit = before


# ---------------------------------------------------------------- JAX and tinygrad


@pytest.fixture
def fake_jax(monkeypatch):
    """jax and optax replaced by mocks, so jax_jit imports without them; every module the
    import touches is put back afterwards."""
    fake = mock.MagicMock(name="jax")
    peers = sys.modules["stepgraph.bench.peers"]
    names = [f"stepgraph.bench.peers.{m}" for m in ("jax_jit", "jax_gpt", "jax_vision")]
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
        monkeypatch.delattr(peers, name.rsplit(".", 1)[1], raising=False)
    fakes = {"jax": fake, "jax.numpy": fake.numpy, "jax.lax": fake.lax,
             "optax": mock.MagicMock(name="optax")}
    for name, module in fakes.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # set by jax_jit's import
    yield fake
    for name in names:  # imported against the mocks: not to be found by later tests
        sys.modules.pop(name, None)
        if hasattr(peers, name.rsplit(".", 1)[1]):
            delattr(peers, name.rsplit(".", 1)[1])


def test_jax_dropout_keys_come_from_the_rbg_prng(fake_jax):
    jax_jit = importlib.import_module("stepgraph.bench.peers.jax_jit")
    options = jax_jit.configure("fp32")
    assert options == {"jax_default_matmul_precision": "highest",
                       "jax_default_prng_impl": "rbg"}
    assert mock.call("jax_default_prng_impl", "rbg") in fake_jax.config.update.call_args_list
    assert mock.call("jax_default_matmul_precision", "highest") \
        in fake_jax.config.update.call_args_list
    assert jax_jit.configure("tf32")["jax_default_matmul_precision"] == "tensorfloat32"


def test_tinygrad_kernels_are_searched_with_beam_in_a_fair_run():
    from stepgraph.bench.peers import FAIR_TINYGRAD_BEAM, tinygrad_jit
    assert FAIR_TINYGRAD_BEAM == 2
    config = harness.parse_config(["--fair"])
    spec = harness.make_spec(wl.get_workload("mlp", tiny=True), "fp32", config)
    assert tinygrad_jit.kernel_settings(spec) == {"ALLOW_TF32": 0, "BEAM": 2}
    config = harness.parse_config([])          # a default run: no search
    spec = harness.make_spec(wl.get_workload("mlp", tiny=True), "fp32", config)
    assert tinygrad_jit.kernel_settings(spec) == {"ALLOW_TF32": 0, "BEAM": 0}
    config = harness.parse_config(["--fair", "--tinygrad-beam", "0", "--precision", "tf32"])
    spec = harness.make_spec(wl.get_workload("mlp", tiny=True), "tf32", config)
    assert tinygrad_jit.kernel_settings(spec) == {"ALLOW_TF32": 1, "BEAM": 0}
    with pytest.raises(ValueError, match="--tinygrad-beam"):
        harness.parse_config(["--tinygrad-beam", "-1"])


# ---------------------------------------------------------------- labels


def test_stepgraph_fp32_attention_rows_are_labelled_3xtf32():
    label = stepgraph_runner.precision_label
    assert label("fp32", "cuda", {"matmul", "sdpa_qkv", "sdpa_qkv_grad"}) \
        == "fp32 (3xTF32 attention)"
    assert label("fp32", "cuda", {"matmul", "conv2d"}) == ""   # strict float32 GEMMs only
    assert label("tf32", "cuda", {"sdpa"}) == ""                # TF32 is what tf32 names
    assert label("fp32", "cpu", {"sdpa"}) == ""                 # NumPy: float32 arithmetic
    row = harness.PeerResult("gpt", "fp32", "stepgraph graph", "ok", is_stepgraph=True,
                             step_us=10.0, precision_label="fp32 (3xTF32 attention)")
    report = harness.BenchReport("2026-11-28", "H100", "host", "3.11", {}, bench_config(),
                                 {}, [row])
    table = harness.render_table(report)
    assert "gpt       fp32 (3xTF32 attention)  stepgraph graph" in table


# ---------------------------------------------------------------- the floor


def test_needed_flops_leave_out_the_data_gradient():
    mlp = wl.get_workload("mlp")                               # 784 -> 512 -> 512 -> 10, batch 128
    first = 2 * 2 * 128 * 784 * 512                            # forward + weight gradient
    rest = 3 * 2 * 128 * (512 * 512 + 512 * 10)                # + input gradient
    assert floor.needed_flops(mlp) == first + rest == 410_779_648
    assert floor.needed_flops(mlp) == wl.flops_per_step(mlp) - 2 * 128 * 784 * 512
    cnn = wl.get_workload("cnn")                               # convs over 24x24 and 8x8 pixels
    conv1 = 2 * 2 * 64 * 24 * 24 * 10 * 25
    rest = 3 * 2 * 64 * (8 * 8 * 20 * 250 + 320 * 50 + 50 * 10)
    assert floor.needed_flops(cnn) == conv1 + rest


def test_needed_flops_count_causal_attention_once():
    gpt = wl.get_workload("gpt", tiny=True)    # vocab 11, T 8, 1 layer, C 16, batch 4
    # c_attn 16->48, c_proj 16->16, c_fc 16->64, mlp c_proj 64->16, tied lm_head 16->11, each
    # over 8 tokens; all three passes (the first Linear reads ln_1, not the data)
    linears = 3 * 2 * 4 * 8 * (16 * 48 + 16 * 16 + 16 * 64 + 64 * 16 + 16 * 11)
    attention = 12 * 1 * 4 * 36 * 16           # 8 * 9 / 2 = 36 unmasked (query, key) pairs
    assert floor.needed_flops(gpt) == linears + attention == 651_264
    assert wl.flops_per_step(gpt) - floor.needed_flops(gpt) == 12 * 4 * (64 - 36) * 16


def test_the_floor_is_the_slower_of_gemms_and_update():
    mlp = wl.get_workload("mlp")
    params = wl.parameter_count(mlp)                           # 669,706, AdamW: 28 bytes each
    gemm_bound = floor.step_floor(mlp, "mlp", "fp32", peak_tflops=50.0, bandwidth_gbs=3000.0)
    assert gemm_bound.gemm_us == pytest.approx(410_779_648 / 50e12 * 1e6)        # 8.22 µs
    assert gemm_bound.optimizer_us == pytest.approx(params * 28 / 3000e9 * 1e6)  # 6.25 µs
    assert gemm_bound.floor_us == pytest.approx(gemm_bound.gemm_us)
    memory_bound = floor.step_floor(mlp, "mlp", "fp32", peak_tflops=500.0, bandwidth_gbs=1000.0)
    assert memory_bound.floor_us == pytest.approx(params * 28 / 1000e9 * 1e6)    # 18.75 µs
    assert memory_bound.floor_us > memory_bound.gemm_us


def test_the_gemm_peak_is_the_best_library_measured():
    peak, source = floor.best_peak({"cuBLASLt (stepgraph)": 48.5, "cuBLAS (torch.matmul)": 51.2})
    assert peak == 51.2
    assert source == "cuBLASLt (stepgraph) 48.5, cuBLAS (torch.matmul) 51.2"


def test_measure_floors_takes_the_faster_library(monkeypatch):
    monkeypatch.setattr(floor, "measure_bandwidth_gbs", lambda: 2000.0)
    monkeypatch.setattr(floor, "measure_peaks", lambda precision: {
        "cuBLASLt (stepgraph)": {"fp32": 50.0, "tf32": 400.0}[precision],
        "cuBLAS (torch.matmul)": {"fp32": 52.0, "tf32": 380.0}[precision]})
    fp32, tf32 = floor.measure_floors(["mlp"], ["fp32", "tf32"])
    assert (fp32.peak_tflops, tf32.peak_tflops) == (52.0, 400.0)
    text = floor.render_floors([fp32, tf32], [])
    assert "GEMM peak at fp32, TFLOP/s: cuBLASLt (stepgraph) 50.0, cuBLAS (torch.matmul) 52.0" \
        in text


# ---------------------------------------------------------------- on a GPU


@pytest.mark.cuda
def test_both_gemm_libraries_are_measured_and_tf32_beats_fp32():
    pytest.importorskip("torch")
    fp32, tf32 = floor.measure_peaks("fp32"), floor.measure_peaks("tf32")
    assert set(fp32) == set(tf32) == {"cuBLASLt (stepgraph)", "cuBLAS (torch.matmul)"}
    for name in fp32:
        assert 1.0 < fp32[name] < tf32[name]  # strict float32 runs without tensor cores


def test_loss_curve_warmup_trains_the_first_batch_before_the_curve():
    from stepgraph.bench.peers import select_peers
    spec = harness.make_spec(wl.get_workload("mlp", tiny=True), "fp32",
                             bench_config(batches=1))  # every step on batch 0
    (peer,) = select_peers(["stepgraph_eager"])
    curve = harness.loss_curve(peer, spec, 3)
    assert harness.loss_curve(peer, spec, 1, warmup=2) == curve[2:]
    assert curve[2] != curve[0]


@pytest.mark.cuda
def test_torch_graph_with_the_fused_optimizer_trains_as_eager():
    """The graph peer trains WARMUP_STEPS side-stream steps on the first batch before its
    capture (as PyTorch's CUDA Graphs docs do), so its curve starts after them: eager takes
    the same warm-up, and then both run the same steps from the same state."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    from stepgraph.bench.peers import select_peers, torch_graph
    spec = harness.make_spec(wl.get_workload("big", tiny=True), "fp32",
                             bench_config(device="cuda"))  # no dropout: same losses
    eager, graph = select_peers(["torch_eager", "torch_graph"])
    expected = harness.loss_curve(eager, spec, 4, warmup=torch_graph.WARMUP_STEPS)
    got = harness.loss_curve(graph, spec, 4)
    assert got == pytest.approx(expected, rel=1e-5)
    assert got[2] < got[0]  # the same batch, two steps later


@pytest.mark.cuda
def test_stepgraph_gpt_fp32_row_carries_the_3xtf32_label():
    spec = harness.make_spec(wl.get_workload("gpt", tiny=True), "fp32",
                             bench_config(device="cuda"))
    prepared = stepgraph_runner.prepare_graph(spec)
    try:
        assert prepared.precision_label == "fp32 (3xTF32 attention)"
    finally:
        prepared.close()
