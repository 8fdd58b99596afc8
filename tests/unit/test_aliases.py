"""The planner's aliases (compile/aliases.py): contiguous slices and unstacks as views, concats
whose inputs are written in place or already lie in place, and the cases where they must not
apply. Every plan here is checked twice: no node that runs writes memory a live value holds
(a simulation of the arena over the schedule), and the NumPy results are bit for bit those of
the same graph planned without aliases."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import stepgraph as sg
from stepgraph import nn, optim
from stepgraph.backends.numpy import NumpyBackend
from stepgraph.compile.executable import INFERENCE, Executable
from stepgraph.compile.plan import ALIGN, make_plan
from stepgraph.ir.trace import Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import randn, seeded

# float32 rows of 64 elements: 256 bytes, one ALIGN each
ROW = ALIGN // 4


def where(plan, v):
    """(buffer, first byte, end) of v under the plan: the arena or an external's own."""
    root = plan.views.get(v, v)
    if root.is_external:
        return id(root), 0, v.nbytes
    start = plan.slots[root].offset + plan.offsets.get(v, 0)
    return "arena", start, start + v.nbytes


def assert_no_clobber(plan) -> int:
    """No node that runs writes bytes of a value written before it and read at or after it
    (or a step output): each value holds what its producer wrote until its last reader.
    Returns the number of (write, live value) pairs checked."""
    written, last = {}, {}
    for i, n in enumerate(plan.steps):
        for v in n.outputs:
            written[v] = i
        for v in n.inputs:
            last[v] = i
    for v in plan.graph.outputs.values():
        last[v] = len(plan.steps)
    checked = 0
    for i, n in enumerate(plan.steps):
        if not plan.runs(i):
            continue
        for out in n.outputs:
            buf, a, b = where(plan, out)
            for v, w in written.items():
                if v is out or not w < i <= last.get(v, -1):
                    continue
                vbuf, va, vb = where(plan, v)
                checked += 1
                assert vbuf != buf or b <= va or vb <= a, \
                    f"node {i} ({n.op}) writes {out!r} over live {v!r}"
    return checked


def run(graph, arrays: dict, aliases: bool = True) -> dict:
    plan = make_plan(graph, aliases=aliases)
    exe = Executable(plan, NumpyBackend(), None, None, INFERENCE, None)
    exe.feed([arrays[v.name] for v in graph.inputs])
    exe.run_eager()
    return {k: np.array(buf, copy=True) for k, buf in exe.outputs.items()}


def checked_plan(tracer: Tracer, outputs: dict, arrays: dict):
    """The aliased plan of the traced graph, after checking it (module docstring)."""
    tracer.graph.outputs = {k: t.value for k, t in outputs.items()}
    plan = make_plan(tracer.graph)
    assert assert_no_clobber(plan) > 0
    got, want = run(tracer.graph, arrays), run(tracer.graph, arrays, aliases=False)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    return plan


def elided(plan, op: str) -> list[bool]:
    """For each `op` node of the plan: whether it runs no kernel."""
    return [not plan.runs(i) for i, n in enumerate(plan.steps) if n.op == op]


def tanh(t):
    return t.tracer.op("act", [t], kind="tanh", slope=0.0)


def inputs(tracer, **shapes):
    gen = seeded(str(sorted(shapes.items())))
    arrays = {k: randn(gen, *s) for k, s in shapes.items()}
    return {k: tracer.input(a.shape, "float32", k) for k, a in arrays.items()}, arrays


# ---- slices --------------------------------------------------------------------------------

@pytest.mark.parametrize("reverse", [False, True])
def test_unstack_of_contiguous_steps_is_views_of_its_input(reverse):
    t = Tracer()
    ins, arrays = inputs(t, x=(3, 2, ROW))
    a = tanh(ins["x"])
    steps = t.op_all("unstack", [a], dim=0, reverse=reverse)
    plan = checked_plan(t, {f"s{k}": tanh(s) for k, s in enumerate(steps)}, arrays)
    assert elided(plan, "unstack") == [True]
    order = [2, 1, 0] if reverse else [0, 1, 2]
    for s, k in zip(steps, order):
        assert plan.views[s.value] is a.value and plan.offsets[s.value] == k * 2 * ALIGN


