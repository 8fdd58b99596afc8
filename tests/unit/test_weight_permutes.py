"""compile/weight_permutes.py: a channels-last float32 step's convolutions read their weights
from transposed float32 copies the update writes, in place of a permute of every conv weight
every step; it trains bit for bit as with the permutes, the copies follow parameters loaded
from outside the step, and a weight whose slices would not fit the update's tile keeps its
permute."""
from __future__ import annotations

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import optim
from stepgraph.compile import build, overlap
from stepgraph.compile.autocast import parse_weight_copy
from stepgraph.compile.weight_permutes import bind_permuted_weights
from stepgraph.ir.graph import PARAM, STATE
from stepgraph.ir.trace import Tracer
from stepgraph.ops.optim import UPDATE_OPS

from tests.unit.test_update_permutes import (TO_KRSC, ConvNet, assert_same_training, batches,
                                             channels_last_step, initial_weights, plan_nodes)
from tests.unit.test_update_permutes import steps as update_steps


def steps(monkeypatch, make_optimizer, model=ConvNet, precision="fp32"):
    """The channels-last step with the pass and without it, the same starting weights."""
    return update_steps(monkeypatch, make_optimizer, precision, model,
                        without=(build, "bind_permuted_weights", lambda graph, copied: []))


def weight_permutes(nodes):
    """The forward permutes of parameters to (O, kh, kw, C), alone or in a group."""
    return [d for n in nodes if n.op in ("permute", "permute_group")
            for d, v in zip([n.attrs["dims"]] if n.op == "permute" else n.attrs["dims"],
                            n.inputs)
            if tuple(d) == TO_KRSC and v.role == "param"]


def update_copies(nodes):
    """(copy value, copy_dims) of each weight copy the step's updates write."""
    found = []
    for u in (n for n in nodes if n.op in UPDATE_OPS):
        k, n = u.attrs["n_scalars"], u.attrs["n_params"]
        first = k + (2 + u.attrs["n_slots"]) * n
        dims = u.attrs.get("copy_dims") or (None,) * len(u.attrs.get("copies", ()))
        found += [(u.inputs[first + j], d) for j, d in enumerate(dims)]
    return found


@pytest.mark.parametrize("make_optimizer", [
    lambda: optim.SGD(lr=0.1, momentum=0.9, weight_decay=1e-4),
    lambda: optim.Adam(lr=1e-2)], ids=["sgd", "adam"])
def test_update_writes_the_transposed_weights(make_optimizer, monkeypatch):
    (bound, plain), data = steps(monkeypatch, make_optimizer)
    nodes = plan_nodes(bound)
    copies = update_copies(nodes)
    assert len(copies) == 2 and all(d == TO_KRSC for _, d in copies), copies
    for value, _ in copies:
        assert value.dtype == "float32" and value.name.startswith("layout.float32@0231.")
        assert parse_weight_copy(value.name)[1] == TO_KRSC
    assert not weight_permutes(nodes)
    assert len(weight_permutes(plan_nodes(plain))) == 2
    assert not update_copies(plan_nodes(plain))
    assert_same_training(bound, plain, data)


def test_copies_follow_parameters_loaded_from_outside(monkeypatch):
    """load_state_dict between steps: the next step's convolutions read the loaded weights,
    as a step built from them does."""
    sgd = lambda: optim.SGD(lr=0.1)     # noqa: E731  (no momentum: nothing kept from before)
    (bound, _), data = steps(monkeypatch, sgd)
    sg.nn.manual_seed(5)
    other = ConvNet().state_dict()
    bound.model.load_state_dict(other)
    fresh = channels_last_step(ConvNet, other, sgd, data[0])
    x, y = data[1]
    assert float(bound(x, y)) == float(fresh(x, y))
    for k, v in fresh.model.state_dict().items():
        if "running" in k or "tracked" in k:
            continue    # the bound step's buffers saw one more batch before the load
        np.testing.assert_array_equal(np.asarray(bound.model.state_dict()[k]), np.asarray(v),
                                      err_msg=k)


def test_slices_past_the_tile_keep_their_permute(monkeypatch):
    """A 7x7 conv of 256 to 512 channels: its slices are past the update's tile; the first
    conv's (3 channels) are not."""

    class Wide(ConvNet):
        def __init__(self):
            super().__init__(width=256, kernel=7)

    (bound, plain), data = steps(monkeypatch, lambda: optim.SGD(lr=0.1), model=Wide)
    nodes = plan_nodes(bound)
    assert len(update_copies(nodes)) == 1 and len(weight_permutes(nodes)) == 1
    assert_same_training(bound, plain, data[:1])


def test_bf16_steps_keep_their_bf16_copies(monkeypatch):
    """precision="bf16": the bf16 copies take the permutes first; no float32 copy is made."""
    (bound, plain), data = steps(monkeypatch, lambda: optim.SGD(lr=0.1), precision="bf16")
    copies = update_copies(plan_nodes(bound))
    assert sum(d == TO_KRSC for _, d in copies) == 2
    assert copies and all(v.dtype == "bfloat16" for v, _ in copies)
    assert [v.name for v, _ in copies] == [v.name for v, _ in update_copies(plan_nodes(plain))]
    assert_same_training(bound, plain, data)


def test_one_copy_a_parameter():
    """The update's table holds one copy a parameter: a second permute of a parameter, and one
    of a parameter that already has a (bf16) copy, stay permutes."""
    t = Tracer()
    w, v = (t.input((8, 4, 3, 3), "float32", name).value for name in ("w", "v"))
    w.role = v.role = PARAM
    (first,) = t.emit("permute", [w], dims=TO_KRSC)
    (second,) = t.emit("permute", [w], dims=TO_KRSC)
    (other,) = t.emit("permute", [v], dims=TO_KRSC)
    (s,) = t.emit("add", [first, second])
    (total,) = t.emit("add", [s, other])
    t.graph.outputs = {"total": total}
    copies = bind_permuted_weights(t.graph, {v})
    assert [(c.param, c.value, c.dims) for c in copies] == [(w, first, TO_KRSC)]
    assert first.role == STATE and first in t.graph.state
    assert [n.op for n in t.graph.nodes] == ["permute", "permute", "add", "add"]


def test_overlapped_updates_write_their_buckets_copies(monkeypatch):
    """An update split into buckets (overlap_update) writes each bucket's copies, after the
    backward's last read of them: the step trains as with the one update."""
    monkeypatch.setattr(overlap, "UPDATE_BUCKET_CAP_MB", 1e-3)    # a bucket a kilobyte
    data, start = batches(), initial_weights()
    sgd = lambda: optim.SGD(lr=0.1, momentum=0.9)     # noqa: E731
    built = []
    for overlapped in (True, False):
        step = channels_last_step(ConvNet, start, sgd, data[0], on_bad_batch="ignore",
                                  overlap_update=overlapped)
        nodes = plan_nodes(step)
        assert len(update_copies(nodes)) == 2
        assert (sum(n.op in UPDATE_OPS for n in nodes) > 1) == overlapped
        built.append(step)
    assert_same_training(*built, data * 2)
