"""compile/cross_entropy_rewrite.py: cross-entropy written by hand (log_softmax, then a gather
of the targets' log-probabilities negated and averaged or summed, or F.nll_loss) becomes one
cross_entropy node (cross_entropy_train in the plan), and the step trains as the same model
file on torch (tests/reference.py's policy: torch float64 the reference, stepgraph float32
within 4x torch float32's own error, on the losses and on every parameter's change).
Near-misses and the switched-off pass keep log_softmax and gather / nll and train as torch
too."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import optim
from stepgraph.compile.cross_entropy_rewrite import SWITCH_ENV, rewrite_cross_entropy
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import randn, seeded, trace_inputs
from tests.reference import assert_close_to_reference, assert_state_changes_close, state_float64

B, T, C, H, V = 3, 6, 4, 8, 5
STEPS, LR = 3, 0.5
COMPOSED_OPS = ("log_softmax", "log_softmax_grad", "gather", "gather_grad", "nll_loss",
                "nll_loss_grad")


def model_class(tm, form: str):
    """A two-layer model for the torch-like namespace `tm` (torch or stepgraph) whose forward
    returns its loss, written as `form`."""
    nn, F = tm.nn, tm.nn.functional

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.head = nn.Linear(C, H), nn.Linear(H, V)

        def forward(self, x, t):
            logits = self.head(tm.tanh(self.fc(x)))
            if form.startswith("nll"):
                return nll_form(tm, F, logits, t)
            logp = F.log_softmax(logits, dim=1 if form == "softmax_other_axis" else -1)
            if form == "gather_other_axis":            # picks along T, not the classes
                return -logp.gather(1, t[:, :V].unsqueeze(1)).mean()
            picked = logp.gather(-1, t.unsqueeze(-1))
            if form == "unsqueezed_mean":
                return -picked.mean()
            if form == "negated_after_mean":
                return -(picked.squeeze(-1).mean())
            squeezed = picked.squeeze(-1)
            nll = -0.5 * squeezed if form == "scale_half" else -squeezed
            if form in ("sum", "sum_2d"):
                return nll.sum()
            if form == "divided_by_batch":
                return nll.sum() / B
            if form == "partial_mean":
                return nll.mean(dim=-1).sum()
            if form == "logp_read_elsewhere":
                return nll.mean() + 0.01 * logp.mean()
            if form == "picked_read_elsewhere":
                return nll.mean() + 0.01 * nll.square().mean()
            return nll.mean()

    return Net


def nll_form(tm, F, logits, t):
    """F.nll_loss of the log-probabilities: (B*T, V) logits as they are ("nll_2d"), (B, T, V)
    ones viewed as rows ("nll_view")."""
    if logits.ndim == 3:
        return F.nll_loss(logits.log_softmax(-1).view(-1, V), t.view(-1))
    return F.nll_loss(tm.log_softmax(logits, -1), t)


REWRITTEN = ["mean", "sum", "mean_2d", "sum_2d", "unsqueezed_mean", "negated_after_mean",
             "nll_view", "nll_2d", "divided_by_batch"]
LEFT = ["softmax_other_axis", "gather_other_axis", "logp_read_elsewhere", "picked_read_elsewhere",
        "partial_mean", "scale_half"]


def batches(form: str) -> list[tuple]:
    gen = seeded(form)
    lead = (B * T,) if form.endswith("_2d") else (B, T)
    return [(randn(gen, *lead, C), gen.integers(0, V, lead).astype(np.int64))
            for _ in range(STEPS)]


def torch_run(model, data, dtype) -> list[float]:
    model = model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    result = []
    for x, t in data:
        opt.zero_grad()
        loss = model(torch.tensor(x).to(dtype), torch.tensor(t))
        loss.backward()
        opt.step()
        result.append(loss.item())
    return result


def stepgraph_run(form: str, start: dict, data, precision: str = "fp32"):
    """(losses, final state, the plan's op names) of the stepgraph model trained on data."""
    model = model_class(sg, form)()
    model.load_state_dict(start)
    step = sg.compile_train_step(model, None, optim.SGD(lr=LR), example_inputs=data[0],
                                 device="cpu", precision=precision)
    result = [float(step(*b)) for b in data]
    ops = [n.op for n in step.plan(step.signature).graph.nodes]
    return result, state_float64(model), ops, step


def check_trains_as_torch(form: str) -> list[str]:
    torch.manual_seed(0)
    t32 = model_class(torch, form)()
    start = {k: v.detach().numpy().copy() for k, v in t32.state_dict().items()}
    data = batches(form)
    t64 = copy.deepcopy(t32)
    losses = {"float64": torch_run(t64, data, torch.float64),
              "float32": torch_run(t32, data, torch.float32)}
    got, final, ops, _ = stepgraph_run(form, start, data)
    assert_close_to_reference(got, losses["float64"], losses["float32"], f"{form} losses")
    assert_state_changes_close({k: np.asarray(v, np.float64) for k, v in start.items()},
                               final, state_float64(t64), state_float64(t32), f"{form} ",
                               value_floor=True)
    return ops


def composed(ops: list[str]) -> int:
    return sum(ops.count(o) for o in COMPOSED_OPS)


@pytest.mark.parametrize("form", REWRITTEN)
def test_hand_written_cross_entropy_becomes_one_fused_op_and_trains_as_torch(form):
    """A sum is the fused mean times the row count: its backward seed is then that count,
    not 1, so the forward and its gradient stay two ops (cross_entropy, cross_entropy_grad)
    where a mean's fuse into one cross_entropy_train."""
    ops = check_trains_as_torch(form)
    summed = form.startswith("sum") or form == "divided_by_batch"     # nll.sum() / B
    fused = ("cross_entropy", "cross_entropy_grad") if summed else \
        ("cross_entropy_train",)
    assert [o for o in ops if o.startswith("cross_entropy")] == list(fused), ops
    assert composed(ops) == 0, ops


@pytest.mark.parametrize("form", LEFT)
def test_near_misses_keep_their_ops_and_train_as_torch(form):
    ops = check_trains_as_torch(form)
    assert "cross_entropy_train" not in ops and "cross_entropy" not in ops, ops
    assert "log_softmax" in ops and "gather" in ops, ops


@pytest.mark.parametrize("form", ["mean", "sum", "nll_view"])
def test_switched_off_the_step_keeps_log_softmax_and_gather(form, monkeypatch):
    monkeypatch.setenv(SWITCH_ENV, "0")
    ops = check_trains_as_torch(form)
    assert "cross_entropy_train" not in ops and "log_softmax" in ops, ops
    assert ("nll_loss" if form.startswith("nll") else "gather") in ops, ops


def traced(returns_logp: bool):
    """(graph, loss value) of the hand-written loss on float64 inputs; the graph returns the
    log-probabilities too when asked."""
    tracer = Tracer()
    ins = trace_inputs(tracer, {"x": np.zeros((B, T, V)), "t": np.zeros((B, T), np.int64)})
    logp = ins["x"].log_softmax(-1)
    loss = (-logp.gather(-1, ins["t"].unsqueeze(-1)).squeeze(-1)).mean()
    tracer.graph.outputs = {"logp": logp.value} if returns_logp else {}
    return tracer.graph, loss.value


def test_the_graph_gets_one_cross_entropy_node_of_the_flattened_rows():
    graph, loss = traced(False)
    ops = [n for n in rewrite_cross_entropy(graph, (loss,)).nodes if n.op not in ("reshape",)]
    assert [n.op for n in ops] == ["cross_entropy"], ops
    (ce,) = ops
    assert ce.outputs[0] is loss
    assert ce.inputs[0].shape == (B * T, V) and ce.inputs[1].shape == (B * T,)


def test_log_probabilities_a_step_returns_stay():
    graph, loss = traced(True)
    assert rewrite_cross_entropy(graph, (loss,)) is graph


def test_bf16_step_fuses_through_autocast_and_is_as_near_torch_as_the_composed_one(
        monkeypatch):
    """precision="bf16": autocast runs cross_entropy in float32 on the bf16 logits of the
    head (compile/fuse.py fuse_loss_casts takes the widening cast into the kernel), as the
    composed log_softmax ran. Judged against torch float64, the fused step is as near as the
    composed bf16 step (within 1.5x its error: both round the same bf16 GEMMs; the loss and
    dlogits differ by float32 roundings only)."""
    torch.manual_seed(0)
    t64 = model_class(torch, "mean")().double()
    start = {k: v.detach().float().numpy().copy() for k, v in t64.state_dict().items()}
    data = batches("mean")
    ref = torch_run(t64, data, torch.float64)
    fused, _, ops, step = stepgraph_run("mean", start, data, "bf16")
    train = [n for n in step.plan(step.signature).graph.nodes
             if n.op == "cross_entropy_train"]
    assert len(train) == 1 and train[0].inputs[0].dtype == "bfloat16", ops
    assert composed(ops) == 0, ops
    monkeypatch.setenv(SWITCH_ENV, "0")
    plain, _, plain_ops, _ = stepgraph_run("mean", start, data, "bf16")
    assert "log_softmax" in plain_ops
    err = np.abs(np.subtract(fused, ref)).max()
    plain_err = np.abs(np.subtract(plain, ref)).max()
    assert err <= 1.5 * plain_err + 4 * np.finfo(np.float32).eps * max(map(abs, ref)), \
        (fused, plain, ref)
