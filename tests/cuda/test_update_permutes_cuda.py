"""The optimizer updates reading channels-last gradients and writing channels-last weight copies
(bf16, or float32: compile/weight_permutes.py) in their own launch (include/update.cuh update_slices; compile/update_permutes.py): every
optimizer, float32 and bf16 gradients, slices from a few elements to the tile's size, several
slices a block and one slice over many threads, against the numpy backend on fresh random
inputs; and bit for bit against the same update fed the gradients in the parameter's order,
which does the same arithmetic. A whole channels-last step trains as with the permutes (of the
gradients, or of the float32 weights), and its graph replays as its eager run."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

cp = require_gpu()

import stepgraph as sg  # noqa: E402
from stepgraph import api, optim  # noqa: E402
from stepgraph.compile import build  # noqa: E402
from stepgraph.backends.numpy import NumpyBackend, bf16  # noqa: E402
from stepgraph.ir.graph import BF16, Node, Value  # noqa: E402
from stepgraph.ir.ops import OPS  # noqa: E402
from tests.cuda.helpers import update_hyperparameters  # noqa: E402
from tests.ops.helpers import seeded  # noqa: E402
from tests.unit.test_update_permutes import ConvNet, batches, gradient_permutes  # noqa: E402
from tests.unit.test_weight_permutes import weight_permutes  # noqa: E402

KRSC = (0, 2, 3, 1)
# (O, C, kh, kw): 5x5 slices of 3 channels, many a block; 3x3 of 32; one ragged 7x7 slice of
# 13; the largest 3x3 slice the tile holds (1,024 channels, one a block); a 7x7 slice of 249
# channels, 49 x 250 of the tile's 12,288 floats
SHAPES = [(6, 3, 5, 5), (64, 32, 3, 3), (5, 13, 7, 7), (3, 1024, 3, 3), (2, 249, 7, 7)]
FORMULAS = {
    "sgd_update": (1, dict(momentum=0.9, dampening=0.0, weight_decay=5e-4, nesterov=True)),
    "adam_update": (2, dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                            decoupled=True)),
    "rmsprop_update": (2, dict(alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.9,
                               centered=False)),
    "adagrad_update": (1, dict(weight_decay=0.0, lr_decay=0.0, eps=1e-10)),
}


def update_node(op, grads, grad_dims, copy_dims, step=1, copy_dtype=BF16):
    """The update of SHAPES' parameters (fresh values, slots) from `grads` given transposed by
    grad_dims, each with a copy (bf16 or float32) transposed by copy_dims (poisoned), and its
    inputs."""
    n_slots, formula = FORMULAS[op]
    attrs, hyper = update_hyperparameters(op, formula, len(SHAPES))
    rng = seeded(f"update permutes {op}")
    params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    slots = [np.abs(rng.standard_normal(s)).astype(np.float32) * 0.1
             for _ in range(n_slots) for s in SHAPES]
    poison = np.uint16(0x7FA1) if copy_dtype == BF16 else np.float32(np.nan)
    copies = [np.full(tuple(s[d] for d in KRSC) if copy_dims else s, poison) for s in SHAPES]
    arrays = [np.array(1e-2, np.float32), np.array(step, np.int64), hyper, *params, *grads,
              *slots, *copies]
    values = [Value(a.shape, BF16 if a.dtype == np.uint16 else str(a.dtype)) for a in arrays]
    n = len(SHAPES)
    attrs.update(n_params=n, n_scalars=3, n_slots=n_slots, max_norm=None,
                 copies=tuple(range(n)))
    if copy_dims:
        attrs["copy_dims"] = (KRSC,) * n
    if grad_dims:
        attrs["grad_dims"] = (KRSC,) * n
    return Node(op, values, [], attrs, OPS[op].mutates(attrs)), arrays


def run_cuda(backend, ctx, node, arrays):
    with ctx.stream:
        dev = [cp.asarray(a) for a in arrays]
    backend.impls[node.op](node, dev, [], ctx)
    ctx.stream.synchronize()
    return [cp.asnumpy(a) for a in dev]


def gradients(grad_dtype):
    rng = seeded(f"update permutes grads {grad_dtype}")
    grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    return [bf16.to_bits(g) for g in grads] if grad_dtype == BF16 else grads


@pytest.mark.parametrize("copy_dtype", [BF16, "float32"])
@pytest.mark.parametrize("grad_dtype", ["float32", BF16])
@pytest.mark.parametrize("op", list(FORMULAS))
def test_update_reads_transposed_gradients_and_writes_transposed_copies(backend, ctx, op,
                                                                        grad_dtype, copy_dtype):
    plain_grads = gradients(grad_dtype)
    node, arrays = update_node(op, [g.transpose(KRSC).copy() for g in plain_grads], True, True,
                               copy_dtype=copy_dtype)
    rounded = bf16.to_bits if copy_dtype == BF16 else (lambda a: a)
    got = run_cuda(backend, ctx, node, arrays)
    want = [a.copy() for a in arrays]
    NumpyBackend().run_node(node, want, [])
    n, k = len(SHAPES), 3
    for i in [*range(k, k + n), *range(k + 2 * n, len(arrays) - n)]:
        np.testing.assert_allclose(got[i], want[i], rtol=1e-6, atol=1e-7, err_msg=f"input {i}")
    for j in range(n):      # each copy (poisoned before): the device's new parameter, rounded
        np.testing.assert_array_equal(got[len(arrays) - n + j],
                                      rounded(got[k + j].transpose(KRSC)))
    # the same update given the gradients in the parameter's order, copies in its order
    node, arrays = update_node(op, plain_grads, False, False)
    plain = run_cuda(backend, ctx, node, arrays)
    for i in [*range(k, k + n), *range(k + 2 * n, len(arrays) - n)]:
        np.testing.assert_array_equal(got[i], plain[i], err_msg=f"input {i}")
    for j in range(n if copy_dtype == BF16 else 0):
        np.testing.assert_array_equal(got[len(arrays) - n + j],
                                      plain[len(arrays) - n + j].reshape(SHAPES[j])
                                      .transpose(KRSC))


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_channels_last_step_trains_as_with_the_permutes(precision, monkeypatch):
    """A conv net's CUDA step with the update reading the gradients channels-last (and at tf32
    writing the convolutions' transposed float32 weights), and the same step built with the
    permutes of either, train the same bits; graph replay == eager."""
    data = batches(n=8, size=16)
    sg.nn.manual_seed(0)
    start = ConvNet(width=32).state_dict()
    runs = []
    for fused, copied, graph in ((True, True, True), (True, True, False), (False, True, True),
                                 (True, False, True)):
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(api, "read_gradients_through_permutes", lambda g: g)
            if not copied:
                patch.setattr(build, "bind_permuted_weights", lambda g, copied: [])
            model = ConvNet(width=32)
            model.load_state_dict(start)
            step = sg.compile_train_step(model, sg.nn.functional.cross_entropy,
                                         optim.SGD(lr=0.1, momentum=0.9), example_inputs=data[0],
                                         device="cuda", precision=precision, graph=graph,
                                         memory_format="channels_last")
            losses = [float(step(x, y)) for x, y in data]
            nodes = step.executable(step.signature).plan.graph.nodes
            assert bool(gradient_permutes(nodes)) == (not fused)
            assert bool(weight_permutes(nodes)) == (precision == "tf32" and not copied)
            runs.append((losses, {k: np.asarray(v) for k, v in model.state_dict().items()}))
    for losses, state in runs[1:]:
        assert losses == runs[0][0]
        for k, v in state.items():
            np.testing.assert_array_equal(v, runs[0][1][k], err_msg=k)
