"""The optimizer's update overlapping the backward pass on the GPU (compile/overlap.py,
issue 11): the update split into buckets, each forked onto the update stream inside the step
and joined before its end, gives the serial step's losses, parameters, optimizer state and
bf16 weight copies bit for bit (fp32 and bf16 AdamW, SGD with Nesterov momentum, a
channels-last bf16 cnn whose updates also permute the conv weights' copies); a graph replay
of the overlapped step equals its eager run bit for bit, and the captured graph holds the
serial step's kernels plus one update launch per extra bucket (fork and join are edges, no
nodes). Both sides run with on_bad_batch="ignore" (a guard turns the overlap off)."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import losses, models, nn, optim
from stepgraph.compile import overlap
from stepgraph.compile.distribute import UPDATE_OPS

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda
cp = require_gpu()

# 16 KiB of parameters a bucket: the larger weights of the mlp and the cnn get a bucket each,
# the biases share; several buckets without a model of hundreds of MiB.
SMALL_CAP_MB = 16 / 1024
STEPS = 6

CASES = {
    "mlp fp32 adamw": ("mlp", "fp32", "adamw", "contiguous"),
    "mlp bf16 adamw": ("mlp", "bf16", "adamw", "contiguous"),
    "mlp fp32 sgd nesterov": ("mlp", "fp32", "sgd", "contiguous"),
    "cnn bf16 sgd nesterov channels-last": ("cnn", "bf16", "sgd", "channels_last"),
}


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch):
    monkeypatch.setattr(overlap, "UPDATE_BUCKET_CAP_MB", SMALL_CAP_MB)


def workload(name: str):
    if name == "mlp":
        return models.mlp(784, 512, 10, dropout=0.2), losses.cross_entropy, (784,)
    return models.cnn(dropout=0.3), losses.nll_loss, (1, 28, 28)


def make_optimizer(kind: str):
    if kind == "adamw":
        return optim.AdamW(lr=1e-3, weight_decay=0.01)
    return optim.SGD(lr=0.01, momentum=0.9, weight_decay=5e-4, nesterov=True)


def batches(shape, n, seed, batch=64):
    rng = np.random.default_rng(seed)
    return [(cp.asarray(rng.standard_normal((batch, *shape), dtype=np.float32)),
             cp.asarray(rng.integers(0, 10, batch))) for _ in range(n)]


def compile_twin(case: str, overlap_update, graph: bool, data):
    """A step of CASES[case] over a fresh model with the same initial weights every call."""
    name, precision, kind, memory_format = CASES[case]
    nn.init.manual_seed(0)
    model, loss, _ = workload(name)
    return sg.compile_train_step(model, loss, make_optimizer(kind), data[0], device="cuda",
                                 graph=graph, seed=1, precision=precision,
                                 on_bad_batch="ignore", memory_format=memory_format,
                                 overlap_update=overlap_update)


def executable(step):
    (exe,) = step.executables.values()
    return exe


def forked_updates(step) -> list:
    return [n for n, _, _ in executable(step).calls
            if n.op in UPDATE_OPS and n.attrs.get("update_stream")]


def update_launches(step) -> int:
    """Kernels the step's update nodes launch: one for each kind of job a node has, its
    parameters in plain chunks and those it moves through its tile (backends/cuda/optim.py)."""
    from stepgraph.backends.cuda import optim as cuda_optim

    exe = executable(step)
    tables = [cuda_optim._update_tables(node, ins, exe.ctx)[0]
              for node, ins, _ in exe.calls if node.op in UPDATE_OPS]
    return sum(bool(len(t["plain"])) + bool(len(t["sliced"])) for t in tables)


def assert_same_state(got, want) -> None:
    """Parameters, optimizer state, step counter and bf16 weight copies, bit for bit."""
    a, b = got.state_dict(), want.state_dict()
    assert sorted(a) == sorted(b)
    for key in b:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    for key, buf in want.state.items():
        if key.startswith("autocast."):
            np.testing.assert_array_equal(cp.asnumpy(got.state[key]), cp.asnumpy(buf),
                                          err_msg=key)


@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapped_graph_equals_the_serial_graph_bit_for_bit(case):
    shape = workload(CASES[case][0])[2]
    data = batches(shape, STEPS, seed=2)
    serial = compile_twin(case, False, True, data)
    overlapped = compile_twin(case, True, True, data)
    assert len(forked_updates(overlapped)) > 1 and not forked_updates(serial)
    for x, y in data:
        assert float(serial(x, y)) == float(overlapped(x, y))
    assert_same_state(overlapped, serial)
    # The same kernels, the update's launches now per bucket; forks and joins add none.
    plain, split = executable(serial).captured, executable(overlapped).captured
    assert plain is not None and split is not None
    if plain.node_count is None:
        pytest.skip("cuda-python is missing: graph nodes cannot be counted")
    assert split.node_count - plain.node_count == \
        update_launches(overlapped) - update_launches(serial)


@pytest.mark.parametrize("case", ["mlp bf16 adamw", "mlp fp32 sgd nesterov"])
def test_overlapped_graph_replay_equals_its_eager_run(case):
    shape = workload(CASES[case][0])[2]
    data = batches(shape, STEPS, seed=3)
    eager = compile_twin(case, True, False, data)
    graph = compile_twin(case, True, True, data)
    for x, y in data:
        assert float(eager(x, y)) == float(graph(x, y))
    assert executable(graph).captured is not None and executable(eager).captured is None
    assert_same_state(graph, eager)


def test_auto_overlaps_an_unguarded_step_with_several_buckets_only():
    data = batches((784,), 1, seed=4)
    auto = compile_twin("mlp fp32 adamw", "auto", True, data)
    assert len(forked_updates(auto)) > 1
    nn.init.manual_seed(0)
    model, loss, _ = workload("mlp")
    guarded = sg.compile_train_step(model, loss, make_optimizer("adamw"), data[0],
                                    device="cuda", on_bad_batch="raise")
    assert not forked_updates(guarded)
