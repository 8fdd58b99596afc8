"""cuda vs the NumPy emulation for the bfloat16 (precision="bf16") convolution, pooling and
BatchNorm kernels: fresh random bf16 inputs (raw bits in uint16 arrays), outputs poisoned
first, each node run through NumpyBackend.run_node (float32 compute, one rounding of what a
node writes) and through the cuda launchers.

Where the cuda kernel does the reference's arithmetic in the reference's order the bits must
match: max pooling and its gradient (a maximum is an input; the gradient's gather adds in
np.add.at's row-major window order; the channels-last kernels with 16 bytes of channels a
thread too, in float32 as well, NaNs among the inputs), average pooling's non-overlapping
gradient (one term).
Elsewhere the float32 values before the one rounding may differ in their last places, so the
bf16 results may differ by one bf16 ulp where that float32 value lies next to a rounding
boundary, which a random float32 does with probability about 2^-16 per float32 ulp of
difference:
  - avgpool2d forward: numpy's sum over two strided axes takes another order than the
    kernel's row-major walk;
  - batch_norm_train / _grad: the reference runs in float64 (then float32, then bf16), the
    kernels in float32 with float64 sums; where x - mean or the dx bracket cancels, the
    float32 difference is relatively larger, still far below 1e-4 of the tensor's scale;
  - cuDNN's convolutions: products of bf16 values are exact in float32, but cuDNN adds them
    in another order (tiles, split reductions) than numpy's einsum. The float32 sums then
    differ by at most gamma_K * sum |terms| (K terms per output, gamma_K ~ K * 2^-24), the
    classic bound for recursive summation, which the tests allow on top of one bf16 ulp;
  - the own tiled convolution kernels (conv.PATH forced to "tiled"): the same bound, their
    sums running in a fixed order of their own (conv_tiled.cu).
A wrong kernel (unrounded output, rounding twice, wrong layout or index) differs in most
elements or by far more, so each test also bounds the fraction of elements that differ at all.

The last tests train a small ResNet (channels-last and NCHW) and the MNIST CNN for a few bf16
steps on cuda and on the NumPy emulation. Every op of those steps has bf16 kernels now (the
elementwise ones: test_bf16_elementwise_cuda.py); an op of a future step without them would
make it skip, naming it.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

import stepgraph as sg  # noqa: E402
from stepgraph import models, optim  # noqa: E402
from stepgraph.backends.cuda import norm, pool  # noqa: E402
from stepgraph.backends.cuda.conv import conv, conv_cudnn, conv_tiled  # noqa: E402
from stepgraph.backends.numpy import bf16  # noqa: E402
from stepgraph.backends.numpy.backend import NumpyBackend  # noqa: E402
from stepgraph.errors import UnsupportedPrecisionError  # noqa: E402
from stepgraph.ir.graph import BF16, Node, Value  # noqa: E402
from stepgraph.ir.ops import OPS, infer_outputs  # noqa: E402
from stepgraph.nn import functional as F  # noqa: E402
from tests.cuda.helpers import ce_smooth  # noqa: E402
from tests.ops.helpers import relative_error as rel, seeded  # noqa: E402

CUDA_IMPLS = {**conv.IMPLS, **pool.IMPLS, **norm.IMPLS}
POISON = {"uint16": 0x7FA1, "float32": np.nan, "int32": -7, "int64": -7}
BF16_PARTIALS_UNIT = 2.0 ** -9   # bf16's unit roundoff
GAMMA_UNIT = 2.0 ** -24    # float32's unit roundoff


# ---- harness -------------------------------------------------------------------------------

def bf16_random(rng, *shape, scale=1.0, shift=0.1) -> np.ndarray:
    """bf16 bits of normal values shifted off zero."""
    return bf16.to_bits(rng.standard_normal(shape).astype(np.float32) * scale + shift)


def node_of(op: str, arrays: list, **attrs) -> Node:
    """A node over these host arrays: uint16 arrays are bf16 values, others their dtype."""
    ins = [Value(a.shape, BF16 if a.dtype == np.uint16 else str(a.dtype)) for a in arrays]
    outs = [Value(s, d) for s, d in infer_outputs(op, ins, attrs)]
    return Node(op, ins, outs, attrs, mutates=OPS[op].mutates(attrs))


def storage(v: Value) -> str:
    return "uint16" if v.dtype == BF16 else v.dtype


def emulate(node: Node, arrays: list) -> tuple[list, list]:
    """(outputs, inputs after the run) of the NumPy emulation, on copies."""
    ins = [a.copy() for a in arrays]
    outs = [np.full(v.shape, POISON[storage(v)], storage(v)) for v in node.outputs]
    NumpyBackend().run_node(node, ins, outs)
    return outs, ins


def on_cuda(ctx, node: Node, arrays: list, misalign_first: bool = False) -> tuple[list, list]:
    """(outputs, inputs after the run) of the cuda launcher, outputs poisoned first.
    misalign_first: the first input one element past a 16-byte boundary (still C-contiguous),
    which turns the launchers' vector paths down."""
    with ctx.stream:
        ins = [cp.asarray(a) for a in arrays]
        if misalign_first:
            shifted = cp.empty(ins[0].size + 1, ins[0].dtype)[1:].reshape(ins[0].shape)
            shifted[...] = ins[0]
            ins[0] = shifted
        outs = [cp.full(v.shape, POISON[storage(v)], storage(v)) for v in node.outputs]
    CUDA_IMPLS[node.op](node, ins, outs, ctx)
    ctx.stream.synchronize()
    return [cp.asnumpy(a) for a in outs], [cp.asnumpy(a) for a in ins]


