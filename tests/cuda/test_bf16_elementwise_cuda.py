"""cuda vs numpy for the bf16 (precision="bf16") elementwise kernels a ResNet step needs: act,
act_grad, add (elementwise.cu), binary, scalar, expand and permute (broadcast.cu), generated
bf16 `pointwise` programs (backends/cuda/pointwise.py), and a small bf16 ResNet trained for
three steps on cuda and on the numpy emulation.

Every op runs on fresh random bf16 inputs (raw bits) into poisoned outputs; the reference is
NumpyBackend.run_node (float32 compute, each bf16 output rounded once; a pointwise program
rounds each bf16 instruction, ops/pointwise.py). These kernels do the reference's float32
arithmetic in its order (__fadd_rn & co: no FMA contraction), so the bits must be equal. The
exceptions compare within 1 bf16 ulp, where a float32 library function may differ from numpy's
in the last float32 place and so move a bf16 rounding by one step:
  - act sigmoid, tanh, silu, gelu_tanh (CUDA expf / tanhf vs numpy's), gelu (float32 normcdff
    vs the reference's float64 erf); act_grad of gelu, gelu_tanh, silu (the same functions;
    relu, leaky_relu, sigmoid and tanh derivatives are products and differences: exact);
  - scalar pow (the kernel's double pow rounded once vs numpy's powf).
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

import stepgraph as sg  # noqa: E402
from stepgraph import models, optim  # noqa: E402
from stepgraph.backends.cuda import broadcast, elementwise, pointwise  # noqa: E402
from stepgraph.backends.numpy import bf16  # noqa: E402
from stepgraph.compile.pointwise import fuse_pointwise  # noqa: E402
from stepgraph.ir.graph import BF16, Node  # noqa: E402
from stepgraph.ir.trace import Tracer  # noqa: E402
from tests.cuda.test_bf16_cuda import (POISON, assert_bf16_within, bits, ctx,  # noqa: E402,F401
                                       node_of, run_both)
from tests.cuda.helpers import ce_smooth  # noqa: E402
from tests.ops.helpers import seeded  # noqa: E402
from tests.cuda.test_bf16_conv_cuda import assert_params_follow  # noqa: E402

KINDS = ["relu", "leaky_relu", "sigmoid", "tanh", "gelu", "gelu_tanh", "silu"]
EXACT_ACT = {"relu", "leaky_relu"}                          # selections and one product
EXACT_ACT_GRAD = {"relu", "leaky_relu", "sigmoid", "tanh"}  # products and differences only
SHAPES = [(64, 48), (7, 13), (1,), (2, 8, 8, 16)]


def specials(x: np.ndarray) -> np.ndarray:
    """x (bf16 bits) with NaN, +-inf and a few exact values planted at its first elements."""
    flat = x.copy().reshape(-1)
    planted = bf16.to_bits(np.array([np.nan, np.inf, -np.inf, 1.0, -2.0, 0.5], np.float32))
    k = min(flat.size, planted.size)
    flat[:k] = planted[:k]
    return flat.reshape(x.shape)


def assert_bits(got, want, exact: bool, what: str) -> None:
    assert got.dtype == np.uint16 and not np.any(got == POISON[BF16]), f"{what}: unwritten"
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:       # 1 ulp; in the GELUs' far-negative tails the float32 formulas cancel
        # (1 + tanh(u) with tanh(u) near -1): values and gradients under ~1e-5 for inputs and
        # gradients of unit scale lose their float64 digits (measured on an H100: y -1.5e-7 ->
        # -0, dx -6.5e-6 -> -7.6e-6 and -2.7e-6 -> 0), so those may differ by up to 2^-16
        assert_bf16_within(got, want, atol=2.0 ** -16, what=what)


# ---- elementwise.cu: act, act_grad, add ----------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_act_and_act_grad(backend, ctx, kind, shape, request):
    rng = seeded(request.node.name)
    x = bits(rng, *shape, scale=3.0)
    if kind in EXACT_ACT:
        x = specials(x)
    node = node_of("act", [x], [BF16], kind=kind, slope=0.01)
    (want,), (got,), _, _ = run_both(backend, ctx, node, [x])
    assert_bits(got, want, kind in EXACT_ACT, f"act {kind}")
    dy, saved = bits(rng, *shape), want if kind in ("relu", "sigmoid", "tanh") else x
    grad = node_of("act_grad", [dy, saved], [BF16, BF16], kind=kind, slope=0.01)
    (want,), (got,), _, _ = run_both(backend, ctx, grad, [dy, saved])
    assert_bits(got, want, kind in EXACT_ACT_GRAD, f"act_grad {kind}")


@pytest.mark.parametrize("shape", SHAPES)
def test_add(backend, ctx, shape, request):
    rng = seeded(request.node.name)
    a, b = specials(bits(rng, *shape)), bits(rng, *shape)
    (want,), (got,), _, _ = run_both(backend, ctx, node_of("add", [a, b], [BF16, BF16]), [a, b])
    assert_bits(got, want, True, "add")


@pytest.mark.parametrize("value", [0.0, 0.1, -3.0])
def test_fill(backend, ctx, value):
    """bf16 fill: the zero blocks between slice gradients (compile/slice_sums.py)."""
    (want,), (got,), _, _ = run_both(backend, ctx, node_of("fill", [], [], shape=(7, 13),
                                                           dtype=BF16, value=value), [])
    assert_bits(got, want, True, "fill")


def test_unaligned_and_in_place_launches(ctx, request):
    """Views one element off 16 bytes take the kernels' scalar path; y = x in place works."""
    rng = seeded(request.node.name)
    a, b = bits(rng, 4 * 37 + 1), bits(rng, 4 * 37 + 1)
    wa, wb = bf16.from_bits(a[1:]), bf16.from_bits(b[1:])
    with ctx.stream:
        da, db = cp.asarray(a), cp.asarray(b)
        out = cp.full(a.shape, POISON[BF16], np.uint16)
    elementwise.add_forward(ctx, da[1:], db[1:], out[1:])
    elementwise.act_forward(ctx, db[1:], db[1:], "relu")            # in place
    broadcast.binary_forward(ctx, da[1:], out[1:], da[1:], "mul")  # in place, a * (a + b)
    ctx.stream.synchronize()
    s = bf16.to_bits(wa + wb)
    np.testing.assert_array_equal(cp.asnumpy(out[1:]), s)
    np.testing.assert_array_equal(cp.asnumpy(db[1:]), bf16.to_bits(np.maximum(wb, 0)))
    np.testing.assert_array_equal(cp.asnumpy(da[1:]), bf16.to_bits(wa * bf16.from_bits(s)))


