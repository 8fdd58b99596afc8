"""Generated pointwise kernels (backends/cuda/pointwise.py) against the numpy reference of the
same fused programs: fresh random inputs, outputs poisoned first, broadcast inputs of several
ranks, multi-output programs, activations and their gradients, the four-elements-a-thread
kernel against the scalar one, and a whole fused train graph."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

from stepgraph.backends.cuda import pointwise  # noqa: E402
from stepgraph.compile.pointwise import fuse_pointwise  # noqa: E402
from stepgraph.ops.activation import ACTIVATIONS  # noqa: E402
from stepgraph.ir.trace import Tracer  # noqa: E402
from tests.cuda import helpers  # noqa: E402
from tests.ops.helpers import build_train_graph, seeded, trace_inputs  # noqa: E402

run_both = functools.partial(helpers.run_both, impls=pointwise.IMPLS)


def fused_node(body, arrays):
    t = Tracer()
    ins = trace_inputs(t, arrays)
    results = body(t, ins)
    t.graph.outputs = {f"out{i}": r.value for i, r in enumerate(results)}
    (node,) = [n for n in fuse_pointwise(t.graph).nodes if n.op == "pointwise"]
    return node, [arrays[v.name] for v in node.inputs]


SHAPES = [((4, 3, 5, 5), (1, 3, 1, 1)), ((7, 33), (33,)), ((2, 3, 4, 5, 6), (3, 1, 5, 1)),
          ((1029,), ()), ((5, 1, 7), (5, 9, 1))]


@pytest.mark.parametrize("big,small", SHAPES)
@pytest.mark.parametrize("kind", ["add", "sub", "mul", "div"])
def test_broadcast_binary_chain(ctx, big, small, kind):
    rng = seeded(f"{big}{small}{kind}")
    out_shape = tuple(np.broadcast_shapes(big, small))
    arrays = {"a": rng.standard_normal(big).astype(np.float32),
              "b": (rng.standard_normal(small) + 2.0).astype(np.float32),
              "c": rng.standard_normal(out_shape).astype(np.float32)}

    def body(t, ins):
        y = t.op("binary", [ins["a"], ins["b"]], kind=kind)
        y = t.op("scalar", [y], kind="rsub", value=0.5)
        return [t.op("binary", [y, ins["c"]], kind="mul"), y]

    node, ins = fused_node(body, arrays)
    ref, got = run_both(ctx, node, ins)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ACTIVATIONS)
def test_activation_and_gradient_chain(ctx, kind):
    rng = seeded(f"act-{kind}")
    arrays = {"x": (rng.standard_normal((3, 37)) * 2).astype(np.float32),
              "s": rng.standard_normal((37,)).astype(np.float32),
              "dy": rng.standard_normal((3, 37)).astype(np.float32)}

    def body(t, ins):
        z = t.op("binary", [ins["x"], ins["s"]], kind="add")
        y = t.op("act", [z], kind=kind, slope=0.05)
        g = t.op("act_grad", [ins["dy"], z], kind=kind, slope=0.05)
        return [t.op("scalar", [y], kind="mul", value=3.0), g]

    node, ins = fused_node(body, arrays)
    ref, got = run_both(ctx, node, ins)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=2e-6, atol=5e-6)


def test_fused_train_graph_nodes(ctx):
    """Every pointwise node of a fused residual train graph, cuda vs numpy."""
    rng = seeded("train")
    arrays = {"x": rng.standard_normal((8, 6, 7, 7)), "scale": rng.standard_normal((1, 6, 1, 1)),
              "shift": rng.standard_normal((1, 6, 1, 1)), "skip": rng.standard_normal((8, 6, 7, 7)),
              "target": rng.standard_normal((8, 6, 7, 7))}
    arrays = {k: v.astype(np.float32) for k, v in arrays.items()}

    def residual(t, ins):
        y = t.op("binary", [ins["x"], ins["scale"]], kind="mul")
        y = t.op("binary", [y, ins["shift"]], kind="add")
        y = t.op("binary", [y, ins["skip"]], kind="add")
        return t.op("act", [y], kind="relu", slope=0.01)

    graph = build_train_graph(residual, arrays, tuple(k for k in arrays if k != "target"), True)
    nodes = [n for n in graph.nodes if n.op == "pointwise"]
    assert nodes
    for node in nodes:
        ins = [rng.standard_normal(v.shape).astype(np.float32) for v in node.inputs]
        ref, got = run_both(ctx, node, ins)
        for r, g in zip(ref, got):
            np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)


def run_at_offset(ctx, node, ins, offset: int) -> list[np.ndarray]:
    """node's outputs with every array `offset` elements past an allocation's start (0: the
    16-byte aligned arrays VEC_KERNEL_NAME takes; 1: misaligned, the scalar kernel), outputs
    poisoned first (NaN, and for a bool the byte 2, no bool's value)."""
    with ctx.stream:
        args = []
        for a in ins:
            buf = cp.empty(a.size + offset, a.dtype)
            buf[offset:] = cp.asarray(a).ravel()
            args.append(buf[offset:].reshape(a.shape))
        outs = [cp.full(v.size + offset, 2, np.uint8)[offset:].view(np.bool_) if v.dtype == "bool"
                else cp.full(v.size + offset, np.nan, np.dtype(v.dtype))[offset:]
                for v in node.outputs]
        outs = [o.reshape(v.shape) for o, v in zip(outs, node.outputs)]
    assert all(a.data.ptr % 16 == 0 for a in (*args, *outs)) == (offset == 0)
    pointwise.pointwise_forward(ctx, node, args, outs)
    ctx.stream.synchronize()
    return [cp.asnumpy(o) for o in outs]


@pytest.mark.parametrize("shape", [(6, 40), (2, 16, 9, 9)])
def test_vector_kernel_equals_the_scalar_kernel(ctx, shape):
    """A program without broadcast inputs over a multiple of 4 elements runs VEC_KERNEL_NAME
    on aligned arrays and the scalar kernel on misaligned views of the same values: the same
    bits, and numpy's values."""
    rng = seeded(f"vec{shape}")
    arrays = {k: rng.standard_normal(shape).astype(np.float32) for k in ("a", "b", "y")}

    def body(t, ins):
        s = t.op("add", [ins["a"], ins["b"]])
        return [t.op("act_grad", [s, ins["y"]], kind="relu", slope=0.01),
                t.op("scalar", [s], kind="mul", value=0.5)]

    node, ins = fused_node(body, arrays)
    assert pointwise.vectorizable(*pointwise._program(node))
    ref, got = run_both(ctx, node, ins)
    for r, g, o in zip(ref, got, run_at_offset(ctx, node, ins, 1)):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(o, g)


@pytest.mark.parametrize("shapes", [((4, 6, 6, 16), (1, 1, 1, 16), (4, 6, 6, 1)),
                                    ((4, 3, 3, 8), (4, 1, 1, 8), ()),
                                    ((2, 5, 4, 12), (1, 5, 1, 12), (1, 1, 4, 1))])
def test_vector_kernel_with_broadcast_inputs_equals_the_scalar_kernel(ctx, shapes):
    """relu(x * scale + shift) with a per-channel and a per-pixel (or 0-d) operand runs
    VEC_KERNEL_NAME on aligned arrays (each lane group reading four channels of the vector
    and one element of the per-pixel value) and the scalar kernel on misaligned copies: the
    same bits, and numpy's values."""
    rng = seeded(f"vecb{shapes}")
    arrays = {k: rng.standard_normal(s).astype(np.float32)
              for k, s in zip(("x", "scale", "shift"), shapes)}

    def body(t, ins):
        y = t.op("binary", [ins["x"], ins["scale"]], kind="mul")
        y = t.op("binary", [y, ins["shift"]], kind="add")
        return [t.op("act", [y], kind="relu", slope=0.01)]

    node, ins = fused_node(body, arrays)
    assert [v.name for v in node.inputs] == ["x", "scale", "shift"]
    assert pointwise.vectorizable(*pointwise._program(node))
    ref, got = run_both(ctx, node, ins)
    for r, g, o in zip(ref, got, run_at_offset(ctx, node, ins, 1)):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(o, g)


def test_vector_kernel_with_masks_equals_the_scalar_kernel(ctx):
    """A bool mask read and one written, four a thread in one 4-byte access: numpy's bits on
    aligned arrays (the vector kernel) and on misaligned copies (the scalar kernel)."""
    rng = seeded("vecmask")
    shape = (4, 6, 6, 16)
    arrays = {"x": rng.standard_normal(shape).astype(np.float32),
              "dy": rng.standard_normal(shape).astype(np.float32),
              "mask": rng.standard_normal(shape) > 0.3}

    def body(t, ins):
        y = t.op("masked_fill", [ins["dy"], ins["mask"]], value=0.0)
        z = t.op("binary", [y, ins["x"]], kind="mul")
        return [z, t.op("compare_scalar", [z], kind="gt", value=0.25)]

    node, ins = fused_node(body, arrays)
    assert pointwise.vectorizable(*pointwise._program(node))
    ref = [np.empty(v.shape, v.dtype) for v in node.outputs]
    helpers.NUMPY_IMPLS[node.op](node, [a.copy() for a in ins], ref, None)
    assert [r.dtype for r in ref] == [np.float32, np.bool_]

    for got in (run_at_offset(ctx, node, ins, 0), run_at_offset(ctx, node, ins, 1)):
        np.testing.assert_array_equal(got[0], ref[0])
        np.testing.assert_array_equal(got[1].view(np.uint8), ref[1].view(np.uint8))


@pytest.mark.parametrize("second, permuted, vec", [(8, False, True), (7, False, False),
                                                    (8, True, False)],
                         ids=["aligned", "unaligned", "permuted"])
def test_inputs_read_through_views(ctx, second, permuted, vec):
    """A program reading two halves of one buffer (and a permute of another) through strided
    views (compile/pointwise_views.py): the four-elements-a-thread kernel where every view
    is aligned with a contiguous last axis, the element loop where one is not (an offset of
    7, a permute); the same bits as NumPy's reads of the same views (bf16 views run in the
    compat files' replays)."""
    from stepgraph.ops.pointwise import Instr

    rng = seeded(f"views-{second}-{permuted}")
    x = rng.standard_normal((10, 24)).astype(np.float32)
    p = rng.standard_normal((2, 8, 5) if permuted else (2, 5, 8)).astype(np.float32)
    program = (Instr("binary", (0, 1), (("kind", "mul"),)),
               Instr("binary", (3, 2), (("kind", "add"),)))
    views = (((2, 5, 8), (120, 24, 1), 0), ((2, 5, 8), (120, 24, 1), second),
             ((2, 5, 8), (40, 1, 5), 0) if permuted else None)
    node = helpers.make_node("pointwise", [x, x, p], program=program, results=(4,),
                             shape=(2, 5, 8), views=views)
    assert pointwise.vectorizable(*pointwise._program(node)) == vec
    ref, got = run_both(ctx, node, [x, x, p])
    np.testing.assert_array_equal(got[0], ref[0])


@pytest.mark.parametrize("shape", [(6, 40), (512, 64), (3, 1024), (7, 1)])
def test_pointwise_sum(ctx, shape):
    """compile/pointwise_sums.py's fused node (a product summed over the last axis, a clamp,
    square root and exp of the sums, the sums kept too) against its NumPy reference, outputs
    poisoned: the sums agree to float32 rounding (float64 lanes here, float32 pairwise
    there), the epilogue's value to its functions' ulps."""
    from stepgraph.backends.cuda import pointwise_sum
    from tests.unit.test_pointwise_views import fuse, sum_graph

    (node,) = fuse(sum_graph(shape)).nodes
    assert node.op == "pointwise_sum"
    rng = seeded(f"sum-{shape}")
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    ref, got = helpers.run_both(ctx, node, arrays, pointwise_sum.IMPLS)
    scale = np.abs(arrays[0] * arrays[1]).sum(axis=-1)       # the sums' condition
    for r, g in zip(ref, got):
        assert np.all(np.abs(g - r) <= 4e-7 * scale + 2e-6 * np.abs(r)), (g, r)


@pytest.mark.parametrize("shape, dim, vec", [((4, 6, 16), 2, True), ((4, 6, 16), 1, True),
                                             ((3, 5, 6), 2, False), ((7, 9), 0, False)],
                         ids=["last", "inner", "rows-of-6", "first"])
def test_results_joined_into_one_output(ctx, shape, dim, vec):
    """A program storing three registers into the parts of one joined output and one more on
    its own (compile/pointwise_joins.py): NumPy's values (to the sigmoid's ulps), with four
    elements a thread where each part starts at a multiple of four (aligned arrays) and element
    by element where not (and on misaligned arrays), the two kernels' bits the same; every
    element of the output written (poisoned first)."""
    from stepgraph.ops.pointwise import Instr, concat_joined

    rng = seeded(f"joins-{shape}-{dim}")
    x, g = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    program = (Instr("act", (0,), (("kind", "sigmoid"), ("slope", 0.01))),
               Instr("binary", (2, 1), (("kind", "mul"),)),
               Instr("scalar", (3,), (("kind", "mul"), ("value", 0.5))))
    node = helpers.make_node("pointwise", [x, g], program=program,
                             results=(concat_joined(shape, dim, (3, 2, 4)), 4),
                             shape=shape)
    assert pointwise.vectorizable(*pointwise._program(node)) == vec
    ref = [np.empty(v.shape, v.dtype) for v in node.outputs]
    helpers.NUMPY_IMPLS[node.op](node, [x.copy(), g.copy()], ref, None)
    aligned, misaligned = (run_at_offset(ctx, node, [x, g], offset) for offset in (0, 1))
    for r, a, m in zip(ref, aligned, misaligned):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, r, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(m, a)


def test_the_heads_gradients_joined_in_the_head_layout(ctx):
    """compile/pointwise_joins.py's program joining q's, k's and v's gradients through the
    head split's permute (tests/unit/test_pointwise_joins.py), on fresh inputs: NumPy's values
    to float32 division's rounding, on aligned arrays (four elements a thread, permuted
    stores) and misaligned ones (element by element) with the same bits; every element of the
    joined output written (poisoned first)."""
    from tests.unit.test_pointwise_joins import heads_join_node

    node = heads_join_node()
    rng = seeded("heads-join")
    ins = [(rng.standard_normal(v.shape) + (3.0 if v.shape[-1] == 1 else 0.0))
           .astype(np.float32) for v in node.inputs]
    ref = [np.empty(v.shape, v.dtype) for v in node.outputs]
    helpers.NUMPY_IMPLS[node.op](node, [a.copy() for a in ins], ref, None)
    aligned, misaligned = (run_at_offset(ctx, node, ins, offset) for offset in (0, 1))
    for r, a, m in zip(ref, aligned, misaligned):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, r, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(m, a)