def both(ctx, node, arrays):
    return emulate(node, arrays)[0], on_cuda(ctx, node, arrays)[0]


def ordinal(bits: np.ndarray) -> np.ndarray:
    """bf16 bits as integers in value order (adjacent bf16 values differ by 1)."""
    b = bits.astype(np.int64)
    return np.where(b & 0x8000, 0x8000 - b, b)


def ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(ordinal(got) - ordinal(want))


def assert_bits_equal(got, want, what):
    assert got.dtype == want.dtype == np.uint16, what
    np.testing.assert_array_equal(got, want, err_msg=what)


def assert_near_bits(got, want, what, max_fraction, slack=None, outliers=0.0):
    """got within one bf16 ulp of want, or within slack (float32, per element) of it, but for
    at most an `outliers` fraction of the elements; at most max_fraction of the elements
    differ at all."""
    assert got.dtype == want.dtype == np.uint16 and got.shape == want.shape, what
    assert (got != POISON["uint16"]).all() or (want == POISON["uint16"]).any(), \
        f"{what}: elements left unwritten"
    d = ulps(got, want)
    g, w = bf16.from_bits(got).astype(np.float64), bf16.from_bits(want).astype(np.float64)
    ok = (d <= 1) if slack is None else (d <= 1) | (np.abs(g - w) <= slack)
    assert (~ok).mean() <= outliers, (f"{what}: {int((~ok).sum())} elements off by more than "
                                      f"allowed; worst {int(d.max())} ulps")
    fraction = float((d > 0).mean())
    print(f"{what}: {fraction:.2e} of the elements differ (<= {max_fraction:g} allowed)")
    assert fraction <= max_fraction, f"{what}: {fraction:.2e} of the elements differ"


# ---- max pooling: bit for bit --------------------------------------------------------------

# (shape (N, C, H, W), kernel, stride, padding): tiling 2x2 (the cnn), odd overlapping 3x3/2
# with padding (the gather), 3x3/1.
MAX_CASES = [((4, 10, 24, 24), (2, 2), (2, 2), (0, 0)), ((2, 5, 9, 11), (3, 3), (2, 2), (1, 1)),
             ((3, 4, 7, 6), (3, 3), (1, 1), (0, 0))]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("case", MAX_CASES, ids=str)
def test_maxpool2d_bf16_forward_and_grad_match_the_emulation_bit_for_bit(ctx, case, relu,
                                                                         layout, request):
    shape, kernel, stride, padding = case
    rng = seeded(request.node.name)
    # a coarse grid: windows hold ties, and the first maximum must win
    x = bf16.to_bits(np.round(rng.standard_normal(shape) * 2) / 2)
    if layout == "NHWC":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    attrs = dict(kernel=kernel, stride=stride, padding=padding, relu=relu)
    if layout == "NHWC":
        attrs["layout"] = "NHWC"
    fwd = node_of("maxpool2d", [x], **attrs)
    want, got = both(ctx, fwd, [x])
    assert_bits_equal(got[0], want[0], "maxpool2d y")
    np.testing.assert_array_equal(got[1], want[1], err_msg="maxpool2d indices")
    y, idx = want
    dy = bf16_random(rng, *y.shape)
    grad_ins = [dy, idx] + ([y] if relu else [])
    nchw = shape if layout == "NCHW" else (shape[0], shape[2], shape[3], shape[1])
    bwd = node_of("maxpool2d_grad", grad_ins, input_shape=nchw, **attrs)
    want, got = both(ctx, bwd, grad_ins)
    assert_bits_equal(got[0], want[0], "maxpool2d_grad dx")


# ---- max pooling, channels-last, 16 bytes of channels a thread ------------------------------

# (N, H, W), kernel, stride, padding: overlapping 3x3/2 (SqueezeNet's pools), the same padded
# (the gather), 2x2/2 (the tiling scatter)
PACK_WINDOWS = [((2, 9, 11), (3, 3), (2, 2), (0, 0)), ((2, 9, 11), (3, 3), (2, 2), (1, 1)),
                ((2, 8, 6), (2, 2), (2, 2), (0, 0))]


def pool_values(rng, shape, storage: str) -> np.ndarray:
    """Values on a coarse grid (windows hold ties and -0: the first maximum must win) with
    NaNs among them (a window's first NaN wins), as float32 or bf16 bits."""
    x = (np.round(rng.standard_normal(shape) * 2) / 2).astype(np.float32)
    x[rng.random(shape) < 0.03] = np.nan
    return bf16.to_bits(x) if storage == "uint16" else x


def assert_same_floats(got, want, what):
    """bf16 bits equal; float32 bits equal where want is a number (the sign of a zero too),
    NaN where it is NaN."""
    if want.dtype == np.uint16:
        return assert_bits_equal(got, want, what)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan],
                                  err_msg=what)


