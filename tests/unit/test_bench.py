"""`stepgraph bench` without a GPU: harness arithmetic, table, missing/failed/n-a rows, the
no-GPU exit, and every installed peer's step function trained for a few steps on the CPU at
tiny sizes (each peer's test is skipped when its library is missing)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from stepgraph.bench import harness
from stepgraph.bench import workloads as wl
from stepgraph.bench.peers import PeerInfo, PreparedStep, Unsupported, select_peers
from tests.unit.bench_support import bench_config, can_run, have, peer_or_skip


def _result(peer: str, step_us: float | None, status: str = "ok", stepgraph: bool = False,
            workload: str = "mlp") -> harness.PeerResult:
    return harness.PeerResult(workload, "fp32", peer, status, is_stepgraph=stepgraph,
                              step_us=step_us)


# ---------------------------------------------------------------- workloads and arithmetic


def test_workloads_match_benchmarks_md():
    mlp, cnn, big = (wl.get_workload(n) for n in ("mlp", "cnn", "big"))
    assert (mlp.batch, cnn.batch, big.batch) == (128, 64, 4096)
    assert wl.parameter_count(mlp) == 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    assert wl.parameter_count(cnn) == 10 * 25 + 10 + 20 * 10 * 25 + 20 + 320 * 50 + 50 + 510
    assert mlp.optimizer == wl.OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01)
    assert cnn.optimizer.kind == "sgd" and cnn.optimizer.momentum == 0.5
    assert cnn.loss == "nll_loss" and big.loss == "cross_entropy"


def test_flops_count_six_n_k_m_per_gemm():
    big = wl.get_workload("big")
    expected = 6 * 4096 * (4 * 4096 * 4096 + 4096 * 10)
    assert wl.flops_per_step(big) == expected
    mlp = wl.get_workload("mlp")
    assert wl.flops_per_step(mlp) == 6 * 128 * (784 * 512 + 512 * 512 + 512 * 10)
    cnn = wl.get_workload("cnn")
    assert wl.conv_output_sizes(cnn) == [(24, 24), (8, 8)]
    conv = 6 * 64 * (24 * 24 * 10 * 25 + 8 * 8 * 20 * 250)
    assert wl.flops_per_step(cnn) == conv + 6 * 64 * (320 * 50 + 50 * 10)


def test_initial_parameters_follow_pytorch_default_bounds():
    params = wl.initial_parameters(wl.get_workload("mlp"), seed=0)
    assert [p.weight.shape for p in params] == [(512, 784), (512, 512), (10, 512)]
    for p in params:
        bound = 1 / np.sqrt(p.weight.shape[1])
        assert p.weight.dtype == np.float32 and np.abs(p.weight).max() <= bound
        assert np.abs(p.bias).max() <= bound
    again = wl.initial_parameters(wl.get_workload("mlp"), seed=0)
    assert np.array_equal(params[0].weight, again[0].weight)


def test_batches_are_shared_and_well_formed():
    cnn = wl.get_workload("cnn")
    batches = wl.make_batches(cnn, 3, seed=0)
    assert len(batches) == 3 and batches[0].x.shape == (64, 1, 28, 28)
    assert batches[0].y.dtype == np.int32 and batches[0].y.max() < 10
    assert np.array_equal(batches[1].x, wl.make_batches(cnn, 3, seed=0)[1].x)


def test_steps_per_repeat_targets_the_run_length():
    config = harness.BenchConfig(target_seconds=0.3, max_steps_per_repeat=20000)
    assert harness.steps_per_repeat(100e-6, config) == 3000
    assert harness.steps_per_repeat(1.0, config) == 3  # never fewer than 3
    assert harness.steps_per_repeat(1e-9, config) == 20000


def test_median_spread_and_tflops():
    result = harness.PeerResult("big", "fp32", "x", "ok")
    timing = harness.Timing([110.0, 100.0, 90.0, 105.0, 95.0], 10, 1.5)
    harness._record_timing(result, timing, wl.get_workload("big"))
    assert result.step_us == 100.0 and result.step_us_min == 90.0
    assert result.spread_percent == pytest.approx(10.0)
    flops = wl.flops_per_step(wl.get_workload("big"))
    assert result.tflops == pytest.approx(flops / 100e-6 / 1e12)


def test_speed_vs_best_peer_uses_fastest_non_stepgraph_row():
    rows = [_result("stepgraph graph", 50.0, stepgraph=True), _result("torch eager", 400.0),
            _result("jax jit", 200.0), _result("tinygrad jit", None, status="missing")]
    harness.fill_speed_vs_best_peer(rows)
    assert rows[0].speed_vs_best_peer == pytest.approx(4.0)
    assert rows[1].speed_vs_best_peer == pytest.approx(0.5)
    assert rows[2].speed_vs_best_peer == pytest.approx(1.0)
    assert rows[3].speed_vs_best_peer is None


def test_timing_loop_syncs_once_per_repeat():
    calls = {"steps": 0, "syncs": 0}

    def run_step(i):
        calls["steps"] += 1
        return float(i)

    def synchronize():
        calls["syncs"] += 1

    prepared = PreparedStep(run_step, synchronize, float)
    timing = harness.time_repeats(prepared, n_batches=3, steps=7, repeats=4)
    assert calls == {"steps": 28, "syncs": 8}  # one before and one after each timed run
    assert len(timing.repeats_us) == 4 and timing.final_loss == 0.0  # 6 % 3: last batch 0


# ---------------------------------------------------------------- rows that are not measured


def test_missing_failed_and_unsupported_peers_are_reported(monkeypatch):
    spec = harness.make_spec(wl.get_workload("mlp", tiny=True), "fp32", bench_config())
    ghost = PeerInfo("ghost", "no_such_peer_module", "prepare", "ghost")
    missing = harness.measure_peer(ghost, spec, bench_config())
    assert missing.status == "missing" and "no_such_peer_module" in missing.reason

    def explode(spec):
        raise RuntimeError("kernel launch failed\nmore detail")

    def decline(spec):
        raise Unsupported("no bf16 here")

    monkeypatch.setattr(harness, "_load_prepare", lambda peer: explode)
    failed = harness.measure_peer(ghost, spec, bench_config())
    assert failed.status == "failed" and failed.reason == "RuntimeError: kernel launch failed"
    assert "Traceback" in failed.traceback
    monkeypatch.setattr(harness, "_load_prepare", lambda peer: decline)
    unsupported = harness.measure_peer(ghost, spec, bench_config())
    assert (unsupported.status, unsupported.reason) == ("n/a", "no bf16 here")


def test_fake_peer_is_measured_and_closed(monkeypatch):
    closed = []

    def prepare(spec):
        return PreparedStep(lambda i: 2.0 - i, lambda: None, float, close=lambda: closed.append(1))

    monkeypatch.setattr(harness, "_load_prepare", lambda peer: prepare)
    spec = harness.make_spec(wl.get_workload("mlp", tiny=True), "fp32", bench_config())
    result = harness.measure_peer(PeerInfo("fake", "x", "prepare", "x"), spec, bench_config())
    assert result.status == "ok" and result.step_us > 0 and result.setup_s >= 0
    assert result.steps_per_repeat >= 3 and len(result.repeats_us) == 2
    assert closed == [1]


def test_table_shows_every_row_with_its_reason():
    rows = [_result("stepgraph graph", 40.0, stepgraph=True), _result("jax jit", 176.0),
            harness.PeerResult("mlp", "fp32", "tinygrad jit", "missing",
                               reason="ModuleNotFoundError: No module named 'tinygrad'"),
            harness.PeerResult("mlp", "fp32", "torch graph", "failed",
                               reason="RuntimeError: " + "x" * 200)]
    harness.fill_speed_vs_best_peer(rows)
    report = harness.BenchReport("2026-01-01", "Fake GPU", "host", "3.12", {}, bench_config(),
                                 {}, rows)
    lines = harness.render_table(report).splitlines()
    assert "Fake GPU" in lines[0]
    body = "\n".join(lines)
    assert "4.40x" in body and "1.00x" in body
    assert "No module named 'tinygrad'" in body and "missing" in body
    assert "failed" in body and "..." in body  # long reasons are cut in the table
    assert max(len(line) for line in lines[2:-1]) <= max(len(lines[2]), 200)


def test_select_peers_aliases_and_errors():
    assert [p.name for p in select_peers(["torch"])] == ["torch eager", "torch graph",
                                                          "torch compile"]
    assert [p.name for p in select_peers(["jax", "stepgraph_graph"])] == ["stepgraph graph",
                                                                           "jax jit"]
    with pytest.raises(ValueError, match="unknown peer"):
        select_peers(["mxnet"])


def test_the_unguarded_row_is_asked_for_by_name():
    """The guard's cost row runs only when named: a default run's rows are the public ones."""
    assert "stepgraph unguarded" not in [p.name for p in select_peers(None)]
    (row,) = select_peers(["stepgraph_unguarded"])
    assert row.is_stepgraph and row.name == "stepgraph unguarded"
    from stepgraph.bench.peers import stepgraph_runner

    with pytest.raises(Unsupported, match="cuda"):
        stepgraph_runner.prepare_graph_unguarded(type("Spec", (), {"device": "cpu"})())


# ---------------------------------------------------------------- command line


def test_main_without_gpu_says_it_needs_one(monkeypatch, capsys):
    monkeypatch.setattr(harness, "cuda_device_name", lambda: None)
    code = harness.main(["--workloads", "mlp"])
    assert code != 0
    assert "needs an NVIDIA GPU" in capsys.readouterr().err
    # The CLI (`python -m stepgraph.bench`) turns that into the process's exit status.


def test_require_device_raises_instead_of_exiting(monkeypatch):
    monkeypatch.setattr(harness, "cuda_device_name", lambda: None)
    with pytest.raises(harness.NoGpuError):
        harness.run_benchmark(harness.BenchConfig(workloads=["mlp"]))


def test_main_rejects_bad_arguments(capsys):
    assert harness.main(["--workloads", "vit"]) == 2
    assert "unknown workload" in capsys.readouterr().err
    assert harness.main(["--precision", "fp8"]) == 2


def test_main_on_cpu_writes_json_chart_and_prints_table_last(monkeypatch, tmp_path, capsys):
    def prepare(spec):
        return PreparedStep(lambda i: 1.0, lambda: None, float)

    monkeypatch.setattr(harness, "_load_prepare",
                        lambda peer: prepare if peer.name == "jax jit" else _raise_import)
    code = harness.main(["--device", "cpu", "--tiny", "--workloads", "mlp", "--repeats", "2",
                         "--target-seconds", "0.01", "--peers", "jax,tinygrad",
                         "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[-1].startswith("memory:") and any("jax jit" in line for line in out)
    data = json.loads((tmp_path / "bench_mlp_fp32.json").read_text())
    assert data["device"].startswith("CPU") and "versions" in data
    assert {r["peer"]: r["status"] for r in data["results"]} == {"jax jit": "ok",
                                                               "tinygrad jit": "missing"}
    assert data["workloads"]["mlp"]["flops_per_step"] > 0
    assert (tmp_path / "bench_mlp_fp32.png").stat().st_size > 1000


def _raise_import(spec):
    raise ImportError("No module named 'tinygrad'")


def test_the_step_floor_takes_gemm_time_at_the_peak_or_optimizer_bytes_at_the_bandwidth():
    from stepgraph.bench import floor

    big = wl.get_workload("big")                                  # AdamW
    params = wl.parameter_count(big)
    assert floor.optimizer_bytes(big, "fp32") == params * 28      # p g m v read, p m v written
    assert floor.optimizer_bytes(big, "bf16") == params * 30      # + the bf16 weight copy
    resnet = wl.get_workload("resnet")                            # SGD with momentum
    assert resnet.optimizer.kind == "sgd" and resnet.optimizer.momentum
    assert floor.optimizer_bytes(resnet, "fp32") == wl.parameter_count(resnet) * 20
    f = floor.step_floor(big, "big", "tf32", peak_tflops=500.0, bandwidth_gbs=2000.0)
    assert f.gemm_flops == floor.needed_flops(big)
    assert f.gemm_us == pytest.approx(f.gemm_flops / 500e12 * 1e6)
    assert f.optimizer_us == pytest.approx(params * 28 / 2000e9 * 1e6)
    assert f.floor_us == pytest.approx(max(f.gemm_us, f.optimizer_us))


def test_main_with_floor_reports_each_row_against_it(monkeypatch, tmp_path, capsys):
    """--floor: the floors (device measurements faked here) go into the JSON and a table
    printed before the main one, each row as a multiple of its floor."""
    from stepgraph.bench import floor

    def prepare(spec):
        return PreparedStep(lambda i: 1.0, lambda: None, float)

    monkeypatch.setattr(harness, "_load_prepare", lambda peer: prepare)
    monkeypatch.setattr(harness, "measure_floors", lambda names, precisions, tiny: [
        floor.step_floor(wl.get_workload(n, tiny), n, p, 100.0, 1000.0)
        for p in precisions for n in names])
    monkeypatch.setattr(harness, "require_device", lambda config: "Fake GPU")
    monkeypatch.setattr(harness, "restore_primary_context", lambda: None)
    cuda_config = harness.parse_config
    monkeypatch.setattr(harness, "parse_config", lambda argv: dataclasses.replace(
        cuda_config(argv), device="cuda"))                # the peers themselves run on the CPU
    code = harness.main(["--device", "cpu", "--tiny", "--workloads", "mlp", "--repeats", "2",
                         "--target-seconds", "0.01", "--peers", "jax", "--floor",
                         "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "step floor" in out and out.index("step floor") < out.index("memory:")
    (row,) = json.loads((tmp_path / "bench_mlp_fp32.json").read_text())["floors"]
    assert row["workload"] == "mlp" and row["peak_tflops"] == 100.0
    assert row["floor_us"] == pytest.approx(max(row["gemm_us"], row["optimizer_us"]))
    assert "jax jit" in out[out.index("step floor"):out.index("memory:")]


# ---------------------------------------------------------------- the real peers on the CPU


def _curve(peer: PeerInfo, workload: str, steps: int = 20, precision: str = "fp32"):
    config = bench_config(batches=1)  # one batch: the loss must fall as the net fits it
    spec = harness.make_spec(wl.get_workload(workload, tiny=True), precision, config)
    return harness.loss_curve(peer, spec, steps)


def _assert_trains(losses: list[float]) -> None:
    assert all(np.isfinite(losses)), losses
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.02, losses


@pytest.mark.parametrize("workload", ["mlp", "cnn", "big"])
@pytest.mark.parametrize("peer_name", ["stepgraph eager", "torch eager", "jax jit",
                                       "tinygrad jit"])
def test_peer_trains_on_cpu(peer_name, workload):
    _assert_trains(_curve(peer_or_skip(peer_name), workload))


def test_torch_compile_trains_on_cpu():
    _assert_trains(_curve(peer_or_skip("torch compile"), "mlp"))


@pytest.mark.parametrize("peer_name", ["torch eager", "jax jit", "tinygrad jit"])
def test_peer_trains_in_bf16_on_cpu(peer_name, monkeypatch):
    peer = peer_or_skip(peer_name)
    if peer_name == "tinygrad jit":
        # Older clang (Debian's 14) has no __bf16 on x86: let tinygrad emulate it on the CPU.
        from tinygrad.helpers import EMULATED_DTYPES
        monkeypatch.setattr(EMULATED_DTYPES, "value", "bfloat16")
    _assert_trains(_curve(peer, "big", precision="bf16"))


def test_peers_agree_step_by_step_without_dropout():
    """`big` has no dropout: same init, data and optimizer must give the same losses."""
    curves = {}
    for name in ["torch eager", "jax jit", "tinygrad jit", "stepgraph eager"]:
        if can_run(name):
            curves[name] = _curve(select_peers([name])[0], "big", steps=6)
    if len(curves) < 2:
        pytest.skip("needs two peers installed")
    reference_name, reference = next(iter(curves.items()))
    for name, losses in curves.items():
        np.testing.assert_allclose(losses, reference, rtol=1e-4,
                                   err_msg=f"{name} vs {reference_name}")


def test_graph_peers_say_na_on_cpu():
    spec = harness.make_spec(wl.get_workload("mlp", tiny=True), "fp32", bench_config())
    sg_graph = harness.measure_peer(select_peers(["stepgraph_graph"])[0], spec, bench_config())
    assert sg_graph.status in ("n/a", "missing")
    if have("torch"):
        torch_graph = harness.measure_peer(select_peers(["torch_graph"])[0], spec, bench_config())
        assert (torch_graph.status, torch_graph.reason) == ("n/a",
                                                            "CUDA graphs need a CUDA device")


def test_stepgraph_runs_bf16_and_says_na_for_ops_without_bf16_kernels(monkeypatch):
    """bf16 rows run (on the CPU, the NumPy emulation); a plan the backend refuses for
    missing bf16 kernels is an n/a row naming them, not a failure."""
    import stepgraph.api
    from stepgraph.errors import UnsupportedPrecisionError

    spec = harness.make_spec(wl.get_workload("mlp", tiny=True), "bf16", bench_config())
    peer = select_peers(["stepgraph_eager"])[0]
    assert harness.measure_peer(peer, spec, bench_config()).status == "ok"

    def refuse(graph, ops, device):
        raise UnsupportedPrecisionError("bf16 on cuda: no bf16 kernels for op(s) layer_norm\n"
                                        "details")
    monkeypatch.setattr(stepgraph.api, "check_bf16_support", refuse)
    result = harness.measure_peer(peer, spec, bench_config())
    assert result.status == "n/a" and "layer_norm" in result.reason
