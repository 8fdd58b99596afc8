"""The kernels of the ops compile/norm_rewrite.py makes (layer_norm.cu: add_layer_norm, rms_norm,
add_rms_norm and their gradients) against the numpy backend on fresh random inputs with
poisoned outputs: float32, a bf16 or float16 y / dy beside float32 x (the casts
fuse_layer_norm_casts drops), and float16 everywhere (a model.half()); row widths that take
the float4-register kernels, the one-float kernels and the loop kernels; layer_norm's kernels,
which share their bodies with add_layer_norm's, against both. Then whole steps of
a pre-norm net with both rewrites on CUDA (eager and graph) against the same steps on the
CPU."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

import stepgraph as sg  # noqa: E402
from stepgraph import optim  # noqa: E402
from stepgraph.backends.cuda import layer_norm  # noqa: E402
from stepgraph.backends.numpy import bf16  # noqa: E402
from stepgraph.ir.graph import Value, storage_dtype  # noqa: E402
from stepgraph.ir.ops import IMPLS as NUMPY_IMPLS  # noqa: E402
from tests.cuda.helpers import make_node  # noqa: E402
from tests.ops.helpers import seeded  # noqa: E402
from tests.unit.test_norm_rewrite import C as NET_C  # noqa: E402
from tests.unit.test_norm_rewrite import ROWS as NET_ROWS  # noqa: E402
from tests.unit.test_norm_rewrite import op_counts, pre_norm_net  # noqa: E402

WIDTHS = [384, 33, 9000]          # float4 registers; one float a thread; the loop kernels
ROWS = 37


def _rand(rng, shape, dtype):
    return (rng.standard_normal(shape) * 1.5 + 0.3).astype(dtype)


def _wide(a: np.ndarray) -> np.ndarray:
    return bf16.from_bits(a) if a.dtype == np.uint16 else a.astype(np.float32)


# What outputs hold before a run (NaN of each storage), so an unwritten element shows.
POISON = {"float32": np.float32(np.nan), "float16": np.float16(np.nan),
          "bfloat16": np.uint16(0x7FC1), "uint8": np.uint8(7)}


def _poisoned(node) -> list[np.ndarray]:
    return [np.full(v.shape, POISON[v.dtype], storage_dtype(v.dtype)) for v in node.outputs]


def reference(node, arrays) -> list[np.ndarray]:
    """The numpy backend's outputs of one node: bf16 inputs widened, bf16 outputs computed
    in float32 scratch and rounded once (backends/numpy/backend.py), in their storage."""
    ins = [bf16.from_bits(a) if v.dtype == "bfloat16" else a.copy()
           for v, a in zip(node.inputs, arrays)]
    outs = [np.full(v.shape, np.nan, np.float32) if v.dtype == "bfloat16" else o
            for v, o in zip(node.outputs, _poisoned(node))]
    NUMPY_IMPLS[node.op](node, ins, outs, None)
    return [bf16.to_bits(o) if v.dtype == "bfloat16" else o
            for v, o in zip(node.outputs, outs)]


def run_cuda(ctx, node, arrays, impls) -> list[np.ndarray]:
    with ctx.stream:
        dev_in = [cp.asarray(a) for a in arrays]
        dev_out = [cp.asarray(o) for o in _poisoned(node)]
    impls[node.op](node, dev_in, dev_out, ctx)
    ctx.stream.synchronize()
    return [cp.asnumpy(o) for o in dev_out]


def _retyped(v: Value, dtype: str) -> Value:
    return Value(v.shape, dtype)


def _compare(got: list, want: list, bound: float, what: str):
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = _wide(g).astype(np.float64), _wide(w).astype(np.float64)
        assert np.isfinite(g).all(), f"{what} output {i}: an element not written"
        scale = max(1.0, float(np.abs(w).max()))
        err = float(np.abs(g - w).max())
        assert err <= bound * scale, f"{what} output {i}: max error {err:.3g}"


# float32 kernels do float32 arithmetic against the float64 reference: a few float32
# roundings a term over sums of C terms; 16-bit storage: one rounding of the stored value.
BOUNDS = {"float32": 2e-5, "bfloat16": 1e-2, "float16": 2e-3}


@pytest.mark.parametrize("c", WIDTHS)
@pytest.mark.parametrize("x_dtype,y_dtype", [("float32", "float32"), ("float32", "bfloat16"),
                                             ("float32", "float16"), ("float16", "float16")])
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)])
def test_add_layer_norm_forward_and_backward_match_numpy(ctx, c, x_dtype, y_dtype, affine):
    weight, bias = affine
    rng = seeded(f"add_layer_norm {c} {x_dtype} {y_dtype} {affine}")
    a, b, ds = (_rand(rng, (ROWS, c), x_dtype) for _ in range(3))
    params = [_rand(rng, (c,), x_dtype) for _ in range(weight + bias)]
    attrs = {"eps": 1e-5, "weight": weight, "bias": bias}
    node = make_node("add_layer_norm", [a, b, *params], **attrs)
    if y_dtype != x_dtype:         # the y a fused cast leaves in bf16 / float16
        node.outputs[0] = _retyped(node.outputs[0], y_dtype)
    want = reference(node, [a, b, *params])
    got = run_cuda(ctx, node, [a, b, *params], layer_norm.IMPLS)
    _compare(got, want, BOUNDS[y_dtype if y_dtype != "float32" else x_dtype],
             "add_layer_norm")
    # s is the add's own rounding of a + b, bit for bit
    np.testing.assert_array_equal(got[3], (a.astype(np.float32) + b).astype(x_dtype))

    dy = _rand(rng, (ROWS, c), "float32")
    dy = bf16.to_bits(dy) if y_dtype == "bfloat16" else dy.astype(y_dtype)
    s, mean, rstd = want[3], want[1], want[2]
    grad_ins = [dy, s, *params[:weight], mean, rstd, ds]
    grad = make_node("add_layer_norm_grad", [_wide(dy).astype(x_dtype), s, *params[:weight],
                                             mean, rstd, ds], weight=weight, bias=bias)
    grad.inputs[0] = _retyped(grad.inputs[0], y_dtype)
    want = reference(grad, grad_ins)
    got = run_cuda(ctx, grad, grad_ins, layer_norm.IMPLS)
    _compare(got, want, 5 * BOUNDS[x_dtype], "add_layer_norm_grad")


@pytest.mark.parametrize("c", WIDTHS)
@pytest.mark.parametrize("b_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("y_dtype", ["float32", "bfloat16"])
def test_add_layer_norm_widens_a_half_b_as_loaded(ctx, c, b_dtype, y_dtype):
    """precision="bf16": a float32 residual stream a plus the branch's bf16 (or float16) GEMM
    output b, whose widening cast the rewrite folded into the op: s bit for bit a + float32(b)
    rounded to float32, y and the statistics as the numpy backend's."""
    rng = seeded(f"add_layer_norm widened b {c} {b_dtype} {y_dtype}")
    a, w, bias = _rand(rng, (ROWS, c), "float32"), _rand(rng, (c,), "float32"), \
        _rand(rng, (c,), "float32")
    b32 = _rand(rng, (ROWS, c), "float32")
    b = bf16.to_bits(b32) if b_dtype == "bfloat16" else b32.astype(np.float16)
    node = make_node("add_layer_norm", [a, b32, w, bias], eps=1e-5, weight=True, bias=True)
    node.inputs[1] = _retyped(node.inputs[1], b_dtype)
    node.outputs[0] = _retyped(node.outputs[0], y_dtype)
    want = reference(node, [a, b, w, bias])
    got = run_cuda(ctx, node, [a, b, w, bias], layer_norm.IMPLS)
    _compare(got, want, BOUNDS[y_dtype], "add_layer_norm")
    np.testing.assert_array_equal(got[3], a + _wide(b))


