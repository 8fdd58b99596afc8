"""Loop capture on the GPU: a PyTorch training loop is one CUDA graph launch per step, with no
host sync unless the script reads a value, and trains as compile_train_step does."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import losses, models, optim
from stepgraph.compile.executable import Executable
from stepgraph.loop import hooks

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda
require_gpu()


def data(n, batch=32, shape=(784,), seed=0):
    gen = np.random.default_rng(seed)
    return [(gen.standard_normal((batch, *shape), dtype=np.float32),
             gen.integers(0, 10, batch)) for _ in range(n)]


def loop(model, opt, batches, loss_fn, read=True):
    out = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(sg.from_numpy(x)), sg.from_numpy(y))
        loss.backward()
        opt.step()
        out.append(loss)
    return [float(l) for l in out] if read else out


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_captured_loop_equals_compile_train_step_on_cuda(name):
    shape = (784,) if name == "mlp" else (1, 28, 28)
    build = models.mlp if name == "mlp" else models.cnn
    loss_fn = losses.cross_entropy if name == "mlp" else losses.nll_loss
    sg.manual_seed(0)
    a = build()
    b = build()
    b.load_state_dict(a.state_dict())
    batches = data(6, shape=shape)
    step = sg.compile_train_step(a, loss=loss_fn, optimizer=optim.AdamW(lr=1e-3),
                                 example_inputs=batches[0], device="cuda",
                                 on_bad_batch="ignore")
    ref = [float(step(x, y)) for x, y in batches]
    got = loop(b, optim.AdamW(b.parameters(), lr=1e-3), batches, loss_fn)
    assert got == ref
    sa, sb = a.state_dict(), b.state_dict()
    assert all(np.array_equal(sa[k], sb[k]) for k in sa)
    (theirs,) = step.executables.values()
    mine = hooks.SESSION.last_executable
    assert mine.captured is not None
    assert mine.captured.node_count == theirs.captured.node_count


def test_one_graph_launch_and_no_sync_per_step(monkeypatch):
    model = models.mlp()
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = data(8)
    loop(model, opt, batches[:3], losses.cross_entropy)         # record, warm up, capture
    exe = hooks.SESSION.last_executable
    launches, syncs = [], []
    captured = exe.captured
    real_launch = type(captured).launch
    monkeypatch.setattr(type(captured), "launch",
                        lambda self, *a, **k: (launches.append(1), real_launch(self, *a, **k)))
    real_run_eager = Executable.run_eager
    monkeypatch.setattr(Executable, "run_eager",
                        lambda self: (_ for _ in ()).throw(AssertionError("ran eagerly")))
    backend = hooks.SESSION.last_step.backend
    for name in ("synchronize", "to_numpy"):
        real = getattr(backend, name)
        monkeypatch.setattr(backend, name,
                            lambda *a, real=real, **k: (syncs.append(1), real(*a, **k))[1])
    held = loop(model, opt, batches[3:], losses.cross_entropy, read=False)
    assert len(launches) == 5 and not syncs
    monkeypatch.setattr(Executable, "run_eager", real_run_eager)
    values = [float(l) for l in held]          # reading syncs, and gives each step's loss
    assert len(set(values)) == 5 and all(np.isfinite(values))


def test_bf16_autocast_loop_trains_on_cuda():
    model = models.mlp()
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    first = None
    for x, y in data(20) * 3:
        opt.zero_grad()
        with sg.autocast("cuda", dtype=sg.bfloat16):
            loss = losses.cross_entropy(model(sg.from_numpy(x)), sg.from_numpy(y))
        loss.backward()
        opt.step()
        first = first if first is not None else float(loss)
    assert hooks.SESSION.last_step.precision == "bf16"
    assert float(loss) < first
