"""Whole train steps on the GPU: cuda eager vs the numpy backend, graph replay vs eager,
device-side LR, ragged batches, memory stability and bad feeds (issues: CUDA backend, graph)."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import losses, models, optim
from tests.cuda.gpu import require_gpu
from tests.ops.helpers import relative_error as rel

pytestmark = pytest.mark.cuda
cp = require_gpu()


def workload(name: str, dropout: float):
    if name == "mlp":
        return models.mlp(dropout=dropout), losses.cross_entropy, (784,)
    return models.cnn(dropout=dropout), losses.nll_loss, (1, 28, 28)


def make_optimizer(kind: str):
    return optim.AdamW(lr=1e-3) if kind == "adamw" else optim.SGD(lr=0.01, momentum=0.5)


def batches(feature_shape, n_steps, batch=32, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch, *feature_shape), dtype=np.float32),
             rng.integers(0, 10, batch)) for _ in range(n_steps)]


def twin_steps(name, dropout, opt, devices, graph=False, seed=0):
    """One train step per device over identically initialised copies of one model."""
    base, loss, shape = workload(name, dropout)
    data = batches(shape, 1)
    steps = []
    for device in devices:
        model, _, _ = workload(name, dropout)
        model.load_state_dict(base.state_dict())
        steps.append(sg.compile_train_step(model, loss=loss, optimizer=make_optimizer(opt),
                                           example_inputs=data[0], device=device,
                                           graph=graph if device == "cuda" else False, seed=seed))
    return steps, shape


def kernels_of_ops(exe) -> int:
    """Graph nodes of the plan's ops captured one at a time: the whole-step graph must hold
    exactly these (no copies, syncs or allocations slipped into the step)."""
    total = 0
    for node, ins, outs in exe.calls:
        captured = exe.backend.capture(lambda: exe.backend.run_node(node, ins, outs, exe.ctx),
                                       exe.ctx)
        total += captured.node_count
    return total


def assert_replay_matches_eager(eager, graph, data) -> list[str]:
    """Steps `eager` and `graph` (its graph replay on) on each (x, y) of `data`: the same
    losses and parameters bit for bit, and the captured step holding exactly its ops' kernels.
    Returns the captured plan's ops, in order."""
    graph.use_graph = True
    for x, y in data:
        x, y = cp.asarray(x), cp.asarray(y)
        assert float(eager(x, y)) == float(graph(x, y))
    for k, v in eager.model.state_dict().items():
        assert np.array_equal(v, graph.model.state_dict()[k]), k
    (exe,) = graph.executables.values()
    assert exe.captured is not None and exe.captured.node_count == kernels_of_ops(exe)
    return [node.op for node, _, _ in exe.calls]


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_cuda_trajectory_matches_numpy_with_dropout(name, opt):
    (cpu, gpu), shape = twin_steps(name, 0.3, opt, ["cpu", "cuda"])
    for x, y in batches(shape, 20, seed=1):
        lc, lg = float(cpu(x, y)), float(gpu(cp.asarray(x), cp.asarray(y)))
        assert abs(lg - lc) <= 1e-5 * abs(lc) + 1e-6, (lc, lg)
    ref, got = cpu.model.state_dict(), gpu.model.state_dict()
    for k in ref:
        assert rel(got[k], ref[k]) < 1e-4, k


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_cuda_trajectory_matches_torch_without_dropout(name):
    torch = pytest.importorskip("torch")
    from torch import nn as tnn
    torch.manual_seed(0)
    if name == "mlp":
        ref = tnn.Sequential(tnn.Linear(784, 512), tnn.ReLU(), tnn.Dropout(0.0),
                             tnn.Linear(512, 512), tnn.ReLU(), tnn.Dropout(0.0),
                             tnn.Linear(512, 10))
        loss_fn = tnn.functional.cross_entropy
    else:
        ref = tnn.Sequential(tnn.Conv2d(1, 10, 5), tnn.MaxPool2d(2), tnn.ReLU(),
                             tnn.Conv2d(10, 20, 5), tnn.Dropout2d(0.0), tnn.MaxPool2d(2),
                             tnn.ReLU(), tnn.Flatten(), tnn.Linear(320, 50), tnn.ReLU(),
                             tnn.Dropout(0.0), tnn.Linear(50, 10), tnn.LogSoftmax(dim=1))
        loss_fn = tnn.functional.nll_loss
    model, loss, shape = workload(name, 0.0)
    model.load_state_dict({k: v.detach().numpy() for k, v in ref.state_dict().items()})
    data = batches(shape, 20, seed=2)
    topt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    step = sg.compile_train_step(model, loss=loss, optimizer=optim.AdamW(lr=1e-3),
                                 example_inputs=data[0], device="cuda", graph=True)
    for x, y in data:
        topt.zero_grad()
        tl = loss_fn(ref(torch.from_numpy(x)), torch.from_numpy(y))
        tl.backward()
        topt.step()
        got = float(step(cp.asarray(x), cp.asarray(y)))
        assert abs(got - tl.item()) <= 1e-5 * abs(tl.item()) + 1e-6, (got, tl.item())
    want = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    for k, v in model.state_dict().items():
        assert rel(v, want[k]) < 1e-4, k


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_graph_replay_is_bit_identical_to_eager(name):
    (eager, graph), shape = twin_steps(name, 0.5, "adamw", ["cuda", "cuda"], seed=3)
    assert_replay_matches_eager(eager, graph, batches(shape, 50, seed=4))


