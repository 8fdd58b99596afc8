"""conv_nhwc.py's small channels-last weight gradient (the "small" conv path: few input taps,
a vision network's stem) against the float64 NumPy reference, float32 and bf16 storage, on
fresh inputs with poisoned outputs, each run twice for the same bits: the stem's geometry, a
strided 5x5 one-channel conv (four tap groups, zero-padded patch rows), 256 output channels
(one lane), 12 output channels (threads left idle) and a 1x1 conv; the path forced through
conv.py with db."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.cuda
cp = pytest.importorskip("cupy")

from stepgraph.backends import cuda_available  # noqa: E402

if not cuda_available():
    pytest.skip("no GPU visible to CuPy", allow_module_level=True)

from stepgraph.backends.cuda import conv, conv_nhwc  # noqa: E402
from stepgraph.backends.cuda.conv import Geometry  # noqa: E402
from stepgraph.backends.numpy import bf16  # noqa: E402
from stepgraph.backends.numpy.kernels import IMPLS as NUMPY_IMPLS  # noqa: E402
from tests.cuda.helpers import make_node  # noqa: E402

# Geometry(n, c, h, w, o, kh, kw, sh, sw, ph, pw)
GEOMETRIES = [Geometry(8, 3, 32, 32, 64, 3, 3, 1, 1, 1, 1),     # the resnet stem
              Geometry(3, 1, 12, 10, 4, 5, 5, 2, 2, 2, 2),
              Geometry(2, 3, 9, 7, 256, 3, 3, 1, 1, 1, 1),
              Geometry(2, 2, 7, 9, 12, 3, 3, 2, 1, 0, 1),
              Geometry(4, 4, 6, 6, 8, 1, 1, 1, 1, 0, 0)]
IDS = [f"c{g.c}-o{g.o}-k{g.kh}{g.kw}-s{g.sh}{g.sw}-p{g.ph}{g.pw}" for g in GEOMETRIES]
STORAGE = {"float32": np.float32, "bf16": np.uint16}


def stored(values: np.ndarray, storage: str) -> np.ndarray:
    """values as float32, or as bf16 bits (rounded to nearest even)."""
    return values.astype(np.float32) if storage == "float32" else bf16.to_bits(values)


def widened(a: np.ndarray) -> np.ndarray:
    return (bf16.from_bits(a) if a.dtype == np.uint16 else a).astype(np.float64)


def reference(op: str, g: Geometry, arrays: list[np.ndarray]) -> np.ndarray:
    """The NumPy reference (float64, channels-last) of the forward or the weight gradient."""
    attrs = dict(stride=(g.sh, g.sw), padding=(g.ph, g.pw), layout="NHWC")
    if op == "conv2d_grad_weight":
        attrs["weight_shape"] = (g.o, g.kh, g.kw, g.c)
    node = make_node(op, [np.zeros(a.shape, np.float32) for a in arrays], **attrs)
    out = np.full(node.outputs[0].shape, np.nan)
    NUMPY_IMPLS[op](node, [widened(a) for a in arrays], [out], None)
    return out


def check(got: cp.ndarray, want: np.ndarray, storage: str, what: str) -> None:
    host = widened(cp.asnumpy(got))
    assert np.isfinite(host).all(), f"{what}: not every element written"
    # float32: FMA sums in another order; bf16: one rounding of the float32 sum (2^-8)
    rtol = 1e-5 if storage == "float32" else 2 ** -8
    bound = rtol * np.abs(want) + 1e-5 * np.abs(want).max()
    assert (np.abs(host - want) <= bound).all(), \
        f"{what}: max error {np.abs(host - want).max():.3e}"


def run_twice(launch, out: cp.ndarray) -> cp.ndarray:
    """launch() into a poisoned out, twice: the same bits both times."""
    results = []
    for _ in range(2):
        out.fill(0x7FC0 if out.dtype == np.uint16 else np.nan)
        launch()
        results.append(out.copy())
    cp.testing.assert_array_equal(results[0], results[1])
    return results[0]


class Ctx:
    stream = cp.cuda.Stream.null


@pytest.mark.parametrize("storage", list(STORAGE))
@pytest.mark.parametrize("g", GEOMETRIES, ids=IDS)
def test_small_grad_weight(g, storage):
    assert conv_nhwc.unsupported(g, "NHWC", np.dtype(STORAGE[storage])) is None
    rng = np.random.default_rng([g.c, g.o, g.kh, g.sh, len(storage)])
    x = stored(rng.standard_normal((g.n, g.h, g.w, g.c)), storage)
    dy = stored(rng.standard_normal((g.n, g.ho, g.wo, g.o)), storage)
    dev_x, dev_dy = cp.asarray(x), cp.asarray(dy)
    blocks, _ = conv_nhwc.grad_weight_split(g)
    partial = cp.empty(blocks * g.o * g.ck, np.float32)
    dw = cp.empty((g.o, g.kh, g.kw, g.c), x.dtype)
    got = run_twice(
        lambda: conv_nhwc.conv2d_small_grad_weight(Ctx, g, dev_dy, dev_x, dw, partial), dw)
    check(got, reference("conv2d_grad_weight", g, [dy, x]), storage, f"dw {g} {storage}")


def test_small_path_through_conv_with_bias(backend, monkeypatch):
    """conv.PATH "small" forces the path: the weight gradient with db."""
    monkeypatch.setattr(conv, "PATH", "small")
    ctx = backend.make_context("fp32")
    g = GEOMETRIES[0]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((g.n, g.h, g.w, g.c)).astype(np.float32)
    dy = rng.standard_normal((g.n, g.ho, g.wo, g.o)).astype(np.float32)
    w_shape = (g.o, g.kh, g.kw, g.c)
    node = make_node("conv2d_grad_weight", [dy, x], weight_shape=w_shape, bias=True,
                     stride=(1, 1), padding=(1, 1), layout="NHWC")
    with ctx.stream:
        outs = [cp.full(w_shape, np.nan, np.float32), cp.full(g.o, np.nan, np.float32)]
    conv.IMPLS["conv2d_grad_weight"](node, [cp.asarray(dy), cp.asarray(x)], outs, ctx)
    check(outs[0], reference("conv2d_grad_weight", g, [dy, x]), "float32", "dw")
    check(outs[1], dy.astype(np.float64).sum(axis=(0, 1, 2)), "float32", "db")
