"""compile/attention_rewrite.py: attention written by hand (q @ k^T, scale, mask, softmax,
dropout, @ v) becomes one sdpa node of the step's plan (sdpa_grad in its backward), and the
step trains as the same model file on torch (tests/reference.py's policy: torch float64 the
reference, stepgraph float32 within 4x torch float32's own error, on the losses and on every
parameter's change). Near-misses keep their composed ops and train as torch too. The dropout
cases run the traced graph in float64 with and without the rewrite: sdpa draws the dropout
op's own mask, so the two agree to float64 rounding."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import losses, optim
from stepgraph.autodiff import append_backward
from stepgraph.compile.attention_rewrite import SWITCH_ENV, rewrite_attention
from stepgraph.errors import PlanError
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import randn, run_graph, seeded, trace_inputs
from tests.reference import assert_close_to_reference, assert_state_changes_close, state_float64

B, T, HEADS, D = 2, 6, 2, 4
C = HEADS * D
BLOCK = 8                      # the causal buffer's size: sliced to T as minGPT does
STEPS, LR = 3, 0.1
ATTENTION_OPS = ("sdpa", "sdpa_qkv")


def model_class(tm, variant: str):
    """A one-layer attention model for the torch-like namespace `tm` (torch or stepgraph),
    its attention written as `variant`."""
    nn, F = tm.nn, tm.nn.functional

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(C, 3 * C)
            self.proj = nn.Linear(C, C)
            self.register_buffer("bias", tm.tril(tm.ones(BLOCK, BLOCK))
                                 .view(1, 1, BLOCK, BLOCK))
            self.register_buffer("keep", tm.tril(tm.ones(T, T)).bool())
            rel = tm.arange(T).view(1, T) - tm.arange(T).view(T, 1)
            self.register_buffer("alibi", -0.25 * rel.float().abs())
            self.temperature = nn.Parameter(tm.ones(()))
            self.rel_bias = nn.Parameter(0.1 * tm.ones(HEADS, T, T))
            self.head_scale = nn.Parameter(tm.full((HEADS, 1, 1), 1.5))
            self.key_scale = nn.Parameter(1.0 + 0.1 * tm.arange(T).float().view(1, T))
            self.drop = nn.Dropout(0.0)

        def heads(self, x):
            q, k, v = self.qkv(x).split(C, dim=2)
            return [a.view(B, T, HEADS, D).transpose(1, 2) for a in (q, k, v)]

        def forward(self, x, m=None):
            q, k, v = self.heads(x)
            att = self.scores(q, k, m)
            att = self.drop(F.softmax(att, dim=-2 if variant == "softmax_other_axis" else -1))
            y = att @ v
            if variant == "probs_read_elsewhere":
                y = y + att.mean(dim=-1, keepdim=True)
            return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))

        def scores(self, q, k, m):
            if variant == "q_scaled_first":
                return (q * D ** -0.5) @ k.transpose(-2, -1)
            if variant == "grouped_heads":          # k and v of one head, shared by both
                k = k[:, :1].repeat_interleave(HEADS, dim=1)
            att = q @ k.transpose(-2, -1)
            att = att / math.sqrt(D) if variant == "div_sqrt" else att * (1.0 / math.sqrt(D))
            if variant in ("causal_buffer", "dropout_p0"):
                att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            elif variant == "bool_buffer":
                att = att.masked_fill(~self.keep, float("-inf"))
            elif variant == "tril_in_forward":
                att = att.masked_fill(tm.tril(tm.ones(T, T)) == 0, -1e9)
            elif variant == "constant_additive":
                att = att + self.alibi
            elif variant in ("additive_mask", "finite_fill_runtime"):
                att = att + m if variant == "additive_mask" else att.masked_fill(m == 0, -1e4)
            elif variant == "bool_mask":
                att = att.masked_fill(~m, float("-inf"))
            elif variant == "parameter_scale":
                att = att * self.temperature
            elif variant == "head_scale":             # mixer's / Swin v2's temperature
                att = (att * self.head_scale).masked_fill(self.bias[:, :, :T, :T] == 0,
                                                          float("-inf"))
            elif variant == "key_scale":              # varies along the keys: not q's
                att = att * self.key_scale
            elif variant == "parameter_mask":
                att = att + self.rel_bias
            elif variant == "scale_after_mask":
                att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")) * 0.5
            return att

    return Attention


REWRITTEN = ["scores_scaled", "q_scaled_first", "div_sqrt", "causal_buffer", "bool_buffer",
             "tril_in_forward", "constant_additive", "additive_mask", "bool_mask",
             "dropout_p0", "grouped_heads", "parameter_scale", "head_scale"]
LEFT = ["softmax_other_axis", "probs_read_elsewhere", "key_scale", "parameter_mask",
        "scale_after_mask", "finite_fill_runtime"]


def batches(variant: str) -> list[tuple]:
    gen = seeded(variant)
    out = []
    for _ in range(STEPS):
        x, y = randn(gen, B, T, C), randn(gen, B, T, C)
        keys = np.ones((B, 1, 1, T), bool)
        keys[0, ..., T - 2:] = False                  # padding: the first sample's last keys
        if variant == "additive_mask":
            out.append((x, np.where(keys, 0.0, -np.inf).astype(np.float32), y))
        elif variant == "bool_mask":
            out.append((x, keys, y))
        elif variant == "finite_fill_runtime":
            out.append((x, keys.astype(np.float32), y))
        else:
            out.append((x, y))
    return out


def torch_run(model, data, dtype) -> list[float]:
    model = model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    result = []
    for *ins, y in data:
        ins = [torch.tensor(a).to(dtype) if a.dtype == np.float32 else torch.tensor(a)
               for a in ins]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(*ins), torch.tensor(y).to(dtype))
        loss.backward()
        opt.step()
        result.append(loss.item())
    return result


def stepgraph_run(variant: str, start: dict, data, device="cpu"):
    """(losses, final state, the plan's op names) of the stepgraph model trained on data."""
    model = model_class(sg, variant)()
    model.load_state_dict(start)
    step = sg.compile_train_step(model, sg.nn.functional.mse_loss, optim.SGD(lr=LR),
                                 example_inputs=data[0], device=device)
    result = [float(step(*b)) for b in data]
    ops = [n.op for n in step.plan(step.signature).graph.nodes]
    return result, state_float64(model), ops


# parameter -> the variant whose scores read it (the others leave it untouched)
OWN = {"temperature": "parameter_scale", "rel_bias": "parameter_mask",
       "head_scale": "head_scale", "key_scale": "key_scale"}


def trained(model, variant: str) -> list[str]:
    """The parameters a step of `variant` trains: all but the other variants' own."""
    return [k for k, _ in model.named_parameters() if OWN.get(k, variant) == variant]


def check_trains_as_torch(variant: str, seed: str | None = None) -> list[str]:
    """seed: the name the batches are drawn from (the variant's own by default).
    The parameter changes are judged with the floor of one float32 rounding of the
    parameter's values (value_floor): proj.bias sits near 0.3 and moves by about 0.03 in three
    steps, so its values' ulp (3e-8) is ten times the change's, and where float64's update falls
    near the midpoint of two float32 values, torch and stepgraph can round to different ones
    (test_q_scaled_first_on_the_data_of_its_first_name: 0.469 vs 0.531 ulp after step 1, one
    ulp apart from then on, 4.19x torch's lucky 0.25 ulp after step 3, with the rewrite on or
    off; both gradients are within 1.6 ulp of float64's, stepgraph's the nearer)."""
    torch.manual_seed(0)
    t32 = model_class(torch, variant)()
    start = {k: v.detach().numpy().copy() for k, v in t32.state_dict().items()}
    data = batches(seed or variant)
    t64 = copy.deepcopy(t32)
    losses = {"float64": torch_run(t64, data, torch.float64),
              "float32": torch_run(t32, data, torch.float32)}
    got, final, ops = stepgraph_run(variant, start, data)
    assert_close_to_reference(got, losses["float64"], losses["float32"], f"{variant} losses")
    assert_state_changes_close({k: np.asarray(v, np.float64) for k, v in start.items()},
                               final, state_float64(t64), state_float64(t32), f"{variant} ",
                               trained=trained(t32, variant), value_floor=True)
    return ops


def attention_counts(ops: list[str]) -> tuple[int, int, int]:
    fused = sum(ops.count(o) for o in ATTENTION_OPS)
    grads = sum(ops.count(o + "_grad") for o in ATTENTION_OPS)
    return fused, grads, ops.count("softmax")


@pytest.mark.parametrize("variant", REWRITTEN)
def test_hand_written_attention_becomes_one_sdpa_and_trains_as_torch(variant):
    ops = check_trains_as_torch(variant)
    assert attention_counts(ops) == (1, 1, 0), ops
    assert "bmm" not in ops


@pytest.mark.parametrize("rewrite", ["1", "0"])
def test_q_scaled_first_on_the_data_of_its_first_name(rewrite, monkeypatch):
    """q scaled before q @ k^T on the batches drawn from "q_prescaled", the case's earlier name:
    stepgraph's proj.bias change is 4.19x torch float32's error there, one rounding of the
    value away (check_trains_as_torch), the same with the rewrite off."""
    monkeypatch.setenv(SWITCH_ENV, rewrite)
    ops = check_trains_as_torch("q_scaled_first", seed="q_prescaled")
    assert (attention_counts(ops)[:2] == (1, 1)) == (rewrite == "1"), ops


@pytest.mark.parametrize("variant", LEFT)
def test_near_misses_keep_their_ops_and_train_as_torch(variant):
    ops = check_trains_as_torch(variant)
    assert attention_counts(ops)[:2] == (0, 0) and "bmm" in ops, ops


def test_the_switch_turns_the_rewrite_off(monkeypatch):
    torch.manual_seed(0)
    start = {k: v.detach().numpy().copy()
             for k, v in model_class(torch, "causal_buffer")().state_dict().items()}
    data = batches("causal_buffer")
    on, final_on, ops_on = stepgraph_run("causal_buffer", start, data)
    monkeypatch.setenv(SWITCH_ENV, "0")
    off, final_off, ops_off = stepgraph_run("causal_buffer", start, data)
    assert attention_counts(ops_on) == (1, 1, 0) and attention_counts(ops_off)[:2] == (0, 0)
    assert ops_off.count("softmax") == 1
    np.testing.assert_allclose(on, off, rtol=1e-5)


def test_causal_needs_a_buffer_the_step_never_writes():
    """A mask the step updates in place (here a buffer written by a BatchNorm-like running
    statistic would be; modelled as a state value the graph mutates) is not folded."""
    tracer = Tracer()
    ins = trace_inputs(tracer, {n: np.zeros((B, HEADS, T, D)) for n in "qkv"})
    bias = tracer.state((1, 1, T, T), "float64", "bias")
    att = (ins["q"] @ ins["k"].transpose(-2, -1)) * 0.5
    blocked = tracer.op("compare_scalar", [bias], kind="eq", value=0.0)
    y = tracer.op("softmax", [att.masked_fill(blocked, float("-inf"))]) @ ins["v"]
    tracer.graph.outputs = {"y": y.value}
    tril = np.tril(np.ones((1, 1, T, T)))
    folded = rewrite_attention(tracer.graph, lambda v: tril, masked=False)
    assert [n.attrs["causal"] for n in folded.nodes if n.op == "sdpa"] == [True]
    tracer.graph.nodes.append(sg.ir.graph.Node("step_increment", [bias], [], {}, (0,)))
    written = rewrite_attention(tracer.graph, lambda v: tril, masked=False)
    assert "sdpa" not in [n.op for n in written.nodes]


def test_masks_that_are_not_causal_stay_where_sdpa_takes_none():
    """Where sdpa takes no mask (masked=False: no backend now, numpy and CUDA both take one),
    a known non-causal mask or a runtime one leaves the composed ops; a causal one still
    rewrites."""
    for kind, want in (("triu", False), ("tril", True), ("input", False)):
        tracer = Tracer()
        ins = trace_inputs(tracer, {n: np.zeros((B, HEADS, T, D)) for n in "qkv"})
        if kind == "input":
            blocked = tracer.input((B, 1, 1, T), "bool", "pad")
        else:
            ones = np.ones((T, T), bool)
            keep = np.tril(ones) if kind == "tril" else np.triu(ones)
            blocked = sg.tensor(~keep)
        att = (ins["q"] @ ins["k"].transpose(-2, -1)).masked_fill(blocked, float("-inf"))
        y = tracer.op("softmax", [att]) @ ins["v"]
        tracer.graph.outputs = {"y": y.value}
        ops = [n.op for n in rewrite_attention(tracer.graph, masked=False).nodes]
        assert ("sdpa" in ops) == want, (kind, ops)
        assert ("sdpa" in [n.op for n in rewrite_attention(tracer.graph, masked=True).nodes])


# ---- dropout p > 0: the same mask as the composed dropout op, judged in float64 ------------

def dropout_body(p: float, causal: bool):
    def body(tracer, ins):
        q, k, v = (ins[n] for n in "qkv")
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        if causal:
            blocked = sg.tensor(~np.tril(np.ones((T, T), bool)))
            att = att.masked_fill(blocked, float("-inf"))
        att = tracer.op("softmax", [att])
        site = tracer.next_dropout_site()
        att = tracer.op_all("dropout", [att, tracer.rng_step()], p=p, seed=3, site=site,
                            per_channel=False)[0]
        return (att @ v) * ins["w"]
    return body


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_draws_the_composed_ops_mask(causal):
    gen = seeded(f"dropout{causal}")
    data = {n: randn(gen, B, HEADS, T, D, dtype=np.float64) for n in "qkv"}
    data["w"] = randn(gen, D, dtype=np.float64)
    data["target"] = randn(gen, B, HEADS, T, D, dtype=np.float64)
    results = []
    for rewrite in (False, True):
        tracer = Tracer()
        ins = trace_inputs(tracer, data)
        out = dropout_body(0.3, causal)(tracer, ins)
        if rewrite:
            tracer.graph = rewrite_attention(tracer.graph, kept=(out.value,))
            ops = [n.op for n in tracer.graph.nodes]
            assert ops.count("sdpa") == 1 and "dropout" not in ops and "softmax" not in ops
        loss = losses.mse(out, ins["target"])
        wrt = [ins[n].value for n in ("q", "k", "v", "w")]
        grads = append_backward(tracer, loss.value, wrt)
        tracer.graph.outputs = {"loss": loss.value,
                                **{f"grad{i}": g for i, g in enumerate(grads)}}
        results.append(run_graph(tracer.graph, data,
                                 {"optimizer.step": np.array(5, np.int64)}))
    plain, fused = results
    for name in plain:
        np.testing.assert_allclose(fused[name], plain[name], rtol=1e-12,
                                   atol=1e-12 * float(np.abs(plain[name]).max()), err_msg=name)
    assert float(plain["grad0"].std()) > 0


# ---- the model files: tests/compat/models ----------------------------------------------------

def test_model_files_with_hand_written_attention_plan_sdpa():
    """gpt.py (nanoGPT's registered tril buffer, whole) and vit.py (timm's `* self.scale`) run
    their attention as one fused op a layer; prefix_seq.py has none to rewrite.
    test_compat_models.py judges their training against torch."""
    from tests.compat.test_compat_models import LR as CLR, CASES, setup

    for name, layers in (("gpt", 2), ("vit", 2), ("prefix_seq", 0)):
        s = setup(name, "plan")
        loss = getattr(sg.nn.functional, s.case.loss) if s.case.loss else None
        step = sg.compile_train_step(s.stepgraph_model(), loss, optim.SGD(lr=CLR),
                                     example_inputs=s.batches[0])
        ops = [n.op for n in step.plan(step.signature).graph.nodes]
        assert attention_counts(ops) == (layers, layers, 0), (name, ops)
    assert CASES["gpt"].cls == "GPT"


class MinGPTAttention(sg.nn.Module):
    """minGPT's CausalSelfAttention: the `bias` buffer of block_size, sliced to T."""

    def __init__(self, block_size=16):
        super().__init__()
        nn = sg.nn
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.1), nn.Dropout(0.1)
        self.register_buffer("bias", sg.tril(sg.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k, q, v = (a.view(b, t, HEADS, c // HEADS).transpose(1, 2) for a in (k, q, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = self.attn_dropout(sg.nn.functional.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


def test_mingpt_attention_with_dropout_rewrites_in_training_and_predict():
    x, y = randn(seeded("mingpt"), B, T, C), randn(seeded("mingpt-y"), B, T, C)
    model = MinGPTAttention()
    step = sg.compile_train_step(model, sg.nn.functional.mse_loss, optim.SGD(lr=LR),
                                 example_inputs=(x, y))
    plan = step.plan(step.signature).graph.nodes
    fused = [n for n in plan if n.op in ATTENTION_OPS]
    assert len(fused) == 1 and fused[0].attrs["causal"] and fused[0].attrs["dropout_p"] == 0.1
    assert "softmax" not in [n.op for n in plan]
    assert np.isfinite(float(step(x, y)))
    predict = sg.compile_predict(model, example_inputs=(x,))
    ops = [n.op for n in predict.plan(predict.signature).graph.nodes]
    assert sum(ops.count(o) for o in ATTENTION_OPS) == 1 and "softmax" not in ops


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["causal_buffer", "bool_mask", "additive_mask",
                                     "constant_additive", "head_scale"])
def test_hand_written_attention_trains_on_cuda_as_on_numpy(variant):
    """The causal-buffer model and the masked ones (a runtime key-padding mask, bool or
    additive, and a constant ALiBi-like bias: sdpa's mask input on CUDA too) on CUDA: one
    sdpa (packed or not) a step, and its losses and parameter changes within the policy of
    the numpy run's (float32 both; judged against torch float64 with torch float32's error as
    the bound, as on the CPU)."""
    pytest.importorskip("cupy")
    torch.manual_seed(0)
    t32 = model_class(torch, variant)()
    start = {k: v.detach().numpy().copy() for k, v in t32.state_dict().items()}
    data = batches(variant)
    t64 = copy.deepcopy(t32)
    ref64, ref32 = torch_run(t64, data, torch.float64), torch_run(t32, data, torch.float32)
    for device in ("cpu", "cuda"):
        got, final, ops = stepgraph_run(variant, start, data, device=device)
        assert attention_counts(ops) == (1, 1, 0), (device, ops)
        assert_close_to_reference(got, ref64, ref32, f"{device} losses")
        assert_state_changes_close({k: np.asarray(v, np.float64) for k, v in start.items()},
                                   final, state_float64(t64), state_float64(t32), f"{device} ",
                                   trained=trained(t32, variant))


def test_a_folded_buffer_given_new_values_stops_the_step():
    """The causal mask is read from the buffer when the step compiles: writing the same values
    again is fine, other values (a state_dict of another mask) stop the step with a reason."""
    x, y = randn(seeded("folded"), B, T, C), randn(seeded("folded-y"), B, T, C)
    model = MinGPTAttention()
    step = sg.compile_train_step(model, sg.nn.functional.mse_loss, optim.SGD(lr=LR),
                                 example_inputs=(x, y))
    step(x, y)
    model.bias.data = np.tril(np.ones((16, 16), np.float32)).reshape(1, 1, 16, 16)
    step(x, y)
    model.bias.data = np.ones((1, 1, 16, 16), np.float32)
    with pytest.raises(PlanError, match="bias was given new values"):
        step(x, y)
