"""compile/permute_groups.py: a channels-last step's weight permutes become two permute_group
nodes (the forward's, of the parameters, where the first was; the gradients', where the last
was), and the step trains bit for bit as with one permute node each; permutes that cannot move
stay (an output read before the others' point, one the step returns)."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import api, optim
from stepgraph.compile.permute_groups import group_permutes
from stepgraph.ir.trace import Tracer
from tests.compat import loader
from tests.ops.helpers import run_graph

F32 = "float32"


def resnet_steps(precision: str, monkeypatch):
    """The compat ResNet-18 file's channels-last step with the pass and without it (its
    executable built, by a first step, with the pass off), each after that first step, and
    the batch."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 32, 32)).astype(np.float32)
    y = (np.arange(4) % 10).astype(np.int64)
    module = loader.load("resnet18", "stepgraph")
    start = module.resnet18(num_classes=10).state_dict()
    steps, first = [], []
    for grouped in (True, False):
        with monkeypatch.context() as patch:
            # the gradients' permutes, which the update would otherwise read through
            # (compile/update_permutes.py), stay to be grouped
            patch.setattr(api, "read_gradients_through_permutes", lambda graph: graph)
            if not grouped:
                patch.setattr(api, "group_permutes", lambda graph: graph)
            model = module.resnet18(num_classes=10)
            model.load_state_dict(start)
            step = sg.compile_train_step(model, sg.nn.functional.cross_entropy,
                                         optim.SGD(lr=0.1, momentum=0.9),
                                         example_inputs=(x, y), precision=precision,
                                         memory_format="channels_last")
            first.append(float(step(x, y)))
            steps.append(step)
    assert first[0] == first[1]
    return steps, (x, y)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gradient_permutes_run_as_one_group_and_train_the_same(precision, monkeypatch):
    (grouped, single), batch = resnet_steps(precision, monkeypatch)
    nodes = grouped.executable(grouped.signature).plan.graph.nodes
    groups = [n for n in nodes if n.op == "permute_group"]
    weights = [n for n in nodes if n.op == "permute" and n.inputs[0].role == "param"]
    grads = [n for n in nodes if n.op == "permute" and n.attrs["dims"] == (0, 3, 1, 2)]
    assert not weights and not grads, (weights, grads)
    # 17 of ResNet-18's 20 convolutions permute their weight (the three 1x1 ones are views);
    # the update writes the forward's channels-last copies (bf16, or float32:
    # compile/weight_permutes.py), so only the gradients' are grouped
    forward = [g for g in groups if all(v.role == "param" for v in g.inputs)]
    backward = [g for g in groups if g not in forward]
    assert not forward and len(backward) == 1, groups
    assert all(len(g.inputs) == 17 for g in groups)
    update = next(i for i, n in enumerate(nodes) if n.op == "sgd_update")
    assert nodes.index(backward[0]) < update
    plain = single.executable(single.signature).plan.graph.nodes
    assert not any(n.op == "permute_group" for n in plain)
    for _ in range(3):
        assert float(grouped(*batch)) == float(single(*batch))
    for k, v in single.model.state_dict().items():
        np.testing.assert_array_equal(np.asarray(grouped.model.state_dict()[k]), np.asarray(v),
                                      err_msg=k)


def test_permutes_read_early_or_returned_stay():
    """p0's output is read before p1 and p2 exist: it stays; p1 and p2 join at p2's point;
    p3's output is returned: it stays. The group computes what the permutes did."""
    t = Tracer()
    xs = [t.input((2, 3, 4, 5), F32, f"x{i}") for i in range(4)]
    (p0,) = t.emit("permute", [xs[0].value], dims=(0, 2, 3, 1))
    (early,) = t.emit("act", [p0], kind="relu")
    (p1,) = t.emit("permute", [xs[1].value], dims=(0, 2, 3, 1))
    (p2,) = t.emit("permute", [xs[2].value], dims=(3, 2, 1, 0))
    (p3,) = t.emit("permute", [xs[3].value], dims=(0, 2, 3, 1))
    (s,) = t.emit("add", [p1, early])
    (total,) = t.emit("reduce_sum", [p2], axes=(0, 1, 2, 3))
    t.graph.outputs = {"s": s, "total": total, "p3": p3}
    grouped = group_permutes(t.graph)
    ops = [n.op for n in grouped.nodes]
    assert ops == ["permute", "act", "permute_group", "permute", "add", "reduce_sum"], ops
    (group,) = [n for n in grouped.nodes if n.op == "permute_group"]
    assert group.outputs == [p1, p2] and group.attrs["dims"] == ((0, 2, 3, 1), (3, 2, 1, 0))
    arrays = {f"x{i}": np.random.default_rng(i).standard_normal((2, 3, 4, 5)).astype(np.float32)
              for i in range(4)}
    want, got = run_graph(t.graph, arrays), run_graph(grouped, arrays)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
