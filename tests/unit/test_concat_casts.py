"""compile/concat_casts.py: a concat that autocast promotes to float32 and that a bf16 op
reads back runs in bf16 instead, with the same bits: a U-Net-like step trains to identical
losses and parameters with and without the pass, its concats are bf16, and it casts fewer
elements; a concat that is read in float32 stays float32."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import nn, optim
from stepgraph.compile import autocast as autocast_pass
from stepgraph.compile.concat_casts import narrow_concats
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import seeded


class SkipNet(nn.Module):
    """conv -> BatchNorm (bf16 under autocast) joined with the float32 input (promoted to a
    float32 concat), then a conv that reads the join back in bf16."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.head = nn.Conv2d(11, 4, 3, padding=1), nn.Linear(4, 5)

    def forward(self, x):
        h = sg.cat([self.bn(self.conv1(x)).relu(), x], dim=1)
        return self.head(self.conv2(h).mean((2, 3)))


def run(monkeypatch, narrow: bool, steps: int = 3):
    if not narrow:
        monkeypatch.setattr(autocast_pass, "narrow_concats", lambda graph, low: graph)
    gen = seeded("concat-casts")
    data = [(gen.standard_normal((4, 3, 8, 8)).astype(np.float32),
             gen.integers(0, 5, 4).astype(np.int64)) for _ in range(steps)]
    nn.init.manual_seed(0)
    model = SkipNet()
    step = sg.compile_train_step(model, nn.functional.cross_entropy,
                                 optim.SGD(lr=0.1, momentum=0.9), data[0], precision="bf16")
    losses = [float(step(*batch)) for batch in data]
    graph = step.plan(step.signature).graph
    return losses, model.state_dict(), graph


def test_the_narrowed_step_trains_to_the_same_bits_and_casts_less(monkeypatch):
    losses, state, graph = run(monkeypatch, narrow=True)
    with monkeypatch.context() as m:
        losses0, state0, graph0 = run(m, narrow=False)
    assert losses == losses0
    for key in state0:
        np.testing.assert_array_equal(np.asarray(state[key]), np.asarray(state0[key]), key)
    assert [n.outputs[0].dtype for n in graph0.nodes if n.op == "concat"] == ["float32"]
    assert [n.outputs[0].dtype for n in graph.nodes if n.op == "concat"] == ["bfloat16"]

    def cast_elements(g):
        return sum(n.outputs[0].size for n in g.nodes if n.op == "cast")
    assert cast_elements(graph) < cast_elements(graph0)


@pytest.mark.parametrize("reader", ["float32 op", "step output"])
def test_a_concat_read_in_float32_stays_float32(reader):
    t = Tracer()
    a = t.input((2, 3), "bfloat16", "a")
    b = t.input((2, 4), "float32", "b")
    joined = t.op("concat", [t.op("cast", [a], dtype="float32"), b], dim=1)
    low = t.op("cast", [joined], dtype="bfloat16")
    t.graph.outputs = {"low": low.value}
    if reader == "float32 op":
        t.graph.outputs["sum"] = t.op("scalar", [joined], kind="mul", value=2.0).value
    else:
        t.graph.outputs["joined"] = joined.value
    before = [n.op for n in t.graph.nodes]
    assert [n.op for n in narrow_concats(t.graph, "bfloat16").nodes] == before


def test_widened_inputs_are_joined_as_they_are_and_float32_ones_cast_once():
    t = Tracer()
    a = t.input((2, 3), "bfloat16", "a")
    b = t.input((2, 4), "float32", "b")
    joined = t.op("concat", [t.op("cast", [a], dtype="float32"), b, b], dim=1)
    t.graph.outputs = {"low": t.op("cast", [joined], dtype="bfloat16").value}
    graph = narrow_concats(t.graph, "bfloat16")
    cast, concat = graph.nodes
    assert cast.op == "cast" and cast.inputs[0].name == "b"
    assert concat.op == "concat" and concat.inputs[0].name == "a"
    assert concat.inputs[1:] == [cast.outputs[0]] * 2
    assert concat.outputs[0] is t.graph.outputs["low"]