def test_lr_change_takes_effect_without_recapture():
    (eager, graph), shape = twin_steps("mlp", 0.1, "adamw", ["cuda", "cuda"])
    graph.use_graph = True
    data = batches(shape, 12, seed=5)
    for i, (x, y) in enumerate(data):
        if i == 6:
            eager.optimizer.lr = graph.optimizer.lr = 3e-3
            eager.optimizer.schedule = graph.optimizer.schedule = optim.StepDecay(2, 0.5)
        assert float(eager(x, y)) == float(graph(x, y))
    (exe,) = graph.executables.values()
    captured = exe.captured
    graph(*data[0])
    assert exe.captured is captured, "changing the LR must not re-capture"


def test_ragged_epoch_matches_eager_and_caches_one_graph_per_shape():
    (eager, graph), shape = twin_steps("mlp", 0.2, "sgd", ["cuda", "cuda"])
    graph.use_graph = True
    x, y = batches(shape, 1, batch=100, seed=6)[0]
    for _ in range(3):                        # three epochs of batches 32, 32, 32, 4
        for i in range(0, 100, 32):
            xb, yb = cp.asarray(x[i:i + 32]), cp.asarray(y[i:i + 32])
            assert float(eager(xb, yb)) == float(graph(xb, yb))
    assert sorted(e.key.signature[0].shape[0] for e in graph.executables.values()) == [4, 32]
    for exe in graph.executables.values():
        assert exe.captured is not None and exe.captured.node_count == kernels_of_ops(exe)
    for k, v in eager.model.state_dict().items():
        assert np.array_equal(v, graph.model.state_dict()[k]), k


def test_replays_do_not_grow_device_memory():
    (step,), shape = twin_steps("mlp", 0.1, "adamw", ["cuda"], graph=True)
    x, y = (cp.asarray(a) for a in batches(shape, 1, seed=7)[0])
    for _ in range(10):
        step(x, y)
    cp.cuda.runtime.deviceSynchronize()
    pool = cp.get_default_memory_pool()
    before = pool.used_bytes()
    for _ in range(100_000):
        step(x, y)
    cp.cuda.runtime.deviceSynchronize()
    assert pool.used_bytes() == before
    assert np.isfinite(float(step(x, y)))


SPIN = r"""extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}"""