@pytest.mark.parametrize("c", WIDTHS)
@pytest.mark.parametrize("x_dtype,y_dtype", [("float32", "float32"), ("float32", "bfloat16"),
                                             ("float32", "float16"), ("float16", "float16")])
def test_add_layer_norm_is_layer_norm_of_its_sum_bit_for_bit(ctx, c, x_dtype, y_dtype):
    """layer_norm and add_layer_norm run one body per kernel kind (forward, backward, their
    loop kernels at 9000 columns): layer_norm of add_layer_norm's s against numpy, and its y,
    mean and rstd are add_layer_norm's bit for bit; layer_norm_grad against numpy, and with a
    float32 x add_layer_norm_grad's dx is its dx + ds rounded once."""
    rng = seeded(f"add_layer_norm vs layer_norm {c} {x_dtype} {y_dtype}")
    a, b, ds = (_rand(rng, (ROWS, c), x_dtype) for _ in range(3))
    params = [_rand(rng, (c,), x_dtype) for _ in range(2)]
    attrs = {"eps": 1e-5, "weight": True, "bias": True}
    add = make_node("add_layer_norm", [a, b, *params], **attrs)
    add.outputs[0] = _retyped(add.outputs[0], y_dtype)
    added = run_cuda(ctx, add, [a, b, *params], layer_norm.IMPLS)
    s = added[3]
    node = make_node("layer_norm", [s, *params], **attrs)
    node.outputs[0] = _retyped(node.outputs[0], y_dtype)
    want = reference(node, [s, *params])
    got = run_cuda(ctx, node, [s, *params], layer_norm.IMPLS)
    _compare(got, want, BOUNDS[y_dtype if y_dtype != "float32" else x_dtype], "layer_norm")
    for i, what in enumerate(("y", "mean", "rstd")):
        np.testing.assert_array_equal(added[i], got[i], err_msg=what)

    dy = _rand(rng, (ROWS, c), "float32")
    dy = bf16.to_bits(dy) if y_dtype == "bfloat16" else dy.astype(y_dtype)
    grad_ins = [dy, s, params[0], got[1], got[2]]
    grad = make_node("layer_norm_grad", [_wide(dy).astype(x_dtype), *grad_ins[1:]], **attrs)
    grad.inputs[0] = _retyped(grad.inputs[0], y_dtype)
    want = reference(grad, grad_ins)
    got = run_cuda(ctx, grad, grad_ins, layer_norm.IMPLS)
    _compare(got, want, 5 * BOUNDS[x_dtype], "layer_norm_grad")
    if x_dtype != "float32":        # a float16 dx is rounded before ds could be added here
        return
    add_grad = make_node("add_layer_norm_grad", [_wide(dy).astype(x_dtype), *grad_ins[1:], ds],
                         weight=True, bias=True)
    add_grad.inputs[0] = _retyped(add_grad.inputs[0], y_dtype)
    added = run_cuda(ctx, add_grad, grad_ins + [ds], layer_norm.IMPLS)
    np.testing.assert_array_equal(added[0], got[0] + ds)


