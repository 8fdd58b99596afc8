"""The planner (compile/plan.py) and the executable cache: memory reuse without overlap, views
aliasing their source, typed errors for malformed graphs, one executable per feed signature."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stepgraph as sg
from stepgraph import losses, models, nn, optim
from stepgraph.backends.numpy import NumpyBackend
from stepgraph.ops.activation import act_forward
from stepgraph.compile.build import build_train_graph
from stepgraph.compile.executable import TRAIN, Executable
from stepgraph.compile.feed import signature_of
from stepgraph.compile.fuse import fuse
from stepgraph.compile.plan import ALIGN, VIEW_OPS, make_plan
from stepgraph.errors import PlanError
from stepgraph.ir.graph import PARAM, STATE, Graph, Node, Value
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import run_graph

BATCH = 16
WORKLOADS = {   # model, loss, input shape
    "mlp": (models.mlp, losses.cross_entropy, (784,)),
    "cnn": (models.cnn, losses.nll_loss, (1, 28, 28)),
}


def train_plan(workload: str, fused: bool = True):
    make_model, loss, shape = WORKLOADS[workload]
    x = np.ones((BATCH, *shape), np.float32)
    y = np.zeros(BATCH, np.int64)
    graph = build_train_graph(make_model(), loss, optim.SGD(lr=0.1, momentum=0.9),
                              signature_of(("x", "y"), (x, y)), seed=0)
    return make_plan(fuse(graph) if fused else graph)


@pytest.fixture(scope="module", params=["mlp", "cnn"])
def plan(request):
    return train_plan(request.param)


def test_arena_reuses_memory(plan):
    summary = plan.summary()
    assert summary.arena_bytes < summary.bytes_without_reuse, str(summary)


def test_no_two_live_buffers_overlap(plan):
    """Lifetimes are closed intervals of step indices: a node's outputs are live together with
    its inputs, so a buffer may only reuse memory whose last reader ran strictly earlier."""
    checked = 0
    for (a, sa), (b, sb) in itertools.combinations(plan.slots.items(), 2):
        la, lb = plan.lifetimes[a], plan.lifetimes[b]
        if la.first <= lb.last and lb.first <= la.last:
            checked += 1
            disjoint = sa.offset + sa.nbytes <= sb.offset or sb.offset + sb.nbytes <= sa.offset
            assert disjoint, f"{a!r} {la} at {sa} overlaps {b!r} {lb} at {sb}"
    assert checked > 0


def test_slots_are_aligned_and_inside_the_arena(plan):
    for v, slot in plan.slots.items():
        assert slot.offset % ALIGN == 0
        assert slot.nbytes == v.nbytes
        assert slot.offset + slot.nbytes <= plan.arena_bytes


def test_lifetimes_cover_every_use(plan):
    """Each intermediate is live from its writer to its last reader (or the end of the step
    for a step output), following views back to the buffer they share."""
    root = lambda v: plan.views.get(v, v)   # noqa: E731
    for i, node in enumerate(plan.steps):
        for v in node.inputs + node.outputs:
            if root(v).is_external:
                continue
            life = plan.lifetimes[root(v)]
            assert life.first <= i <= life.last, f"step {i} {node.op} uses {v!r} outside {life}"
    for v in plan.graph.outputs.values():
        if not root(v).is_external:
            assert plan.lifetimes[root(v)].last == len(plan.steps)


def test_every_intermediate_has_memory_and_externals_have_none(plan):
    written = {v for n in plan.steps for v in n.outputs}
    assert written == set(plan.slots) | set(plan.views)
    assert not any(v.is_external for v in plan.slots)


def test_views_alias_their_source():
    plan = train_plan("cnn")
    views = [n for n in plan.steps if n.op in VIEW_OPS]
    assert len(views) == 2     # Flatten forward, and its gradient reshaped back
    exe = Executable(plan, NumpyBackend(), lambda v: np.zeros(v.shape, v.dtype), None, TRAIN, None)
    for n in views:
        out, src = n.outputs[0], n.inputs[0]
        assert out not in plan.slots and plan.views[out] == plan.views.get(src, src)
        assert np.shares_memory(exe.buffers[out], exe.buffers[src])


def test_view_extends_its_source_lifetime():
    t = Tracer()
    x = t.input((4, 6), "float32", "x")
    a = t.op("act", [x], kind="tanh", slope=0.0)
    v = a.reshape(24)
    filler = [t.op("act", [x], kind="relu", slope=0.0) for _ in range(3)]
    out = t.op("act", [v], kind="sigmoid", slope=0.0)
    t.graph.outputs = {"out": out.value, **{f"f{i}": f.value for i, f in enumerate(filler)}}
    plan = make_plan(t.graph)
    assert plan.lifetimes[a.value].last == len(plan.steps) - 1   # read through the view
    for f in filler:
        sa, sf = plan.slots[a.value], plan.slots[f.value]
        assert sa.offset + sa.nbytes <= sf.offset or sf.offset + sf.nbytes <= sa.offset


def _graph(*nodes: Node, inputs=(), outputs=None) -> Graph:
    return Graph(list(nodes), list(inputs), [], [], outputs or {})


def test_plan_error_on_read_before_write():
    x = Value((2, 3), "float32", "input", "x")
    tmp, out = Value((2, 3), "float32"), Value((2, 3), "float32")
    graph = _graph(Node("act", [tmp], [out], dict(kind="relu")),
                   Node("act", [x], [tmp], dict(kind="relu")), inputs=[x],
                   outputs={"out": out})
    with pytest.raises(PlanError, match="reads"):
        make_plan(graph)


def test_plan_error_on_an_output_never_computed():
    x = Value((2, 3), "float32", "input", "x")
    with pytest.raises(PlanError, match="'loss'"):
        make_plan(_graph(inputs=[x], outputs={"loss": Value((), "float32")}))


def test_plan_error_on_a_value_written_twice():
    x = Value((2, 3), "float32", "input", "x")
    out = Value((2, 3), "float32")
    graph = _graph(Node("act", [x], [out], dict(kind="relu")),
                   Node("act", [x], [out], dict(kind="tanh")), inputs=[x],
                   outputs={"out": out})
    with pytest.raises(PlanError, match="written"):
        make_plan(graph)


def test_plan_error_on_a_node_writing_an_external():
    x = Value((2, 3), "float32", "input", "x")
    with pytest.raises(PlanError, match="external"):
        make_plan(_graph(Node("act", [x], [x], dict(kind="relu")), inputs=[x],
                         outputs={"out": x}))


# ---- the executable cache ------------------------------------------------------------------

_GEN = np.random.default_rng(0)    # shared: every call draws a fresh batch


def _data(batch):
    return _GEN.standard_normal((batch, 8)).astype(np.float32), _GEN.integers(0, 3, batch)


def test_compile_train_step_returns_the_same_step_for_the_same_arguments():
    model = nn.Sequential(nn.Linear(8, 3))
    opt = optim.SGD(lr=0.1)
    step = sg.compile_train_step(model, losses.cross_entropy, opt, _data(4))
    step(*_data(4))
    assert sg.compile_train_step(model, losses.cross_entropy, opt, _data(4)) is step
    assert sg.compile_train_step(model, losses.cross_entropy, optim.SGD(lr=0.1),
                                 _data(4)) is not step
    assert sg.compile_train_step(model, losses.cross_entropy, opt, _data(4), seed=1) is not step
    other = nn.Sequential(nn.Linear(8, 3))
    assert sg.compile_train_step(other, losses.cross_entropy, opt, _data(4)) is not step


def shared_buffers(exe) -> dict:
    """The parameter and optimizer-state buffers of an executable, by name."""
    return {v.name: buf for v, buf in exe.buffers.items() if v.role in (PARAM, STATE)}


def test_one_executable_per_batch_size_sharing_params_and_state():
    model = nn.Sequential(nn.Linear(8, 3))
    step = sg.compile_train_step(model, losses.cross_entropy, optim.Adam(), _data(4))
    for batch in (4, 3, 4, 1, 3):
        step(*_data(batch))
    assert len(step.executables) == 3
    first, *others = (shared_buffers(e) for e in step.executables.values())
    assert "0.weight" in first and "optimizer.exp_avg.0.weight" in first
    for exe in others:
        assert exe.keys() == first.keys()
        for name, buf in exe.items():
            assert buf is first[name], name
    assert int(step.state_dict()["optimizer.step"]) == 5


# ---- random graphs: arena reuse never changes what a graph computes -------------------------

SHAPES = {24: [(4, 6), (24,), (2, 12)], 60: [(6, 10), (60,)]}
KINDS = ("relu", "tanh", "sigmoid")


@st.composite
def random_graphs(draw):
    """A straight-line program of act / add / reshape nodes over values of two sizes, with
    random step outputs: lifetimes overlap, end and restart in every pattern."""
    t = Tracer()
    values = [t.input(SHAPES[n][0], "float32", f"x{n}").value for n in SHAPES]
    for _ in range(draw(st.integers(3, 30))):
        a = draw(st.sampled_from(values))
        op = draw(st.sampled_from(["act", "add", "reshape"]))
        if op == "act":
            out = t.emit("act", [a], kind=draw(st.sampled_from(KINDS)), slope=0.0)[0]
        elif op == "add":
            same = [v for v in values if v.shape == a.shape]
            out = t.emit("add", [a, draw(st.sampled_from(same))])[0]
        else:
            out = t.emit("reshape", [a], shape=draw(st.sampled_from(SHAPES[a.size])))[0]
        values.append(out)
    picked = draw(st.lists(st.sampled_from(values[2:]), min_size=1, max_size=4, unique=True))
    t.graph.outputs = {f"out{i}": v for i, v in enumerate(picked + [values[-1]])}
    return t.graph


def evaluate_directly(graph, arrays):
    """The same program with a fresh array per value: no arena, no reuse."""
    env = {v: arrays[v.name] for v in graph.inputs}
    for n in graph.nodes:
        a = env[n.inputs[0]]
        if n.op == "act":
            env[n.outputs[0]] = act_forward(a, n.attrs["kind"])
        elif n.op == "add":
            env[n.outputs[0]] = a + env[n.inputs[1]]
        else:
            env[n.outputs[0]] = a.reshape(n.attrs["shape"])
    return {k: env[v] for k, v in graph.outputs.items()}


@settings(max_examples=60, deadline=None)
@given(random_graphs())
def test_random_graphs_plan_without_overlap_and_compute_the_same(graph):
    plan = make_plan(graph)
    for (a, sa), (b, sb) in itertools.combinations(plan.slots.items(), 2):
        la, lb = plan.lifetimes[a], plan.lifetimes[b]
        if la.first <= lb.last and lb.first <= la.last:
            assert sa.offset + sa.nbytes <= sb.offset or sb.offset + sb.nbytes <= sa.offset
    gen = np.random.default_rng(len(graph.nodes))
    arrays = {v.name: gen.standard_normal(v.shape).astype(np.float32) for v in graph.inputs}
    got, want = run_graph(graph, arrays), evaluate_directly(graph, arrays)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
