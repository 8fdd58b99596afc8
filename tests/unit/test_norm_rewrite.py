"""compile/norm_rewrite.py: residual add + LayerNorm as add_layer_norm, hand-written RMSNorm as
rms_norm. Each pattern rewrites (node counts of the step's graph), near-misses stay as written,
each switch turns its pass off, the ops' NumPy references and VJPs match torch in float64, and
steps with and without the rewrites train as torch does (tests/reference.py's policy)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import nn as sgnn
from stepgraph import optim
from stepgraph.compile import norm_rewrite
from stepgraph.compile.norm_rewrite import ADD_LAYER_NORM_SWITCH, RMS_NORM_SWITCH
from tests.ops.helpers import seeded
from tests.reference import assert_close_to_reference, assert_state_changes_close

C, ROWS, STEPS, LR = 16, 6, 4, 0.05


def pre_norm_net(t, rms: str | None = None, layers: int = 2):
    """A pre-norm residual net built from namespace `t` (torch or stepgraph): layers blocks of
    x = x + fc1(ln1(x)); x = x + gelu(fc2(ln2(x))), then a final LayerNorm and a head. rms:
    the norm of every block written by hand as that RMSNorm variant instead (RMS_FORMS)."""
    nn, F = t.nn, t.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(C, C), nn.Linear(C, C)
            if rms is None:
                self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
            else:
                self.w1 = nn.Parameter(1.0 + 0.1 * t.randn(C))
                self.w2 = nn.Parameter(1.0 + 0.1 * t.randn(C))

        def norm(self, k, x):
            if rms is None:
                return (self.ln1, self.ln2)[k](x)
            w = (self.w1, self.w2)[k]
            return {**RMS_FORMS, **RMS_NEAR_MISSES}[rms](t, x, w)

        def forward(self, x):
            x = x + self.fc1(self.norm(0, x))
            return x + F.gelu(self.fc2(self.norm(1, x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(C, C)
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
            self.ln_f, self.head = nn.LayerNorm(C), nn.Linear(C, 5)

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.head(self.ln_f(x))
    return Net


# Hand-written RMSNorms that rewrite (over the last axis, with eps, weight after or none:
# no_weight's w is a shift added after the rms_norm op).
RMS_FORMS = {
    "rsqrt_pow": lambda t, x, w: x * t.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
    "weight_first": lambda t, x, w: w * (x * t.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5)),
    "div_sqrt": lambda t, x, w: x / t.sqrt(x.square().mean(dim=-1, keepdim=True) + 1e-6) * w,
    "one_over_sqrt": lambda t, x, w:
        x * (1.0 / t.sqrt(t.mean(x ** 2, -1).unsqueeze(-1) + 1e-6)) * w,
    "no_weight": lambda t, x, w: x * t.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) + w,
    "functional": lambda t, x, w: t.nn.functional.rms_norm(x, (C,), w, 1e-6),
}
# Near-misses: not an RMSNorm over the last axis with an eps, or the weight not after it.
RMS_NEAR_MISSES = {
    "other_axis": lambda t, x, w: x * t.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6) * w,
    "no_eps": lambda t, x, w: x * t.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w,
    "weight_before": lambda t, x, w:
        (x * w) * t.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
    "cube": lambda t, x, w: x * t.rsqrt(x.pow(3).mean(-1, keepdim=True) + 1e-6) * w,
}


def batches(test_id: str, steps: int = STEPS):
    gen = seeded(test_id)
    return [(gen.standard_normal((ROWS, C)).astype(np.float32),
             gen.integers(0, 5, ROWS).astype(np.int64)) for _ in range(steps)]


def models(make):
    """(torch model, () -> a stepgraph model loaded with the torch model's weights)."""
    torch.manual_seed(0)
    tm = make(torch)()
    start = {k: v.detach().numpy().copy() for k, v in tm.state_dict().items()}

    def ours():
        m = make(sg)()
        m.load_state_dict(start)
        return m
    return tm, ours


def compiled(model, data, **options):
    return sg.compile_train_step(model, sgnn.functional.cross_entropy, optim.SGD(lr=LR),
                                 example_inputs=data[0], **options)


def op_counts(step) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in step.plan(step.signature).graph.nodes:
        counts[n.op] = counts.get(n.op, 0) + 1
    return counts


def torch_run(model, data, dtype):
    model = model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.tensor(x).to(dtype)),
                                                 torch.tensor(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().double().numpy() for k, v in model.state_dict().items()}


