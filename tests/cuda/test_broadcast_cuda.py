"""cuda vs numpy for the elementwise, shape and softmax families (backends/cuda/broadcast.py,
softmax.py, and reduce_sum / log_softmax / act in reduce.py, loss.py, elementwise.py) against the numpy references:
fresh random inputs (never zeros), cuda outputs poisoned with NaN first, broadcast shapes with
size-1 dims, scalars, 5-D and sizes off multiples of 4; permutes of 2-D to 5-D (tiled and
strided paths); reduce_sum over any axes; softmax rows of 1 to 5000 at ranks 1 to 4."""
from __future__ import annotations

import functools
import itertools
import zlib

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

from stepgraph.backends.cuda import broadcast, elementwise, loss, reduce, softmax  # noqa: E402
from stepgraph.errors import ShapeError  # noqa: E402
from stepgraph.ir.graph import Node, Value  # noqa: E402
from stepgraph.ir.ops import infer_outputs  # noqa: E402
from stepgraph.ir.ops import IMPLS as NUMPY_IMPLS  # noqa: E402
from tests.cuda import helpers  # noqa: E402
from tests.cuda.helpers import capture, make_node, random, to_device, to_host  # noqa: E402

CUDA_IMPLS = {**elementwise.IMPLS, **reduce.IMPLS, **loss.IMPLS, **broadcast.IMPLS,
              **softmax.IMPLS}
run_both = functools.partial(helpers.run_both, impls=CUDA_IMPLS)
# Every output of these families is finite: a NaN on either side is a failure.
assert_close = functools.partial(helpers.assert_close, all_finite=True)


def away_from_zero(rng, *shape):
    """float32 values with |v| in [0.5, 2.5): safe divisors and pow bases."""
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    return (sign * (0.5 + 2.0 * rng.random(shape))).astype(np.float32)


def seed(*parts) -> np.random.Generator:
    """A generator seeded by the test's parameters (stable across processes)."""
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


# ---- binary --------------------------------------------------------------------------------

BINARY_SHAPES = [
    ((3, 5), (3, 5)), ((1029,), (1029,)), ((64, 128), (64, 128)),     # same shapes (flat)
    ((4, 5), (5,)), ((4, 5), (4, 1)), ((5, 4), (1, 4)), ((1, 4), (5, 1)),
    ((7,), ()), ((), (7,)), ((), ()), ((1, 1), (1,)), ((1,), (3, 1, 1)),
    ((2, 1, 5), (1, 3, 1)), ((3, 1, 1029), (1, 2, 1)), ((64, 128), (128,)),
    ((8, 3, 16, 16), (1, 3, 1, 1)), ((8, 3, 5, 7), (3, 1, 1)), ((2, 3, 4, 5, 6), (6,)),
    ((2, 3, 4, 5, 6), (1, 3, 1, 5, 1)), ((2, 3, 4, 5, 6), (2, 1, 4, 1, 6)),
    ((6, 1, 4, 1, 3), (5, 1, 7, 1)), ((2, 1, 3, 1, 2, 1), (1, 2, 1, 2, 1, 2)),   # 6 dims
    ((33, 1), (33, 12)), ((12,), (5, 3, 12)),
]