@pytest.mark.parametrize("c", WIDTHS)
@pytest.mark.parametrize("x_dtype,y_dtype", [("float32", "float32"), ("float32", "bfloat16"),
                                             ("float16", "float16")])
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm_forward_and_backward_match_numpy(ctx, c, x_dtype, y_dtype, weight):
    rng = seeded(f"rms_norm {c} {x_dtype} {y_dtype} {weight}")
    x = _rand(rng, (ROWS, c), x_dtype)
    params = [_rand(rng, (c,), x_dtype)] if weight else []
    node = make_node("rms_norm", [x, *params], eps=1e-6, weight=weight)
    if y_dtype != x_dtype:
        node.outputs[0] = _retyped(node.outputs[0], y_dtype)
    want = reference(node, [x, *params])
    got = run_cuda(ctx, node, [x, *params], layer_norm.IMPLS)
    _compare(got, want, BOUNDS[y_dtype if y_dtype != "float32" else x_dtype], "rms_norm")

    dy = _rand(rng, (ROWS, c), "float32")
    dy = bf16.to_bits(dy) if y_dtype == "bfloat16" else dy.astype(y_dtype)
    grad_ins = [dy, x, *params, want[1]]
    grad = make_node("rms_norm_grad", [_wide(dy).astype(x_dtype), x, *params, want[1]],
                     weight=weight)
    grad.inputs[0] = _retyped(grad.inputs[0], y_dtype)
    want = reference(grad, grad_ins)
    got = run_cuda(ctx, grad, grad_ins, layer_norm.IMPLS)
    _compare(got, want, 5 * BOUNDS[x_dtype], "rms_norm_grad")


@pytest.mark.parametrize("c", WIDTHS)
@pytest.mark.parametrize("x_dtype,b_dtype,y_dtype", [
    ("float32", "float32", "float32"), ("float32", "bfloat16", "bfloat16"),
    ("float32", "float16", "float32"), ("float16", "float16", "float16")])
