"""The ranks of `stepgraph bench --gpus N` as real processes on the CPU (the hidden --device
cpu --tiny of the smoke tests): two stepgraph ranks under `stepgraph launch`, two PyTorch DDP
ranks under torchrun (gloo; torch.compile with aot_eager), each launch as multigpu.measure
starts it, timing read back from rank 0's JSON. The GPU run is
tests/cuda/test_bench_gpus_cuda.py."""
from __future__ import annotations

import pytest

from stepgraph.bench import multigpu
from stepgraph.bench.multigpu import Measurement, MultiGpuConfig

STEPS, WARMUP = 2, 1


def cpu_config(tmp_path) -> MultiGpuConfig:
    return MultiGpuConfig(2, steps=STEPS, warmup=WARMUP, timeout=240.0, out=str(tmp_path),
                          device="cpu", tiny=True)


def test_stepgraph_ranks_take_the_bucket_cap_and_the_no_op_all_reduce(tmp_path):
    config = cpu_config(tmp_path)
    small = multigpu.measure(Measurement("stepgraph", "resnet", "fp32", 2, 0.001), config)
    assert not small.error, small.error
    assert small.step_ms > 0 and small.unit == "samples/s" and small.silenced_all_reduces == 0
    buckets = int(small.notes[0].split()[0])
    assert small.notes[0] == f"{buckets} gradient buckets, all-reduced in fp32" and buckets > 1
    silent = multigpu.measure(Measurement("stepgraph", "resnet", "fp32", 2, 0.001,
                                          collectives=False), config)
    assert not silent.error, silent.error
    assert silent.notes[0] == f"{buckets} gradient buckets, all-reduced in fp32"
    # every bucket of every step (warm-up included) skipped, on rank 0 as on the others
    assert silent.silenced_all_reduces == buckets * (STEPS + WARMUP)


def test_compiled_ddp_ranks_with_the_no_op_hook(tmp_path):
    pytest.importorskip("torch")
    row = multigpu.measure(Measurement("torch-ddp-compile", "gpt", "fp32", 2,
                                       collectives=False), cpu_config(tmp_path))
    assert not row.error, row.error
    assert row.step_ms > 0 and row.unit == "tokens/s"
    assert "torch.compile(DDP(model), {'backend': 'aot_eager'})" in row.notes
    assert row.silenced_all_reduces == STEPS + WARMUP     # the tiny GPT is one bucket


def test_eager_ddp_ranks_at_a_bucket_cap(tmp_path):
    pytest.importorskip("torch")
    row = multigpu.measure(Measurement("torch-ddp", "gpt", "bf16", 2, 1.0),
                           cpu_config(tmp_path))
    assert not row.error, row.error
    assert row.silenced_all_reduces == 0 and row.throughput > 0
    assert not any("torch.compile" in note for note in row.notes)
    assert not (tmp_path / multigpu.LOG_FOLDER).exists()
