"""`stepgraph run script.py [args]`: an unchanged PyTorch script run with torch resolved to
stepgraph (stepgraph/run_script.py). Scripts are written into tmp_path and run through the
command line in a subprocess (from the worktree root, so this tree is imported), or in this
process through run_script where the state of the process after the run is the point."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A classic PyTorch training script: nothing in it names stepgraph. The start is the same
# under any torch (parameters written from linspace, data without shuffling), so its losses
# can be compared with PyTorch's own run of the same file.
TRAIN = '''
import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--dtype", default="float32")
args = parser.parse_args()
print("argv", sys.argv[1:], "torch is", torch.__name__)
dtype = getattr(torch, args.dtype)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

x = torch.linspace(-1, 1, 96).reshape(32, 3).to(dtype) * torch.tensor([1.0, -0.5, 2.0]).to(dtype)
y = (x.sum(1) > 0.1).long()
loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


model = Net().to(device).to(dtype)
with torch.no_grad():
    for i, p in enumerate(model.parameters()):
        p.copy_(torch.linspace(-0.6, 0.6, p.numel()).reshape(p.shape).to(dtype) * (1 + 0.3 * i))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
model.train()
for epoch in range(args.epochs):
    for xb, yb in loader:
        xb, yb = xb.to(device), yb.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        print(f"loss {loss.item():.12f}")
'''


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def stepgraph_run(*args, cwd=ROOT) -> subprocess.CompletedProcess:
    """`python -m stepgraph run ARGS` in a subprocess importing this tree."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "stepgraph", "run", *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def report_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("stepgraph run:")]


def losses(stdout: str) -> list[float]:
    return [float(v) for v in re.findall(r"^loss (\S+)$", stdout, re.M)]


def test_classic_training_script_runs_unchanged_and_matches_torch(tmp_path):
    script = write(tmp_path, "train.py", TRAIN)
    done = stepgraph_run(script, "--lr", "0.1")
    assert done.returncode == 0, done.stderr
    assert "argv ['--lr', '0.1'] torch is stepgraph" in done.stdout
    assert report_lines(done.stderr) == []          # nothing the script met was refused
    ours = losses(done.stdout)
    assert len(ours) == 8

    # The same file under PyTorch, in float32 and float64, in one process (one torch import).
    oracle = ("import runpy, sys\n"
              "for dtype in ('float32', 'float64'):\n"
              f"    sys.argv = [{str(script)!r}, '--lr', '0.1', '--dtype', dtype]\n"
              f"    runpy.run_path({str(script)!r}, run_name='__main__')\n")
    ref = subprocess.run([sys.executable, "-c", oracle], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr
    both = losses(ref.stdout)
    t32, t64 = both[:8], both[8:]
    # Judged against float64: within a small multiple of torch float32's own error (a floor
    # of a few float32 ulps of the loss where torch's error happens to be ~0).
    torch_err = max(abs(a - b) for a, b in zip(t32, t64))
    for step, (got, want) in enumerate(zip(ours, t64)):
        bound = 8 * torch_err + 8 * 2.0 ** -23 * max(abs(want), 1.0)
        assert abs(got - want) <= bound, (step, got, want, bound)
    assert ours[-1] < ours[0]                         # and it trains


def test_script_folder_first_on_path_argv_and_sibling_import(tmp_path):
    write(tmp_path, "helper.py", """
        import torch.nn as nn
        def f():
            return type(nn.Linear(2, 3)).__module__
    """)
    script = write(tmp_path, "main.py", """
        import sys
        from helper import f
        print("argv", sys.argv)
        print("path0", sys.path[0])
        print("name", __name__, "layer from", f())
    """)
    done = stepgraph_run(script, "--lr", "0.1", "-x")
    assert done.returncode == 0, done.stderr
    assert f"argv [{str(script)!r}, '--lr', '0.1', '-x']" in done.stdout
    assert f"path0 {tmp_path}" in done.stdout
    assert "name __main__ layer from stepgraph.nn.layers" in done.stdout


def test_exit_codes_and_tracebacks_as_python_gives_them(tmp_path):
    cases = {"sys.exit(3)": (3, ""), "sys.exit()": (0, ""), "sys.exit(None)": (0, ""),
             "sys.exit('stopped early')": (1, "stopped early"), "pass": (0, "")}
    for body, (code, err) in cases.items():
        script = write(tmp_path, "exits.py", f"import sys\nimport torch\nprint('ran')\n{body}\n")
        done = stepgraph_run(script)
        assert (done.returncode, done.stdout, done.stderr.strip()) == (code, "ran\n", err), body
    script = write(tmp_path, "fails.py", """
        import sys

        def inner():
            raise ValueError("boom")

        inner()
    """)
    done = stepgraph_run(script)
    python = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            timeout=300)
    assert done.returncode == 1
    assert done.stderr == python.stderr
    assert "runpy" not in done.stderr and "run_script" not in done.stderr
    assert done.stderr.splitlines()[-1] == "ValueError: boom"


