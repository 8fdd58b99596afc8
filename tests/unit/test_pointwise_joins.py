"""compile/pointwise_joins.py: a concat (or a head-layout layout_concat) with a part made by
a pointwise program is stored by the last such program into the parts of one output
(ops/pointwise.py `Joined`). The rewritten graphs equal the graphs without the pass bit for
bit on the NumPy backend: a gated MLP's backward, sines and cosines joined along an inner
axis, parts the program reads and stores (an input, another program's result), the head
split's gradients joined through its permute, and the mixer file trained at fp32 and bf16.
The near-misses keep their concat; the op joins along any axis; the generated CUDA sources
store the parts through their views and compile with NVRTC (no GPU needed)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import stepgraph
import stepgraph.nn.functional as F
from stepgraph.compile.fuse import PASSES, fuse
from stepgraph.compile.pointwise_joins import join_pointwise_results
from stepgraph.errors import ShapeError
from stepgraph.ir.graph import Value
from stepgraph.ir.ops import infer_outputs
from stepgraph.ir.trace import Tracer
from stepgraph.ops.pointwise import Instr, Joined, concat_joined, result_stores
from tests.ops.helpers import randn, run_graph, seeded
from tests.unit.compat_training import torch_state, train_steps
from tests.unit.test_layout_chains import B, C, T, head_split, traced

WITHOUT = tuple(p for p in PASSES if p is not join_pointwise_results)


def gated_mlp(x, w):
    """SwiGLU's gate on one projection: its backward computes both halves' gradients in one
    program, and the projection's backward reads them joined."""
    a, b = (x @ w).chunk(2, dim=-1)
    return (F.silu(a) * b).pow(2).sum()


def position_features(x, w):
    """sin and cos of one table joined along an inner axis (the tokens), then used."""
    angles = (x @ w) * 0.5
    return (stepgraph.cat([angles.sin(), angles.cos()], 1) * 3.0).sum()


def ops(graph) -> Counter:
    return Counter(n.op for n in graph.nodes)


@pytest.mark.parametrize("loss", [gated_mlp, position_features], ids=["gated", "inner-axis"])
def test_the_concat_is_stored_by_its_program(request, loss):
    graph = traced(loss, 2 * C)
    before, after = fuse(graph, WITHOUT), fuse(graph)
    assert ops(before)["concat"] == 1 and ops(after)["concat"] == 0
    (joined,) = [n for n in after.nodes if n.op == "pointwise"
                 and any(isinstance(r, Joined) for r in n.attrs["results"])]
    assert len(joined.outputs) == len(joined.attrs["results"])
    rng = seeded(request.node.name)
    a = {"x": randn(rng, B, T, C), "w": randn(rng, C, 2 * C)}
    want, got = run_graph(before, a), run_graph(after, a)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def two_results(case: str):
    """y = cat([sin(2x), cos(2x)], 1), made in one program, or with `case`'s change."""
    tracer = Tracer()
    x = tracer.input((3, 6) if case == "rows of 6" else (3, 8), "float32", "x")
    (t,) = tracer.emit("scalar", [x.value], kind="mul", value=2.0)
    (s,) = tracer.emit("unary", [t], kind="sin")
    (c,) = tracer.emit("unary", [t], kind="cos")
    if case == "two programs":                 # a reduction between: s made by a second one
        (m,) = tracer.emit("reduce_sum", [s], axes=(0,))
        (s,) = tracer.emit("binary", [s, m], kind="mul")
    if case == "made later":                   # made after the program, by no program
        (c,) = tracer.emit("softmax", [x.value], axis=1)
    if case == "an input":
        c = x.value
    if case == "a slice":                      # read through a view that is no permutation
        (y,) = tracer.emit("layout_concat", [s, c], dim=1,
                           views=(((3, 8), (8, 1), 0), ((3, 4), (8, 1), 4)))
    else:
        (y,) = tracer.emit("concat", [s, c], dim=1)
    tracer.graph.outputs = {"y": y}
    if case == "a graph output":
        tracer.graph.outputs["s"] = s
    if case == "another reader":
        tracer.graph.outputs["z"] = tracer.emit("reduce_sum", [s], axes=(0,))[0]
    return tracer.graph


