"""`stepgraph bench --gpus N` without GPUs: argument handling, world sizes, the launch
commands, scaling and the table (the measurements themselves need GPUs)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stepgraph.bench import multigpu
from stepgraph.bench.multigpu import MultiGpuConfig, ScalingRow
from stepgraph.cli import main as cli_main


def test_arguments_give_the_configuration():
    config = multigpu.parse_config(["--gpus", "4", "--models", "gpt", "--frameworks",
                                    "torch-ddp,stepgraph", "--steps", "7", "--warmup", "2"])
    assert config == MultiGpuConfig(4, ("gpt",), ("torch-ddp", "stepgraph"), 7, 2)
    assert multigpu.parse_config(["--gpus=2"]) == MultiGpuConfig(2)


@pytest.mark.parametrize("argv", [["--gpus", "0"], ["--gpus", "2", "--models", "mlp"],
                                  ["--gpus", "2", "--frameworks", "jax"], [],
                                  ["--gpus", "2", "--steps", "0"]])
def test_bad_arguments_are_usage_errors(argv, capsys):
    assert multigpu.main(argv) == 2
    assert "usage: stepgraph bench --gpus N" in capsys.readouterr().err


def test_the_cli_hands_gpus_to_the_multigpu_bench(monkeypatch):
    seen = []
    monkeypatch.setattr(multigpu, "run", lambda config: seen.append(config) or [])
    assert cli_main(["bench", "--gpus", "3", "--models", "resnet"]) == 0
    assert seen == [MultiGpuConfig(3, ("resnet",))]


@pytest.mark.parametrize("gpus,sizes", [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]),
                                        (8, [1, 2, 4, 8])])
def test_world_sizes_double_up_to_the_gpus(gpus, sizes):
    assert multigpu.world_sizes(gpus) == sizes


def test_each_framework_launches_its_ranks_as_processes():
    config = MultiGpuConfig(2, steps=5, warmup=1)
    ours = multigpu.launch_command("stepgraph", "gpt", 2, config, Path("/r.json"))
    assert ours[:6] == [sys.executable, "-m", "stepgraph", "launch", "--gpus", "2"]
    theirs = multigpu.launch_command("torch-ddp", "resnet", 4, config, Path("/r.json"))
    assert theirs[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc_per_node=4" in theirs
    for command, framework in ((ours, "stepgraph"), (theirs, "torch-ddp")):
        at = command.index("--worker")
        assert command[at + 1] == framework and command[-2:] == ["--result", "/r.json"]


def test_scaling_is_throughput_over_gpus_times_one_gpu_and_the_table_shows_it():
    rows = multigpu.with_scaling([
        ScalingRow("stepgraph", "resnet", 1, 1000.0, "samples/s", 5.0),
        ScalingRow("stepgraph", "resnet", 2, 1900.0, "samples/s", 5.3),
        ScalingRow("torch-ddp", "gpt", 2, 50000.0, "tokens/s", 9.0),
        ScalingRow("torch-ddp", "resnet", 1, error="timed out after 900 s")])
    assert [r.scaling for r in rows] == [1.0, 0.95, None, None]
    lines = multigpu.render_table(rows).splitlines()
    assert lines[0].split() == ["framework", "model", "GPUs", "throughput", "step", "ms",
                                "scaling"]
    assert set(lines[1]) == {"-", " "}
    assert lines[3].split() == ["stepgraph", "resnet", "2", "1,900", "samples/s", "5.30", "0.95"]
    assert lines[4].split() == ["torch-ddp", "gpt", "2", "50,000", "tokens/s", "9.00"]
    assert lines[5].split()[:4] == ["torch-ddp", "resnet", "1", "failed:"]
    assert len({len(line) for line in lines[:4]}) == 1      # aligned columns