@pytest.fixture
def max_launches(monkeypatch):
    """The names of the pool.cu kernels launched during the test, in order."""
    names, real = [], pool._launch

    def record(ctx, filename, name, grid, block, args):
        names.append(name)
        real(ctx, filename, name, grid, block, args)

    monkeypatch.setattr(pool, "_launch", record)
    return names


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("window", PACK_WINDOWS, ids=str)
@pytest.mark.parametrize("channels", [64, 8, 12, 3])
@pytest.mark.parametrize("storage", ["uint16", "float32"])
def test_nhwc_maxpool2d_channel_packs_match_the_emulation_bit_for_bit(
        ctx, storage, channels, window, relu, max_launches, request):
    """Channels-last max pooling and its gradient (fused ReLU or not) take the kernels with
    16 bytes of channels a thread (_nhwc_vec_) where C is a multiple of 8 bf16 / 4 float32
    values, the one-element kernels elsewhere: both give the emulation's bits, ties, -0 and
    NaNs included. Where the pack kernels ran, the one-element kernels (an input off 16-byte
    alignment sends the launch there) give the same bits on the same data."""
    (n, h, w), kernel, stride, padding = window
    rng = seeded(request.node.name)
    x = pool_values(rng, (n, h, w, channels), storage)
    attrs = dict(kernel=kernel, stride=stride, padding=padding, relu=relu, layout="NHWC")
    fwd = node_of("maxpool2d", [x], **attrs)
    want, got = both(ctx, fwd, [x])
    assert_same_floats(got[0], want[0], "maxpool2d y")
    np.testing.assert_array_equal(got[1], want[1], err_msg="maxpool2d indices")
    y, idx = want
    dy = bf16_random(rng, *y.shape) if storage == "uint16" \
        else rng.standard_normal(y.shape).astype(np.float32)
    grad_ins = [dy, idx] + ([y] if relu else [])
    bwd = node_of("maxpool2d_grad", grad_ins, input_shape=x.shape, **attrs)
    want_dx, got_dx = both(ctx, bwd, grad_ins)
    assert_same_floats(got_dx[0], want_dx[0], "maxpool2d_grad dx")

    vec = channels % (16 // x.itemsize) == 0
    ctype = "unsigned short" if storage == "uint16" else "float"
    backward = "maxpool2d_backward_tiling_kernel" if kernel == stride and padding == (0, 0) \
        else "maxpool2d_backward_kernel"
    ran = [pool._kernel(k, "_nhwc_vec" if vec else "_nhwc", ctype)
           for k in ("maxpool2d_forward_kernel", backward)]
    assert max_launches == ran
    if vec:
        element = on_cuda(ctx, fwd, [x], misalign_first=True)[0]
        assert_same_floats(got[0], element[0], "maxpool2d y, one-element kernel")
        np.testing.assert_array_equal(got[1], element[1], err_msg="maxpool2d indices")
        element_dx = on_cuda(ctx, bwd, grad_ins, misalign_first=True)[0]
        assert_same_floats(got_dx[0], element_dx[0], "maxpool2d_grad dx, one-element kernel")
        assert max_launches[2:] == [pool._kernel(k, "_nhwc", ctype)
                                    for k in ("maxpool2d_forward_kernel", backward)]


# ---- average pooling -----------------------------------------------------------------------

# global 8x8 (the resnet's head: the warp kernel in NCHW), 2x2/2, padded 3x3/2 both divisors
AVG_CASES = [((16, 64, 8, 8), (8, 8), (8, 8), (0, 0), True),
             ((4, 6, 10, 12), (2, 2), (2, 2), (0, 0), True),
             ((2, 5, 9, 11), (3, 3), (2, 2), (1, 1), False),
             ((2, 5, 9, 11), (3, 3), (2, 2), (1, 1), True)]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", AVG_CASES, ids=str)
def test_avgpool2d_bf16_matches_the_emulation(ctx, case, layout, request):
    shape, kernel, stride, padding, include = case
    rng = seeded(request.node.name)
    x = bf16_random(rng, *shape)
    nchw = shape
    if layout == "NHWC":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    attrs = dict(kernel=kernel, stride=stride, padding=padding, count_include_pad=include)
    if layout == "NHWC":
        attrs["layout"] = "NHWC"
    fwd = node_of("avgpool2d", [x], **attrs)
    want, got = both(ctx, fwd, [x])
    # float32 sums in another order: a bf16 flip where the mean sits next to a boundary
    assert_near_bits(got[0], want[0], "avgpool2d y", max_fraction=1e-2)
    dy = bf16_random(rng, *want[0].shape)
    bwd = node_of("avgpool2d_grad", [dy], input_shape=nchw if layout == "NCHW" else
                  (shape[0], shape[2], shape[3], shape[1]), **attrs)
    want, got = both(ctx, bwd, [dy])
    if kernel == stride:        # one window per element: dy / divisor, the same one rounding
        assert_bits_equal(got[0], want[0], "avgpool2d_grad dx")
    else:                       # overlapping windows: taps (numpy) vs windows (kernel) order;
        # where the taps cancel to near zero, their float32 sums differ by more than a bf16
        # ulp of the result (measured on an H100: one element 128 ulps off, by 1e-8)
        assert_near_bits(got[0], want[0], "avgpool2d_grad dx", max_fraction=1e-2,
                         slack=abs_bound(bwd, [dy], terms=4)[0])


# ---- BatchNorm -----------------------------------------------------------------------------

# (N, C, H, W) NCHW: planes (inner % 4 == 0: float4 packs; odd: one at a time); NHWC: columns
# (two channels a thread in one access where C is even, one where it is odd: norm.py
# COLUMN_WALKS)
BN_CASES = [((8, 16, 8, 8), "NCHW"), ((4, 5, 7, 7), "NCHW"), ((16, 64, 8, 8), "NHWC"),
            ((6, 40, 5, 5), "NHWC"), ((6, 9, 5, 5), "NHWC")]


def bn_arrays(rng, shape, layout):
    c = shape[1]
    x = bf16_random(rng, *shape, scale=2.0, shift=3.0)      # mean far from 0: a real shift
    if layout == "NHWC":
        x = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    f32 = lambda *s, **k: (rng.standard_normal(s) * k.get("scale", 1.0) + 0.1).astype(
        np.float32)
    return x, f32(c), f32(c), f32(c, scale=0.1), np.abs(f32(c)) + 0.5, np.array(3, np.int64)


@pytest.mark.parametrize("residual", [False, True, "norm"], ids=["", "residual", "norm"])
@pytest.mark.parametrize("act", ["none", "relu"])
@pytest.mark.parametrize("case", BN_CASES, ids=str)
def test_batch_norm_bf16_train_and_grad_match_the_emulation(ctx, case, act, residual, request):
    """With residual, the fused residual add (compile/fuse.py fuse_batch_norm_residual) and
    the fused gradient sum (fuse_batch_norm_grad_sum); "norm": the residual is a shortcut's
    raw value and its BatchNorm is applied on the way in (statistics of batch_norm_stats)."""
    shape, layout = case
    rng = seeded(request.node.name)
    ins = list(bn_arrays(rng, shape, layout))
    attrs = dict(eps=1e-5, momentum=0.1, affine=True, track=True, act=act,
                 residual=bool(residual))
    if residual:
        ins.append(bf16_random(rng, *ins[0].shape, scale=2.0, shift=-1.0))
    if residual == "norm":
        r, c = ins[-1], shape[1]
        stats = node_of("batch_norm_stats", [r], eps=1e-5, momentum=0.1, track=False,
                        **({"layout": "NHWC"} if layout == "NHWC" else {}))
        (r_mean, r_invstd), _ = emulate(stats, [r])
        f32 = lambda: rng.standard_normal(c).astype(np.float32)      # noqa: E731
        ins += [r_mean, r_invstd, f32(), f32()]
        attrs.update(residual_norm=True, residual_affine=True, residual_eps=1e-5)
    if layout == "NHWC":
        attrs["layout"] = "NHWC"
    fwd = node_of("batch_norm_train", ins, **attrs)
    (want, want_ins), (got, got_ins) = emulate(fwd, ins), on_cuda(ctx, fwd, ins)
    scale = float(np.abs(bf16.from_bits(want[0])).max())
    # float64 (reference) vs float32 arithmetic before the one rounding; cancellation in
    # x - mean can cost float32 ulps of the mean, far below 1e-4 of the tensor's scale
    assert_near_bits(got[0], want[0], "batch_norm_train y", max_fraction=1e-2,
                     slack=1e-4 * scale)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6, err_msg="save_mean")
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6, err_msg="save_invstd")
    for i, what in ((3, "running_mean"), (4, "running_var")):
        np.testing.assert_allclose(got_ins[i], want_ins[i], rtol=1e-6, atol=1e-7, err_msg=what)
    assert int(got_ins[5]) == int(want_ins[5]) == 4

    y, mean, invstd = want
    dy = bf16_random(rng, *y.shape)
    grad_ins = [dy, ins[0], ins[1], mean, invstd] + ([ins[2]] if act == "relu" else [])
    gattrs = dict(affine=True, act=act) | ({"layout": "NHWC"} if layout == "NHWC" else {})
    if residual:     # and the fused gradient sum (fuse_batch_norm_grad_sum) in the backward
        grad_ins.append(bf16_random(rng, *y.shape))
        gattrs["dy_sum"] = True
    bwd = node_of("batch_norm_grad", grad_ins, **gattrs)
    want, got = both(ctx, bwd, grad_ins)
    scale = float(np.abs(bf16.from_bits(want[0])).max())
    # the dx bracket (g - mean g - xhat mean(g xhat)) cancels: float32 vs float64 there
    assert_near_bits(got[0], want[0], "batch_norm_grad dx", max_fraction=2e-2,
                     slack=1e-4 * scale)
    for i, what in ((1, "dweight"), (2, "dbias")):
        np.testing.assert_allclose(got[i], want[i], rtol=1e-5, atol=1e-5, err_msg=what)


