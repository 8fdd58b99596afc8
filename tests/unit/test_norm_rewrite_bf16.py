"""compile/norm_rewrite.py under precision="bf16": the rewrites run after autocast, so they match
through its casts. The compatibility files' residual adds (a float32 stream plus a widened bf16
branch output) become add_layer_norm reading the bf16 branch output itself, and hand-written
RMSNorms of a bf16 x (a bf16 square read through a cast) become rms_norm. Judged on the NumPy
backend against torch float64 (tests/reference.py's policy), with the unfused bf16 step (the
switch off) as the yardstick of bf16's own error: torch's CPU autocast lists are not the CUDA
ones stepgraph follows, so torch has no bf16 run of the same problem to measure."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import nn as sgnn
from stepgraph import optim
from stepgraph.compile.norm_rewrite import ADD_LAYER_NORM_SWITCH, RMS_NORM_SWITCH
from stepgraph.models import GPT, GPTConfig, next_token_loss
from tests.compat.test_compat_models import setup, state, torch_run
from tests.reference import assert_close_to_reference, assert_state_changes_close
from tests.unit.test_norm_rewrite import (C, RMS_FORMS, RMS_NEAR_MISSES, _near_miss_net, batches,
                                          models, op_counts, pre_norm_net)

STEPS, LR, MOMENTUM = 3, 0.05, 0.9
# gpt.py and vit.py: 2 blocks of x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)), then ln_f. The
# sums of each block feed the next LayerNorm (ln_2, the next block's ln_1, ln_f): 4 sites. The
# first block's ln_1 reads x = embedding + position (a broadcast add): no site.
FILES = {"gpt": 4, "vit": 4}


def bf16_step(model, loss, data, precision="bf16"):
    return sg.compile_train_step(model, loss, optim.SGD(lr=LR, momentum=MOMENTUM),
                                 example_inputs=data[0], precision=precision)


def forward_ops(step) -> list:
    return [n for n in step.plan(step.signature).graph.nodes if n.op == "add_layer_norm"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(FILES))
def test_compat_files_fuse_every_residual_layer_norm(name, precision, request):
    s = setup(name, request.node.name)
    loss = getattr(sgnn.functional, s.case.loss) if s.case.loss else None
    step = bf16_step(s.stepgraph_model(), loss, s.batches[:1], precision)
    counts = op_counts(step)
    assert counts.get("add_layer_norm") == FILES[name] and counts.get("layer_norm") == 1
    fused = forward_ops(step)
    # under bf16 the widening cast is folded: b is the branch's bf16 GEMM output, s float32
    want = "bfloat16" if precision == "bf16" else "float32"
    assert [(n.inputs[0].dtype, n.inputs[1].dtype, n.outputs[3].dtype) for n in fused] == \
        [("float32", want, "float32")] * FILES[name]


def _run(make_model, loss, data, monkeypatch, switch, on: bool):
    monkeypatch.setenv(switch, "1" if on else "0")
    model = make_model()
    step = bf16_step(model, loss, data)
    losses = [float(step(*b)) for b in data]
    return op_counts(step), losses, {k: np.asarray(v) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", list(FILES))
def test_compat_file_bf16_step_with_the_rewrite_trains_as_without(name, request, monkeypatch):
    """The forward is the unfused bf16 step's bit for bit (the first loss); over the run, the
    losses and every parameter's change are within 4x the unfused bf16 step's own error of
    torch float64's (the backward rounds dx + ds once where the unfused one rounded twice)."""
    s = setup(name, request.node.name)
    data = s.batches[:STEPS]
    loss = getattr(sgnn.functional, s.case.loss) if s.case.loss else None
    t64 = copy.deepcopy(s.torch_model)
    loss64 = torch_run(t64, s.case, data, torch.float64)
    plain = _run(s.stepgraph_model, loss, data, monkeypatch, ADD_LAYER_NORM_SWITCH, False)
    fused = _run(s.stepgraph_model, loss, data, monkeypatch, ADD_LAYER_NORM_SWITCH, True)
    assert "add_layer_norm" not in plain[0]
    assert fused[0].get("add_layer_norm") == FILES[name]
    assert fused[1][0] == plain[1][0]
    assert_close_to_reference(fused[1], loss64, plain[1], "losses")
    assert_state_changes_close(s.initial, fused[2], state(t64), plain[2],
                               trained=[k for k, _ in s.torch_model.named_parameters()])


def _shared_branch_net(t):
    """s = x + h whose bf16 h another float32 reader widens too (autocast's one cast of h):
    the cast stays, add_layer_norm reads its float32 output."""
    nn = t.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.ln, self.head = nn.Linear(C, C), nn.LayerNorm(C), nn.Linear(C, 5)

        def forward(self, x):
            h = self.fc(x)
            return self.head(self.ln(x + h) * h)
    return Net