def test_a_padded_permute_is_joined_in_bf16_and_the_norm_writes_bf16(monkeypatch):
    """tests/compat/models/mixer.py's causal convolution reads F.pad(h.transpose(1, 2), (2, 0))
    viewed as 4-D: the zeros, the transpose, the join and the view run in bf16, the zeros are
    made in bf16, and h's LayerNorm stores one bf16 h that its Linear and the join both read
    (compile/norm_casts.py fuse_layer_norm_casts); three steps train to the same bits as with every
    cast in place."""
    from collections import Counter

    from tests.unit.compat_training import torch_state, train_steps

    kw = dict(vocab_size=32, dim=24, heads=3, layers=2, block_size=12)
    state = torch_state("mixer", "TokenMixer", kw)
    gen = seeded("mixer concat casts")
    batches = [tuple(gen.integers(0, 32, (4, 12)) for _ in range(2)) for _ in range(3)]

    def train():
        plan, losses, params = train_steps("mixer", "TokenMixer", kw, state, batches,
                                           precision="bf16")
        steps = [n for i, n in enumerate(plan.steps) if plan.runs(i)]
        return steps, losses, params

    steps, losses, params = train()
    monkeypatch.setattr(autocast_pass, "narrow_concats", lambda graph, low: graph)
    steps0, losses0, params0 = train()
    assert losses == losses0
    for k in params0:
        np.testing.assert_array_equal(params[k], params0[k], err_msg=k)

    def joins(nodes):
        return Counter(n.outputs[0].dtype for n in nodes if n.op in ("concat", "layout_concat"))

    def casts(nodes):
        return Counter((n.inputs[0].dtype, n.outputs[0].dtype) for n in nodes if n.op == "cast")
    layers = kw["layers"]
    assert joins(steps0) == {"float32": layers} and joins(steps) == {"bfloat16": layers}
    assert [n.outputs[0].dtype for n in steps if n.op == "layer_norm"] == ["bfloat16"] * layers
    # per block, gone: the casts of h for its Linear and of the join (the zeros cast none)
    assert casts(steps0)["float32", "bfloat16"] - casts(steps)["float32", "bfloat16"] == \
        2 * layers
    assert len(steps) < len(steps0)


@pytest.mark.parametrize("permute_out", [False, True])
def test_the_join_narrows_through_views_and_makes_its_zeros_in_bf16(permute_out):
    """cast(bf16) <- reshape <- concat(fill f32, permute(x f32)): the fill is made in bf16, x
    is cast before its permute, and the join and the view run in bf16, the view writing the
    cast's value. A permute whose output is a step output is left, and its output cast."""
    t = Tracer()
    x = t.input((2, 3, 5), "float32", "x")
    moved = t.op("permute", [x], dims=(0, 2, 1))
    zeros = t.op("fill", [], value=0.0, shape=(2, 5, 2), dtype="float32")
    joined = t.op("concat", [zeros, moved], dim=2)
    low = t.op("cast", [t.op("reshape", [joined], shape=(2, 5, 1, 5))], dtype="bfloat16")
    t.graph.outputs = {"low": low.value}
    if permute_out:
        t.graph.outputs["moved"] = moved.value
    graph = narrow_concats(t.graph, "bfloat16")
    ops = [(n.op, n.inputs[0].name if n.inputs else "", n.outputs[0].dtype) for n in graph.nodes]
    if permute_out:
        assert ("permute", "x", "float32") in ops and ("cast", "", "bfloat16") in ops
    else:
        assert ("cast", "x", "bfloat16") in ops and \
            not any(op == "permute" and dtype == "float32" for op, _, dtype in ops)
    assert ("fill", "", "bfloat16") in ops and ("fill", "", "float32") not in ops
    assert [dtype for op, _, dtype in ops if op in ("concat", "reshape")] == ["bfloat16"] * 2
    assert graph.nodes[-1].op == "reshape" and graph.nodes[-1].outputs[0] is low.value
