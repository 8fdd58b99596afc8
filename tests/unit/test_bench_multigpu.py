"""`stepgraph bench --gpus N` without GPUs: argument handling, world sizes, the launches a run
plans, their commands, scaling, exposed communication, the bucket sweep's choice, the table
and the JSON (the measurements themselves: test_bench_multigpu_ranks.py on CPU processes,
tests/cuda/test_bench_gpus_cuda.py on GPUs)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from stepgraph.bench import multigpu, multigpu_rank
from stepgraph.bench.multigpu import BucketChoice, Measurement, MultiGpuConfig, ScalingRow
from stepgraph.cli import main as cli_main


def test_arguments_give_the_configuration():
    config = multigpu.parse_config(["--gpus", "4", "--models", "gpt", "--frameworks",
                                    "torch-ddp,stepgraph", "--steps", "7", "--warmup", "2"])
    assert config == MultiGpuConfig(4, ("gpt",), ("torch-ddp", "stepgraph"), 7, 2)
    assert multigpu.parse_config(["--gpus=2"]) == MultiGpuConfig(2)
    assert MultiGpuConfig(2).frameworks == ("stepgraph", "torch-ddp", "torch-ddp-compile")
    config = multigpu.parse_config(["--gpus", "2", "--precision", "bf16,fp32", "--no-comm",
                                    "--bucket-caps", "100,5", "--compile-mode",
                                    "reduce-overhead", "--out", "o"])
    assert (config.precisions, config.no_comm, config.bucket_caps, config.compile_mode,
            config.out) == (("bf16", "fp32"), True, (5.0, 100.0), "reduce-overhead", "o")


def test_bucket_caps_without_a_list_is_the_documented_sweep():
    assert multigpu.parse_config(["--gpus", "2", "--bucket-caps"]).bucket_caps == \
        (1.0, 5.0, 25.0, 100.0)
    assert multigpu.parse_config(["--gpus", "2", "--bucket-caps", "--no-comm"]).no_comm


def test_caps_below_one_mib_are_for_frameworks_other_than_compiled_ddp():
    config = multigpu.parse_config(["--gpus", "2", "--bucket-caps", "0.25,1",
                                    "--frameworks", "stepgraph,torch-ddp"])
    assert config.bucket_caps == (0.25, 1.0)


@pytest.mark.parametrize("argv", [["--gpus", "0"], ["--gpus", "2", "--models", "mlp"],
                                  ["--gpus", "2", "--frameworks", "jax"], [],
                                  ["--gpus", "2", "--steps", "0"],
                                  ["--gpus", "2", "--precision", "fp8"],
                                  ["--gpus", "2", "--bucket-caps", "5,x"],
                                  ["--gpus", "2", "--bucket-caps", "0,5"],
                                  ["--gpus", "2", "--bucket-caps", "0.5,5"],
                                  ["--gpus", "1", "--no-comm"],
                                  ["--gpus", "1", "--bucket-caps", "5"],
                                  ["--gpus", "2", "--compile-mode", "fast"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    assert multigpu.main(argv) == 2
    assert "usage: stepgraph bench --gpus N" in capsys.readouterr().err


def test_help_names_every_option(capsys):
    assert multigpu.main(["--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--gpus", "--models", "--frameworks", "--precision", "--steps", "--warmup",
                   "--no-comm", "--bucket-caps", "--compile-mode", "--timeout", "--out",
                   "torch-ddp-compile"):
        assert option in out
    assert "--tiny" not in out and "--device" not in out        # smoke tests only


def test_the_cli_hands_gpus_to_the_multigpu_bench(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(multigpu, "run", lambda config: seen.append(config) or [])
    assert cli_main(["bench", "--gpus", "3", "--models", "resnet", "--out", str(tmp_path)]) == 0
    assert seen == [MultiGpuConfig(3, ("resnet",), out=str(tmp_path))]
    assert (tmp_path / "bench_gpus3_resnet_fp32_stepgraph-torch-ddp-torch-ddp-compile.json"
            ).exists()


@pytest.mark.parametrize("gpus,sizes", [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]),
                                        (8, [1, 2, 4, 8])])
def test_world_sizes_double_up_to_the_gpus(gpus, sizes):
    assert multigpu.world_sizes(gpus) == sizes


def test_the_plan_adds_no_op_runs_and_the_sweep_at_the_largest_world_size():
    config = MultiGpuConfig(4, ("gpt",), ("stepgraph",), precisions=("fp32", "bf16"),
                            no_comm=True, bucket_caps=(1.0, 25.0, 100.0))
    runs = multigpu.plan(config)
    fp32 = [r for r in runs if r.precision == "fp32"]
    assert fp32 == [Measurement("stepgraph", "gpt", "fp32", 1),
                    Measurement("stepgraph", "gpt", "fp32", 2),
                    Measurement("stepgraph", "gpt", "fp32", 4),
                    Measurement("stepgraph", "gpt", "fp32", 2, collectives=False),
                    Measurement("stepgraph", "gpt", "fp32", 4, collectives=False),
                    Measurement("stepgraph", "gpt", "fp32", 4, bucket_cap_mb=1.0),
                    Measurement("stepgraph", "gpt", "fp32", 4, bucket_cap_mb=100.0)]
    assert [r for r in runs if r.precision == "bf16"] == \
        [Measurement(r.framework, r.model, "bf16", r.gpus, r.bucket_cap_mb, r.collectives)
         for r in fp32]
    plain = multigpu.plan(MultiGpuConfig(2, ("resnet",)))
    assert [(r.framework, r.gpus) for r in plain] == [
        ("stepgraph", 1), ("stepgraph", 2), ("torch-ddp", 1), ("torch-ddp", 2),
        ("torch-ddp-compile", 1), ("torch-ddp-compile", 2)]
    assert all(r.collectives and r.bucket_cap_mb == 25.0 for r in plain)


def test_each_framework_launches_its_ranks_as_processes():
    config = MultiGpuConfig(2, steps=5, warmup=1)
    ours = multigpu.launch_command(Measurement("stepgraph", "gpt", "fp32", 2), config,
                                   Path("/r.json"))
    assert ours[:6] == [sys.executable, "-m", "stepgraph", "launch", "--gpus", "2"]
    theirs = multigpu.launch_command(Measurement("torch-ddp", "resnet", "bf16", 4), config,
                                     Path("/r.json"))
    assert theirs[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc_per_node=4" in theirs
    for command, framework in ((ours, "stepgraph"), (theirs, "torch-ddp")):
        at = command.index("--worker")
        assert command[at + 1] == framework and command[-2:] == ["--result", "/r.json"]
        assert "--no-comm" not in command and "--compile-mode" not in command
        assert "--device" not in command and "--tiny" not in command
    assert theirs[theirs.index("--precision") + 1] == "bf16"
    assert theirs[theirs.index("--bucket-cap-mb") + 1] == "25"


def test_the_worker_arguments_round_trip_through_the_launch_command():
    config = MultiGpuConfig(4, steps=3, warmup=2, compile_mode="max-autotune", device="cpu",
                            tiny=True)
    m = Measurement("torch-ddp-compile", "gpt", "tf32", 4, 2.5, collectives=False)
    command = multigpu.launch_command(m, config, Path("/tmp/r.json"))
    worker = command[command.index("--worker") + 1:]
    assert multigpu_rank.parse_worker(worker) == multigpu_rank.RankOptions(
        "torch-ddp-compile", "gpt", 3, 2, Path("/tmp/r.json"), "tf32", 2.5, False,
        "max-autotune", "cpu", True)


def rows_of_a_sweep() -> list[ScalingRow]:
    return [ScalingRow("stepgraph", "resnet", 1, 1000.0, "samples/s", 5.0),
            ScalingRow("stepgraph", "resnet", 2, 1900.0, "samples/s", 5.25),
            ScalingRow("stepgraph", "resnet", 2, 1990.0, "samples/s", 5.05,
                       collectives=False, silenced_all_reduces=14),
            ScalingRow("stepgraph", "resnet", 2, 1950.0, "samples/s", 5.125,
                       bucket_cap_mb=5.0),
            ScalingRow("stepgraph", "resnet", 2, 1800.0, "samples/s", 5.5,
                       bucket_cap_mb=100.0),
            ScalingRow("stepgraph", "resnet", 1, 400.0, "samples/s", 2.5, precision="bf16"),
            ScalingRow("stepgraph", "resnet", 2, 700.0, "samples/s", 3.0, precision="bf16"),
            ScalingRow("torch-ddp", "gpt", 2, 50000.0, "tokens/s", 9.0),
            ScalingRow("torch-ddp", "resnet", 1, error="timed out after 900 s"),
            ScalingRow("torch-ddp", "resnet", 2, 1500.0, "samples/s", 7.0)]


def test_scaling_and_exposed_communication_per_framework_model_and_precision():
    rows = multigpu.with_exposed(multigpu.with_scaling(rows_of_a_sweep()))
    assert [r.scaling for r in rows] == pytest.approx(
        [1.0, 0.95, 0.995, 0.975, 0.9, 1.0, 0.875, None, None, None])
    assert [r.scaling for r in rows][7:] == [None, None, None]
    exposed = [(r.exposed_ms, r.exposed_noop_ms) for r in rows]
    assert exposed[0] == (None, None)                         # one GPU
    assert exposed[1] == pytest.approx((0.25, 0.2))
    assert exposed[2] == (None, None)                         # the no-op row itself
    assert exposed[3] == pytest.approx((0.125, 0.075))        # the same no-op baseline
    assert exposed[4] == pytest.approx((0.5, 0.45))
    assert exposed[6] == (pytest.approx(0.5), None)           # bf16: its own 1-GPU row
    assert exposed[7:] == [(None, None)] * 3                  # no (successful) 1-GPU row


def test_the_fastest_bucket_cap_is_named_with_every_caps_time():
    rows = multigpu.with_exposed(multigpu.with_scaling(rows_of_a_sweep()))
    assert multigpu.best_bucket_caps(rows) == [BucketChoice(
        "stepgraph", "resnet", "fp32", 2, 5.0, 5.125,
        ((5.0, 5.125), (25.0, 5.25), (100.0, 5.5)))]
    text = multigpu.render_bucket_choices(multigpu.best_bucket_caps(rows))
    assert text == ("best bucket cap, stepgraph resnet fp32 at 2 GPUs: 5 MiB (5.12 ms; step "
                    "ms by cap: 5: 5.12, 25: 5.25, 100: 5.50)")


def test_the_table_shows_every_column():
    rows = multigpu.with_exposed(multigpu.with_scaling(rows_of_a_sweep()))
    lines = multigpu.render_table(rows).splitlines()
    assert lines[0].split() == ["framework", "model", "precision", "GPUs", "bucket_MiB",
                                "all-reduce", "throughput", "step_ms", "scaling",
                                "exposed_ms_vs_1_GPU", "exposed_ms_vs_no-op"]
    assert set(lines[1]) == {"-", " "}
    assert lines[2].split() == ["stepgraph", "resnet", "fp32", "1", "25", "on", "1,000",
                                "samples/s", "5.00", "1.00"]
    assert lines[3].split() == ["stepgraph", "resnet", "fp32", "2", "25", "on", "1,900",
                                "samples/s", "5.25", "0.95", "+0.25", "+0.20"]
    assert lines[4].split() == ["stepgraph", "resnet", "fp32", "2", "25", "no-op", "1,990",
                                "samples/s", "5.05", "0.99"]
    assert lines[9].split() == ["torch-ddp", "gpt", "fp32", "2", "25", "on", "50,000",
                                "tokens/s", "9.00"]
    assert lines[10].split()[:7] == ["torch-ddp", "resnet", "fp32", "1", "25", "on",
                                     "failed:"]
    assert len({len(lines[i]) for i in (0, 1, 3)}) == 1      # aligned columns


def test_run_measures_the_plan_in_order_and_main_writes_the_json(monkeypatch, tmp_path,
                                                                 capsys):
    times = {(1, True, 25.0): 4.0, (2, True, 25.0): 5.0, (2, False, 25.0): 4.5,
             (2, True, 1.0): 6.0}
    seen = []

    def fake_measure(m: Measurement, config):
        seen.append(m)
        ms = times[(m.gpus, m.collectives, m.bucket_cap_mb)]
        return ScalingRow(m.framework, m.model, m.gpus, 1e3 * m.gpus / ms, "samples/s", ms,
                          precision=m.precision, bucket_cap_mb=m.bucket_cap_mb,
                          collectives=m.collectives)

    monkeypatch.setattr(multigpu, "measure", fake_measure)
    argv = ["--gpus", "2", "--models", "resnet", "--frameworks", "torch-ddp-compile",
            "--no-comm", "--bucket-caps", "1,25", "--out", str(tmp_path)]
    assert multigpu.main(argv) == 0
    assert seen == multigpu.plan(multigpu.parse_config(argv))
    path = tmp_path / "bench_gpus2_resnet_fp32_torch-ddp-compile_no-comm_caps1-25.json"
    report = json.loads(path.read_text())
    assert report["config"]["no_comm"] is True and report["config"]["bucket_caps"] == [1, 25]
    by_kind = {(r["gpus"], r["collectives"], r["bucket_cap_mb"]): r for r in report["rows"]}
    assert by_kind[(2, True, 25.0)]["exposed_ms"] == pytest.approx(1.0)
    assert by_kind[(2, True, 25.0)]["exposed_noop_ms"] == pytest.approx(0.5)
    assert by_kind[(2, True, 1.0)]["exposed_noop_ms"] == pytest.approx(1.5)
    assert report["best_bucket_caps"] == [{
        "framework": "torch-ddp-compile", "model": "resnet", "precision": "fp32", "gpus": 2,
        "best_mb": 25.0, "step_ms": 5.0, "step_ms_by_cap": [[1.0, 6.0], [25.0, 5.0]]}]
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("framework")
    assert "best bucket cap, torch-ddp-compile resnet fp32 at 2 GPUs: 25 MiB" in out
    assert out.strip().endswith(f"wrote {path}")


TORCHRUN_FAILURE = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "x.py", line 3, in <module>
[rank0]: AssertionError: First bucket should be smaller/equal to other buckets
E1128 21:42:37.666000 29437 api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 29459)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_a_failed_launch_is_named_by_its_error_not_the_launchers_summary():
    assert multigpu.error_of(TORCHRUN_FAILURE, 1) == \
        "[rank0]: AssertionError: First bucket should be smaller/equal to other buckets"
    assert multigpu.error_of("", 3) == "exit code 3"
    assert multigpu.error_of("one\ntwo\n", 1) == "two"


def test_a_failed_launch_keeps_its_stderr(monkeypatch, tmp_path):
    class Done:
        returncode, stderr = 1, TORCHRUN_FAILURE

    monkeypatch.setattr(multigpu.subprocess, "run", lambda *a, **k: Done())
    config = MultiGpuConfig(2, out=str(tmp_path))
    row = multigpu.measure(Measurement("torch-ddp", "gpt", "bf16", 2, 5.0), config)
    assert row.error and (row.precision, row.bucket_cap_mb) == ("bf16", 5.0)
    logs = list((tmp_path / multigpu.LOG_FOLDER).iterdir())
    assert [p.read_text() for p in logs] == [TORCHRUN_FAILURE]
    assert "torch-ddp" in logs[0].name.replace("_", "-")


# ---- the no-op all-reduce ------------------------------------------------------------------

def test_stepgraph_cuda_buckets_keep_everything_but_the_nccl_call(monkeypatch):
    from stepgraph.backends.cuda import collective

    calls = []

    class Communicator:
        def allReduce(self, *args):                       # noqa: N802
            calls.append(("allReduce", args))

        def bcast(self, *args):
            calls.append(("bcast", args))

    def issue(nccl, comm, stream, dtype, memory, ins, outs, flat, kind=""):
        calls.append(("pack", flat))
        comm.allReduce(1, 2, 3)
        calls.append(("unpack", flat))

    monkeypatch.setattr(collective, "_issue_all_reduce", issue)   # restored after the test
    counter = multigpu_rank.silence_stepgraph_all_reduces("cuda")
    collective._issue_all_reduce("nccl", Communicator(), "stream", 7, {}, [], [], True)
    assert calls == [("pack", True), ("unpack", True)] and counter == [1]
    silent = multigpu_rank._NoAllReduce(Communicator(), counter)
    silent.bcast(4)
    assert calls[-1] == ("bcast", (4,))                           # other calls go through


def test_stepgraph_cpu_buckets_become_local_copies(monkeypatch):
    from stepgraph.ir.ops import IMPLS

    monkeypatch.setitem(IMPLS, "all_reduce", IMPLS["all_reduce"])  # restored after the test
    counter = multigpu_rank.silence_stepgraph_all_reduces("cpu")
    rng = np.random.default_rng(0)
    ins = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(5)]
    outs = [np.full_like(a, np.nan) for a in ins]
    IMPLS["all_reduce"](None, ins, outs, None)       # no group looked up: nothing sent
    assert counter == [1]
    for a, o in zip(ins, outs):
        np.testing.assert_array_equal(a, o)


def test_torch_layout_follows_the_one_gpu_bench_default():
    from stepgraph.bench.workloads import get_workload

    resnet, gpt = get_workload("resnet"), get_workload("gpt")
    assert multigpu_rank.torch_layout(resnet, "fp32", "cuda") == "NCHW"
    assert multigpu_rank.torch_layout(resnet, "bf16", "cuda") == "channels_last"
    assert multigpu_rank.torch_layout(resnet, "bf16", "cpu") == "NCHW"
    assert multigpu_rank.torch_layout(gpt, "tf32", "cuda") == "NCHW"