# ---- convolutions through cuDNN ------------------------------------------------------------

needs_cudnn = pytest.mark.skipif(not conv_cudnn.available(),
                                 reason=f"cuDNN unusable: {conv_cudnn.unavailable_reason()}")

# (x NCHW shape, weight shape, stride, padding, bias, layout): the cnn's two convs (bias),
# the resnet's 3x3, stride-2 3x3 and 1x1 shortcut (no bias), channels-last and NCHW
CONV_CASES = [((16, 1, 28, 28), (10, 1, 5, 5), 1, 0, True, "NCHW"),
              ((16, 10, 12, 12), (20, 10, 5, 5), 1, 0, True, "NCHW"),
              ((8, 16, 16, 16), (16, 16, 3, 3), 1, 1, False, "NHWC"),
              ((8, 16, 16, 16), (32, 16, 3, 3), 2, 1, False, "NHWC"),
              ((8, 16, 16, 16), (32, 16, 1, 1), 2, 0, False, "NHWC"),
              ((8, 16, 16, 16), (16, 16, 3, 3), 1, 1, False, "NCHW")]


def to_layout(a: np.ndarray, layout: str) -> np.ndarray:
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1)) if layout == "NHWC" else a


def _terms(node: Node) -> int:
    """K: the products summed into one output of a convolution op (NCHW geometry)."""
    layout = node.attrs.get("layout", "NCHW")
    nchw = (lambda s: (s[0], s[3], s[1], s[2])) if layout == "NHWC" else tuple
    if node.op == "conv2d":
        o, c, kh, kw = nchw(node.inputs[1].shape)
        return c * kh * kw
    if node.op == "conv2d_grad_input":
        o, c, kh, kw = nchw(node.inputs[1].shape)
        return o * kh * kw
    n, o, ho, wo = nchw(node.inputs[0].shape)
    return n * ho * wo