# ---- broadcast.cu: binary, scalar, expand, permute ------------------------------------------

BINARY_SHAPES = [((4, 3, 5, 5), (4, 3, 5, 5)), ((2, 8, 8, 16), (16,)),
                 ((4, 3, 5, 5), (1, 3, 1, 1)), ((6, 1), (1, 8)), ((7, 33), (33,)),
                 ((2, 3, 4, 5, 6), (3, 1, 5, 1))]


@pytest.mark.parametrize("big,small", BINARY_SHAPES)
@pytest.mark.parametrize("kind", ["add", "sub", "mul", "div"])
def test_binary(backend, ctx, kind, big, small, request):
    rng = seeded(request.node.name)
    a, b = specials(bits(rng, *big)), bits(rng, *small)
    for x, y in ((a, b), (b, a)):
        node = node_of("binary", [x, y], [BF16, BF16], kind=kind)
        (want,), (got,), _, _ = run_both(backend, ctx, node, [x, y])
        assert_bits(got, want, True, f"binary {kind} {x.shape} {y.shape}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind,value", [("add", 0.3), ("sub", 1.7), ("rsub", 1.0),
                                        ("mul", 0.1), ("div", 3.0), ("rdiv", 1.0),
                                        ("pow", 2.0), ("pow", 0.5), ("pow", 1.3)])
def test_scalar(backend, ctx, kind, value, shape, request):
    rng = seeded(request.node.name)
    x = bits(rng, *shape)
    if kind == "pow":
        x = bf16.to_bits(np.abs(bf16.from_bits(x)) + np.float32(0.01))
    node = node_of("scalar", [x], [BF16], kind=kind, value=value)
    (want,), (got,), _, _ = run_both(backend, ctx, node, [x])
    assert_bits(got, want, kind != "pow", f"scalar {kind} {value}")


@pytest.mark.parametrize("src,dst", [((1, 3, 1, 1), (4, 3, 5, 5)), ((16,), (2, 8, 8, 16)),
                                     ((5, 1), (5, 7)), ((), (9,))])
def test_expand(backend, ctx, src, dst, request):
    x = specials(bits(seeded(request.node.name), *src)) if src else bits(
        seeded(request.node.name), 1).reshape(())
    node = node_of("expand", [x], [BF16], shape=dst)
    (want,), (got,), _, _ = run_both(backend, ctx, node, [x])
    assert_bits(got, want, True, f"expand {src} -> {dst}")


@pytest.mark.parametrize("shape,dims", [((8, 16, 16, 32), (0, 2, 3, 1)),   # NCHW -> NHWC tiles
                                        ((8, 16, 16, 32), (0, 3, 1, 2)),
                                        ((40, 70), (1, 0)),
                                        ((16, 130, 3, 3), (0, 2, 3, 1)),      # conv weights
                                        ((16, 3, 3, 130), (0, 3, 1, 2)),
                                        ((2, 3, 4), (2, 0, 1)),               # strided copy
                                        ((3, 5, 7), (1, 0, 2))])