@pytest.mark.parametrize("case", ["later axis", "misaligned", "input", "step 2"])
def test_slices_that_are_no_contiguous_range_of_an_intermediate_copy(case):
    t = Tracer()
    shape = {"later axis": (2, 3, ROW), "misaligned": (3, 5)}.get(case, (4, ROW))
    ins, arrays = inputs(t, x=shape)
    x = ins["x"] if case == "input" else tanh(ins["x"])
    if case == "later axis":
        outs = t.op_all("unstack", [x], dim=1, reverse=False)
    elif case == "step 2":
        outs = [t.op("slice", [x], dim=0, start=0, stop=4, step=2)]
    else:
        outs = t.op_all("unstack", [x], dim=0, reverse=False)
    plan = checked_plan(t, {f"o{k}": tanh(o) for k, o in enumerate(outs)}, arrays)
    assert not any(elided(plan, "unstack") + elided(plan, "slice"))


def test_slice_of_leading_rows_is_a_view():
    t = Tracer()
    ins, arrays = inputs(t, x=(4, ROW))
    a = tanh(ins["x"])
    rows = t.op("slice", [a], dim=0, start=1, stop=3)
    plan = checked_plan(t, {"rows": tanh(rows), "a": tanh(a)}, arrays)
    assert elided(plan, "slice") == [True] and plan.offsets[rows.value] == ALIGN


# ---- concats -------------------------------------------------------------------------------

def test_concat_inputs_are_written_in_place():
    """Each input's producer writes its range of the output; the inputs are read after the
    concat too, so they stay live inside the output's buffer."""
    t = Tracer()
    ins, arrays = inputs(t, x=(2, ROW), y=(1, ROW))
    a, b = tanh(ins["x"]), tanh(ins["y"])
    c = sg.cat([a, b], 0)
    plan = checked_plan(t, {"c": tanh(c), "a": tanh(a), "b": tanh(b)}, arrays)
    assert elided(plan, "concat") == [True]
    assert a.value not in plan.slots and plan.views[a.value] is c.value
    assert plan.offsets[b.value] == 2 * ALIGN


def test_stack_of_a_recurrence_holds_every_step_in_place():
    t = Tracer()
    ins, arrays = inputs(t, h=(1, ROW))
    h, hs = ins["h"], []
    for _ in range(5):
        h = tanh(h * 0.5)
        hs.append(h)
    plan = checked_plan(t, {"out": tanh(sg.cat(hs, 0))}, arrays)
    assert elided(plan, "concat") == [True]


def test_nested_concats_and_a_channel_concat_of_batch_one():
    """A U-Net's torch.cat([up, skip], dim=1) is in place where the batch is 1 (each input
    then one contiguous range), nested concats too; with batch 2 the channel ranges are
    strided and the concat copies."""
    for batch, want in ((1, True), (2, False)):
        t = Tracer()
        ins, arrays = inputs(t, x=(batch, 2, ROW), y=(batch, 1, ROW), z=(batch, 1, ROW))
        a, b, c = (tanh(ins[k]) for k in "xyz")
        inner = sg.cat([a, b], 1)
        outer = sg.cat([inner, c], 1)
        plan = checked_plan(t, {"outer": tanh(outer), "inner": tanh(inner)}, arrays)
        assert elided(plan, "concat") == [want, want], batch


def test_concat_of_ranges_already_in_place_is_a_view():
    """stack(unbind(a)) and a concat of consecutive steps read a's own buffer."""
    t = Tracer()
    ins, arrays = inputs(t, x=(4, 1, ROW))
    a = tanh(ins["x"])
    steps = t.op_all("unstack", [a], dim=0, reverse=False)
    whole = sg.stack(steps, 0)
    middle = sg.cat([s.reshape(1, ROW) for s in steps[1:3]], 0)
    plan = checked_plan(t, {"whole": tanh(whole), "middle": tanh(middle)}, arrays)
    assert elided(plan, "concat") == [True, True]
    assert plan.views[whole.value] is a.value and plan.offsets.get(whole.value, 0) == 0
    assert plan.views[middle.value] is a.value and plan.offsets[middle.value] == ALIGN


def test_an_input_of_two_concats_is_placed_in_the_larger_only():
    t = Tracer()
    ins, arrays = inputs(t, x=(1, ROW), y=(1, ROW), z=(2, ROW), w=(1, ROW))
    a, b, c, d = (tanh(ins[k]) for k in "xyzw")
    small = sg.cat([a, d], 0)
    large = sg.cat([a, b, c], 0)
    plan = checked_plan(t, {"small": tanh(small), "large": tanh(large)}, arrays)
    assert elided(plan, "concat") == [False, True]
    assert plan.views[a.value] is large.value