def run_float32(node: Node, arrays: list, of=lambda a: a) -> list:
    """The float32 outputs of the node's float32 twin run by NumPy on of(each bf16 input's
    value): the sums before their bf16 rounding."""
    wide = [of(bf16.from_bits(a)) if a.dtype == np.uint16 else a for a in arrays]
    f32 = Node(node.op, [Value(a.shape, "float32") for a in wide],
               [Value(v.shape, "float32") for v in node.outputs], node.attrs)
    outs = [np.zeros(v.shape, np.float32) for v in f32.outputs]
    NumpyBackend().run_node(f32, wide, outs)
    return outs


def abs_bound(node: Node, arrays: list, terms: int | None = None, unit: float = None) -> list:
    """2 gamma_K * (the op run in float32 on |inputs|): the recursive-summation error bound of
    a float32 sum of K (`terms`, else _terms(node)) exact products in any order, for cuDNN's sum
    and numpy's each. `unit` replaces float32's unit roundoff (BF16_PARTIALS_UNIT)."""
    gamma = 2 * (terms or _terms(node)) * (unit or GAMMA_UNIT)
    return [o.astype(np.float64) * gamma for o in run_float32(node, arrays, np.abs)]


@needs_cudnn
@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv2d_bf16_through_cudnn_is_within_the_summation_bound(ctx, case, request,
                                                                 monkeypatch):
    xs, ws, s, p, has_bias, layout = case
    # cuDNN's plans alone, timed by the autotuner: the tiled kernels, which run the NCHW cases
    # too, are tested below
    monkeypatch.setattr(conv_tiled, "unsupported", lambda *args: "cuDNN under test")
    rng = seeded(request.node.name)
    attrs = dict(stride=(s, s), padding=(p, p), dilation=(1, 1), groups=1)
    if layout == "NHWC":
        attrs["layout"] = "NHWC"
    x = to_layout(bf16_random(rng, *xs), layout)
    w = to_layout(bf16_random(rng, *ws, scale=0.3), layout)
    ins = [x, w] + ([bf16_random(rng, ws[0])] if has_bias else [])
    fwd = node_of("conv2d", ins, **attrs)
    want, got = both(ctx, fwd, ins)
    assert_near_bits(got[0], want[0], "conv2d y", max_fraction=5e-2,
                     slack=abs_bound(fwd, ins)[0])

    dy = bf16_random(rng, *want[0].shape)
    nchw_x, nchw_w = xs, ws
    shape_of = (lambda sh: (sh[0], sh[2], sh[3], sh[1])) if layout == "NHWC" else tuple
    dgrad = node_of("conv2d_grad_input", [dy, w], input_shape=shape_of(nchw_x), **attrs)
    want, got = both(ctx, dgrad, [dy, w])
    # cuDNN's bf16 NCHW dgrad plans (the cnn's shapes) do not keep one float32 sum: measured
    # on an H100, 2-3% of the elements sit up to 4 ulps from the once-rounded sum, within one
    # bf16 rounding of the whole |sum|, and 4 of 12544 (9 of 23040) elements near zero beyond
    # even that: partial sums rounded to bf16, which no per-element bound short of K bf16
    # roundings covers. Those are allowed as outliers, at most 1 in 1000. Which plan the
    # autotuner keeps varies between runs: 2% to 11% of the elements differed at all.
    nchw = layout == "NCHW"
    bound = dict(terms=1, unit=BF16_PARTIALS_UNIT) if nchw else {}
    assert_near_bits(got[0], want[0], "conv2d_grad_input dx", max_fraction=0.15 if nchw else 5e-2,
                     slack=abs_bound(dgrad, [dy, w], **bound)[0], outliers=1e-3 if nchw else 0)

    wgrad = node_of("conv2d_grad_weight", [dy, x], weight_shape=shape_of(nchw_w),
                    bias=has_bias, **attrs)
    want, got = both(ctx, wgrad, [dy, x])
    bounds = abs_bound(wgrad, [dy, x])
    # the NCHW plans for the cnn's shapes differ at all on up to 9% of dw (H100), all
    # within the float32 summation bound
    assert_near_bits(got[0], want[0], "conv2d_grad_weight dw",
                     max_fraction=0.15 if nchw else 5e-2, slack=bounds[0])
    if has_bias:      # db: bf16 dy summed in float32 by reduce_sum, rounded once
        assert_near_bits(got[1], want[1], "conv2d_grad_weight db", max_fraction=0.5,
                         slack=bounds[1])


def first_rounding(ins: list, attrs: dict) -> np.ndarray:
    """What a plain plan + the epilogue kernel may add to a bf16 conv's error: the sum is
    rounded to bf16 before the bias is added (2^-8 of |sum|: one rounding, with room for the
    summation order flipping it). Where the bias cancels the sum, that is many ulps of y."""
    plain = node_of("conv2d", ins[:2], **attrs)
    return np.abs(run_float32(plain, ins[:2])[0].astype(np.float64)) * 2.0 ** -8