def test_permute(backend, ctx, shape, dims, request):
    x = specials(bits(seeded(request.node.name), *shape))
    node = node_of("permute", [x], [BF16], dims=dims)
    (want,), (got,), _, _ = run_both(backend, ctx, node, [x])
    assert_bits(got, want, True, f"permute {shape} {dims}")


def test_permute_group(backend, ctx, request):
    """A bf16 weight gradients' group back to (O, C, kh, kw): bits as the permutes store them."""
    rng = seeded(request.node.name)
    arrays = [specials(bits(rng, *shape)) for shape in ((64, 3, 3, 32), (9, 5, 5, 3))]
    node = node_of("permute_group", arrays, [BF16, BF16], dims=((0, 3, 1, 2), (0, 3, 1, 2)))
    want, got, _, _ = run_both(backend, ctx, node, arrays)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_bits(g, w, True, f"permute_group {k}")


# ---- generated bf16 pointwise programs -------------------------------------------------------

def _program_node(body, shapes: dict) -> Node:
    t = Tracer()
    ins = {name: t.input(shape, BF16, name) for name, shape in shapes.items()}
    results = body(t, ins)
    t.graph.outputs = {f"out{i}": r.value for i, r in enumerate(results)}
    (node,) = [n for n in fuse_pointwise(t.graph).nodes if n.op == "pointwise"]
    return node


def _residual_block(t, ins):
    """BatchNorm's eval form, the residual add and ReLU, a scalar, and the ReLU's gradient of
    a gradient sum: the ResNet's elementwise ops, two outputs, in one program."""
    y = t.op("binary", [ins["x"], ins["scale"]], kind="mul")
    y = t.op("binary", [y, ins["shift"]], kind="add")
    y = t.op("binary", [y, ins["skip"]], kind="add")
    r = t.op("act", [y], kind="relu", slope=0.01)
    g = t.op("add", [t.op("scalar", [r], kind="mul", value=0.3), ins["dy"]])
    return [r, t.op("act_grad", [g, r], kind="relu", slope=0.01)]


def _transcendental_tail(t, ins):
    y = t.op("binary", [ins["x"], ins["skip"]], kind="add")
    return [t.op("act", [y], kind="sigmoid", slope=0.01)]


# (the last: no broadcast input, so the four-elements-a-thread kernel runs; the sigmoid tail
# runs it where the size is a multiple of 4)
@pytest.mark.parametrize("big,small", [((4, 3, 5, 5), (1, 3, 1, 1)), ((2, 8, 8, 16), (16,)),
                                       ((1029,), ()), ((2, 8, 8, 16), (2, 8, 8, 16))])
def test_generated_bf16_program(backend, ctx, big, small, request):
    rng = seeded(request.node.name)
    shapes = {"x": big, "scale": small, "shift": small, "skip": big, "dy": big}
    node = _program_node(_residual_block, shapes)
    assert len(node.outputs) == 2 and all(v.dtype == BF16 for v in node.inputs + node.outputs)
    arrays = [specials(bits(rng, *v.shape)) if v.shape == big else bits(rng, *v.shape)
              for v in node.inputs]
    want, got, _, _ = run_both(backend, ctx, node, arrays)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bits(g, w, True, f"pointwise output {i}")
    node = _program_node(_transcendental_tail, {"x": big, "skip": big})
    arrays = [bits(rng, *v.shape) for v in node.inputs]
    (want,), (got,), _, _ = run_both(backend, ctx, node, arrays)
    assert_bits(got, want, False, "pointwise sigmoid")        # expf: within 1 ulp


def test_generated_program_rounds_each_instruction(backend, ctx):
    """a + b + c with a = 1, b = c = 2^-8: each add of 1 + 2^-8 ties to 1 (even), so the
    unfused and the fused result is 1; a program adding in float32 without rounding would
    give 1 + 2^-7."""
    node = _program_node(lambda t, ins: [t.op("add", [t.op("add", [ins["a"], ins["b"]]),
                                                     ins["c"]])],
                         {"a": (37,), "b": (37,), "c": (37,)})
    arrays = [bf16.to_bits(np.full(37, v, np.float32)) for v in (1.0, 2.0**-8, 2.0**-8)]
    (want,), (got,), _, _ = run_both(backend, ctx, node, arrays)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(bf16.from_bits(got), np.ones(37, np.float32))


