"""cuda vs numpy for the lstm_cell family (backends/cuda/lstm_cell.cu): the forward with two
addends and with one, the backward with dh' (one or two terms) and dc', either alone, at
shapes whose
B * H is not a multiple of the block; fresh random inputs, cuda outputs poisoned first."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

require_gpu()

import stepgraph  # noqa: E402,F401  (registers the op families)
from tests.cuda.helpers import assert_close, make_node, random, run_both  # noqa: E402

SHAPES = [(1, 1), (3, 7), (64, 512), (5, 300)]


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("fp32")


@pytest.mark.parametrize("addends", [2, 1])
@pytest.mark.parametrize("batch,hidden", SHAPES)
def test_lstm_cell_forward(ctx, impls, batch, hidden, addends):
    rng = np.random.default_rng([batch, hidden, addends])
    ins = [random(rng, batch, 4 * hidden, scale=2.0) for _ in range(addends)]
    ins.append(random(rng, batch, hidden))
    ref, got = run_both(ctx, make_node("lstm_cell", ins), ins, impls)
    for what, g, r in zip(("h'", "c'", "gates"), got, ref):
        assert_close(g, r, rtol=1e-5, atol=1e-6, what=what, all_finite=True)


@pytest.mark.parametrize("dh,dc", [(2, True), (1, True), (1, False), (0, True), (2, False)],
                         ids=["dh2_dc", "dh_dc", "dh", "dc", "dh2"])
@pytest.mark.parametrize("batch,hidden", SHAPES)
def test_lstm_cell_backward(ctx, impls, batch, hidden, dh, dc):
    rng = np.random.default_rng([batch, hidden, dh, dc, 1])
    pre = [random(rng, batch, 4 * hidden, scale=2.0), random(rng, batch, 4 * hidden)]
    c = random(rng, batch, hidden)
    _, c_new, gates = run_both(ctx, make_node("lstm_cell", [*pre, c]), [*pre, c], impls)[0]
    grads = [random(rng, batch, hidden) for _ in range(dh + dc)]
    ins = [*grads, gates, c, c_new]
    node = make_node("lstm_cell_grad", ins, dh=dh, dc=dc)
    ref, got = run_both(ctx, node, ins, impls)
    for what, g, r in zip(("d(pre)", "dc"), got, ref):
        assert_close(g, r, rtol=1e-5, atol=1e-6, what=what, all_finite=True)