@needs_cudnn
@pytest.mark.parametrize("kernel", [3, 7])
def test_depthwise_conv2d_bf16_with_bias_through_cudnn(ctx, kernel, request):
    """A ConvNeXt / MobileNet depthwise conv (NHWC, bias): its fastest cuDNN engines fuse no
    bias, so a plain plan + the epilogue kernel competes (conv.py), rounding y twice as
    torch's conv then bias add does. Bound: the float32 summation bound plus one bf16
    rounding of the sum before the bias (first_rounding); the gradients keep the summation
    bound."""
    rng = seeded(request.node.name)
    c, p = 32, kernel // 2
    attrs = dict(stride=(1, 1), padding=(p, p), dilation=(1, 1), groups=c, layout="NHWC")
    x = to_layout(bf16_random(rng, 8, c, 14, 14), "NHWC")
    w = to_layout(bf16_random(rng, c, 1, kernel, kernel, scale=0.3), "NHWC")
    ins = [x, w, bf16_random(rng, c)]
    fwd = node_of("conv2d", ins, **attrs)
    want, got = both(ctx, fwd, ins)
    assert_near_bits(got[0], want[0], "depthwise conv2d y", max_fraction=0.5,
                     slack=abs_bound(fwd, ins)[0] + first_rounding(ins, attrs))
    dy = bf16_random(rng, *want[0].shape)
    dgrad = node_of("conv2d_grad_input", [dy, w], input_shape=x.shape, **attrs)
    want, got = both(ctx, dgrad, [dy, w])
    assert_near_bits(got[0], want[0], "depthwise conv2d_grad_input dx", max_fraction=0.15,
                     slack=abs_bound(dgrad, [dy, w])[0])
    wgrad = node_of("conv2d_grad_weight", [dy, x], weight_shape=w.shape, bias=True, **attrs)
    want, got = both(ctx, wgrad, [dy, x])
    bounds = abs_bound(wgrad, [dy, x])
    assert_near_bits(got[0], want[0], "depthwise conv2d_grad_weight dw", max_fraction=0.5,
                     slack=bounds[0])


@needs_cudnn
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("kernel", [3, 7])
def test_every_depthwise_bf16_plan_is_within_the_summation_bound(monkeypatch, ctx, kernel,
                                                                 bias, request):
    """Each cuDNN plan offered for a bf16 depthwise conv (the runtime-compiled engines among
    them, and with a bias the plain plans + the epilogue kernel), run on its own against the
    emulation: names every plan (and its engine) that puts an element of y beyond the float32
    summation bound (plus first_rounding where the epilogue adds the bias), rather than only
    the one the autotuner keeps."""
    from tests.cuda.test_layout_cuda import paths_of

    rng = seeded(request.node.name)
    c, p = 32, kernel // 2
    attrs = dict(stride=(1, 1), padding=(p, p), dilation=(1, 1), groups=c, layout="NHWC")
    x = to_layout(bf16_random(rng, 8, c, 14, 14), "NHWC")
    w = to_layout(bf16_random(rng, c, 1, kernel, kernel, scale=0.3), "NHWC")
    ins = [x, w] + ([bf16_random(rng, c)] if bias else [])
    node = node_of("conv2d", ins, **attrs)
    want = emulate(node, ins)[0][0]
    slack = abs_bound(node, ins)[0]
    with ctx.stream:
        dev_in = [cp.asarray(a) for a in ins]
        dev_out = [cp.empty(v.shape, np.uint16) for v in node.outputs]
    paths, through = paths_of(monkeypatch, ctx, node, dev_in, dev_out)
    assert paths and not through, sorted(paths)
    engines = {c.path: c.name for job in conv_cudnn._PLANS.values()
               for c in job.result().entries}
    twice = slack + first_rounding(ins, attrs)
    bad = []
    for name, run in sorted(paths.items()):
        with ctx.stream:
            dev_out[0].fill(POISON["uint16"])
        run()
        ctx.stream.synchronize()
        got = cp.asnumpy(dev_out[0])
        d = ulps(got, want)
        g, r = bf16.from_bits(got).astype(np.float64), bf16.from_bits(want).astype(np.float64)
        bound = twice if name.endswith(conv.EPILOGUE_SUFFIX) else slack
        off = ~((d <= 1) | (np.abs(g - r) <= bound))
        print(f"{name} ({engines.get(name.removesuffix(conv.EPILOGUE_SUFFIX))}): "
              f"{off.mean():.2%} beyond the bound, worst {int(d.max())} ulps")
        if off.any():
            bad.append(f"{name} ({engines.get(name.removesuffix(conv.EPILOGUE_SUFFIX))}): "
                       f"{off.mean():.2%} off, worst {int(d.max())} ulps")
    assert not bad, bad


# ---- convolutions on the tiled kernels -------------------------------------------------------

# (x shape, weight shape, padding): the cnn's two convs at its batch, and an odd one (3
# channels, a 9x11 image, a padded 3x3 kernel: partial channel groups and pixel tiles)
TILED_CASES = [((64, 1, 28, 28), (10, 1, 5, 5), 0), ((64, 10, 12, 12), (20, 10, 5, 5), 0),
               ((4, 3, 9, 11), (5, 3, 3, 3), 1)]
# The tiled kernels do the emulation's arithmetic (exact products, float32 sums, one rounding)
# in their own order, so an element differs only where its float32 sum lies within the two
# sums' difference of a bf16 rounding boundary: 0 to 1e-4 of the elements of y, dx and dw in a
# NumPy float32 simulation of the kernels' order on these cases. An unrounded (truncated)
# output differs in about half of them (each by one ulp), one rounded twice in a quarter or
# more: TILED_FRACTION tells them apart (test_the_tiled_bounds_reject_a_wrong_rounding).
TILED_FRACTION = 1e-2
# db has 5 to 20 elements, too few for a fraction to tell: a quarter may differ (one of 5, two
# of 10). The sum kernel rounds it with the store that rounds dw, which TILED_FRACTION checks.
TILED_DB_FRACTION = 0.25


