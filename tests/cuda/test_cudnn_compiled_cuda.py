"""cuDNN's runtime-compiled plans (conv/cudnn_compiled.py) on the GPU: a depthwise bf16
channels-last problem's first such plan, built here, gives the same bits as the same plan
loaded from the disk and as the one a build worker process made; and a depthwise model
trains to the same bits with build workers as without."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu("nvmath")

import stepgraph as sg  # noqa: E402
from stepgraph import cache, losses, nn, optim  # noqa: E402
from stepgraph.backends.cuda.conv import conv_cudnn, cudnn_compiled  # noqa: E402
from stepgraph.backends.cuda.conv.geometry import Geometry  # noqa: E402
from stepgraph.backends.cuda.runtime import autotune  # noqa: E402

if not conv_cudnn.available():
    pytest.skip(f"cuDNN is not usable: {conv_cudnn.unavailable_reason()}",
                allow_module_level=True)

OPERANDS = {"conv2d": ("x", "w", "y"), "conv2d_grad_input": ("dy", "w", "dx"),
            "conv2d_grad_weight": ("x", "dy", "dw")}
KIND = {"x": "x", "dx": "x", "w": "w", "dw": "w", "y": "y", "dy": "y"}


@pytest.fixture
def fresh_process(tmp_path, monkeypatch):
    """An empty disk cache, and this process's memory of plans and answers forgotten."""
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "sg-cache"))
    monkeypatch.delenv(cache.SWITCH_ENV, raising=False)
    monkeypatch.setenv(cudnn_compiled.WORKERS_ENV, "0")
    for name in ("_PLANS", "_CHOSEN"):
        monkeypatch.setattr(conv_cudnn, name, {})
    monkeypatch.setattr(autotune, "_caches", {})
    monkeypatch.setattr(cudnn_compiled, "_asked", {})
    monkeypatch.setattr(cudnn_compiled, "_pool", None)
    return monkeypatch


def run(runner, index, p, arrays, uids, handle, workspace: int) -> np.ndarray:
    out = arrays[OPERANDS[p.op][2]]
    out.fill(0xFFFF)                                    # poisoned: NaN in bf16
    scratch = cp.empty(max(1, workspace), cp.uint8)
    runner.execute_plan_at_index({uids[k]: a.data.ptr for k, a in arrays.items()},
                                 scratch.data.ptr, index=index, handle=handle)
    cp.cuda.Device().synchronize()
    return cp.asnumpy(out)


@pytest.mark.parametrize("op", list(OPERANDS))
def test_a_loaded_or_worker_built_plan_gives_the_bits_of_the_plan_built_here(fresh_process,
                                                                              op):
    g = Geometry(n=16, c=32, h=16, w=16, o=32, kh=3, kw=3, sh=1, sw=1, ph=1, pw=1, groups=32)
    p = conv_cudnn.Problem(op, g, "bfloat16", "bf16", layout="NHWC",
                           device=cp.cuda.runtime.getDevice())
    cudnn = conv_cudnn._load()[0]
    handle = cudnn.create_handle()
    plans = conv_cudnn._build(cudnn, p, handle)
    compiled = [c for c in plans.entries
                if conv_cudnn._runtime_compiled(cudnn, plans.graphs[c.graph][0], c.index)]
    if not compiled:
        pytest.skip(f"{op}: cuDNN ranks no runtime-compiled plan for this problem")
    (c,) = compiled
    uids = plans.graphs[c.graph][1]
    dims = g.cudnn_dims()
    gen = np.random.default_rng(0)
    arrays = {}
    for name in OPERANDS[op]:
        f = gen.standard_normal(int(np.prod(dims[KIND[name]]))).astype(np.float32)
        arrays[name] = cp.asarray((f.view(np.uint32) >> 16).astype(np.uint16))
    built = run(plans.graphs[c.graph][0], c.index, p, arrays, uids, handle, c.workspace)
    assert not np.isnan(built.view(np.uint16).astype(np.uint32) << 16).any()
    modes = conv_cudnn._ranked_list(c.path)[0]

    key, lock = conv_cudnn._compiled_key(p), conv_cudnn._FRONTEND
    plan, loaded = cudnn_compiled.take(cudnn, p, key, modes, c.index, handle, lock)  # the disk
    assert (plan.name, plan.workspace) == (c.name, c.workspace)
    assert np.array_equal(run(loaded, c.index, p, arrays, uids, handle, plan.workspace), built)

    for entry in cache.entries():                        # a new process, the disk emptied
        entry.unlink()
    fresh_process.setenv(cudnn_compiled.WORKERS_ENV, "2")
    cudnn_compiled.prefetch(p, key)
    plan, loaded = cudnn_compiled.take(cudnn, p, key, modes, c.index, handle, lock)  # worker
    assert cudnn_compiled._pool.started == 1 and plan.name == c.name
    assert np.array_equal(run(loaded, c.index, p, arrays, uids, handle, plan.workspace), built)
    assert cudnn_compiled._stored(p, key) is not None   # and stored for later processes


def depthwise_losses(precision: str) -> list[float]:
    nn.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 24, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(24, 24, 5, stride=2, padding=2, groups=24), nn.ReLU(),
                          nn.Conv2d(24, 24, 3, padding=1, groups=24), nn.Flatten(),
                          nn.Linear(24 * 8 * 8, 10))
    gen = np.random.default_rng(1)
    x = cp.asarray(gen.standard_normal((32, 3, 16, 16), dtype=np.float32))
    y = cp.asarray(gen.integers(0, 10, 32))
    step = sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.05), (x, y),
                                 device="cuda", precision=precision)
    return [float(step(x, y)) for _ in range(4)]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_depthwise_model_trains_alike_with_and_without_build_workers(fresh_process,
                                                                       precision):
    """The second run keeps the first's choices (the same plans, so the same bits are
    expected) but not its stored plans: the workers build the chosen compiled ones."""
    alone = depthwise_losses(precision)
    for entry in cache.entries():
        if entry.parent.name == cudnn_compiled.NAMESPACE:
            entry.unlink()
    for name in ("_PLANS", "_CHOSEN"):
        fresh_process.setattr(conv_cudnn, name, {})
    fresh_process.setattr(autotune, "_caches", {})
    fresh_process.setenv(cudnn_compiled.WORKERS_ENV, "2")
    with_workers = depthwise_losses(precision)
    assert with_workers == alone
    assert cudnn_compiled._pool is not None and cudnn_compiled._pool.started >= 1