@pytest.mark.parametrize("weight", [True, False])
def test_add_rms_norm_matches_numpy_and_is_rms_norm_of_its_sum(ctx, c, x_dtype, b_dtype,
                                                               y_dtype, weight):
    """add_rms_norm and its gradient against the numpy backend (a half b beside a float32 a
    widened as loaded); s is the add's rounding of a + b bit for bit; y and rstd are
    rms_norm's of s bit for bit (one kernel body), and with a float32 x the gradient's dx is
    rms_norm_grad's dx + ds rounded once."""
    rng = seeded(f"add_rms_norm {c} {x_dtype} {b_dtype} {y_dtype} {weight}")
    a, ds = _rand(rng, (ROWS, c), x_dtype), _rand(rng, (ROWS, c), x_dtype)
    b32 = _rand(rng, (ROWS, c), "float32")
    b = bf16.to_bits(b32) if b_dtype == "bfloat16" else b32.astype(b_dtype)
    params = [_rand(rng, (c,), x_dtype)] if weight else []
    node = make_node("add_rms_norm", [a, b32.astype(x_dtype), *params], eps=1e-6,
                     weight=weight)
    node.inputs[1] = _retyped(node.inputs[1], b_dtype)
    node.outputs[0] = _retyped(node.outputs[0], y_dtype)
    want = reference(node, [a, b, *params])
    added = run_cuda(ctx, node, [a, b, *params], layer_norm.IMPLS)
    bound = BOUNDS[y_dtype if y_dtype != "float32" else x_dtype]
    _compare(added, want, bound, "add_rms_norm")
    s = added[2]
    np.testing.assert_array_equal(s, (a.astype(np.float32) + _wide(b)).astype(x_dtype))
    plain = make_node("rms_norm", [s, *params], eps=1e-6, weight=weight)
    plain.outputs[0] = _retyped(plain.outputs[0], y_dtype)
    got = run_cuda(ctx, plain, [s, *params], layer_norm.IMPLS)
    for i, what in enumerate(("y", "rstd")):
        np.testing.assert_array_equal(added[i], got[i], err_msg=what)

    dy = _rand(rng, (ROWS, c), "float32")
    dy = bf16.to_bits(dy) if y_dtype == "bfloat16" else dy.astype(y_dtype)
    grad_ins = [dy, s, *params, added[1], ds]
    grad = make_node("add_rms_norm_grad", [_wide(dy).astype(x_dtype), *grad_ins[1:]],
                     weight=weight)
    grad.inputs[0] = _retyped(grad.inputs[0], y_dtype)
    want = reference(grad, grad_ins)
    got = run_cuda(ctx, grad, grad_ins, layer_norm.IMPLS)
    _compare(got, want, 5 * BOUNDS[x_dtype], "add_rms_norm_grad")
    if x_dtype != "float32":        # a float16 dx is rounded before ds could be added here
        return
    plain_grad = make_node("rms_norm_grad", [_wide(dy).astype(x_dtype), *grad_ins[1:-1]],
                           weight=weight)
    plain_grad.inputs[0] = _retyped(plain_grad.inputs[0], y_dtype)
    unfused = run_cuda(ctx, plain_grad, grad_ins[:-1], layer_norm.IMPLS)
    np.testing.assert_array_equal(got[0], unfused[0] + ds)


DROP_P = 0.2


@pytest.mark.parametrize("c", WIDTHS)
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("b_dtype", ["float32", "bfloat16"])
def test_add_norms_drop_b_as_the_dropout_op_does(ctx, c, norm, b_dtype):
    """attrs dropout (compile/norm_rewrite.py: x + dropout(h) read by a norm): the keep mask is
    the numpy backend's (the dropout op's Philox) bit for bit, s is a + the dropped b rounded
    as the dropout and the add stored them, bit for bit; y and the statistics as numpy's. The
    gradient's dx_half copy through the folded dropout_grad: the kernel's own float32 dx
    rounded to bf16, then times mask and scale rounded again, bit for bit, and as numpy's."""
    rng = seeded(f"dropped add_{norm} {c} {b_dtype}")
    a, w, bias, ds = (_rand(rng, shape, "float32") for shape in
                      ((ROWS, c), (c,), (c,), (ROWS, c)))
    b32 = _rand(rng, (ROWS, c), "float32")
    b = bf16.to_bits(b32) if b_dtype == "bfloat16" else b32
    step = np.array(11, np.int64)
    params = [w, bias] if norm == "layer_norm" else [w]
    affine = {"weight": True, "bias": True} if norm == "layer_norm" else {"weight": True}
    node = make_node(f"add_{norm}", [a, b32, *params, step], eps=1e-5, dropout=DROP_P,
                     seed=2**33 + 9, site=5, **affine)
    node.inputs[1] = _retyped(node.inputs[1], b_dtype)
    node.outputs[0] = _retyped(node.outputs[0], "bfloat16")
    ins = [a, b, *params, step]
    want = reference(node, ins)
    got = run_cuda(ctx, node, ins, layer_norm.IMPLS)
    mask, s = got[-1], got[-2]
    np.testing.assert_array_equal(mask, want[-1])
    assert 0.7 < mask.mean() < 0.9
    scale = np.float32(1 / (1 - DROP_P))
    dropped = _wide(b) * mask * scale
    if b_dtype == "bfloat16":
        dropped = bf16.round_bf16(dropped)
    np.testing.assert_array_equal(s, a + dropped)
    _compare(got[:-1], want[:-1], BOUNDS["bfloat16"], f"add_{norm}")

    dy = bf16.to_bits(_rand(rng, (ROWS, c), "float32"))
    stats = got[1:-2]
    grad_ins = [dy, s, w, *stats, ds, mask]
    grad = make_node(f"add_{norm}_grad", [_wide(dy), s, w, *stats, ds, mask], dx_half="bfloat16",
                     dx_half_dropout=DROP_P, **affine)
    grad.inputs[0] = _retyped(grad.inputs[0], "bfloat16")
    want = reference(grad, grad_ins)
    got = run_cuda(ctx, grad, grad_ins, layer_norm.IMPLS)
    _compare(got[:-1], want[:-1], 5 * BOUNDS["float32"], f"add_{norm}_grad")
    _compare(got[-1:], want[-1:], BOUNDS["bfloat16"], f"add_{norm}_grad dx_half")
    np.testing.assert_array_equal(
        got[-1], bf16.to_bits(bf16.round_bf16(got[0]) * mask * scale))


