"""compile/pointwise_views.py, compile/elementwise_reshapes.py and compile/pointwise_sums.py:
pointwise programs read slices and permutes of a value through strided views instead of their
copies, elementwise ops move to the shape their inputs had before a reshape so that they fuse
with their neighbours, and sums over the last axis run with the elementwise code before and
after them. None changes the arithmetic, so the rewritten graphs equal the graphs without the
three passes bit for bit on the NumPy backend: a gated MLP (chunk, SiLU, product), the hand-written
head split with a normalisation, `stack(...).prod(-1)`; then the near-misses left alone, the
op's strided reads, and the generated CUDA source (compiled with NVRTC, without a GPU)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import stepgraph
import stepgraph.nn.functional as F
from stepgraph.compile.elementwise_reshapes import move_elementwise_before_reshapes
from stepgraph.compile.fuse import PASSES, eliminate_dead_code, fuse
from stepgraph.compile.plan import make_plan
from stepgraph.compile.pointwise_sums import fuse_row_sums
from stepgraph.compile.pointwise_views import read_pointwise_views
from stepgraph.errors import ShapeError
from stepgraph.ir.graph import Value
from stepgraph.ir.ops import infer_outputs
from stepgraph.ir.trace import Tracer
from stepgraph.ops.pointwise import Instr
from tests.ops.helpers import randn, run_graph, seeded
from tests.unit.test_layout_chains import B, C, T, head_split, traced

NEW = (read_pointwise_views, move_elementwise_before_reshapes, fuse_row_sums)
WITHOUT = tuple(p for p in PASSES if p not in NEW)


def gated_mlp(x, w):
    """A gated MLP's gate (SwiGLU's form): the projection's halves, SiLU of one times the
    other."""
    a, b = (x @ w).chunk(2, dim=-1)
    return (F.silu(a) * b).pow(2).sum()


def stack_prod(x, w):
    a, b = (x @ w).chunk(2, dim=-1)
    return (x.tanh() * stepgraph.stack([a.sigmoid(), b.tanh()], -1).prod(-1)).relu().sum()


def steps(graph) -> Counter:
    """The ops that run (views placed by the planner are not steps)."""
    plan = make_plan(graph)
    return Counter(n.op for i, n in enumerate(plan.steps) if plan.runs(i))


def same_bits(request, graph, wide: int) -> None:
    rng = seeded(request.node.name)
    a = {"x": randn(rng, B, T, C), "w": randn(rng, C, wide)}
    want, got = run_graph(fuse(graph, WITHOUT), a), run_graph(fuse(graph), a)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_the_gate_halves_are_read_in_place(request):
    graph = traced(gated_mlp, 2 * C)
    before, after = steps(fuse(graph, WITHOUT)), steps(fuse(graph))
    assert before["slice"] == 2 and after["slice"] == 0
    viewed = [n for n in fuse(graph).nodes if n.op == "pointwise" and n.attrs.get("views")]
    assert viewed and any(sum(v is not None for v in n.attrs["views"]) == 2 for n in viewed)
    same_bits(request, graph, 2 * C)


def test_the_normalised_heads_are_read_in_place(request):
    graph = traced(head_split, 3 * C)
    before, after = steps(fuse(graph, WITHOUT)), steps(fuse(graph))
    # q and k are read only by the normalisation's elementwise code; v by the attention
    assert before["layout_copy"] == 3 and after["layout_copy"] == 1
    # each normalisation's sum of squares with its square before and its clamped square root
    # after, one kernel each way for q and for k
    assert after["pointwise_sum"] == 4 and after["reduce_sum"] == before["reduce_sum"] - 4
    same_bits(request, graph, 3 * C)


def test_stack_prod_is_one_program_each_way(request):
    graph = traced(stack_prod, 2 * C)
    before, after = steps(fuse(graph, WITHOUT)), steps(fuse(graph))
    elementwise = ("pointwise", "binary", "act", "act_grad", "unary", "slice", "concat")
    assert sum(after[op] for op in elementwise) < sum(before[op] for op in elementwise)
    # forward: the slices, both activations, the product and the rest of the gate in one
    forward = [n for n in fuse(graph).nodes if n.op == "pointwise"
               and {i.op for i in n.attrs["program"]} >= {"act", "binary"}]
    assert forward and forward[0].attrs.get("views")
    same_bits(request, graph, 2 * C)


def one_reader_graph(extra=None, mutate=False):
    """x -> slice (a copy) -> sin -> y, with `extra` another reader of the slice."""
    tracer = Tracer()
    x = tracer.input((3, 4, 6), "float32", "x")
    (s,) = tracer.emit("slice", [x.value], dim=2, start=1, stop=5)
    (y,) = tracer.emit("unary", [s], kind="sin")
    tracer.graph.outputs = {"y": y}
    if extra:
        tracer.graph.outputs["z"] = extra(tracer, s)
    if mutate:
        tracer.graph.nodes[-1].mutates = (0,)     # as if a node wrote the root in place
    return tracer.graph


def rewritten_ops(graph) -> Counter:
    return Counter(n.op for n in fuse(graph, (read_pointwise_views, eliminate_dead_code)).nodes)


def test_a_lone_reader_of_a_slice_reads_it_in_place(request):
    graph = one_reader_graph()
    ops = rewritten_ops(graph)
    assert ops == {"pointwise": 1}
    a = {"x": randn(seeded(request.node.name), 3, 4, 6)}
    rewritten = fuse(graph, (read_pointwise_views, eliminate_dead_code))
    np.testing.assert_array_equal(run_graph(rewritten, a)["y"], run_graph(graph, a)["y"])


@pytest.mark.parametrize("case", ["other reader", "graph output", "root written"])
def test_near_misses_keep_their_copy(case):
    if case == "other reader":
        graph = one_reader_graph(lambda t, s: t.emit("reduce_sum", [s], axes=(1,))[0])
    elif case == "graph output":
        graph = one_reader_graph(lambda t, s: s)
    else:
        graph = one_reader_graph(mutate=True)
    assert rewritten_ops(graph)["slice"] == 1


def test_an_elementwise_op_moves_before_unit_axis_reshapes_only_without_broadcast():
    tracer = Tracer()
    a = tracer.input((3, 4), "float32", "a")
    b = tracer.input((3, 4), "float32", "b")
    c = tracer.input((3, 4, 1), "float32", "c")
    ra, rb = (tracer.emit("reshape", [v.value], shape=(3, 4, 1))[0] for v in (a, b))
    (m,) = tracer.emit("binary", [ra, rb], kind="mul")            # moves to (3, 4)
    (back,) = tracer.emit("reshape", [m], shape=(3, 4))           # then gives back m
    (n,) = tracer.emit("binary", [ra, c.value], kind="add")       # c is no reshape: stays
    tracer.graph.outputs = {"m": back, "n": n}
    graph = move_elementwise_before_reshapes(tracer.graph)
    mul = next(x for x in graph.nodes if x.attrs.get("kind") == "mul")
    add = next(x for x in graph.nodes if x.attrs.get("kind") == "add")
    assert mul.outputs[0].shape == (3, 4) and graph.outputs["m"] is mul.outputs[0]
    assert add.outputs[0].shape == (3, 4, 1)
    rng = seeded("move")
    arrays = {"a": randn(rng, 3, 4), "b": randn(rng, 3, 4), "c": randn(rng, 3, 4, 1)}
    want, got = run_graph(tracer.graph, arrays), run_graph(graph, arrays)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_pointwise_reads_its_views(request):
    rng = seeded(request.node.name)
    x = randn(rng, 6, 10)
    program = (Instr("binary", (0, 1), (("kind", "sub"),)),)
    view = ((2, 3, 4), (20, 1, 3), 5)
    tracer = Tracer()
    xs = tracer.input((6, 10), "float32", "x")
    (y,) = tracer.emit("pointwise", [xs.value, xs.value], program=program, results=(2,),
                       shape=(2, 3, 4), views=(view, ((2, 3, 4), (0, 10, 1), 0)))
    tracer.graph.outputs = {"y": y}
    got = run_graph(tracer.graph, {"x": x})["y"]
    flat = x.reshape(-1)
    want = np.lib.stride_tricks.as_strided(flat[5:], (2, 3, 4), (80, 4, 12)) - \
        np.lib.stride_tricks.as_strided(flat, (2, 3, 4), (0, 40, 4))
    np.testing.assert_array_equal(got, want)


def test_pointwise_refuses_a_view_past_its_input():
    x = Value((6, 10), "float32")
    program = (Instr("unary", (0,), (("kind", "sin"),)),)
    with pytest.raises(ShapeError, match="reads past input"):
        infer_outputs("pointwise", [x], dict(program=program, results=(1,), shape=(2, 3, 4),
                                             views=(((2, 3, 4), (50, 1, 3), 5),)))


def test_the_cuda_source_reads_views_and_compiles():
    from stepgraph.backends.cuda import pointwise
    from stepgraph.backends.cuda.runtime.compiler import compile_source_to_cubin

    program = (Instr("act", (0,), (("kind", "sigmoid"), ("slope", 0.01))),
               Instr("binary", (2, 1), (("kind", "mul"),)))
    shape, roots = (2, 5, 8), ((10, 16), (10, 16))
    halves = (((2, 5, 8), (80, 16, 1), 0), ((2, 5, 8), (80, 16, 1), 8))
    args = (program, (3,), shape, roots, ("float32", "float32"), halves)
    source = pointwise.kernel_source(*args)
    assert "in1[" in source and "+ 8]" in source       # the second half's offset
    assert pointwise.vectorizable(*args)                 # rows of 8, offsets of 0 and 8
    assert compile_source_to_cubin(source, "pointwise_views.cu")
    odd = (((2, 5, 8), (80, 16, 1), 0), ((2, 5, 8), (80, 16, 1), 7))
    assert not pointwise.vectorizable(*args[:5], odd)    # an offset of 7 is not aligned


def sum_graph(shape=(6, 40), axes=(1,), dtype="float32"):
    """y = exp(sqrt(max((x * w).sum(axes), 1e-3))), the sums also an output (read later)."""
    tracer = Tracer()
    x = tracer.input(shape, dtype, "x")
    w = tracer.input(shape, dtype, "w")
    (p,) = tracer.emit("binary", [x.value, w.value], kind="mul")
    (s,) = tracer.emit("reduce_sum", [p], axes=axes)
    (c,) = tracer.emit("scalar", [s], kind="maximum", value=1e-3)
    (r,) = tracer.emit("unary", [c], kind="sqrt")
    (y,) = tracer.emit("unary", [r], kind="exp")
    tracer.graph.outputs = {"y": y, "s": s}
    return tracer.graph


def test_a_sum_runs_with_the_code_before_and_after_it(request):
    graph = sum_graph()
    fused = fuse(graph)
    assert Counter(n.op for n in fused.nodes) == {"pointwise_sum": 1}
    (node,) = fused.nodes
    assert len(node.outputs) == 2            # y, and the sums another node reads
    rng = seeded(request.node.name)
    a = {"x": randn(rng, 6, 40), "w": randn(rng, 6, 40)}
    want, got = run_graph(fuse(graph, WITHOUT), a), run_graph(fused, a)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("case", ["first axis", "bf16", "long rows"])
def test_sums_left_alone(case):
    graph = sum_graph(axes=(0,)) if case == "first axis" else \
        sum_graph(dtype="bfloat16") if case == "bf16" else sum_graph(shape=(2, 1025))
    assert "pointwise_sum" not in {n.op for n in fuse(graph).nodes}


def test_the_cuda_sum_source_compiles():
    from stepgraph.backends.cuda import pointwise_sum
    from stepgraph.backends.cuda.runtime.compiler import compile_source_to_cubin

    (node,) = fuse(sum_graph()).nodes
    source = pointwise_sum._source(node)
    assert "warp_sum(acc)" in source and "c < 40; c += 32" in source
    assert compile_source_to_cubin(source, "pointwise_sum.cu")


def test_an_op_stays_where_it_fuses_with_its_reader():
    """scale(reshape(x)) read by an add at the reshaped shape: moving the scale would split
    the pair into two kernels, so it stays, and both fuse into one program."""
    tracer = Tracer()
    x = tracer.input((3, 4), "float32", "x")
    c = tracer.input((3, 4, 1), "float32", "c")
    (r,) = tracer.emit("reshape", [x.value], shape=(3, 4, 1))
    (s,) = tracer.emit("scalar", [r], kind="mul", value=2.0)
    (t,) = tracer.emit("binary", [s, c.value], kind="add")
    tracer.graph.outputs = {"t": t}
    moved = move_elementwise_before_reshapes(tracer.graph)
    scale = next(n for n in moved.nodes if n.op == "scalar")
    assert scale.outputs[0].shape == (3, 4, 1)
    assert Counter(n.op for n in fuse(tracer.graph).nodes) == {"reshape": 1, "pointwise": 1}


def test_a_sum_keeps_an_epilogue_that_reads_through_a_view(request):
    """The epilogue program runs over the sums' shape with its inputs loaded as they are: a
    reader of the sums that reads another input through a view (a column of m) stays a
    pointwise node of its own (its NumPy reference once broadcast the whole of m)."""
    tracer = Tracer()
    x = tracer.input((6, 40), "float32", "x")
    m = tracer.input((6, 12), "float32", "m")
    (s,) = tracer.emit("reduce_sum", [x.value], axes=(1,))
    program = (Instr("binary", (0, 1), (("kind", "add"),)),)
    (y,) = tracer.emit("pointwise", [s, m.value], program=program, results=(2,), shape=(6,),
                       views=(None, ((6,), (12,), 3)))
    tracer.graph.outputs = {"y": y}
    fused = fuse_row_sums(tracer.graph)
    assert Counter(n.op for n in fused.nodes) == {"reduce_sum": 1, "pointwise": 1}
    rng = seeded(request.node.name)
    a = {"x": randn(rng, 6, 40), "m": randn(rng, 6, 12)}
    np.testing.assert_array_equal(run_graph(tracer.graph, a)["y"],
                                  a["x"].sum(axis=1) + a["m"][:, 3])
