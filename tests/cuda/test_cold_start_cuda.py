"""Cold start: a fresh process's compile + first step, with empty caches and then with the
caches the first process left (stepgraph's kernel choices, CuPy's compiled kernels), both in
a private directory. The second process must take every choice from disk (no timing), build
no conv problem's every cuDNN plan (only the chosen ones) and be faster; the seconds are
printed (targets: mlp <= 2 s / cnn <= 3 s cold, <= 0.5 s warm)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import stepgraph as sg

pytestmark = pytest.mark.cuda
if not sg.cuda_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

SCRIPT = """
import json, sys, time
start = time.perf_counter()
import cupy as cp
import stepgraph as sg
from stepgraph.backends.cuda.conv import conv_cudnn
from stepgraph.backends.cuda.runtime import autotune
from stepgraph.profile import build_workload
plans, every = [], []                         # cuDNN plans built; problems with all of theirs
build_plan, build_every = conv_cudnn._build_plan, conv_cudnn._build
conv_cudnn._build_plan = lambda graph, index: plans.append(index) or build_plan(graph, index)
conv_cudnn._build = lambda cudnn, p, handle: every.append(p.op) or build_every(cudnn, p, handle)
cp.zeros(1).sum().item()                      # the CUDA context
ready = time.perf_counter()
step, (x, y) = build_workload(sys.argv[1])
float(step(x, y))
end = time.perf_counter()
disk = {ns: [c.hits, c.misses, c.rejected] for (ns, _), c in autotune._caches.items()}
print(json.dumps({"seconds": end - ready, "process": end - start, "disk": disk,
                  "torch": "torch" in sys.modules, "plans": len(plans), "every": len(every)}))
"""


def first_step(name: str, cache_root) -> dict:
    env = dict(os.environ, STEPGRAPH_CACHE_DIR=str(cache_root / "stepgraph"),
               CUPY_CACHE_DIR=str(cache_root / "cupy"))
    out = subprocess.run([sys.executable, "-c", SCRIPT, name], env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_second_process_reuses_the_kernel_choices(name, tmp_path):
    cold = first_step(name, tmp_path)
    warm = first_step(name, tmp_path)
    print(f"\n{name}: compile + first step: cold {cold['seconds']:.2f} s, warm caches "
          f"{warm['seconds']:.2f} s; whole process {cold['process']:.2f} / "
          f"{warm['process']:.2f} s (disk hits/misses/rejected: cold {cold['disk']}, "
          f"warm {warm['disk']}; cuDNN plans built: cold {cold['plans']}, warm "
          f"{warm['plans']})")
    assert not cold["torch"] and not warm["torch"], "a step imported torch"
    assert sum(h for h, _, _ in cold["disk"].values()) == 0
    assert warm["disk"] and all(m == 0 and r == 0 for _, m, r in warm["disk"].values())
    assert sum(h for h, _, _ in warm["disk"].values()) > 0
    assert warm["every"] == 0, "a warm process built every cuDNN plan of a conv problem"
    assert warm["plans"] < cold["plans"] or cold["plans"] == 0
    assert warm["seconds"] < cold["seconds"]