@pytest.mark.parametrize("kind", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("a_shape,b_shape", BINARY_SHAPES)
def test_binary(ctx, kind, a_shape, b_shape):
    rng = seed("binary", kind, a_shape, b_shape)
    a = random(rng, *a_shape)
    b = away_from_zero(rng, *b_shape) if kind == "div" else random(rng, *b_shape)
    ref, got = run_both(ctx, make_node("binary", [a, b], kind=kind), [a, b])
    # One IEEE-rounded operation on both sides: the same bits.
    assert_close(got[0], ref[0], rtol=0, atol=0, what=f"binary {kind} {a_shape} {b_shape}")


def test_binary_misaligned_views(ctx):
    """Operands and output off 16-byte alignment: the kernels' scalar paths."""
    rng = seed("misaligned")
    a, b = random(rng, 1 + 8 * 12), random(rng, 1 + 12)
    dev_a, dev_b = to_device(ctx, [a, b])
    with ctx.stream:
        out = cp.full(1 + 8 * 12, np.nan, np.float32)
    va, vb, vo = dev_a[1:].reshape(8, 12), dev_b[1:], out[1:].reshape(8, 12)
    broadcast.binary_forward(ctx, va, vb, vo, "mul")
    want = a[1:].reshape(8, 12) * b[1:]
    assert_close(to_host(ctx, [vo])[0], want, rtol=0, atol=0, what="binary misaligned")


def test_binary_too_many_dims(ctx):
    a = random(seed("7d"), *(2,) * 7)
    b = random(seed("7d b"), *(2, 1) * 3 + (2,))
    dev = to_device(ctx, [a, b])
    with ctx.stream:
        out = cp.empty(a.shape, np.float32)
    with pytest.raises(ShapeError, match="strided dims"):
        broadcast.binary_forward(ctx, dev[0], dev[1], out, "add")


# ---- scalar --------------------------------------------------------------------------------

SCALAR_SHAPES = [(), (1,), (7,), (3, 5), (1029,), (2, 3, 4, 5, 6)]


@pytest.mark.parametrize("kind", ["add", "sub", "rsub", "mul", "div", "rdiv"])
@pytest.mark.parametrize("value", [2.0, -0.5, 0.1, 1e-3, 3.7])
@pytest.mark.parametrize("shape", SCALAR_SHAPES)
def test_scalar(ctx, kind, value, shape):
    rng = seed("scalar", kind, value, shape)
    x = away_from_zero(rng, *shape) if kind == "rdiv" else random(rng, *shape)
    ref, got = run_both(ctx, make_node("scalar", [x], kind=kind, value=value), [x])
    assert_close(got[0], ref[0], rtol=0, atol=0, what=f"scalar {kind} {value} {shape}")


@pytest.mark.parametrize("value,negative", [(2.0, True), (3.0, True), (0.5, False),
                                            (-0.5, False), (-1.0, True), (1.7, False),
                                            (0.0, True), (1.0, True), (-2.0, True)])
@pytest.mark.parametrize("shape", SCALAR_SHAPES)
def test_scalar_pow(ctx, value, negative, shape):
    """x ** v: negative bases only with integer exponents (else NaN on both sides)."""
    rng = seed("pow", value, shape)
    x = away_from_zero(rng, *shape)
    x = x if negative else np.abs(x)
    ref, got = run_both(ctx, make_node("scalar", [x], kind="pow", value=value), [x])
    # numpy's float32 powf is within an ulp or two of the correctly rounded power computed here.
    assert_close(got[0], ref[0], rtol=5e-7, atol=0, what=f"pow {value} {shape}")


# ---- expand and permute --------------------------------------------------------------------

@pytest.mark.parametrize("x_shape,shape", [((3, 1), (3, 4)), ((1,), (5,)), ((), (2, 3)),
                                           ((4,), (2, 3, 4)), ((2, 1, 3, 1, 5), (2, 4, 3, 6, 5)),
                                           ((1, 1029), (3, 1029)), ((8, 1, 1), (8, 16, 16)),
                                           ((5,), (5,)), ((1, 3, 1, 1), (4, 3, 5, 7)),
                                           ((7, 1), (2, 7, 33))])
def test_expand(ctx, x_shape, shape):
    x = random(seed("expand", x_shape, shape), *x_shape)
    ref, got = run_both(ctx, make_node("expand", [x], shape=shape), [x])
    assert_close(got[0], ref[0], rtol=0, atol=0, what=f"expand {x_shape} -> {shape}")


PERMUTES = [((33, 65), (1, 0)), ((64, 64), (1, 0)), ((16, 1000), (1, 0)),
            ((5, 40, 70), (0, 2, 1)), ((2, 32, 17, 19), (0, 2, 3, 1)),     # tiled transposes
            ((2, 3, 5, 7), (0, 2, 3, 1)), ((2, 3, 4, 5, 6), (4, 2, 0, 3, 1)),
            ((1, 3, 1, 5, 2), (4, 3, 2, 1, 0)), ((2, 3, 4), (0, 1, 2)), ((), ()),
            ((16, 20, 3), (1, 0, 2)), ((20, 17, 30, 2), (0, 2, 1, 3)), ((7, 1), (1, 0)),
            ((3, 2, 4, 5, 2), (0, 3, 1, 4, 2))]
# a side under 16 (strided copies): conv weights to and from (O, kh, kw, C), an image's 3
# channels to channels-last
PERMUTES += [((64, 32, 3, 3), (0, 2, 3, 1)), ((64, 3, 3, 32), (0, 3, 1, 2)),
             ((5, 300, 2, 2), (0, 2, 3, 1)), ((5, 2, 2, 300), (0, 3, 1, 2)),
             ((3, 130, 14), (0, 2, 1)), ((8, 3, 40, 40), (0, 2, 3, 1)), ((15, 1000), (1, 0))]
PERMUTES += [((3, 4, 5), p) for p in itertools.permutations(range(3))]
PERMUTES += [((2, 3, 4, 5), p) for p in [(3, 2, 1, 0), (1, 3, 0, 2), (0, 3, 1, 2)]]


@pytest.mark.parametrize("shape,dims", PERMUTES)
def test_permute(ctx, shape, dims):
    x = random(seed("permute", shape, dims), *shape)
    ref, got = run_both(ctx, make_node("permute", [x], dims=dims), [x])
    assert_close(got[0], ref[0], rtol=0, atol=0, what=f"permute {shape} {dims}")


def test_permute_group(ctx):
    """Several permutes in one gather launch (compile/permute_groups.py): conv weights to
    channels-last and back, over several of the launch's 1024-element chunks with a partial
    last one, a matrix transpose and a 3-D permute beside them."""
    shapes = [(64, 32, 3, 3), (40, 3, 3, 30), (7, 3, 5, 5), (33, 65), (4, 5, 6)]
    dims = ((0, 2, 3, 1), (0, 3, 1, 2), (0, 2, 3, 1), (1, 0), (2, 0, 1))
    arrays = [random(seed("permute_group", shape), *shape) for shape in shapes]
    ref, got = run_both(ctx, make_node("permute_group", arrays, dims=dims), arrays)
    for k, (g, r) in enumerate(zip(got, ref)):
        assert_close(g, r, rtol=0, atol=0, what=f"permute_group {shapes[k]} {dims[k]}")


# (input shape, output shape, strides, offset): a head split of a packed qkv at each of its
# three offsets (vectorised reads where 16-byte aligned), a slice and permute back of a
# convolution's gradient, odd offsets and strides, every dim of the input read with a step
LAYOUT_COPIES = [((64, 96), (2, 4, 32, 8), (1536, 8, 96, 1), off) for off in (0, 32, 64)]
LAYOUT_COPIES += [((4, 6, 130), (4, 128, 6), (780, 1, 130), 2),
                  ((5, 33), (3, 4, 5), (1, 33, 6), 7), ((1000,), (7, 9), (3, 111), 1),
                  ((2, 3, 4, 5, 6), (2, 3, 2, 5, 3), (360, 120, 60, 6, 2), 1), ((4,), (0, 3), (1, 1), 0)]


@pytest.mark.parametrize("dtype", ["float32", "uint16", "float16"])
@pytest.mark.parametrize("x_shape,shape,strides,offset", LAYOUT_COPIES)
def test_layout_copy(ctx, x_shape, shape, strides, offset, dtype):
    """Bits moved as they lie: bf16 (uint16 storage: the high halves of float32 values, so no
    NaN, whose payload the kernels' float round trip would not keep) and float16 as float32."""
    x = random(seed("layout_copy", x_shape, shape, offset), *x_shape)
    x = x.view(np.uint16)[..., 1::2].copy() if dtype == "uint16" else x.astype(dtype)
    ir_dtype = "bfloat16" if dtype == "uint16" else dtype          # uint16 holds bf16 bits
    attrs = dict(shape=shape, strides=strides, offset=offset)
    node = Node("layout_copy", [Value(x.shape, ir_dtype)], [Value(shape, ir_dtype)], attrs)
    poison = np.array(0x7FC1 if dtype == "uint16" else np.nan).astype(dtype)[()]
    ref = np.full(shape, poison, dtype=dtype)
    NUMPY_IMPLS["layout_copy"](node, [x.copy()], [ref], None)
    with ctx.stream:
        out = cp.full(shape, poison, dtype=dtype)
    broadcast.IMPLS["layout_copy"](node, to_device(ctx, [x]), [out], ctx)
    np.testing.assert_array_equal(to_host(ctx, [out])[0], ref,
                                  err_msg=f"layout_copy {shape} {strides} {offset}")


# ---- reduce_sum over any axes --------------------------------------------------------------

@pytest.mark.parametrize("shape,axes", [((4, 5, 6, 7), (0, 2)), ((4, 5, 6, 7), (1, 3)),
                                        ((3, 4, 5, 6, 7), (0, 2, 4)), ((3, 4, 5, 6, 7), (1, 3)),
                                        ((5, 1, 7, 1, 3), (1, 3)), ((2, 3, 4), (1,)),
                                        ((1, 5, 1, 3), (1, 3)), ((2, 3, 2, 3, 2, 3, 2), (1, 3, 5)),
                                        ((8, 3, 16, 16), (0, 2)), ((3, 1000, 5), (1,)),
                                        ((3, 4, 5, 6), (0, 1, 3)), ((9, 13), (0,)),
                                        ((3, 5, 4, 3), (0, 2, 3))])
def test_reduce_sum_any_axes(ctx, shape, axes):
    x = random(seed("reduce", shape, axes), *shape)
    ref, got = run_both(ctx, make_node("reduce_sum", [x], axes=axes), [x])
    scale = float(np.abs(x).sum(axis=axes).max())
    assert_close(got[0], ref[0], rtol=1e-5, atol=2e-6 * scale, what=f"reduce_sum {shape} {axes}")


# ---- softmax and log_softmax at any rank ---------------------------------------------------

SOFTMAX_SHAPES = [shape + (c,) for c in (1, 7, 33, 1000, 5000)
                  for shape in [(), (3,), (2, 3), (2, 1, 3)]] + [(4000, 10), (1, 9000)] \
    + [(8, 64, 64, 2), (300, 16)]                 # narrow rows, several a warp, many blocks


def softmax_of(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("shape", SOFTMAX_SHAPES)
def test_softmax(ctx, shape):
    x = random(seed("softmax", shape), *shape) * 4
    ref, got = run_both(ctx, make_node("softmax", [x]), [x])
    assert_close(got[0], ref[0], rtol=1e-5, atol=1e-7, what=f"softmax {shape}")


@pytest.mark.parametrize("shape", SOFTMAX_SHAPES)
def test_softmax_grad(ctx, shape):
    rng = seed("softmax_grad", shape)
    y, dy = softmax_of(random(rng, *shape) * 2), random(rng, *shape)
    ref, got = run_both(ctx, make_node("softmax_grad", [dy, y]), [dy, y])
    scale = float(np.abs(dy * y).sum(axis=-1).max()) + float(np.abs(dy).max())
    assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6 * scale, what=f"softmax_grad {shape}")


@pytest.mark.parametrize("shape", SOFTMAX_SHAPES)
def test_log_softmax_any_rank(ctx, shape):
    x = random(seed("log_softmax", shape), *shape) * 4
    ref, got = run_both(ctx, make_node("log_softmax", [x]), [x])
    assert_close(got[0], ref[0], rtol=1e-5, atol=2e-6, what=f"log_softmax {shape}")


@pytest.mark.parametrize("shape", SOFTMAX_SHAPES)
def test_log_softmax_grad_any_rank(ctx, shape):
    rng = seed("log_softmax_grad", shape)
    y, dy = np.log(softmax_of(random(rng, *shape))), random(rng, *shape)
    ref, got = run_both(ctx, make_node("log_softmax_grad", [dy, y]), [dy, y])
    scale = float(np.abs(dy).sum(axis=-1).max())
    assert_close(got[0], ref[0], rtol=1e-5, atol=2e-6 * scale,
                 what=f"log_softmax_grad {shape}")


# ---- silu ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1,), (7, 33), (2, 3, 5, 7), (1029,), (64, 128)])
def test_silu(ctx, shape):
    rng = seed("silu", shape)
    z, dy = random(rng, *shape) * 4, random(rng, *shape)
    ref, got = run_both(ctx, make_node("act", [z], kind="silu"), [z])
    assert_close(got[0], ref[0], rtol=1e-6, atol=1e-7, what=f"silu {shape}")
    ref, got = run_both(ctx, make_node("act_grad", [dy, z], kind="silu"), [dy, z])
    assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6, what=f"silu grad {shape}")