def test_an_input_dropped_after_the_call_is_read_before_its_memory_is_reused():
    """A batch made on CuPy's stream and dropped right after the call: CuPy's pool hands its
    memory to the next allocation of that size at once, and writes there run on CuPy's
    stream, unordered with the step's copy still queued on the backend's stream (here behind
    a busy kernel). The step must read the batch as given: the same loss as a twin fed a batch
    kept alive. The batch is allocated before the busy kernel starts: a fresh cudaMalloc
    could wait for the device and hide the race."""
    (held, dropped), shape = twin_steps("mlp", 0.0, "sgd", ["cuda", "cuda"], graph=True)
    data = [tuple(cp.asarray(a) for a in b) for b in batches(shape, 3, seed=11)]
    for x, y in data[:2]:                                # warm-up and capture
        held(x, y), dropped(x, y)
    x, y = data[2]
    spin = cp.RawKernel(SPIN, "spin")
    spin((1,), (1,), (np.int64(1),))                     # compiled and loaded now
    cp.full(1, cp.nan, dtype=x.dtype)                    # so is CuPy's fill kernel
    batch = [x.copy(), y.copy()]
    cp.cuda.runtime.deviceSynchronize()
    with dropped.backend.stream:                         # the step's stream busy ~0.5 s
        spin((1,), (1,), (np.int64(1_000_000_000),))
    got = dropped(*batch)
    assert not dropped.backend.stream.done, "the race was not set up: the copy has run"
    batch.clear()                                        # the caller drops its batch
    junk = cp.full(x.shape, cp.nan, dtype=x.dtype)       # same size, same stream
    assert float(got) == float(held(x, y))
    del junk



def test_a_prediction_read_on_the_callers_stream_waits_for_the_step():
    """compile_predict's output is written on the backend's non-blocking stream; code that
    reads it on its own current stream (cp.asnumpy on CuPy's default stream) must see the
    values, not the memory before the queued work wrote it. The backend's stream is kept busy
    ~0.5 s ahead of the call, so a read that does not wait sees zeros or stale memory."""
    model = models.mlp(784, hidden=64, classes=10)
    x = np.random.default_rng(3).standard_normal((32, 784)).astype(np.float32)
    want = sg.compile_predict(model, (x,), device="cpu")(x)
    predict = sg.compile_predict(model, (x,), device="cuda", graph=True)
    xd = cp.asarray(x)
    for _ in range(2):                                   # warm-up and capture
        predict(xd)
    spin = cp.RawKernel(SPIN, "spin")
    spin((1,), (1,), (np.int64(1),))
    cp.cuda.runtime.deviceSynchronize()
    with predict.backend.stream:
        spin((1,), (1,), (np.int64(1_000_000_000),))
    got = predict(xd)
    assert not predict.backend.stream.done, "the race was not set up: the step has run"
    assert rel(cp.asnumpy(got), want) < 1e-5

def test_bad_feeds_raise_before_touching_state():
    (step,), shape = twin_steps("mlp", 0.1, "adamw", ["cuda"], graph=True)
    x, y = batches(shape, 1, seed=8)[0]
    step(x, y)
    step(x, y)
    before = step.state_dict()
    bad = [(x.astype(np.float64), y, sg.ShapeError), (x[:, :100], y, sg.ShapeError),
           (x[None], y, sg.ShapeError), (x, y[:5], sg.ShapeError),
           (x, np.full_like(y, 10), sg.LabelError), (x, y.astype(np.float32), sg.ShapeError)]
    for bx, by, err in bad:
        with pytest.raises(err):
            step(bx, by)
    after = step.state_dict()
    for k in before:
        assert np.array_equal(before[k], after[k]), k


def test_predict_reads_the_trained_parameters():
    (step,), shape = twin_steps("mlp", 0.1, "adamw", ["cuda"], graph=True)
    x, y = (cp.asarray(a) for a in batches(shape, 1, seed=9)[0])
    predict = sg.compile_predict(step.model, example_inputs=(x,), device="cuda")
    first = sg.to_numpy(predict(x))
    for _ in range(5):
        step(x, y)
    second = sg.to_numpy(predict(x))
    cpu_model, _, _ = workload("mlp", 0.1)
    cpu_model.load_state_dict(step.model.state_dict())
    want = sg.compile_predict(cpu_model, example_inputs=(sg.to_numpy(x),))(sg.to_numpy(x))
    assert not np.array_equal(first, second)
    assert rel(second, want) < 1e-5
