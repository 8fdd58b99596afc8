"""The elementwise ops of ops/unary.py and ops/compare.py, the new binary, scalar and cast
kinds, on the GPU against the NumPy reference: each op alone (a one-instruction generated
program, through the launcher table that owns the op) and all of them fused into one program,
float32 and bf16, on fresh random inputs with every output poisoned first (bool outputs with
the byte 7, which no kernel writes)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

from stepgraph.backends.cuda import broadcast, cast, pointwise  # noqa: E402
from stepgraph.backends.numpy import NumpyBackend, bf16  # noqa: E402
from stepgraph.ir.graph import BF16, Node, Value, storage_dtype  # noqa: E402
from stepgraph.ir.ops import infer_outputs  # noqa: E402
from stepgraph.ops.compare import COMPARE_KINDS, LOGICAL_KINDS  # noqa: E402
from stepgraph.ops.unary import UNARY_KINDS  # noqa: E402
from tests.ops.helpers import seeded  # noqa: E402
from tests.unit.test_pointwise_instructions import _fused_node  # noqa: E402

IMPLS = {**broadcast.IMPLS, **cast.IMPLS, **pointwise.IMPLS}
POISON = {"float32": np.nan, "int32": -7, "int64": -7}
BIG, SMALL = (5, 3, 67), (3, 1)      # 1005 elements: not a multiple of 4; a broadcast input


def _inputs(rng, values: list[Value]) -> list[np.ndarray]:
    """Fresh normal inputs in the backends' storage (bf16 as bits), masks and ints of them."""
    arrays = []
    for v in values:
        x = rng.standard_normal(v.shape).astype(np.float32)
        if v.dtype == "bool":
            arrays.append(x > 0)
        elif v.dtype in ("int32", "int64"):
            arrays.append((x * 100).astype(v.dtype))
        elif v.dtype == BF16:
            arrays.append(bf16.to_bits(x))
        else:
            arrays.append(x)
    return arrays


def _poisoned(v: Value):
    if v.dtype == "bool":
        return cp.full(v.shape, 7, np.uint8).view(np.bool_)
    if v.dtype == BF16:
        return cp.full(v.shape, 0x7FC0, np.uint16)          # a NaN
    return cp.full(v.shape, POISON[v.dtype], storage_dtype(v.dtype))


def run_both(ctx, node: Node, arrays: list[np.ndarray]):
    ref = [np.empty(v.shape, storage_dtype(v.dtype)) for v in node.outputs]
    NumpyBackend().run_node(node, [a.copy() for a in arrays], ref)
    with ctx.stream:
        dev_in = [cp.asarray(a) for a in arrays]
        dev_out = [_poisoned(v) for v in node.outputs]
    IMPLS[node.op](node, dev_in, dev_out, ctx)
    ctx.stream.synchronize()
    return ref, [cp.asnumpy(a) for a in dev_out]


def assert_matches(node: Node, ref, got):
    for v, r, g in zip(node.outputs, ref, got):
        what = f"{node.op} {node.attrs.get('kind', '')} -> {v.dtype}"
        if v.dtype == "bool":                   # written 0 or 1, as NumPy
            np.testing.assert_array_equal(g.view(np.uint8), r.view(np.uint8), err_msg=what)
        elif v.dtype in ("int32", "int64"):
            np.testing.assert_array_equal(g, r, err_msg=what)
        else:
            wide = (lambda a: bf16.from_bits(a)) if v.dtype == BF16 else np.asarray
            rtol = 8e-3 if v.dtype == BF16 else 2e-6    # a bf16 ulp; transcendentals' ulps
            assert (np.isnan(wide(g)) == np.isnan(wide(r))).all(), f"{what}: NaNs differ"
            np.testing.assert_allclose(wide(g), wide(r), rtol=rtol, atol=rtol * 1e-3,
                                       err_msg=what)


def lone(op: str, dtypes: tuple[str, ...], **attrs) -> Node:
    """A node of op whose first input broadcasts (SMALL) against the others (BIG)."""
    ins = [Value(BIG if i or len(dtypes) == 1 else SMALL, d) for i, d in enumerate(dtypes)]
    outs = [Value(s, d) for s, d in infer_outputs(op, ins, attrs)]
    return Node(op, ins, outs, attrs)