def assert_trains_like_torch(make, data, **options):
    """The step (with whatever rewrites are on; options: compile_train_step's) trains as
    torch: losses and every parameter's change over the run within the policy's bound of
    torch float64's."""
    tm, ours = models(make)
    initial = {k: v.detach().double().numpy() for k, v in tm.state_dict().items()}
    loss64, final64 = torch_run(copy.deepcopy(tm), data, torch.float64)
    loss32, final32 = torch_run(tm, data, torch.float32)
    model = ours()
    step = compiled(model, data, **options)
    losses = [float(step(*b)) for b in data]
    assert_close_to_reference(losses, loss64, loss32, "losses")
    final = {k: np.asarray(v) for k, v in model.state_dict().items()}
    assert_state_changes_close(initial, final, final64, final32)
    return step


# ---- residual add + LayerNorm -------------------------------------------------------------

def test_residual_adds_read_by_a_layer_norm_become_add_layer_norm(request):
    data = batches(request.node.name, 1)
    step = compiled(models(pre_norm_net)[1](), data)
    counts = op_counts(step)
    # 2 blocks: the sums of block 1 feed ln2 of block 1, ln1 of block 2; ... the last ln_f
    assert counts.get("add_layer_norm") == 4 and counts.get("layer_norm") == 1
    # the residual join's gradient sum rides the LayerNorm's backward but for the top sum,
    # which only ln_f reads (its gradient has no other term: a plain layer_norm_grad)
    assert counts.get("add_layer_norm_grad") == 3 and counts.get("layer_norm_grad") == 2
    # one elementwise add of (rows, C) gradients is left in the backward: the join at the
    # input Linear's output, which ln1 of block 1 reads (no residual add wrote it)
    graph = step.plan(step.signature).graph
    adds = [n for n in graph.nodes if n.op == "add" and n.outputs[0].shape == (ROWS, C)]
    assert len(adds) == 1 and graph.producers()[adds[0].inputs[1]].op == "layer_norm_grad"


def test_add_layer_norm_switch_turns_the_pass_off(request, monkeypatch):
    monkeypatch.setenv(ADD_LAYER_NORM_SWITCH, "0")
    data = batches(request.node.name, 1)
    counts = op_counts(compiled(models(pre_norm_net)[1](), data))
    assert "add_layer_norm" not in counts and "add_layer_norm_grad" not in counts
    assert counts["layer_norm"] == 5 and counts["layer_norm_grad"] == 5


@pytest.mark.parametrize("rewrite", ["1", "0"])
def test_pre_norm_net_trains_like_torch_with_and_without_the_rewrite(rewrite, request,
                                                                      monkeypatch):
    monkeypatch.setenv(ADD_LAYER_NORM_SWITCH, rewrite)
    step = assert_trains_like_torch(pre_norm_net, batches(request.node.name))
    assert ("add_layer_norm" in op_counts(step)) == (rewrite == "1")


def _near_miss_net(kind: str):
    def make(t):
        nn = t.nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc, self.ln, self.head = nn.Linear(C, C), nn.LayerNorm(C), nn.Linear(C, 5)
                self.row = nn.Parameter(t.zeros(C))
                self.drop = nn.Dropout(0.25)

            def forward(self, x):
                h = self.fc(x)
                if kind == "broadcast":          # (rows, C) + (C,): not a residual sum
                    s = h + self.row
                elif kind == "dropout":          # folded into add_layer_norm
                    s = x + self.drop(h)
                else:                            # the sum is normalised by a later LayerNorm
                    s = self.ln(h) + x
                return self.head(self.ln(s) if kind != "after" else s)
        return Net
    return make


@pytest.mark.parametrize("kind", ["broadcast", "after"])
def test_adds_the_pass_leaves_alone(kind, request):
    data = batches(request.node.name, 1)
    counts = op_counts(compiled(models(_near_miss_net(kind))[1](), data))
    assert "add_layer_norm" not in counts and "add_layer_norm_grad" not in counts


def _dropout_run(data, monkeypatch, on: bool):
    monkeypatch.setenv(ADD_LAYER_NORM_SWITCH, "1" if on else "0")
    model = models(_near_miss_net("dropout"))[1]()
    step = compiled(model, data)
    losses = [float(step(*b)) for b in data]
    graph = step.plan(step.signature).graph      # the plan of this switch's setting
    return graph, losses, {k: np.asarray(v) for k, v in model.state_dict().items()}