def same_bits_on_numpy(graph, seed: str) -> None:
    x = randn(seeded(seed), *graph.inputs[0].shape)
    want = run_graph(fuse(graph, WITHOUT), {"x": x})
    got = run_graph(fuse(graph), {"x": x})
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_two_results_of_one_program_are_joined(request):
    graph = fuse(two_results("one program"))
    assert ops(graph) == {"pointwise": 1}
    (node,) = graph.nodes
    assert node.attrs["results"] == (concat_joined((3, 8), 1, (2, 3)),)
    x = randn(seeded(request.node.name), 3, 8)
    np.testing.assert_array_equal(run_graph(graph, {"x": x})["y"],
                                  np.concatenate([np.sin(x * 2), np.cos(x * 2)], 1))


@pytest.mark.parametrize("case", ["an input", "two programs"])
def test_the_last_program_also_stores_the_other_parts(case):
    """A part the program does not make (an input, another program's result made before it)
    is read by the program and stored as it is."""
    graph = two_results(case)
    assert ops(fuse(graph, WITHOUT))["concat"] == 1 and ops(fuse(graph))["concat"] == 0
    same_bits_on_numpy(graph, case)


@pytest.mark.parametrize("case", ["another reader", "a graph output", "made later", "a slice",
                                  "rows of 6"])
def test_near_misses_keep_their_concat(case):
    """Left alone: a result read elsewhere or kept, a part made after the program, a part
    read through a slice, parts whose rows (of 6) could not be stored four at a time."""
    graph = two_results(case)
    op = "layout_concat" if case == "a slice" else "concat"
    assert ops(fuse(graph))[op] == 1
    same_bits_on_numpy(graph, case)


def test_the_heads_gradients_are_joined_in_the_head_layout(request):
    """q and k normalised after the head split of one packed projection: the backward joins
    q's and k's gradients (programs) and v's (a GEMM) through the split's permute; the last
    program stores all three where the projection's backward reads them."""
    graph = traced(head_split, 3 * C)
    before, after = fuse(graph, WITHOUT), fuse(graph)
    assert ops(before)["layout_concat"] == 1 and ops(after)["layout_concat"] == 0
    (joined,) = [n for n in after.nodes if n.op == "pointwise"
                 and any(isinstance(r, Joined) for r in n.attrs["results"])]
    assert joined.attrs.get("views")       # v's (B * H, T, D) gradient read at (B, H, T, D)
    rng = seeded(request.node.name)
    a = {"x": randn(rng, B, T, C), "w": randn(rng, C, 3 * C)}
    want, got = run_graph(before, a), run_graph(after, a)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def heads_join_node():
    """The program of test_the_heads_gradients_are_joined_in_the_head_layout that stores the
    joined gradients (also run on a GPU, tests/cuda/test_pointwise_cuda.py)."""
    (node,) = [n for n in fuse(traced(head_split, 3 * C)).nodes if n.op == "pointwise"
               and any(isinstance(r, Joined) for r in n.attrs["results"])]
    return node


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_the_op_joins_along_any_axis(request, dim):
    rng = seeded(request.node.name)
    x = randn(rng, 2, 3, 4)
    program = (Instr("unary", (0,), (("kind", "exp"),)),
               Instr("scalar", (0,), (("kind", "mul"), ("value", 2.0))))
    tracer = Tracer()
    xs = tracer.input((2, 3, 4), "float32", "x")
    (y, z) = tracer.emit("pointwise", [xs.value], program=program,
                         results=(concat_joined((2, 3, 4), dim, (1, 0, 2)), 2),
                         shape=(2, 3, 4))
    tracer.graph.outputs = {"y": y, "z": z}
    got = run_graph(tracer.graph, {"x": x})
    np.testing.assert_array_equal(got["y"], np.concatenate([np.exp(x), x, x * 2], dim))
    np.testing.assert_array_equal(got["z"], x * 2)
    # each part is the view of the output a slice of it would read
    stores = result_stores((concat_joined((2, 3, 4), dim, (1, 0, 2)), 2), (2, 3, 4))
    assert [(s.out, s.register) for s in stores] == [(0, 1), (0, 0), (0, 2), (1, 2)]
    flat = got["y"].reshape(-1)
    for part, s in enumerate(stores[:3]):
        seen = np.lib.stride_tricks.as_strided(flat[s.view[2]:], s.view[0],
                                               [4 * d for d in s.view[1]])
        want = np.take(got["y"], range(part * x.shape[dim], (part + 1) * x.shape[dim]), dim)
        np.testing.assert_array_equal(seen, want)