def test_norm_kernels_handle_zero_rows(ctx):
    """No rows: nothing launched but dweight / dbias written as zeros."""
    x = np.zeros((0, 8), np.float32)
    w = np.ones(8, np.float32)
    grad = make_node("rms_norm_grad", [x, x, w, np.zeros(0, np.float32)], weight=True)
    got = run_cuda(ctx, grad, [x, x, w, np.zeros(0, np.float32)], layer_norm.IMPLS)
    np.testing.assert_array_equal(got[1], np.zeros(8, np.float32))


@pytest.mark.parametrize("rms", [None, "rsqrt_pow"])
@pytest.mark.parametrize("graph", [False, True])
def test_pre_norm_steps_on_cuda_match_the_cpu(rms, graph):
    """Six steps of the pre-norm net (residual sums into LayerNorms, or hand-written RMSNorms)
    on CUDA, eager and replayed as a graph, against the same steps on the CPU, fresh data
    each step; the plans hold the fused ops."""
    rng = seeded(f"pre-norm cuda {rms} {graph}")
    data = [(rng.standard_normal((NET_ROWS, NET_C)).astype(np.float32),
             rng.integers(0, 5, NET_ROWS).astype(np.int64)) for _ in range(6)]
    losses, states = {}, {}
    start = pre_norm_net(sg, rms=rms)().state_dict()
    for device in ("cpu", "cuda"):
        model = pre_norm_net(sg, rms=rms)()
        model.load_state_dict(start)
        step = sg.compile_train_step(model, sg.nn.functional.cross_entropy, optim.SGD(lr=0.05),
                                     example_inputs=data[0], device=device,
                                     graph=graph if device == "cuda" else None)
        counts = op_counts(step)
        if rms:       # block 1's first RMSNorm reads no residual sum; the other three do
            assert counts.get("rms_norm") == 1 and counts.get("add_rms_norm") == 3
        else:
            assert counts.get("add_layer_norm") == 4
        losses[device] = [float(step(*b)) for b in data]
        states[device] = {k: np.asarray(v) for k, v in model.state_dict().items()}
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=1e-4, atol=1e-5)
    for k, v in states["cpu"].items():
        np.testing.assert_allclose(states["cuda"][k], v, rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpt_with_residual_dropout_on_cuda_matches_the_cpu(precision):
    """A two-block nanoGPT with residual dropout 0.2 (the dropouts folded into add_layer_norm,
    their gradients into the norm gradients' bf16 dx copies under bf16), four steps replayed as
    a CUDA graph against the same steps on the CPU: the same Philox masks on both, so the
    losses agree to the precision's rounding."""
    from stepgraph.models import GPT, next_token_loss
    from tests.unit.test_norm_rewrite_bf16 import GPT_SIZE

    rng = seeded(f"gpt dropout cuda {precision}")
    data = [(rng.integers(0, 11, (4, 8)).astype(np.int32),
             rng.integers(0, 11, (4, 8)).astype(np.int32)) for _ in range(4)]
    start = GPT(GPT_SIZE).state_dict()
    losses = {}
    for device in ("cpu", "cuda"):
        model = GPT(GPT_SIZE)
        model.load_state_dict(start)
        step = sg.compile_train_step(model, next_token_loss, optim.SGD(lr=0.05),
                                     example_inputs=data[0], device=device, precision=precision,
                                     graph=True if device == "cuda" else None)
        counts = op_counts(step)
        assert counts.get("add_layer_norm") == 4
        if precision == "bf16":
            assert "dropout_grad" not in counts
        losses[device] = [float(step(*b)) for b in data]
    tol = 1e-4 if precision == "fp32" else 2e-2
    np.testing.assert_allclose(losses["cuda"], losses["cpu"], rtol=tol, atol=tol)
