"""cuda vs numpy for the `constant` op (an eager tensor used in a traced forward): every
tensor dtype, outputs poisoned first; a captured graph replays the values with no upload of
its own; a compiled predict on the GPU that reads a constant, a fill and an arange equals the
CPU one."""
from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.gpu import require_gpu

pytestmark = pytest.mark.cuda

require_gpu("nvmath")

import stepgraph as torch  # noqa: E402
from stepgraph import nn  # noqa: E402
from stepgraph.ir.trace import Constant  # noqa: E402
from tests.cuda.helpers import capture, make_node, poisoned, run_both, to_host  # noqa: E402


@pytest.fixture(scope="module")
def ctx(backend):
    return backend.make_context("fp32")


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32", "uint8"])
@pytest.mark.parametrize("shape", [(), (1,), (7, 5), (3, 1, 33)])
def test_constant(ctx, impls, shape, dtype):
    rng = np.random.default_rng([331, len(shape)])
    values = (rng.standard_normal(shape) * 50 + 3).astype(dtype)
    node = make_node("constant", [], data=Constant(values), dtype=dtype)
    ref, got = run_both(ctx, node, [], impls)
    np.testing.assert_array_equal(got[0], values)
    np.testing.assert_array_equal(ref[0], values)


def test_constant_replays_in_a_captured_graph(ctx, impls):
    values = np.random.default_rng(337).standard_normal((64, 9)).astype("float32")
    node = make_node("constant", [], data=Constant(values), dtype="float32")
    out = poisoned(ctx, node)
    impls["constant"](node, [], out, ctx)                      # eager: uploads once
    np.testing.assert_array_equal(to_host(ctx, out)[0], values)
    with ctx.stream:       # the poison lands before the replay, on the replay's stream
        out[0].fill(np.nan)
    graph = capture(ctx, lambda: impls["constant"](node, [], out, ctx))
    for _ in range(3):
        with ctx.stream:
            out[0].fill(np.nan)
        graph.launch(ctx.stream)
        np.testing.assert_array_equal(to_host(ctx, out)[0], values)


class _Offsets(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.offset = torch.randn(6)

    def forward(self, x):
        return self.lin(x) * self.offset + torch.ones(6) + torch.arange(6, dtype=torch.float32)


def test_predict_with_factories_matches_cpu():
    model = _Offsets()
    x = np.random.default_rng(347).standard_normal((5, 6)).astype("float32")
    cpu = np.asarray(torch.compile_predict(model, example_inputs=(x,), device="cpu")(x))
    gpu = torch.compile_predict(model, example_inputs=(x,), device="cuda", graph=True)
    for _ in range(5):
        np.testing.assert_allclose(torch.to_numpy(gpu(x)), cpu, rtol=1e-5, atol=1e-6)