def test_a_join_of_two_dtypes_is_refused():
    x = Value((3, 4), "float32")
    program = (Instr("compare_scalar", (0,), (("kind", "gt"), ("value", 0.0))),)
    with pytest.raises(ShapeError, match="one dtype"):
        infer_outputs("pointwise", [x], dict(program=program, shape=(3, 4),
                                             results=(concat_joined((3, 4), 1, (0, 1)),)))


def test_the_cuda_source_stores_the_parts_and_compiles():
    from stepgraph.backends.cuda import pointwise
    from stepgraph.backends.cuda.runtime.compiler import compile_source_to_cubin

    program = (Instr("act", (0,), (("kind", "sigmoid"), ("slope", 0.01))),
               Instr("binary", (1, 0), (("kind", "mul"),)))
    def args(shape, dim, dtype="float32"):
        return program, (concat_joined(shape, dim, (1, 2)),), shape, (shape,), (dtype,), None

    args8 = args((2, 5, 8), 2)
    source = pointwise.kernel_source(*args8)
    assert "out0[" in source and "+ 8]" in source and "out1" not in source
    assert pointwise.vectorizable(*args8)                # rows of 8: parts at 0 and 8
    assert compile_source_to_cubin(source, "pointwise_joins.cu")
    assert not pointwise.vectorizable(*args((2, 5, 6), 2))   # rows of 6: a part at 6
    bf16 = args((2, 5, 8), 0, "bfloat16")
    assert pointwise.vectorizable(*bf16)
    assert compile_source_to_cubin(pointwise.kernel_source(*bf16), "pointwise_joins_bf16.cu")


def test_the_heads_join_source_compiles():
    """The parts of the head layout are stored through permuted strides, four elements at a
    time (each part's rows of D = 4 start at multiples of four), and v's gradient is read
    through the view that gives its (B * H, T, D) layout the program's (B, H, T, D)."""
    from stepgraph.backends.cuda import pointwise
    from stepgraph.backends.cuda.runtime.compiler import compile_source_to_cubin

    args = pointwise._program(heads_join_node())
    assert pointwise.vectorizable(*args)
    source = pointwise.kernel_source(*args)
    assert "+ 12]" in source and "+ 24]" in source       # k's and v's parts: H * D further
    assert compile_source_to_cubin(source, "pointwise_heads_join.cu")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_mixer_file_trains_bit_for_bit_with_the_joins(monkeypatch, precision):
    """tests/compat/models/mixer.py (gate gradients, the sin/cos table and the packed
    projection's head gradients joined) trains three steps on NumPy to the same losses and
    parameters, bit for bit, with and without the pass."""
    import stepgraph.compile.fuse as fuse_module

    kw = dict(vocab_size=32, dim=24, heads=3, layers=2, block_size=12)
    state = torch_state("mixer", "TokenMixer", kw)
    rng = np.random.default_rng(0)
    batches = [tuple(rng.integers(0, 32, (4, 12)) for _ in range(2)) for _ in range(3)]

    def train(passes):
        monkeypatch.setattr(fuse_module.fuse, "__defaults__", (passes,))
        plan, losses, params = train_steps("mixer", "TokenMixer", kw, state, batches,
                                           precision=precision)
        joins = sum(isinstance(r, Joined) for n in plan.steps if n.op == "pointwise"
                    for r in n.attrs["results"])
        return joins, losses, params

    (joins, losses, params), (none, want_losses, want) = train(PASSES), train(WITHOUT)
    assert joins == 5 and none == 0          # two gates, two heads' joins, the sin/cos table
    assert losses == want_losses
    for k in want:
        np.testing.assert_array_equal(params[k], want[k], err_msg=k)