def conv_attrs(padding: int) -> dict:
    return dict(stride=(1, 1), padding=(padding, padding), dilation=(1, 1), groups=1)


def tiled_dy(rng, xs, ws, padding: int) -> np.ndarray:
    """Fresh bf16 dy of the stride-1 forward's output shape."""
    return bf16_random(rng, xs[0], ws[0], xs[2] + 2 * padding - ws[2] + 1,
                       xs[3] + 2 * padding - ws[3] + 1)


@pytest.fixture
def tiled_launches(monkeypatch):
    """conv.PATH forced to "tiled" for the test (monkeypatch restores it); the .cu file of
    every kernel fetched meanwhile (each launch fetches its kernel), to show what ran."""
    monkeypatch.setattr(conv, "PATH", "tiled")
    files = []
    kernel = conv.compiler.kernel
    monkeypatch.setattr(conv.compiler, "kernel",
                        lambda f, name: files.append(f) or kernel(f, name))
    return files


def relu_bits(bits: np.ndarray) -> np.ndarray:
    """ReLU of bf16 values, exact (it commutes with the rounding): negatives become +0."""
    return np.where(bf16.from_bits(bits) < 0, np.uint16(0), bits)


@pytest.mark.parametrize("epilogue", ["", "bias", "bias_relu"])
@pytest.mark.parametrize("case", TILED_CASES, ids=str)
def test_conv2d_bf16_on_the_tiled_kernels_is_within_the_summation_bound(ctx, tiled_launches,
                                                                       case, epilogue,
                                                                       request):
    """y rounded once from the float32 sum (the bias first); with attrs act "relu" the
    kernel stores max(sum, 0), exact (ReLU commutes with the rounding), in the same launch."""
    xs, ws, p = case
    rng = seeded(request.node.name)
    ins = [bf16_random(rng, *xs), bf16_random(rng, *ws, scale=0.3)]
    ins += [bf16_random(rng, ws[0])] if epilogue else []
    relu = epilogue == "bias_relu"
    plain = node_of("conv2d", ins, **conv_attrs(p))
    want = emulate(plain, ins)[0][0]       # the emulation's conv2d leaves act to its own node
    got = on_cuda(ctx, node_of("conv2d", ins, **conv_attrs(p), act="relu") if relu else plain,
                  ins)[0][0]
    assert tiled_launches == [conv_tiled.SOURCE]
    assert_near_bits(got, relu_bits(want) if relu else want, "conv2d y",
                     max_fraction=TILED_FRACTION, slack=abs_bound(plain, ins)[0])


@pytest.mark.parametrize("case", TILED_CASES, ids=str)
def test_conv2d_grad_input_bf16_on_the_tiled_kernels_is_within_the_summation_bound(
        ctx, tiled_launches, case, request):
    xs, ws, p = case
    rng = seeded(request.node.name)
    w = bf16_random(rng, *ws, scale=0.3)
    ins = [tiled_dy(rng, xs, ws, p), w]
    node = node_of("conv2d_grad_input", ins, input_shape=xs, **conv_attrs(p))
    want, got = both(ctx, node, ins)
    assert tiled_launches == [conv_tiled.SOURCE]
    assert_near_bits(got[0], want[0], "conv2d_grad_input dx", max_fraction=TILED_FRACTION,
                     slack=abs_bound(node, ins)[0])


@pytest.mark.parametrize("bias", [False, True], ids=["", "db"])
@pytest.mark.parametrize("case", TILED_CASES, ids=str)
def test_conv2d_grad_weight_bf16_on_the_tiled_kernels_is_within_the_summation_bound(
        ctx, tiled_launches, case, bias, request):
    """dw, and db alongside it (no reduce_sum launch): float32 partial sums, added in order
    and rounded once."""
    xs, ws, p = case
    rng = seeded(request.node.name)
    ins = [tiled_dy(rng, xs, ws, p), bf16_random(rng, *xs)]
    node = node_of("conv2d_grad_weight", ins, weight_shape=ws, bias=bias, **conv_attrs(p))
    want, got = both(ctx, node, ins)
    assert tiled_launches == [conv_tiled.SOURCE] * 2       # the partials, then their sum
    bounds = abs_bound(node, ins)
    assert_near_bits(got[0], want[0], "conv2d_grad_weight dw", max_fraction=TILED_FRACTION,
                     slack=bounds[0])
    if bias:
        assert_near_bits(got[1], want[1], "conv2d_grad_weight db",
                         max_fraction=TILED_DB_FRACTION, slack=bounds[1])