def test_a_widened_branch_read_elsewhere_keeps_its_cast(request):
    data = batches(request.node.name, 1)
    step = bf16_step(models(_shared_branch_net)[1](), sgnn.functional.cross_entropy, data)
    graph = step.plan(step.signature).graph
    (fused,) = [n for n in graph.nodes if n.op == "add_layer_norm"]
    assert fused.inputs[1].dtype == "float32"
    producer = graph.producers()[fused.inputs[1]]
    assert producer.op == "cast" and producer.inputs[0].dtype == "bfloat16"


@pytest.mark.parametrize("kind", ["broadcast", "after", "bf16_stream"])
def test_bf16_adds_the_pass_leaves_alone(kind, request):
    """A broadcast add, a sum no LayerNorm reads, and a bf16 residual stream (pre_norm_net: x
    is a GEMM's bf16 output, so add(bf16, bf16) -> s reaches the LayerNorm through a cast: the
    op would have to store s in bf16 and normalise it with float32 weights, which it does
    not)."""
    data = batches(request.node.name, 1)
    make = pre_norm_net if kind == "bf16_stream" else _near_miss_net(kind)
    step = bf16_step(models(make)[1](), sgnn.functional.cross_entropy, data)
    assert "add_layer_norm" not in op_counts(step)


GPT_SIZE = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=32, dropout=0.2)


def _gpt_run(start, precision, data, monkeypatch, on: bool):
    """A two-block nanoGPT (stepgraph.models.GPT, residual dropout 0.2) from the weights
    `start`, trained on data: (its plan's graph, losses, final state)."""
    monkeypatch.setenv(ADD_LAYER_NORM_SWITCH, "1" if on else "0")
    model = GPT(GPT_SIZE)
    model.load_state_dict(start)
    step = sg.compile_train_step(model, next_token_loss, optim.SGD(lr=LR, momentum=MOMENTUM),
                                 example_inputs=data[0], precision=precision)
    losses = [float(step(*b)) for b in data]
    graph = step.plan(step.signature).graph      # the plan of this switch's setting
    return graph, losses, {k: np.asarray(v, np.float64) for k, v in model.state_dict().items()}


def _counts(graph) -> dict[str, int]:
    return {op: sum(n.op == op for n in graph.nodes) for op in {n.op for n in graph.nodes}}


def test_bf16_residual_dropout_folds_into_add_layer_norm(request, monkeypatch):
    """x + dropout(proj(h)) under bf16 (the bf16 dropout, its widening cast, the float32 add):
    add_layer_norm reads the GEMM's bf16 output and drops it itself, the residual gradient's
    sum rides add_layer_norm_grad, and the dropout's gradient rides the norm gradient's bf16
    dx copy (dx_half_dropout). The forward is the unfused step's bit for bit (the same Philox
    masks: the first loss); over the run, losses and every parameter's change are within 4x
    the unfused bf16 step's own distance from the float32 step (the same masks)."""
    gen = np.random.default_rng(abs(hash(request.node.name)) % 2**32)
    data = [(gen.integers(0, 11, (4, 8)).astype(np.int32),
             gen.integers(0, 11, (4, 8)).astype(np.int32)) for _ in range(STEPS)]
    start = {k: np.asarray(v).copy() for k, v in GPT(GPT_SIZE).state_dict().items()}
    initial = {k: v.astype(np.float64) for k, v in start.items()}
    graph, fused_losses, fused = _gpt_run(start, "bf16", data, monkeypatch, True)
    plain_graph, plain_losses, plain = _gpt_run(start, "bf16", data, monkeypatch, False)
    ref_graph, ref_losses, ref = _gpt_run(start, "fp32", data, monkeypatch, True)
    counts = _counts(graph)
    # 2 blocks: each block's two residual sums feed ln_2, the next ln_1 / ln_f; the gradient of
    # the last sum has no residual term (ln_f alone reads it): a plain layer_norm_grad
    assert counts.get("add_layer_norm") == 4 and counts.get("add_layer_norm_grad") == 3
    producers = graph.producers()
    for n in (n for n in graph.nodes if n.op == "add_layer_norm"):
        assert n.inputs[1].dtype == "bfloat16" and n.attrs["dropout"] == 0.2
        assert producers[n.inputs[1]].op in ("linear", "reshape")
    # each of the 4 dropped branches' gradients: the bf16 dx copy of the norm gradient of the
    # sum it was added to (3 add_layer_norm_grad, ln_f's layer_norm_grad)
    assert "dropout_grad" not in counts
    assert sum(n.attrs.get("dx_half_dropout") == 0.2 for n in graph.nodes) == 4
    assert "add_layer_norm" not in _counts(plain_graph)
    assert _counts(ref_graph).get("add_layer_norm") == 4     # float32: folded alike
    assert fused_losses[0] == plain_losses[0]
    assert_close_to_reference(fused_losses, ref_losses, plain_losses, "losses")
    assert_state_changes_close(initial, fused, ref, plain)