# ---- a captured graph ----------------------------------------------------------------------

def test_family_ops_capture_and_replay(ctx):
    """binary (broadcast), scalar, permute (tiled), expand, reduce_sum (strided fallback) and
    softmax captured once after an eager warm-up, replayed on fresh inputs."""
    rng = seed("capture")
    a, b = random(rng, 4, 40, 36), random(rng, 40, 1)
    nodes = [make_node("binary", [a, b], kind="mul")]
    ab = np.empty(a.shape, np.float32)
    nodes.append(make_node("scalar", [ab], kind="rsub", value=1.5))
    nodes.append(make_node("permute", [ab], dims=(0, 2, 1)))
    nodes.append(make_node("expand", [b], shape=(3, 40, 5)))
    nodes.append(make_node("reduce_sum", [ab], axes=(1,)))
    nodes.append(make_node("softmax", [ab]))
    wiring = [([0, 1], 2), ([2], 3), ([2], 4), ([1], 5), ([2], 6), ([2], 7)]
    host = [a, b] + [np.empty(n.outputs[0].shape, np.float32) for n in nodes]

    def program(impls, arrays, ctx_):
        for node, (ins, out) in zip(nodes, wiring):
            impls[node.op](node, [arrays[i] for i in ins], [arrays[out]], ctx_)

    dev = to_device(ctx, host)
    program(CUDA_IMPLS, dev, ctx)
    graph = capture(ctx, lambda: program(CUDA_IMPLS, dev, ctx))
    for _ in range(5):
        host[0][...], host[1][...] = random(rng, *a.shape), random(rng, *b.shape)
        for i in (0, 1):
            dev[i].set(host[i], stream=ctx.stream)
        with ctx.stream:
            for i in range(2, len(host)):
                dev[i].fill(np.nan)
        program(NUMPY_IMPLS, host, None)
        graph.launch(ctx.stream)
        got = to_host(ctx, dev)
        for i in range(2, len(host)):
            assert_close(got[i], host[i], rtol=1e-5, atol=1e-5, what=f"replayed {nodes[i - 2]}")