def truncated(wide: np.ndarray) -> np.ndarray:
    """float32 values stored as bf16 without rounding (the upper half of the bits)."""
    return (np.ascontiguousarray(wide, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def rounded_sum(*parts: np.ndarray) -> np.ndarray:
    """bf16 parts added in float32, rounded again: a sum rounded twice."""
    return bf16.to_bits(sum(bf16.from_bits(part) for part in parts))


@pytest.mark.parametrize("case", TILED_CASES[:2], ids=str)
def test_the_tiled_bounds_reject_a_wrong_rounding(case, request):
    """What the three tests above allow fails a kernel that stores its float32 sums unrounded
    or rounds twice (y: the sum, then with the bias, as an epilogue would; dw: each half of
    the batch, then their sum, as bf16 partials would), built here from the emulation: far
    too many elements differ, mostly by one ulp (y rounded twice: some by more than the
    bound, where the bias cancels the sum). Host only."""
    xs, ws, p = case
    rng = seeded(request.node.name)
    x, w, b = bf16_random(rng, *xs), bf16_random(rng, *ws, scale=0.3), bf16_random(rng, ws[0])
    dy, half = tiled_dy(rng, xs, ws, p), xs[0] // 2
    attrs = conv_attrs(p)
    fwd = node_of("conv2d", [x, w, b], **attrs)
    dgrad = node_of("conv2d_grad_input", [dy, w], input_shape=xs, **attrs)
    wgrad = node_of("conv2d_grad_weight", [dy, x], weight_shape=ws, **attrs)
    wgrad_half = node_of("conv2d_grad_weight", [dy[:half], x[:half]], weight_shape=ws, **attrs)
    wrong = {
        "y unrounded": (fwd, [x, w, b], truncated(run_float32(fwd, [x, w, b])[0])),
        "y rounded twice": (fwd, [x, w, b], rounded_sum(
            emulate(node_of("conv2d", [x, w], **attrs), [x, w])[0][0],
            np.broadcast_to(b[None, :, None, None], (xs[0], ws[0], *dy.shape[2:])))),
        "dx unrounded": (dgrad, [dy, w], truncated(run_float32(dgrad, [dy, w])[0])),
        "dw unrounded": (wgrad, [dy, x], truncated(run_float32(wgrad, [dy, x])[0])),
        "dw rounded twice": (wgrad, [dy, x], rounded_sum(
            emulate(wgrad_half, [dy[:half], x[:half]])[0][0],
            emulate(wgrad_half, [dy[half:], x[half:]])[0][0])),
    }
    for what, (node, ins, bad) in wrong.items():
        want = emulate(node, ins)[0][0]
        with pytest.raises(AssertionError, match="elements (differ|off by more)"):
            assert_near_bits(bad, want, what, max_fraction=TILED_FRACTION,
                             slack=abs_bound(node, ins)[0])


# ---- a few bf16 training steps ---------------------------------------------------------------


def twin_steps(make_model, loss, data, memory_format):
    """(numpy, cuda) bf16 steps of one model's two copies; skips, naming them, where ops of
    other families have no bf16 kernels yet."""
    base = make_model()
    steps = []
    for device in ("cpu", "cuda"):
        model = make_model()
        model.load_state_dict(base.state_dict())
        opt = optim.SGD(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
        try:
            steps.append(sg.compile_train_step(model, loss=loss, optimizer=opt,
                                               example_inputs=data[0], device=device,
                                               graph=False, precision="bf16",
                                               memory_format=memory_format))
        except UnsupportedPrecisionError as err:
            pytest.skip(str(err))
    return steps


# A bf16 flip (one 2^-8 relative step on one element, from cuDNN's summation order) in a
# step's activations moves the loss by far less than 1e-2 over three steps; a wrong kernel
# (a layout, index or rounding bug) moves it by more, and the kernel tests above pin the bits.
STEP_LOSS_RTOL, STEP_PARAM_RTOL = 2e-2, 2e-2


def run_twins(cpu, gpu, data):
    for x, y in data:
        lc, lg = float(cpu(x, y)), float(gpu(cp.asarray(x), cp.asarray(y)))
        print(f"loss numpy {lc:.6f} cuda {lg:.6f}")
        assert abs(lg - lc) <= STEP_LOSS_RTOL * abs(lc), (lc, lg)
    assert_params_follow(cpu.model.state_dict(), gpu.model.state_dict(), STEP_PARAM_RTOL)


def assert_params_follow(ref: dict, got: dict, rtol: float) -> None:
    """Each weight (2-D and up) within rtol, and all tensors together within rtol. BatchNorm's
    1-D weight and bias are left to the joint bound: their gradients are channel sums in which
    BN's backward cancels the mean, so after a few steps a bias of ~1e-3 carries the bf16
    noise of the activations at tens of percent (measured on an H100: 0.07 - 0.33)."""
    floats = [k for k in ref if not k.endswith("num_batches_tracked")]
    for k in ref:
        if k.endswith("num_batches_tracked"):
            assert int(got[k]) == int(ref[k]), k
        elif np.ndim(ref[k]) >= 2:
            assert rel(got[k], ref[k]) < rtol, k
    whole = rel(np.concatenate([np.ravel(got[k]) for k in floats]),
                np.concatenate([np.ravel(ref[k]) for k in floats]))
    assert whole < rtol, whole


@needs_cudnn
@pytest.mark.parametrize("memory_format", ["channels_last", "contiguous"])
def test_resnet_bf16_steps_on_cuda_follow_the_emulation(memory_format):
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((16, 3, 16, 16), dtype=np.float32),
             rng.integers(0, 10, 16).astype(np.int32)) for _ in range(3)]
    cpu, gpu = twin_steps(lambda: models.resnet(widths=(8, 16, 32)), ce_smooth, data,
                          memory_format)
    run_twins(cpu, gpu, data)


@needs_cudnn
def test_cnn_bf16_steps_on_cuda_follow_the_emulation():
    rng = np.random.default_rng(1)
    data = [(rng.standard_normal((32, 1, 28, 28), dtype=np.float32),
             rng.integers(0, 10, 32).astype(np.int32)) for _ in range(3)]
    cpu, gpu = twin_steps(models.cnn, F.cross_entropy, data, "contiguous")
    run_twins(cpu, gpu, data)
