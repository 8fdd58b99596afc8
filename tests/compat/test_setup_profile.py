"""scripts/setup-profile on the CPU (NumPy backend, the suite's tiny sizes): the profile of a
compatibility model's setup names the compile and the warm-up steps and lists
compile_train_step among the functions; a model file without its batch ends in one error
line."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "setup-profile"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--device", "cpu", "--tiny"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_compat_models_setup_is_profiled():
    done = run("prefix_seq", "--steps", "2", "--top", "30")
    assert done.returncode == 0, done.stderr[-3000:]
    first = done.stdout.splitlines()[0]
    assert re.fullmatch(r"== prefix_seq fp32 on cpu: compile_train_step [\d.]+ s, "
                        r"2 steps [\d.]+ s", first), first
    assert "(compile_train_step)" in done.stdout and "Ordered by: internal time" in done.stdout


def test_a_file_without_its_batch_is_one_error_line():
    done = run(str(ROOT / "tests" / "compat" / "models" / "mixer.py"), "--class", "TokenMixer")
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "--batch" in done.stderr
    assert "Traceback" not in done.stderr