POSITIVE = ("log", "log1p", "sqrt", "rsqrt")
LONE = {
    **{f"unary-{k}": ("unary", 1, dict(kind=k)) for k in UNARY_KINDS},
    **{f"binary-{k}": ("binary", 2, dict(kind=k)) for k in ("pow", "maximum", "minimum")},
    **{f"scalar-{k}": ("scalar", 1, dict(kind=k, value=0.6))
       for k in ("rpow", "maximum", "minimum")},
    **{f"compare-{k}": ("compare", 2, dict(kind=k)) for k in COMPARE_KINDS},
    **{f"compare_scalar-{k}": ("compare_scalar", 1, dict(kind=k, value=0.25))
       for k in COMPARE_KINDS},
    **{f"logical-{k}": ("logical", 2, dict(kind=k)) for k in LOGICAL_KINDS},
    "logical_not": ("logical_not", 1, {}),
    "where": ("where", 3, {}),
    "masked_fill": ("masked_fill", 2, dict(value=float("-inf"))),
}


def _dtypes(op: str, arity: int, dtype: str) -> tuple[str, ...]:
    if op in ("logical", "logical_not"):
        return ("bool",) * arity
    if op == "where":
        return ("bool", dtype, dtype)
    if op == "masked_fill":
        return (dtype, "bool")
    return (dtype,) * arity


@pytest.mark.parametrize("dtype", ["float32", BF16])
@pytest.mark.parametrize("case", LONE)
def test_each_op_alone(ctx, case, dtype):
    op, arity, attrs = LONE[case]
    node = lone(op, _dtypes(op, arity, dtype), **attrs)
    rng = seeded(f"{case}{dtype}")
    arrays = _inputs(rng, node.inputs)
    if attrs.get("kind") in POSITIVE or op == "binary":      # a power's base: positive
        arrays[0] = bf16.to_bits(np.abs(bf16.from_bits(arrays[0])) + 0.1) if dtype == BF16 \
            else np.abs(arrays[0]) + 0.1
    assert_matches(node, *run_both(ctx, node, arrays))


@pytest.mark.parametrize("src, dst", [("float32", "int64"), ("float32", "int32"),
                                      ("float32", "bool"), ("bool", "float32"),
                                      ("int64", "float32"), ("int32", BF16), (BF16, "bool"),
                                      ("bool", BF16)])
def test_casts_to_and_from_ints_and_bool(ctx, src, dst):
    node = lone("cast", (src,), dtype=dst)
    arrays = _inputs(seeded(f"cast{src}{dst}"), node.inputs)
    assert_matches(node, *run_both(ctx, node, arrays))


@pytest.mark.parametrize("dtype", ["float32", BF16])
def test_every_instruction_fused_in_one_program(ctx, dtype):
    """The program of tests/unit/test_pointwise_instructions.py (every new instruction, bool
    results among its outputs) as one generated kernel."""
    node = _fused_node(dtype)
    rng = seeded(f"fused{dtype}")
    for _ in range(2):              # fresh inputs, the same kernel (NaNs of logs where z < 0)
        assert_matches(node, *run_both(ctx, node, _inputs(rng, node.inputs)))



def test_masked_model_trains_as_on_numpy_and_replays_bit_for_bit():
    """A model using the new ops (tests/ops/test_pointwise_ops.py MaskedNet): cuda eager
    against numpy over 5 steps of fresh data, then a graph replay against eager bit for bit,
    the captured step holding exactly its ops' kernels."""
    import stepgraph as sg
    from tests.cuda.test_step_cuda import assert_replay_matches_eager
    from tests.ops.test_pointwise_ops import MaskedNet

    base = MaskedNet()
    rng = seeded("masked-steps")
    data = [(rng.standard_normal((32, 6)).astype(np.float32), rng.integers(0, 3, 32))
            for _ in range(5)]

    def step(device):
        model = MaskedNet()
        model.load_state_dict(base.state_dict())
        return sg.compile_train_step(model, loss=sg.losses.cross_entropy,
                                     optimizer=sg.optim.SGD(lr=0.5), example_inputs=data[0],
                                     device=device, graph=False)

    reference, eager = step("cpu"), step("cuda")
    for x, y in data:
        want, got = float(reference(x, y)), float(eager(x, y))
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    ops = assert_replay_matches_eager(step("cuda"), step("cuda"), data)
    assert "pointwise" in ops
