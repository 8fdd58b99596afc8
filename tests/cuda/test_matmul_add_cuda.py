"""matmul with add_c (compile/matmul_add.py: a sum that read a product alone) on the GPU:
op(a) @ op(b) + c on each path (cuBLASLt's C with beta = 1, the small kernel, the tiled kernel
with and without k splits, the autotuned choice), every transpose, judged against a float64
(float80 for float64 results) reference by the tolerance policy (tests/reference.py: a small
multiple of torch float32's error on the same problem); c is only read, so the autotuner's
timed calls leave the same result; and a two-branch MLP's steps replayed from a CUDA graph
equal its eager steps bit for bit. Fresh random inputs, outputs poisoned first."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda
cp = require_gpu("nvmath")

import torch  # noqa: E402

import stepgraph as sg  # noqa: E402
from stepgraph import losses, optim  # noqa: E402
from stepgraph.backends import get_backend  # noqa: E402
from stepgraph.backends.cuda.matmul import gemm, linear, small_matmul  # noqa: E402
from tests.cuda import helpers  # noqa: E402
from tests.cuda.helpers import make_node, random  # noqa: E402
from tests.cuda.test_step_cuda import assert_replay_matches_eager  # noqa: E402
from tests.reference import assert_close_to_reference  # noqa: E402
from tests.unit.test_matmul_add import TwoBranchMLP  # noqa: E402

SHAPES = [(1, 1, 1), (7, 130, 5), (33, 17, 9), (5, 300, 7), (128, 512, 256), (300, 64, 200)]


@pytest.fixture(scope="module")
def ctx():
    return get_backend("cuda").make_context("fp32")


@pytest.fixture(params=["small", "cublaslt", "tile", "tile:s4", "auto"])
def path(request, monkeypatch):
    """Forces one of matmul_forward's paths ("auto": the small kernel where it applies, else
    the autotuner's choice)."""
    name = request.param
    if name != "auto":
        monkeypatch.setattr(small_matmul, "SMALL_MACS", 1 << 40 if name == "small" else 0)
        monkeypatch.setattr(linear, "PATH", "auto" if name == "small" else name.split(":")[0])
    if name == "tile:s4":
        monkeypatch.setattr(linear, "tile_splits", lambda m, n, k: [4])
    return name


def operands(shape, trans, dtype="float32"):
    m, k, n = shape
    rng = np.random.default_rng([m, k, n, *map(int, trans), int(dtype == "float64")])
    a = random(rng, *((k, m) if trans[0] else (m, k)), dtype=dtype)
    b = random(rng, *((n, k) if trans[1] else (k, n)), dtype=dtype)
    return a, b, random(rng, m, n, dtype=dtype)


def references(a, b, c, trans, wide=np.float64):
    """(op(a) @ op(b) + c in `wide`, the same in torch float32)."""
    op = [x.T if t else x for x, t in zip((a, b), trans)]
    ref = op[0].astype(wide) @ op[1].astype(wide) + c.astype(wide)
    t32 = [torch.from_numpy(np.ascontiguousarray(x, np.float32)) for x in (*op, c)]
    return ref, (t32[0] @ t32[1] + t32[2]).numpy()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("trans", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["nn", "tn", "nt", "tt"])
def test_add_c_is_the_product_plus_c(ctx, path, shape, trans):
    if path == "tile:s4" and shape[1] < 128:
        pytest.skip("four k splits need k >= 128")
    a, b, c = operands(shape, trans)
    node = make_node("matmul", [a, b, c], trans_a=trans[0], trans_b=trans[1], add_c=True)
    (got,) = helpers.run_cuda(ctx, node, [a, b, c], linear.IMPLS)
    ref64, ref32 = references(a, b, c, trans)
    assert_close_to_reference(got, ref64, ref32, f"{path} {shape} {trans}")


@pytest.mark.parametrize("trans", [(False, False), (True, True)], ids=["nn", "tt"])
def test_add_c_in_float64(ctx, trans):
    a, b, c = operands((65, 129, 33), trans, "float64")
    node = make_node("matmul", [a, b, c], trans_a=trans[0], trans_b=trans[1], add_c=True)
    (got,) = helpers.run_cuda(ctx, node, [a, b, c], linear.IMPLS)
    ref, ref32 = references(a, b, c, trans, np.longdouble)
    assert_close_to_reference(got, np.asarray(ref, np.float64), ref32, "float64",
                              precision=np.float64)


def test_the_autotuned_gemm_reads_c_and_leaves_it(ctx):
    """A spec adding a separate C is timed like any other (its timed calls all write the same
    D), and C is the same after the call: the result is one product plus c."""
    a, b, c = operands((512, 512, 384), (False, True))
    with ctx.stream:
        da, db, dc = (cp.asarray(x) for x in (a, b, c))
        out = cp.full(c.shape, np.nan, np.float32)
    gemm.matmul(ctx, da, db, out, trans_b=True, addend=dc)
    spec = gemm.matmul_spec(da, db, out, trans_b=True, addend=dc, precision=ctx.precision)
    planned = ctx.gemm.plan(spec)
    assert spec.add_c and (planned.tuned or len(planned.heuristic) == 1)
    got, c_after = helpers.to_host(ctx, [out, dc])
    np.testing.assert_array_equal(c_after, c)
    ref64, ref32 = references(a, b, c, (False, True))
    assert_close_to_reference(got, ref64, ref32, "autotuned add_c")
    gemm.matmul(ctx, da, db, out, trans_b=True, addend=dc)       # tuned: the same algorithm
    np.testing.assert_array_equal(helpers.to_host(ctx, [out])[0], got)


@pytest.mark.parametrize("x_shape", [(128, 128), (8, 16, 128)], ids=["2d", "3d"])
def test_a_two_branch_mlp_replays_its_eager_steps(x_shape):
    """h = relu(Linear(x)) read by two Linears: h's gradient is one GEMM adding the other
    Linear's input gradient (through the (B, T, C) views for 3-D x). Large enough (128 x 64
    x 512) that the GEMM is cuBLASLt's or the tiled kernel's, not the small kernel's. Six
    batches: the first compiles, five are replayed."""
    rng = np.random.default_rng(list(x_shape))
    make = lambda: TwoBranchMLP(x_shape[-1], 512, 64)        # noqa: E731
    base = make()
    data = [(random(rng, *x_shape), random(rng, *x_shape[:-1], 64)) for _ in range(6)]
    twins = []
    for graph in (False, True):
        model = make()
        model.load_state_dict(base.state_dict())
        twins.append(sg.compile_train_step(model, loss=losses.mse,
                                           optimizer=optim.SGD(lr=0.05, momentum=0.9),
                                           example_inputs=data[0], device="cuda", graph=graph))
    eager, replayed = twins
    assert_replay_matches_eager(eager, replayed, data[1:])
    (exe,) = replayed.executables.values()
    fused = [node for node, _, _ in exe.calls if node.op == "matmul" and node.attrs.get("add_c")]
    assert len(fused) == 1
    for k, v in base.state_dict().items():
        assert not np.array_equal(v, replayed.model.state_dict()[k]), f"{k} was not updated"