@pytest.mark.parametrize("dtype", ["float32", "uint16", "float16"])
def test_layout_concat(ctx, dtype):
    """The backward of a head split: three (B, H, T, D) gradients read as (B, T, H, D) and
    joined along the heads; a zero block and a transposed one, as a causal padding makes; the
    same padding written channels-last, (B, 1, T + 2, C), with stride 0 on the unit axis
    (layout_chains.py _permuted_concats)."""
    rng = seed("layout_concat", dtype)
    ir_dtype = "bfloat16" if dtype == "uint16" else dtype
    cases = [([(2, 4, 6, 8)] * 3, 2, [((2, 6, 4, 8), (192, 8, 48, 1), 0)] * 3),
             ([(3, 5, 2), (3, 7, 5)], 2, [((3, 5, 2), (10, 2, 1), 0), ((3, 5, 7), (35, 1, 5), 0)]),
             ([(3, 8, 2), (3, 7, 8)], 2, [((3, 1, 2, 8), (16, 0, 1, 2), 0),
                                          ((3, 1, 7, 8), (56, 0, 8, 1), 0)])]
    for shapes, dim, views in cases:
        xs = [random(rng, *shape) for shape in shapes]
        xs = [x.view(np.uint16)[..., 1::2].copy() if dtype == "uint16" else x.astype(dtype)
              for x in xs]
        attrs = dict(dim=dim, views=tuple(views))
        (shape, _), = infer_outputs("layout_concat", [Value(x.shape, ir_dtype) for x in xs], attrs)
        node = Node("layout_concat", [Value(x.shape, ir_dtype) for x in xs],
                    [Value(shape, ir_dtype)], attrs)
        poison = np.array(0x7FC1 if dtype == "uint16" else np.nan).astype(dtype)[()]
        ref = np.full(shape, poison, dtype=dtype)
        NUMPY_IMPLS["layout_concat"](node, [x.copy() for x in xs], [ref], None)
        with ctx.stream:
            out = cp.full(shape, poison, dtype=dtype)
        broadcast.IMPLS["layout_concat"](node, to_device(ctx, xs), [out], ctx)
        np.testing.assert_array_equal(to_host(ctx, [out])[0], ref, err_msg=f"{shapes} {views}")