@pytest.mark.parametrize("case", ["twice", "input", "strided", "misaligned", "slice"])
def test_concats_that_must_copy(case):
    """An input used twice, an external input, ranges that are not contiguous or not aligned,
    and an input that is itself a range of another buffer: the concat runs."""
    t = Tracer()
    shape = {"strided": (2, ROW), "misaligned": (1, 5)}.get(case, (1, ROW))
    ins, arrays = inputs(t, x=shape, y=shape, z=(2, *shape[1:]))
    a, b = tanh(ins["x"]), tanh(ins["y"])
    pieces = {"twice": [a, a], "input": [ins["x"], b], "strided": [a, b],
              "misaligned": [a, b], "slice": None}[case]
    if case == "slice":
        first = t.op("slice", [tanh(ins["z"])], dim=0, start=0, stop=1)
        pieces = [first, b]
    c = sg.cat(pieces, 1 if case == "strided" else 0)
    plan = checked_plan(t, {"c": tanh(c), "a": tanh(a)}, arrays)
    assert elided(plan, "concat") == [False]


def test_a_concat_input_mutated_afterwards_is_copied():
    """batch_norm_train updates its running mean in place after the concat read it: the
    concat's output keeps the values from before (as a copy would), so the running mean may
    not be placed inside it."""
    t = Tracer()
    ins, arrays = inputs(t, x=(4, ROW), y=(ROW,))
    mean = t.op("fill", [], value=0.0, shape=(ROW,), dtype="float32")
    var = t.op("fill", [], value=1.0, shape=(ROW,), dtype="float32")
    count = t.op("fill", [], value=0, shape=(), dtype="int64")
    c = sg.cat([mean, tanh(ins["y"])], 0)
    y, _, _ = t.op_all("batch_norm_train", [ins["x"], mean, var, count], eps=1e-5,
                       momentum=0.5, affine=False, track=True)
    plan = checked_plan(t, {"c": c, "y": y, "mean": mean * 1.0}, arrays)
    assert elided(plan, "concat") == [False]
    got = run(plan.graph, arrays)
    assert not got["c"][:ROW].any() and got["mean"].any()


# ---- training plans ------------------------------------------------------------------------

def lstm_lm(steps: int, vocab: int = 11, hidden: int = 16, batch: int = 4):
    """An LSTM language model (batch_first, 2 layers) and its batch: (batch, hidden) float32
    states are ALIGN bytes."""
    class LanguageModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.lstm = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
            self.head = nn.Linear(hidden, vocab)

        def forward(self, tokens):
            return self.head(self.lstm(self.embed(tokens))[0])

    gen = seeded(f"lm {steps}")
    x = gen.integers(0, vocab, (batch, steps))
    return LanguageModel(), (x, (x + 1) % vocab)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lm_step(model, batch, **kw):
    return sg.compile_train_step(model, loss=lm_loss, optimizer=optim.SGD(lr=0.5, momentum=0.9),
                                 example_inputs=batch, on_bad_batch="ignore", **kw)


def kernels(steps: int) -> tuple[Counter, object]:
    nn.manual_seed(0)
    model, batch = lstm_lm(steps)
    step = lm_step(model, batch)
    step(*batch)
    exe = next(iter(step.executables.values()))
    return Counter(n.op for n, _, _ in exe.calls), exe.plan


def test_lstm_step_runs_four_kernels_per_time_step_and_layer():
    """Per time step and layer: the hidden GEMM and the cell forward, the cell gradient and
    the dh GEMM backward; the first step's GEMM of the zero state is folded away; no slice,
    unstack or concat copies at all."""
    short, plan = kernels(4)
    long, _ = kernels(8)
    assert_no_clobber(plan)
    per_step = {op: (long[op] - short[op]) / 4 for op in long if long[op] != short[op]}
    assert per_step == {"linear": 2, "lstm_cell": 2, "lstm_cell_grad": 2, "matmul": 2}
    assert short["linear"] == 2 * 3 + 2 + 1           # hidden GEMMs, projections, head
    for op in ("slice", "unstack", "concat"):
        assert short[op] == long[op] == 0, op


def test_lstm_training_is_bit_identical_without_aliases(monkeypatch):
    import stepgraph.api as api

    results = []
    for aliases in (True, False):
        monkeypatch.setattr(api, "make_plan", lambda g, a=aliases: make_plan(g, aliases=a))
        nn.manual_seed(1)
        model, batch = lstm_lm(5)
        step = lm_step(model, batch)
        losses = [float(step(*batch)) for _ in range(3)]
        results.append((losses, model.state_dict()))
        exe = next(iter(step.executables.values()))
        assert any(not exe.plan.runs(i) for i, n in enumerate(exe.plan.steps)
                   if n.op == "concat") == aliases
    (l1, s1), (l2, s2) = results
    assert l1 == l2
    for k in s1:
        np.testing.assert_array_equal(s1[k], s2[k], err_msg=k)