@pytest.mark.parametrize("n", [(33, 70), (16, 384)])     # element loop; four a thread
def test_generated_bf16_dropout_program(backend, ctx, n, request):
    """dropout + residual add in bf16 as one program: the mask bits are the op's, y is
    rounded once as the dropout node's store, then the add's result once more; the same
    with four elements (one dropout group) a thread."""
    t = Tracer()
    x, skip = t.input(n, BF16, "x"), t.input(n, BF16, "skip")
    step = t.input((), "int64", "step")
    y, mask = t.emit("dropout", [x.value, step.value], p=0.3, seed=5, site=2)
    (out,) = t.emit("binary", [y, skip.value], kind="add")
    t.graph.outputs = {"out": out, "mask": mask}
    (node,) = fuse_pointwise(t.graph).nodes
    assert pointwise.vectorizable(*pointwise._program(node)) == (n[-1] % 4 == 0)
    rng = seeded(request.node.name)
    feed = {"x": bits(rng, *n), "skip": bits(rng, *n), "step": np.array(4, np.int64)}
    want, got, _, _ = run_both(backend, ctx, node, [feed[v.name] for v in node.inputs])
    for v, g, w in zip(node.outputs, got, want):
        np.testing.assert_array_equal(g, w, err_msg=v.dtype)


@pytest.mark.parametrize("n", [(33, 70), (16, 384)])     # element loop; four a thread
def test_generated_mixed_programs_with_casts(backend, ctx, n, request):
    """gpt's residual stream under autocast, as fuse_pointwise fuses it: a bf16 dropout, its
    widening cast and the float32 residual add; a float32 gradient sum, its narrowing cast and
    the bf16 dropout gradient. The bits are the numpy reference's (each bf16 register rounded
    once, widening exact)."""
    t = Tracer()
    x, resid = t.input(n, BF16, "x"), t.input(n, "float32", "resid")
    g1, g2 = t.input(n, "float32", "g1"), t.input(n, "float32", "g2")
    step = t.input((), "int64", "step")
    y, mask = t.emit("dropout", [x.value, step.value], p=0.2, seed=5, site=2)
    (wide,) = t.emit("cast", [y], dtype="float32")
    (out,) = t.emit("binary", [resid.value, wide], kind="add")
    (gsum,) = t.emit("add", [g1.value, g2.value])
    (narrow,) = t.emit("cast", [gsum], dtype=BF16)
    (dx,) = t.emit("dropout_grad", [narrow, mask], p=0.2)
    t.graph.outputs = {"out": out, "gsum": gsum, "dx": dx}
    # dropout_grad reads the gradient group and the dropout's mask: with nothing between them
    # here (a real step has its GEMMs), both groups merge with it into one program
    (node,) = fuse_pointwise(t.graph).nodes
    assert node.op == "pointwise"
    rng = seeded(request.node.name)
    feed = {"x": bits(rng, *n), "step": np.array(3, np.int64)}
    feed.update({k: rng.standard_normal(n).astype(np.float32) for k in ("resid", "g1", "g2")})
    want, got, _, _ = run_both(backend, ctx, node, [feed[v.name] for v in node.inputs])
    assert {v.dtype for v in node.outputs} == {"float32", BF16}
    for v, g, w in zip(node.outputs, got, want):
        np.testing.assert_array_equal(g, w, err_msg=v.dtype)


# ---- a small bf16 ResNet: three steps, cuda vs numpy ----------------------------------------


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("memory_format", ["channels_last", "contiguous"])
def test_resnet_bf16_steps_run_on_cuda_with_fused_bf16_programs(memory_format, graph):
    """No op of the bf16 ResNet step is refused on cuda any more (no skip here): its residual
    add + ReLU and gradient sum + ReLU gradient run as bf16 pointwise programs, and three
    steps follow the numpy emulation (to cuDNN's summation order: test_bf16_conv_cuda.py)."""
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((16, 3, 16, 16), dtype=np.float32),
             rng.integers(0, 10, 16).astype(np.int32)) for _ in range(3)]
    base = models.resnet(widths=(8, 16, 32))
    steps = []
    for device in ("cpu", "cuda"):
        model = models.resnet(widths=(8, 16, 32))
        model.load_state_dict(base.state_dict())
        opt = optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
        steps.append(sg.compile_train_step(model, loss=ce_smooth, optimizer=opt,
                                           example_inputs=data[0], device=device,
                                           graph=graph if device == "cuda" else None,
                                           precision="bf16", memory_format=memory_format))
    cpu, gpu = steps
    for x, y in data:
        lc, lg = float(cpu(x, y)), float(gpu(cp.asarray(x), cp.asarray(y)))
        print(f"loss numpy {lc:.6f} cuda {lg:.6f}")
        assert abs(lg - lc) <= 2e-2 * abs(lc), (lc, lg)
    plan = next(iter(gpu.executables.values())).plan
    # (the float32 input's cast to bf16 reads it through the channels-last permute's view)
    programs = [n for n in plan.graph.nodes if n.op == "pointwise" and not n.attrs.get("views")]
    assert programs and all(v.dtype == BF16 for n in programs for v in n.inputs)
    assert_params_follow(cpu.model.state_dict(), gpu.model.state_dict(), 2e-2)