def test_residual_dropout_folds_into_add_layer_norm(request, monkeypatch):
    """x + dropout(h) read by a LayerNorm: add_layer_norm drops h itself (the dropout op's
    Philox mask and rounding, its step counter the last input and its mask the last output),
    and its VJP applies the mask to b's gradient. The forward is the unfused step's bit for
    bit (the first loss, the same masks); the backward rounds dx + ds once where the unfused
    step rounded dx first: every loss and parameter within float32 rounding of it."""
    data = batches(request.node.name)
    graph, losses, state = _dropout_run(data, monkeypatch, True)
    _, plain_losses, plain_state = _dropout_run(data, monkeypatch, False)
    (fused,) = [n for n in graph.nodes if n.op == "add_layer_norm"]
    assert fused.attrs["dropout"] == 0.25 and fused.inputs[-1].dtype == "int64"
    assert fused.outputs[-1].dtype == "uint8" and fused.outputs[-2].dtype == "float32"
    assert not [n for n in graph.nodes if n.op == "dropout"]
    assert graph.producers()[fused.inputs[1]].op in ("linear", "reshape")
    assert losses[0] == plain_losses[0]
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    for k in state:
        np.testing.assert_allclose(state[k], plain_state[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _ln_case(gen, weight: bool, bias: bool):
    a, b, dy, ds = (gen.standard_normal((3, 5, C)) for _ in range(4))
    w, bb = gen.standard_normal(C), gen.standard_normal(C)
    return a, b, dy, ds, w, bb


@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, False)])
def test_add_layer_norm_reference_and_vjp_match_torch_in_float64(weight, bias, request):
    """The op's NumPy reference (forward, and its VJP's nodes run by the reference) against
    torch's F.layer_norm(a + b) in float64, with gradients of y and of s both flowing."""
    from stepgraph.ir.ops import IMPLS, VJPS, infer_outputs
    from stepgraph.ir.graph import Node, Value

    a, b, dy, ds, w, bb = _ln_case(seeded(request.node.name), weight, bias)
    ins = [a, b] + ([w] if weight else []) + ([bb] if bias else [])
    attrs = {"eps": 1e-5, "weight": weight, "bias": bias}
    vals = [Value(x.shape, "float64") for x in ins]
    node = Node("add_layer_norm", vals, [Value(s, d) for s, d in
                                         infer_outputs("add_layer_norm", vals, attrs)], attrs)
    outs = [np.empty(v.shape) for v in node.outputs]
    IMPLS["add_layer_norm"](node, ins, outs, None)
    env = dict(zip(vals + node.outputs, ins + outs))
    emitted = []

    def emit(op, inputs, **at):
        o = [Value(s, d) for s, d in infer_outputs(op, inputs, at)]
        emitted.append(Node(op, list(inputs), o, at))
        return o
    dyv, dsv = Value(dy.shape, "float64"), Value(ds.shape, "float64")
    env.update({dyv: dy, dsv: ds})
    grads = VJPS["add_layer_norm"](emit, node, [dyv, None, None, dsv], lambda i: True)
    assert [n.op for n in emitted] == ["add_layer_norm_grad"]
    for n in emitted:
        res = [np.empty(v.shape) for v in n.outputs]
        IMPLS[n.op](n, [env[v] for v in n.inputs], res, None)
        env.update(zip(n.outputs, res))

    ta, tb = (torch.tensor(x, requires_grad=True) for x in (a, b))
    tw = torch.tensor(w, requires_grad=True) if weight else None
    tbb = torch.tensor(bb, requires_grad=True) if bias else None
    s = ta + tb
    y = torch.nn.functional.layer_norm(s, (C,), tw, tbb, 1e-5)
    (y * torch.tensor(dy)).sum().add((s * torch.tensor(ds)).sum()).backward()
    np.testing.assert_allclose(outs[0], y.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(outs[3], s.detach().numpy(), rtol=0, atol=0)
    np.testing.assert_allclose(env[grads[0]], ta.grad.numpy(), rtol=1e-10, atol=1e-12)
    assert grads[1] is grads[0]
    for g, t in zip(grads[2:], [x for x in (tw, tbb) if x is not None]):
        np.testing.assert_allclose(env[g], t.grad.numpy(), rtol=1e-10, atol=1e-12)


# ---- RMSNorm ------------------------------------------------------------------------------

@pytest.mark.parametrize("form", list(RMS_FORMS))
def test_hand_written_rms_norm_becomes_one_op_and_trains_like_torch(form, request):
    step = assert_trains_like_torch(lambda t: pre_norm_net(t, rms=form),
                                    batches(request.node.name))
    counts = op_counts(step)
    # block 1's first norm reads the input Linear's output; the other three read residual sums
    # (add_rms_norm), as the final LayerNorm does (add_layer_norm)
    assert counts.get("rms_norm") == 1 and counts.get("rms_norm_grad") == 1
    assert counts.get("add_rms_norm") == 3 and counts.get("add_rms_norm_grad") == 3
    assert counts.get("add_layer_norm") == 1
    assert "rsqrt" not in [n.attrs.get("kind") for n in step.plan(step.signature).graph.nodes]


def test_rms_norms_stay_apart_from_their_residual_adds_with_that_switch_off(request,
                                                                            monkeypatch):
    monkeypatch.setenv(ADD_LAYER_NORM_SWITCH, "0")
    step = assert_trains_like_torch(lambda t: pre_norm_net(t, rms="rsqrt_pow"),
                                    batches(request.node.name))
    counts = op_counts(step)
    assert counts.get("rms_norm") == 4 and counts.get("rms_norm_grad") == 4
    assert "add_rms_norm" not in counts


@pytest.mark.parametrize("form", list(RMS_NEAR_MISSES))
def test_rms_norm_near_misses_are_left_alone(form, request):
    data = batches(request.node.name, 1)
    counts = op_counts(compiled(models(lambda t: pre_norm_net(t, rms=form))[1](), data))
    assert "rms_norm" not in counts and "rms_norm_grad" not in counts


def test_rms_norm_switch_turns_the_pass_off(request, monkeypatch):
    monkeypatch.setenv(RMS_NORM_SWITCH, "0")
    data = batches(request.node.name, 1)
    counts = op_counts(compiled(models(lambda t: pre_norm_net(t, rms="rsqrt_pow"))[1](), data))
    assert "rms_norm" not in counts


def test_rms_norm_rewrite_keeps_an_intermediate_something_else_reads(request):
    """rstd read by another op as well (a step output here) keeps the chain as written."""
    from stepgraph.ir.trace import Tracer

    tracer = Tracer(seed=0, training=True)
    x = tracer.input((ROWS, C), "float32", "x")
    r = (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
    y = x * r
    tracer.graph.outputs = {"y": y.value, "r": r.value}
    assert norm_rewrite.rewrite_rms_norm(tracer.graph) is tracer.graph
    tracer.graph.outputs = {"y": y.value}
    ops = [n.op for n in norm_rewrite.rewrite_rms_norm(tracer.graph).nodes]
    assert ops == ["rms_norm"]


def test_rms_norm_reference_and_vjp_match_torch_in_float64(request):
    from tests.ops.helpers import op_forward, op_vjp

    gen = seeded(request.node.name)
    x, w, dy = gen.standard_normal((4, 3, C)), gen.standard_normal(C), \
        gen.standard_normal((4, 3, C))
    y, rstd = op_forward("rms_norm", {"x": x, "w": w}, eps=1e-6, weight=True)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    ty = torch.nn.functional.rms_norm(tx, (C,), tw, 1e-6)
    (ty * torch.tensor(dy)).sum().backward()
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-12)
    grads = op_vjp("rms_norm", {"x": x, "w": w}, dy, ("x", "w"), eps=1e-6, weight=True)
    np.testing.assert_allclose(grads["x"], tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(grads["w"], tw.grad.numpy(), rtol=1e-10, atol=1e-12)


# ---- hand-written LayerNorm ---------------------------------------------------------------

def _convnext_ln(t, x, w, b):
    """ConvNeXt's channels-first LayerNorm, over the last axis: the mean once, x - u twice."""
    u = x.mean(-1, keepdim=True)
    s = (x - u).pow(2).mean(-1, keepdim=True)
    x = (x - u) / t.sqrt(s + 1e-6)
    return w * x + b


def _one_centring_ln(t, x, w, b):
    d = x - x.mean(-1, keepdim=True)
    return d * t.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * w + b


def _weight_only_ln(t, x, w, b):
    """rsqrt on the left, a weight and no bias (b.mean() is a scalar: no LayerNorm bias)."""
    u = t.mean(x, -1, keepdim=True)
    return t.rsqrt(((x - u) ** 2).mean(-1, keepdim=True) + 1e-5) * (x - u) * w + b.mean()


def _unbiased_ln(t, x, w, b):
    u = x.mean(-1, keepdim=True)
    return (x - u) / t.sqrt(((x - u) ** 2).sum(-1, keepdim=True) / (C - 1) + 1e-5) * w + b


def _no_eps_ln(t, x, w, b):
    u = x.mean(-1, keepdim=True)
    return (x - u) / t.sqrt((x - u).pow(2).mean(-1, keepdim=True)) * w + b


def _mean_read_elsewhere_ln(t, x, w, b):
    u = x.mean(-1, keepdim=True)
    return (x - u) / t.sqrt((x - u).pow(2).mean(-1, keepdim=True) + 1e-5) * w + b + u


LN_FORMS = {"convnext": _convnext_ln, "one_centring": _one_centring_ln,
            "weight_only": _weight_only_ln}
LN_NEAR_MISSES = {"unbiased": _unbiased_ln, "no_eps": _no_eps_ln,
                  "mean_read_elsewhere": _mean_read_elsewhere_ln}


def hand_ln_net(t, form: str):
    """Two residual blocks x = x + fc(norm(x)), the norm written by hand as `form`."""
    nn = t.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(C, C)
            self.w = nn.Parameter(1.0 + 0.1 * t.randn(C))
            self.b = nn.Parameter(0.1 * t.randn(C))

        def forward(self, x):
            return x + self.fc({**LN_FORMS, **LN_NEAR_MISSES}[form](t, x, self.w, self.b))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.head = nn.Linear(C, C), nn.Linear(C, 5)
            self.blocks = nn.ModuleList([Block() for _ in range(2)])

        def forward(self, x):
            x = self.inp(x)
            for b in self.blocks:
                x = b(x)
            return self.head(x)
    return Net


@pytest.mark.parametrize("form", list(LN_FORMS))
def test_hand_written_layer_norm_becomes_one_op_and_trains_like_torch(form, request):
    step = assert_trains_like_torch(lambda t: hand_ln_net(t, form), batches(request.node.name))
    counts = op_counts(step)
    # the second block's norm reads the first block's residual sum: add_layer_norm
    assert counts.get("layer_norm") == 1 and counts.get("add_layer_norm") == 1
    assert counts.get("layer_norm_grad") == 1 and counts.get("add_layer_norm_grad") == 1
    assert "sqrt" not in [n.attrs.get("kind") for n in step.plan(step.signature).graph.nodes]


@pytest.mark.parametrize("form", list(LN_NEAR_MISSES))
def test_layer_norm_near_misses_are_left_alone(form, request):
    data = batches(request.node.name, 1)
    counts = op_counts(compiled(models(lambda t: hand_ln_net(t, form))[1](), data))
    assert "layer_norm" not in counts and "add_layer_norm" not in counts


def test_layer_norm_switch_turns_the_pass_off(request, monkeypatch):
    monkeypatch.setenv(norm_rewrite.LAYER_NORM_SWITCH, "0")
    data = batches(request.node.name, 1)
    counts = op_counts(compiled(models(lambda t: hand_ln_net(t, "convnext"))[1](), data))
    assert "layer_norm" not in counts


def test_channels_first_layer_norm_under_channels_last_becomes_layer_norm(request):
    """ConvNeXt's LayerNorm over dim 1 of NCHW feature maps is a last-axis LayerNorm once the
    layout pass stores them NHWC: one layer_norm, and the step trains as torch's NCHW one."""
    def net(t):
        class Net(t.nn.Module):
            def __init__(self):
                super().__init__()
                self.conv1, self.conv2 = t.nn.Conv2d(3, 8, 2, 2), t.nn.Conv2d(8, 8, 3, 1, 1)
                self.w = t.nn.Parameter(1.0 + 0.1 * t.randn(8))
                self.b = t.nn.Parameter(0.1 * t.randn(8))
                self.head = t.nn.Linear(8, 5)

            def forward(self, x):
                x = self.conv1(x)
                u = x.mean(1, keepdim=True)
                s = (x - u).pow(2).mean(1, keepdim=True)
                x = (x - u) / t.sqrt(s + 1e-6)
                x = self.w[:, None, None] * x + self.b[:, None, None]
                return self.head(self.conv2(x).mean((2, 3)))
        return Net

    gen = seeded(request.node.name)
    data = [(gen.standard_normal((4, 3, 8, 8)).astype(np.float32),
             gen.integers(0, 5, 4).astype(np.int64)) for _ in range(STEPS)]
    step = assert_trains_like_torch(net, data, memory_format="channels_last")
    assert op_counts(step).get("layer_norm") == 1
