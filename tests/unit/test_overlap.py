"""The optimizer's update overlapping the backward pass (compile/overlap.py, issue 11), on the
CPU: the split updates give the serial step's parameters, optimizer state and losses bit for
bit (numpy backend, program order: SGD with momentum, Nesterov and weight decay, AdamW with
parameter groups, bf16 weight copies, channels-last conv copies, weight tying, attention
dropout); every update sits where nothing later conflicts with it (last readers of the
parameter, its slots and its bf16 copy; the step counter); the option's errors and "auto";
and the CUDA launch sequence of a forked update and the join, with streams faked."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import losses, models, nn, optim
from stepgraph.compile import overlap
from stepgraph.compile.build import build_train_graph
from stepgraph.compile.distribute import UPDATE_OPS
from stepgraph.compile.feed import signature_of
from stepgraph.compile.fuse import fuse
from stepgraph.compile.plan import _view_roots
from stepgraph.errors import CaptureError, PlanError
from stepgraph.ir.graph import Node
from tests.ops.helpers import seeded

TINY_CAP_MB = 2000 / 2**20      # about 2 KB of parameters a bucket: several buckets
ONE_A_BUCKET_MB = 1 / 2**20     # one byte: every parameter is a bucket of its own


@pytest.fixture
def tiny_buckets(monkeypatch):
    monkeypatch.setattr(overlap, "UPDATE_BUCKET_CAP_MB", TINY_CAP_MB)


class WeightFirst(nn.Module):
    """y = (W x^T)^T: W is matmul's first operand, so the backward finalises dW before it
    reads W again for dx (the matmul VJP emits the first operand's gradient first)."""

    def __init__(self, n_in: int, n_out: int, seed: int = 0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.weight = nn.Parameter(rng.standard_normal((n_out, n_in)) / np.sqrt(n_in))

    def forward(self, x):
        return (x.tracer.param(self.weight) @ x.T).T


def mlp():
    return models.mlp(12, 24, 5, dropout=0.2)


def weight_first():
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Dropout(0.1), WeightFirst(16, 16),
                         nn.GELU(), nn.Linear(16, 5))


def grouped_adamw(model):
    decay = [p for p in model.parameters() if p.data.ndim >= 2]
    rest = [p for p in model.parameters() if p.data.ndim < 2]
    return optim.AdamW([{"params": decay, "weight_decay": 0.1},
                        {"params": rest, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2,
                       betas=(0.8, 0.95))


def nesterov_sgd(model):
    return optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)


def plain_sgd(model):
    return optim.SGD(lr=0.05)


def classes_batches(rng, shape, classes, n):
    return [(rng.standard_normal((6, *shape)).astype(np.float32),
             rng.integers(0, classes, 6)) for _ in range(n)]


def token_batches(rng, vocab, block, n):
    return [(rng.integers(0, vocab, (3, block)).astype(np.int32),
             rng.integers(0, vocab, (3, block)).astype(np.int64)) for _ in range(n)]


def tiny_gpt():
    return models.gpt(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.2)


def compile_step(build, make_optimizer, loss, data, overlap_update, precision="fp32",
                 memory_format="contiguous", seed=0, **options):
    nn.init.manual_seed(seed)
    model = build()
    return sg.compile_train_step(model, loss, make_optimizer(model), data[0],
                                 precision=precision, memory_format=memory_format,
                                 on_bad_batch=options.pop("on_bad_batch", "ignore"),
                                 overlap_update=overlap_update, seed=seed, **options)


def plan_nodes(step) -> list[Node]:
    return next(iter(step.executables.values())).plan.steps


CASES = {
    "mlp sgd nesterov": (mlp, nesterov_sgd, losses.cross_entropy, (12,), 5, "fp32", "contiguous"),
    "mlp adamw groups": (mlp, grouped_adamw, losses.cross_entropy, (12,), 5, "fp32",
                         "contiguous"),
    "weight-first sgd nesterov": (weight_first, nesterov_sgd, losses.cross_entropy, (12,), 5,
                                  "fp32", "contiguous"),
    "weight-first adamw bf16": (weight_first, grouped_adamw, losses.cross_entropy, (12,), 5,
                                "bf16", "contiguous"),
    "weight-first sgd nesterov bf16": (weight_first, nesterov_sgd, losses.cross_entropy, (12,),
                                       5, "bf16", "contiguous"),
    "resnet sgd nesterov bf16 channels-last": (
        lambda: models.resnet(widths=(4, 8, 8)), nesterov_sgd, losses.cross_entropy,
        (3, 8, 8), 10, "bf16", "channels_last"),
    "cnn plain sgd": (lambda: models.cnn(0.3), plain_sgd, losses.nll_loss, (1, 28, 28), 10,
                      "fp32", "contiguous"),
}


@pytest.mark.parametrize("cap_mb", [TINY_CAP_MB, ONE_A_BUCKET_MB], ids=["2KB", "1B"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_overlapped_steps_equal_the_serial_step_bit_for_bit(case, cap_mb, monkeypatch):
    monkeypatch.setattr(overlap, "UPDATE_BUCKET_CAP_MB", cap_mb)
    build, make_optimizer, loss, shape, classes, precision, memory_format = CASES[case]
    data = classes_batches(seeded(case), shape, classes, 4)
    assert_same_training(build, make_optimizer, loss, data, precision, memory_format)


def test_tied_weights_and_attention_dropout_train_alike(tiny_buckets):
    """GPT: the token embedding is also the classifier (one parameter, read at both ends of the
    step), and attention's backward regenerates its dropout mask from the step counter."""
    data = token_batches(seeded("gpt overlap"), 11, 8, 3)
    assert_same_training(tiny_gpt, grouped_adamw, models.next_token_loss, data, "fp32",
                         "contiguous")


def assert_same_training(build, make_optimizer, loss, data, precision, memory_format):
    serial, overlapped = (compile_step(build, make_optimizer, loss, data, flag, precision,
                                       memory_format) for flag in (False, True))
    updates = [n for n in plan_nodes(overlapped) if n.op in UPDATE_OPS]
    assert len(updates) > 1 and all(n.attrs["update_stream"] for n in updates)
    assert [n.op for n in plan_nodes(overlapped)].count("update_join") == 1
    assert not any(n.op == "update_join" for n in plan_nodes(serial))
    for x, y in data:
        assert float(serial(x, y)) == float(overlapped(x, y))
    want, got = serial.state_dict(), overlapped.state_dict()
    assert sorted(want) == sorted(got)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    copies = {k: v for k, v in serial.state.items() if k.startswith("autocast.")}
    for key, value in copies.items():     # the bf16 weight copies the updates write
        np.testing.assert_array_equal(overlapped.state[key], value, err_msg=key)
    assert bool(copies) == (precision == "bf16")


# ---- where the updates go -------------------------------------------------------------------

def fused_graph(build, make_optimizer, loss, data, precision="fp32", on_bad_batch="ignore"):
    nn.init.manual_seed(0)
    model = build()
    signature = signature_of(("x", "y"), data[0])
    return fuse(build_train_graph(model, loss, make_optimizer(model), signature, 0,
                                  on_bad_batch, "contiguous", precision))


def touches(node, roots):
    def root(v):
        return roots.get(v, v)
    return ({root(v) for v in node.inputs},
            {root(v) for v in node.outputs} | {root(node.inputs[i]) for i in node.mutates})


def assert_every_update_is_safe_and_early(nodes):
    """Each forked update reads only what earlier nodes wrote; no node between it and the join
    reads or writes what it writes, or writes what it reads; and it sits right after a node it
    could not go before (another update, or one it conflicts with)."""
    roots = _view_roots(nodes)
    (join,) = [i for i, n in enumerate(nodes) if n.op == "update_join"]
    written = {v for n in nodes for v in n.outputs}
    position = {v: i for i, n in enumerate(nodes) for v in n.outputs}
    for q, update in enumerate(nodes):
        if update.op not in UPDATE_OPS:
            continue
        assert q < join
        reads, writes = touches(update, roots)
        assert all(position[v] < q for v in update.inputs if v in written)
        for node in nodes[q + 1:join]:
            r, w = touches(node, roots)
            assert not (w & (reads | writes)) and not (r & writes), (update.label, node)
        before = nodes[q - 1]
        r, w = touches(before, roots)
        assert before.op in UPDATE_OPS or w & (reads | writes) or r & writes, update.label


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_weight_is_updated_only_after_its_last_reader(precision):
    data = classes_batches(seeded("last reader"), (12,), 5, 1)
    graph = overlap.overlap_update(fused_graph(weight_first, grouped_adamw,
                                               losses.cross_entropy, data, precision), 1)
    nodes = graph.nodes
    assert_every_update_is_safe_and_early(nodes)
    weight = next(p for p in graph.params if p.name == "3.weight")
    (update,) = [n for n in nodes if n.op in UPDATE_OPS and weight in n.inputs]
    k, n = update.attrs["n_scalars"], update.attrs["n_params"]
    grad = update.inputs[k + update.inputs[k:k + n].index(weight) + n]
    copies = [v for v in update.inputs if v.name == f"autocast.bf16.{weight.name}"]
    assert bool(copies) == (precision == "bf16")
    position = {v: i for i, node in enumerate(nodes) for v in node.outputs}
    producer = nodes[position[grad]]
    if producer.op == "cast":        # bf16: the float32 gradient is the cast of the bf16 dW
        grad = producer.inputs[0]
    last_read = max(i for i, node in enumerate(nodes)
                    if node is not update and {weight, *copies} & set(node.inputs))
    # dW is computed before the backward's dx = dy @ W reads W (or its bf16 copy) again ...
    assert position[grad] < last_read
    # ... and the update of W waits for that read.
    assert nodes.index(update) > last_read


def test_one_parameter_a_bucket_places_each_right_after_its_safe_point():
    data = classes_batches(seeded("one a bucket"), (12,), 5, 1)
    graph = overlap.overlap_update(fused_graph(mlp, nesterov_sgd, losses.cross_entropy,
                                               data), 1)
    updates = [n for n in graph.nodes if n.op in UPDATE_OPS]
    assert len(updates) == len(graph.params) and all(n.attrs["n_params"] == 1 for n in updates)
    assert_every_update_is_safe_and_early(graph.nodes)
    # The first layer's updates (finalised last) are forked before the join, not earlier.
    assert graph.nodes[-1].op == "update_join"


def test_the_split_keeps_the_serial_program_but_for_the_step_bookkeeping():
    data = classes_batches(seeded("program"), (12,), 5, 1)
    serial = fused_graph(mlp, grouped_adamw, losses.cross_entropy, data)
    graph = overlap.overlap_update(serial, 1)
    rest = [n.op for n in graph.nodes if n.op not in UPDATE_OPS + ("update_join",)]
    assert sorted(rest) == sorted(n.op for n in serial.nodes if n.op not in UPDATE_OPS)
    ops = [n.op for n in graph.nodes]
    # Dropout reads the step counter in the forward only: the bookkeeping follows the loss.
    assert ops[ops.index("cross_entropy_train") + 1] == "advance_step"
    assert max(i for i, n in enumerate(graph.nodes) if n.op == "dropout") < \
        ops.index("advance_step")
    (serial_update,) = [n for n in serial.nodes if n.op in UPDATE_OPS]
    updates = [n for n in graph.nodes if n.op in UPDATE_OPS]
    assert sum(n.attrs["n_params"] for n in updates) == serial_update.attrs["n_params"]
    # Each bucket reads its parameters' rows of the one hyperparameter table (and group).
    hyper = serial_update.inputs[2]
    assert hyper.name == "optimizer.hyperparameters"
    by_param = {}
    for n in updates:
        k, count = n.attrs["n_scalars"], n.attrs["n_params"]
        assert n.inputs[2] is hyper and len(n.attrs["hyper_rows"]) == count
        assert len(n.attrs["param_group"]) == count
        for j, p in enumerate(n.inputs[k:k + count]):
            by_param[p] = (n.attrs["hyper_rows"][j], n.attrs["param_group"][j])
    k, count = serial_update.attrs["n_scalars"], serial_update.attrs["n_params"]
    assert "hyper_rows" not in serial_update.attrs     # parameter i reads row i
    for j, p in enumerate(serial_update.inputs[k:k + count]):
        assert by_param[p] == (j, serial_update.attrs["param_group"][j])


def test_a_late_reader_of_the_step_counter_holds_the_bookkeeping_back():
    data = token_batches(seeded("late counter"), 11, 8, 1)
    graph = overlap.overlap_update(fused_graph(tiny_gpt, grouped_adamw, models.next_token_loss,
                                               data), 1)
    ops = [n.op for n in graph.nodes]
    step = next(v for v in graph.state if v.name == "optimizer.step")
    readers = [i for i, n in enumerate(graph.nodes)
               if step in n.inputs and n.op not in UPDATE_OPS + ("advance_step",)]
    # attention's backward (sdpa_grad, or its packed-heads form) regenerates its dropout mask
    assert any(graph.nodes[i].op.startswith("sdpa") and graph.nodes[i].label.endswith(" bwd")
               for i in readers)
    assert ops.index("advance_step") > max(readers)
    assert_every_update_is_safe_and_early(graph.nodes)


def test_join_holds_the_gradients_until_the_end():
    data = classes_batches(seeded("held"), (12,), 5, 1)
    graph = overlap.overlap_update(fused_graph(mlp, plain_sgd, losses.cross_entropy, data), 1)
    join = graph.nodes[-1]
    grads = {v for n in graph.nodes if n.op in UPDATE_OPS
             for v in n.inputs[3 + n.attrs["n_params"]:3 + 2 * n.attrs["n_params"]]}
    assert grads <= set(join.inputs)
    assert not any(v.is_external for v in join.inputs)


# ---- the option -----------------------------------------------------------------------------

def small_step(overlap_update, **options):
    data = classes_batches(seeded("option"), (12,), 5, 1)
    return compile_step(mlp, options.pop("optimizer", nesterov_sgd), losses.cross_entropy,
                        data, overlap_update, **options)


def test_option_values_are_checked():
    with pytest.raises(ValueError, match="overlap_update must be 'auto', True or False"):
        small_step("yes")
    with pytest.raises(ValueError, match="overlap_update"):
        small_step(1)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_true_with_a_guard_says_why(policy):
    with pytest.raises(PlanError, match="overlap_update=True cannot apply: on_bad_batch"):
        small_step(True, on_bad_batch=policy)


def test_true_with_clipping_says_why():
    with pytest.raises(PlanError, match="max_grad_norm"):
        small_step(True, optimizer=lambda m: optim.AdamW(lr=1e-3, max_grad_norm=1.0))


def test_true_with_data_parallelism_says_why():
    with pytest.raises(PlanError, match="data-parallel"):
        small_step(True, distributed=True)


def test_auto_is_off_on_the_cpu(tiny_buckets):
    step = small_step("auto")
    assert not any(n.op == "update_join" for n in plan_nodes(step))


def test_auto_on_cuda_needs_more_than_one_bucket_and_no_guard_or_clipping(monkeypatch):
    data = classes_batches(seeded("auto"), (12,), 5, 1)
    plain = fused_graph(mlp, nesterov_sgd, losses.cross_entropy, data)
    assert overlap.resolve("auto", plain, "cuda") is plain          # one bucket: unchanged
    assert overlap.resolve("auto", plain, "cpu") is plain
    assert overlap.resolve(False, plain, "cuda") is plain
    assert any(n.op == "update_join" for n in overlap.resolve(True, plain, "cpu").nodes)
    monkeypatch.setattr(overlap, "UPDATE_BUCKET_CAP_MB", TINY_CAP_MB)
    assert any(n.op == "update_join" for n in overlap.resolve("auto", plain, "cuda").nodes)
    guarded = fused_graph(mlp, nesterov_sgd, losses.cross_entropy, data, on_bad_batch="skip")
    clipped = fused_graph(mlp, lambda m: optim.SGD(lr=0.1, max_grad_norm=1.0),
                          losses.cross_entropy, data)
    for graph, why in ((guarded, "on_bad_batch"), (clipped, "max_grad_norm")):
        assert overlap.resolve("auto", graph, "cuda") is graph
        assert why in overlap.overlap_blocker(graph)


def test_the_option_is_part_of_the_compile_cache_key():
    nn.init.manual_seed(0)
    model = mlp()
    opt = nesterov_sgd(model)
    data = classes_batches(seeded("cache"), (12,), 5, 1)

    def compiled(flag):
        return sg.compile_train_step(model, losses.cross_entropy, opt, data[0],
                                     on_bad_batch="ignore", overlap_update=flag)
    on, off = compiled(True), compiled(False)
    assert on is not off and compiled(True) is on and compiled(False) is off


# ---- the CUDA launch sequence, streams and launches faked ----------------------------------

def test_a_forked_update_runs_on_the_update_stream_and_the_join_waits_for_it(monkeypatch):
    pytest.importorskip("cupy")
    from stepgraph.backends.cuda import optim
    from stepgraph.backends.cuda.runtime import side_stream, update_stream
    from stepgraph.backends.cuda.runtime.context import CudaContext
    from tests.unit.test_distributed import fake_cuda

    calls = []
    cp, Stream = fake_cuda(calls)
    monkeypatch.setattr(side_stream, "cp", cp)
    launched = lambda ctx, node, ins: calls.append(("launch", node.op, ctx.stream.name))  # noqa
    monkeypatch.setattr(optim, "adam_update", launched)
    ctx = CudaContext(stream=Stream("main"))
    forked = Node("adam_update", [], [], {"update_stream": True})
    serial = Node("adam_update", [], [], {})
    impls = optim.IMPLS
    impls["adam_update"](serial, [], [], ctx)
    assert calls == [("launch", "adam_update", "main")]
    impls["adam_update"](forked, [], [], ctx)
    impls["adam_update"](Node("adam_update", [], [], {"update_stream": True}), [], [], ctx)
    impls["update_join"](Node("update_join", [], [], {}), [], [], ctx)
    side = ctx.extras[update_stream.EXTRAS_KEY].stream.name
    first, second = calls[1:5], calls[5:9]
    for record, wait, launch, done in (first, second):
        assert record[:2] == ("record", "main") and wait == ("wait", side, record[2])
        assert launch == ("launch", "adam_update", side) and done[:2] == ("record", side)
    assert calls[9] == ("wait", "main", second[3][2]) and len(calls) == 10
    impls["update_join"](Node("update_join", [], [], {}), [], [], ctx)   # nothing pending
    assert len(calls) == 10
    # The next step's fork reuses the node's events: nothing is made per step.
    impls["adam_update"](forked, [], [], ctx)
    assert calls[10][2] == first[0][2]


def test_a_forked_update_refuses_to_make_its_stream_while_capturing(monkeypatch):
    pytest.importorskip("cupy")
    from stepgraph.backends.cuda import optim
    from stepgraph.backends.cuda.runtime import side_stream
    from stepgraph.backends.cuda.runtime.context import CudaContext
    from tests.unit.test_distributed import fake_cuda

    cp, Stream = fake_cuda([])
    monkeypatch.setattr(side_stream, "cp", cp)
    monkeypatch.setattr(optim, "sgd_update", lambda *a: None)
    ctx = CudaContext(stream=Stream("main"), capturing=True)
    with pytest.raises(CaptureError, match="first eager run"):
        optim.IMPLS["sgd_update"](Node("sgd_update", [], [], {"update_stream": True}),
                                  [], [], ctx)


def test_the_optim_family_alone_runs_the_updates_in_the_backend_table():
    """The backend's sgd_update / adam_update / update_join entries are the optim family's
    (which fork onto the update stream): no family registers them as well."""
    pytest.importorskip("cupy")
    import importlib

    from stepgraph.backends.cuda.backend import IMPL_MODULES, declared_bf16_ops

    owners = {op: [m for m in IMPL_MODULES if op in importlib.import_module(
        f"stepgraph.backends.cuda.{m}").IMPLS] for op in ("sgd_update", "adam_update",
                                                          "update_join")}
    assert owners == dict.fromkeys(owners, ["optim"])
    assert "update_join" in declared_bf16_ops()
