"""`stepgraph bench --gpus 2` end to end on two GPUs (marker multigpu: skipped with fewer).
Its own file: nine launches, three of them compiling resnet with torch.compile, take minutes,
past the time the data-parallel tests (test_multigpu_cuda.py, scripts/dp-check) must fit in."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cuda, pytest.mark.multigpu]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_bench_gpus_measures_every_framework_at_each_world_size(tmp_path):
    """`stepgraph bench --gpus 2 --no-comm`: stepgraph, PyTorch DDP and DDP under torch.compile
    at 1 and 2 GPUs and again at 2 with no-op all-reduces, none failed; the one-GPU rows at
    scaling 1.00, the two-GPU rows with both exposed-communication figures, the no-op rows
    with every bucket's all-reduce skipped."""
    import json

    pytest.importorskip("torch")
    done = subprocess.run([sys.executable, "-m", "stepgraph", "bench", "--gpus", "2",
                           "--models", "resnet", "--steps", "5", "--warmup", "2", "--no-comm",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    (path,) = tmp_path.glob("bench_gpus2_resnet_fp32_*_no-comm.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["framework"], r["gpus"], r["collectives"]) for r in rows] == [
        (framework, gpus, comm) for framework in ("stepgraph", "torch-ddp", "torch-ddp-compile")
        for gpus, comm in ((1, True), (2, True), (2, False))]
    assert not [r["error"] for r in rows if r["error"]], done.stdout
    assert [r["scaling"] for r in rows][::3] == [1.0, 1.0, 1.0]
    for r in rows[1::3]:
        assert r["exposed_ms"] is not None and r["exposed_noop_ms"] is not None
    assert all(r["silenced_all_reduces"] > 0 for r in rows[2::3])