def test_unsupported_names_are_listed_at_the_end(tmp_path):
    script = write(tmp_path, "uses.py", """
        import torch
        import torch.nn as nn
        print("has xpu", hasattr(torch, "xpu"), getattr(nn, "Bilinear3", "none"))
        try:
            net = nn.DataParallel(nn.Linear(4, 4))
        except AttributeError as err:
            net = nn.Linear(4, 4)
        try:
            optimizer_class = torch.optim.LBFGS
        except AttributeError:
            optimizer_class = torch.optim.SGD
        try:
            from torch.optim.lr_scheduler import NoSuchLR
        except ImportError as err:
            print("import refused")
        print("done")
    """)
    done = stepgraph_run(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "has xpu False none\nimport refused\ndone\n"
    from stepgraph.errors import ALTERNATIVES

    assert report_lines(done.stderr) == [
        "stepgraph run: torch.nn.DataParallel is not supported "
        f"(use {ALTERNATIVES['torch.nn.DataParallel']})",
        "stepgraph run: torch.optim.LBFGS is not supported",
        "stepgraph run: torch.optim.lr_scheduler.NoSuchLR is not supported",
        "stepgraph run: probed (hasattr / getattr) and not supported: torch.xpu, "
        "torch.nn.Bilinear3"]


def test_refused_name_that_ends_the_run_is_listed_after_the_traceback(tmp_path):
    script = write(tmp_path, "dies.py", """
        import torch
        print("before")
        probe = getattr(torch, "special_thing")      # no default: the refusal propagates
    """)
    done = stepgraph_run(script)
    assert done.returncode == 1 and done.stdout == "before\n"
    lines = done.stderr.splitlines()
    assert lines[-2].startswith("stepgraph.errors.UnsupportedOpError: torch.special_thing is "
                                "not supported by stepgraph")
    assert lines[-1] == "stepgraph run: torch.special_thing is not supported"


def test_unsupported_submodule_import_fails_with_a_clear_message(tmp_path):
    script = write(tmp_path, "dist.py", """
        import torch
        try:
            import torch.distributed.rpc
        except ImportError as err:
            print(type(err).__name__, err.name, "|", err)
        from torch.distributions import Normal
    """)
    done = stepgraph_run(script)
    assert done.returncode == 1
    assert done.stdout == ("ModuleNotFoundError torch.distributed.rpc | "
                           "torch.distributed.rpc is not supported by stepgraph "
                           "(see docs/TORCH_COMPAT.md for the torch names it has)\n")
    assert "ModuleNotFoundError: torch.distributions is not supported by stepgraph" in done.stderr
    assert report_lines(done.stderr) == [
        "stepgraph run: torch.distributed.rpc is not supported",
        "stepgraph run: torch.distributions is not supported"]


def test_missing_script_and_help(tmp_path):
    done = stepgraph_run(tmp_path / "absent.py")
    assert done.returncode == 2 and "can't open file" in done.stderr
    done = stepgraph_run("--help")
    assert done.returncode == 0 and "usage: stepgraph run" in done.stdout


# ---- in this process: the import hook and what the run leaves behind ----

def test_torch_modules_are_stepgraph_module_objects_and_real_torch_is_put_back(tmp_path, capsys):
    import torch as real_torch
    import torch.nn

    import stepgraph
    from stepgraph import errors
    from stepgraph.run_script import run_script

    write(tmp_path, "sibling_mod.py", "import torch\nNAME = torch.__name__\n")
    script = write(tmp_path, "ident.py", """
        import sys
        import stepgraph
        import torch
        import torch.nn
        import torch.nn.functional as F
        import torch.nn.init
        import torch.optim.lr_scheduler
        import torch.utils.data
        import torch.amp, torch.cuda.amp
        import torch.backends.cudnn as cudnn
        from torch.cuda.amp import GradScaler
        from sibling_mod import NAME
        assert torch is stepgraph and torch.nn is stepgraph.nn and NAME == "stepgraph"
        assert F is stepgraph.nn.functional and torch.nn.init is stepgraph.nn.init
        assert torch.optim.lr_scheduler is stepgraph.optim.lr_scheduler
        assert torch.utils.data is stepgraph.utils.data
        assert torch.cuda.amp is stepgraph.amp and GradScaler is stepgraph.amp.GradScaler
        assert cudnn is stepgraph.backends.cudnn
        assert sys.modules["torch.nn.functional"] is stepgraph.nn.functional
        # stepgraph's modules keep their own names and specs
        assert stepgraph.__spec__.name == "stepgraph" and F.__name__ == "stepgraph.nn.functional"
        assert "__spec__" not in vars(cudnn)
        for internal in ("torch.ops", "torch.compile", "torch.ir", "torch._C"):
            try:
                __import__(internal)
            except ModuleNotFoundError as err:
                assert err.name == internal and "not supported by stepgraph" in str(err)
            else:
                raise AssertionError(internal)
        print("identities hold")
    """)
    meta_path, original_missing = list(sys.meta_path), errors.missing_torch_name
    result = run_script(script, ["a"])
    out, err = capsys.readouterr()
    assert result.exit_code == 0, err
    assert out == "identities hold\n"
    assert sorted(result.refusals.used) == ["torch._C", "torch.compile", "torch.ir", "torch.ops"]
    # after the run: real torch back, the hook and the record gone, the script's module
    # forgotten (a second run, or other code, imports it afresh)
    assert sys.modules["torch"] is real_torch and sys.modules["torch.nn"] is torch.nn
    assert real_torch.nn.Linear(2, 3).weight.shape == (3, 2)
    assert sys.meta_path == meta_path and errors.missing_torch_name is original_missing
    assert "sibling_mod" not in sys.modules and stepgraph.__spec__.name == "stepgraph"
    import torch.nn.functional as real_F
    assert real_F.__name__ == "torch.nn.functional"


def test_other_packages_are_not_touched():
    from stepgraph.run_script import TorchFinder

    finder = TorchFinder()
    for name in ("torchvision", "torchaudio", "torch_geometric", "numpy", "torchvision.models"):
        assert finder.find_spec(name) is None


def test_lookups_by_stepgraph_itself_are_not_the_scripts(tmp_path, capsys):
    """A hasattr made inside stepgraph (not by the script) is not recorded."""
    from stepgraph.run_script import run_script

    script = write(tmp_path, "internal.py", """
        import torch
        from stepgraph import errors
        # a lookup made by a stepgraph module's code, as the package's own probes are
        exec(compile("hasattr(torch, 'internal_probe')", errors.__file__, "exec"),
             {"__name__": "stepgraph.some_module", "torch": torch})
        print(hasattr(torch, "script_probe"))
    """)
    result = run_script(script)
    assert capsys.readouterr().out == "False\n"
    assert list(result.refusals.probed) == ["torch.script_probe"] and not result.refusals.used


def test_step_lr_on_a_parameter_optimizer(tmp_path):
    script = write(tmp_path, "sched.py", TRAIN.replace(
        "model.train()\n", "model.train()\nscheduler = StepLR(optimizer, step_size=1)\n"))
    done = stepgraph_run(script)
    assert done.returncode == 0, done.stderr[-2000:]