# ---- RMSNorm ------------------------------------------------------------------------------

def _torch64_run(tm, data) -> tuple[list, dict]:
    """(losses, final state) of a float64 copy of torch model tm trained on data: the
    reference of the bf16 RMSNorm steps."""
    t64 = copy.deepcopy(tm).double()
    opt = torch.optim.SGD(t64.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(t64(torch.tensor(x).double()), torch.tensor(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy() for k, v in t64.state_dict().items()}


@pytest.mark.parametrize("form", list(RMS_FORMS))
def test_bf16_rms_norm_becomes_one_op_and_trains_as_unfused(form, request, monkeypatch):
    """pre_norm_net's x is bf16 (a GEMM's output) under autocast. Fused, the square is taken
    in float32 where the unfused step rounds each x^2 to bf16: within 4x of the unfused bf16
    step's error of torch float64's, losses and every parameter's change."""
    data = batches(request.node.name)
    make = lambda t: pre_norm_net(t, rms=form)    # noqa: E731
    tm, ours = models(make)
    initial = {k: v.detach().double().numpy() for k, v in tm.state_dict().items()}
    loss64, final64 = _torch64_run(tm, data)
    ce = sgnn.functional.cross_entropy
    plain = _run(ours, ce, data, monkeypatch, RMS_NORM_SWITCH, False)
    fused = _run(ours, ce, data, monkeypatch, RMS_NORM_SWITCH, True)
    assert "rms_norm" not in plain[0]
    counts = fused[0]
    assert counts.get("rms_norm") == 4 and counts.get("rms_norm_grad") == 4
    assert_close_to_reference(fused[1], loss64, plain[1], "losses")
    assert_state_changes_close(initial, fused[2], final64, plain[2])


def _float32_stream_rms_net(t):
    """x = x + fc1(rms_norm(x)); x = x + fc2(rms_norm(x)) on a float32 input stream: under
    bf16 the second norm reads x plus the widened bf16 fc1 output."""
    nn, F = t.nn, t.nn.functional

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.head = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, 5)
            self.w1 = nn.Parameter(1.0 + 0.1 * t.randn(C))
            self.w2 = nn.Parameter(1.0 + 0.1 * t.randn(C))

        def forward(self, x):
            x = x + self.fc1(F.rms_norm(x, (C,), self.w1, 1e-6))
            x = x + self.fc2(F.rms_norm(x, (C,), self.w2, 1e-6))
            return self.head(x)
    return Net


def test_bf16_residual_rms_norm_reads_the_bf16_branch_and_trains_as_unfused(request,
                                                                            monkeypatch):
    """The residual add before an RMSNorm under bf16 becomes add_rms_norm reading the branch's
    bf16 output itself; losses and every parameter's change within 4x the unfused bf16 step's
    own error of torch float64's."""
    data = batches(request.node.name)
    tm, ours = models(_float32_stream_rms_net)
    initial = {k: v.detach().double().numpy() for k, v in tm.state_dict().items()}
    loss64, final64 = _torch64_run(tm, data)
    ce = sgnn.functional.cross_entropy
    plain = _run(ours, ce, data, monkeypatch, ADD_LAYER_NORM_SWITCH, False)
    fused = _run(ours, ce, data, monkeypatch, ADD_LAYER_NORM_SWITCH, True)
    assert "add_rms_norm" not in plain[0] and plain[0].get("rms_norm") == 2
    assert fused[0].get("add_rms_norm") == 1 and fused[0].get("rms_norm") == 1
    step = bf16_step(ours(), ce, data)
    (node,) = [n for n in step.plan(step.signature).graph.nodes if n.op == "add_rms_norm"]
    assert [v.dtype for v in node.inputs[:2]] == ["float32", "bfloat16"]
    assert fused[1][0] == plain[1][0]
    assert_close_to_reference(fused[1], loss64, plain[1], "losses")
    assert_state_changes_close(initial, fused[2], final64, plain[2])


@pytest.mark.parametrize("form", list(RMS_NEAR_MISSES))
def test_bf16_rms_norm_near_misses_are_left_alone(form, request):
    data = batches(request.node.name, 1)
    model = models(lambda t: pre_norm_net(t, rms=form))[1]()
    counts = op_counts(bf16_step(model, sgnn.functional.cross_entropy, data))
    assert "rms_norm" not in counts and "rms_norm_grad" not in counts
