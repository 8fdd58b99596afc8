"""Indexing, joining, reductions along a dim and scans (ops/index.py, ops/reduce_axis.py, the
Tensor methods and torch-level functions of part D) against torch.

Each case is one function applied to both sides, with T the stepgraph or the torch module:
the forward and every float input's gradient (through the real autodiff; loss = mse against
a random target for non-scalar outputs) must match torch autograd in float64 and float32,
unfused and through the fusion passes. Integer results (indices) are compared exactly.
Finite-difference checks of the new VJP rules are in test_ops_fd.py.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import stepgraph
from stepgraph.errors import ShapeError, UnsupportedOpError
from stepgraph.ir.trace import Tracer
from tests.ops.helpers import (assert_matches_torch, case_arrays, randn, run_graph, seeded,
                               trace_inputs)

DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
FUSED = pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
RTOL = {np.float64: 1e-10, np.float32: 2e-5}


def x3(g, t):
    return {"x": randn(g, 3, 4, 5, dtype=t)}


def ints(g, high, *shape):
    return g.integers(0, high, shape).astype(np.int64)


# name -> (fn(T, **tensors) -> float tensor, inputs(gen, dtype) -> arrays); float inputs are
# differentiated, integer inputs are indices.
CASES = {
    # indexing
    "index-int": (lambda T, x: x[1], x3),
    "index-neg-int": (lambda T, x: x[:, -1, :], x3),
    "index-col": (lambda T, x: x[:, 0], x3),
    "index-step": (lambda T, x: x[..., ::2], x3),
    "index-step-range": (lambda T, x: x[1:, 1:4:2, -4:-1], x3),
    "index-none": (lambda T, x: x[:, None] * 2.0, x3),
    "index-mixed": (lambda T, x: x[None, -2, ..., 1:, None, 3], x3),
    "index-ellipsis-int": (lambda T, x: x[..., 2], x3),
    "index-tensor-rows": (lambda T, w, i: w[i], lambda g, t: {"w": randn(g, 6, 3, dtype=t),
                                                                "i": ints(g, 6, 2, 4)}),
    "index-tensor-middle": (lambda T, x, i: x[:, i], lambda g, t: {**x3(g, t),
                                                                   "i": ints(g, 4, 5)}),
    "index-tensor-int-beside": (lambda T, x, i: x[1:, 2, i], lambda g, t: {**x3(g, t),
                                                                        "i": ints(g, 5, 2, 3)}),
    "index-int-tensor-beside": (lambda T, x, i: x[-1, i, ::2], lambda g, t: {**x3(g, t),
                                                                          "i": ints(g, 4, 3)}),
    "index_select": (lambda T, x, i: T.index_select(x, -1, i), lambda g, t: {**x3(g, t),
                                                                           "i": ints(g, 5, 7)}),
    "iter": (lambda T, x: T.cat([r * float(i + 1) for i, r in enumerate(x)], -1), x3),
    # shapes
    "unsqueeze-neg": (lambda T, x: x.unsqueeze(-1) * 2.0, x3),
    "squeeze-all": (lambda T, x: x.squeeze() * 2.0,
                    lambda g, t: {"x": randn(g, 3, 1, 5, 1, dtype=t)}),
    "squeeze-dims": (lambda T, x: x.squeeze((1, 2)) * 2.0,
                     lambda g, t: {"x": randn(g, 3, 1, 5, 1, dtype=t)}),
    "T.squeeze-dim": (lambda T, x: T.squeeze(x, -1) * 2.0,
                      lambda g, t: {"x": randn(g, 3, 1, 5, 1, dtype=t)}),
    "expand": (lambda T, x: x.expand(2, -1, 4), lambda g, t: {"x": randn(g, 3, 1, dtype=t)}),
    "expand_as": (lambda T, x, y: x.expand_as(y) * y,
                  lambda g, t: {"x": randn(g, 1, 5, dtype=t), "y": randn(g, 3, 5, dtype=t)}),
    "repeat": (lambda T, x: x.repeat(2, 1, 3), lambda g, t: {"x": randn(g, 3, 2, dtype=t)}),
    "unflatten": (lambda T, x: x.unflatten(-1, (2, -1)) * 2.0,
                  lambda g, t: {"x": randn(g, 3, 6, dtype=t)}),
    "view_as": (lambda T, x, y: x.view_as(y) + y,
                lambda g, t: {"x": randn(g, 3, 4, dtype=t), "y": randn(g, 2, 6, dtype=t)}),
    "movedim": (lambda T, x: T.movedim(x, (0, 1), (2, 0)), x3),
    "swapaxes": (lambda T, x: T.swapaxes(x, 0, -1), x3),
    "T.flatten": (lambda T, x: T.flatten(x, 1), x3),
    "unbind": (lambda T, x: x.unbind(1)[2] * 2.0, x3),
    "T.unbind-neg": (lambda T, x: T.cat(T.unbind(x, -1)[::2], 0), x3),
    # joining
    "cat-neg-dim": (lambda T, a, b: T.cat([a, b], dim=-1),
                    lambda g, t: {"a": randn(g, 2, 3, dtype=t), "b": randn(g, 2, 5, dtype=t)}),
    "concat-3": (lambda T, a, b: T.concat((a, b, a), 0),
                 lambda g, t: {"a": randn(g, 2, 3, dtype=t), "b": randn(g, 1, 3, dtype=t)}),
    "stack": (lambda T, a, b: T.stack([a, b]), lambda g, t: {"a": randn(g, 2, 3, dtype=t),
                                                              "b": randn(g, 2, 3, dtype=t)}),
    "stack-neg": (lambda T, a, b: T.stack([a, b], dim=-1),
                  lambda g, t: {"a": randn(g, 2, 3, dtype=t), "b": randn(g, 2, 3, dtype=t)}),
    # triangles
    "tril": (lambda T, x: x.tril(), x3),
    "triu-diag": (lambda T, x: T.triu(x, diagonal=1), x3),
    "tril-neg-diag": (lambda T, x: T.tril(x, -1), lambda g, t: {"x": randn(g, 5, 3, dtype=t)}),
    # max / min
    "max-all": (lambda T, x: x.max(), x3),
    "min-all": (lambda T, x: T.min(x), x3),
    "max-dim": (lambda T, x: x.max(1).values, x3),
    "max-dim-keepdim": (lambda T, x: T.max(x, -1, keepdim=True)[0], x3),
    "min-dim": (lambda T, x: x.min(dim=0).values, x3),
    "amax-dims": (lambda T, x: x.amax((0, 2)), x3),
    "amin-keepdim": (lambda T, x: T.amin(x, -1, keepdim=True), x3),
    "amax-ties": (lambda T, x: (x * 0.0 + 1.0).amax(1) * x.sum(), x3),
    "maximum": (lambda T, a, b: T.maximum(a, b),
                lambda g, t: {"a": randn(g, 3, 4, dtype=t), "b": randn(g, 4, dtype=t)}),
    "minimum": (lambda T, a, b: T.minimum(a, b),
                lambda g, t: {"a": randn(g, 3, 4, dtype=t), "b": randn(g, 3, 4, dtype=t)}),
    "max-tensor": (lambda T, a, b: a.max(b),
                   lambda g, t: {"a": randn(g, 3, 4, dtype=t), "b": randn(g, 3, 4, dtype=t)}),
    # statistics
    "var-all": (lambda T, x: x.var(), x3),
    "var-dim": (lambda T, x: x.var(1), x3),
    "var-biased-keepdim": (lambda T, x: T.var(x, -1, unbiased=False, keepdim=True), x3),
    "var-correction-dims": (lambda T, x: x.var((0, 2), correction=2), x3),
    "std-dim": (lambda T, x: x.std(dim=-1), x3),
    "std-all": (lambda T, x: T.std(x), x3),
    "logsumexp": (lambda T, x: x.logsumexp(-1), lambda g, t: {"x": 3 * randn(g, 3, 4, 5,
                                                                              dtype=t)}),
    "logsumexp-dims-keepdim": (lambda T, x: T.logsumexp(x, (0, 2), keepdim=True), x3),
    # scans, gather, topk
    "cumsum": (lambda T, x: x.cumsum(-1), x3),
    "cumsum-dim0": (lambda T, x: T.cumsum(x, 0), x3),
    "gather": (lambda T, x, i: x.gather(1, i), lambda g, t: {**x3(g, t), "i": ints(g, 4, 3, 6, 5)}),
    "gather-small-index": (lambda T, x, i: T.gather(x, -1, i),
                           lambda g, t: {**x3(g, t), "i": ints(g, 5, 2, 3, 7)}),
    "topk": (lambda T, x: x.topk(3).values, x3),
    "topk-smallest-dim": (lambda T, x: T.topk(x, 2, dim=0, largest=False)[0], x3),
    "sort": (lambda T, x: x.sort(1).values, x3),
    "sort-descending": (lambda T, x: T.sort(x, descending=True)[0], x3),
}


def _split(arrays):
    return tuple(k for k, v in arrays.items() if v.dtype.kind == "f" and k != "target")


@pytest.mark.parametrize("case", CASES)
@FUSED
@DTYPES
def test_matches_torch(case, fused, dtype):
    fn, make = CASES[case]
    on_torch = functools.partial(fn, torch)
    arrays = case_arrays(case, on_torch, make, dtype)
    wrt = _split(arrays)
    body = lambda t, ins: fn(stepgraph, **{k: v for k, v in ins.items()  # noqa: E731
                                           if k != "target"})
    assert_matches_torch(case, body, on_torch, arrays, wrt, fused, dtype, RTOL[dtype])


INDEX_CASES = {
    "max-dim-indices": lambda T, x: x.max(1).indices,
    "min-keepdim-indices": lambda T, x: T.min(x, -1, keepdim=True).indices,
    "argmax-all": lambda T, x: x.argmax(),
    "argmax-dim": lambda T, x: T.argmax(x, dim=-2),
    "argmin-keepdim": lambda T, x: x.argmin(0, keepdim=True),
    "argmax-all-keepdim": lambda T, x: x.argmax(keepdim=True),
    "topk-indices": lambda T, x: x.topk(2, dim=1, largest=False).indices,
    "sort-indices": lambda T, x: T.sort(x, 0, descending=True).indices,
}


@pytest.mark.parametrize("case", INDEX_CASES)
@DTYPES
def test_indices_match_torch(case, dtype):
    x = randn(seeded(case), 3, 4, 5, dtype=dtype)
    tracer = Tracer()
    out = INDEX_CASES[case](stepgraph, trace_inputs(tracer, {"x": x})["x"])
    tracer.graph.outputs = {"out": out.value}
    got = run_graph(tracer.graph, {"x": x})["out"]
    want = INDEX_CASES[case](torch, torch.tensor(x)).numpy()
    assert got.dtype == np.int64 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_max_with_dim_is_a_named_pair():
    tracer = Tracer()
    x = tracer.input((3, 4), "float32", "x")
    result = x.max(1)
    values, indices = result
    assert (values, indices) == (result.values, result.indices)
    assert type(result) is stepgraph.return_types.max
    assert values.shape == indices.shape == (3,) and indices.dtype == "int64"


def test_argmax_records_one_topk():
    """argmax is topk's int64 indices viewed without the axis; topk's values go unread."""
    tracer = Tracer()
    x = tracer.input((3, 4), "float32", "x")
    assert x.argmax(1).dtype == "int64"
    ops = [n.op for n in tracer.graph.nodes]
    assert ops == ["topk", "reshape"]


def test_index_ops_recorded():
    """Indexing maps to slices and views; whole-axis slices record nothing."""
    tracer = Tracer()
    x = tracer.input((2, 3, 4), "float32", "x")
    _ = x[:, :, :], x[..., ::2], x[:, -1]
    assert [(n.op, n.attrs.get("step")) for n in tracer.graph.nodes] == \
        [("slice", 2), ("slice", None), ("reshape", None)]


@pytest.mark.parametrize("expr, match", [
    (lambda x, m, i: x[m], "boolean-mask indexing.*masked_fill.*where"),
    (lambda x, m, i: x[x > 0], "boolean-mask indexing"),
    (lambda x, m, i: x[x], "float32 tensor"),
    (lambda x, m, i: x[i, i], "several integer tensors"),
    (lambda x, m, i: x[i, None, 0], "an int apart"),
    (lambda x, m, i: x[[0, 1]], "list"),
    (lambda x, m, i: x.cumsum(0, dtype="float64"), "cumsum with dtype"),
])
def test_unsupported_indexing_raises(expr, match):
    tracer = Tracer()
    x = tracer.input((3, 4), "float32", "x")
    m = tracer.input((3, 4), "uint8", "m")
    i = tracer.input((2,), "int64", "i")
    with pytest.raises(UnsupportedOpError, match=match):
        expr(x, m, i)


@pytest.mark.parametrize("expr, error", [
    (lambda x: x[3], IndexError),
    (lambda x: x[0, 0, 0], IndexError),
    (lambda x: x[..., ...], IndexError),
    (lambda x: x[::-1], ValueError),
    (lambda x: stepgraph.cat([x, x.T]), ShapeError),
    (lambda x: stepgraph.stack([x, x[:2]]), ShapeError),
    (lambda x: x.unflatten(1, (3, 2)), ShapeError),
    (lambda x: x.topk(5), ShapeError),
    (lambda x: x.tril().sum(0).tril(), ShapeError),
])
def test_index_errors(expr, error):
    tracer = Tracer()
    with pytest.raises(error):
        expr(tracer.input((3, 4), "float32", "x"))


def test_bf16_cat_and_tril_stay_bf16_where_cuda_takes_them():
    """Under autocast, cat of bf16 tensors and tril keep bf16 (torch's promote and
    no-list ops), and the CUDA families declare bf16 kernels for both; cat with a float32
    operand promotes to float32."""
    pytest.importorskip("cupy")
    from stepgraph.backends.cuda.backend import declared_bf16_ops
    from stepgraph.compile.autocast import autocast, check_bf16_support
    from stepgraph.ir.graph import BF16

    tracer = Tracer()
    x, w = tracer.input((2, 3), "float32", "x"), tracer.input((3, 3), "float32", "w")
    c = tracer.input((2, 6), "float32", "c")
    y = stepgraph.cat([x @ w, x @ w.T], 1).tril()           # matmuls run (and write) bf16
    z = stepgraph.cat([y, c], 0)
    tracer.graph.outputs = {"z": z.value}
    graph = autocast(tracer.graph)
    ops = [(n.op, [v.dtype for v in n.inputs], n.outputs[0].dtype) for n in graph.nodes
           if n.op in ("concat", "triangle")]
    assert ops == [("concat", [BF16, BF16], BF16), ("triangle", [BF16], BF16),
                   ("concat", ["float32", "float32"], "float32")]
    check_bf16_support(graph, declared_bf16_ops(), "cuda")


# ---- a model using them, compiled and trained ----------------------------------------------

def picker_forward(T, h):
    """Indexing, cat, cumsum, tril, max with a dim, topk and var on (N, 12) features."""
    parts = T.cat([h[:, ::2], h[:, 1::2].cumsum(-1)], dim=-1)
    square = parts[:, :9].reshape(-1, 3, 3).tril()
    top = h.topk(3, dim=-1).values.sum(-1)
    return square.max(1).values.sum(-1) + top + h.var(-1) + h[:, -1]


class Picker(stepgraph.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = stepgraph.nn.Linear(8, 12)

    def forward(self, x):
        return picker_forward(stepgraph, self.proj(x))


def picker_batches(steps: int):
    gen = seeded("picker")
    return [(randn(gen, 16, 8), randn(gen, 16)) for _ in range(steps)]


def picker_losses(device: str, steps: int) -> list[float]:
    """The losses of `steps` SGD steps of Picker (mse to random targets) on `device`."""
    model = Picker()
    gen = seeded("picker weights")
    model.proj.weight.data[...] = 0.3 * randn(gen, 12, 8)
    model.proj.bias.data[...] = 0.1 * randn(gen, 12)
    batches = picker_batches(steps)
    step = stepgraph.compile_train_step(model, loss=stepgraph.losses.mse,
                                        optimizer=stepgraph.optim.SGD(lr=0.05),
                                        example_inputs=batches[0], device=device)
    return [float(step(x, y)) for x, y in batches]


def test_model_trains_like_torch():
    """The compiled step (fusion passes, planner, numpy backend) follows torch's SGD losses."""
    gen = seeded("picker weights")
    w, b = 0.3 * randn(gen, 12, 8), 0.1 * randn(gen, 12)
    lin = torch.nn.Linear(8, 12)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor(w))
        lin.bias.copy_(torch.tensor(b))
    opt = torch.optim.SGD(lin.parameters(), lr=0.05)
    want = []
    for x, y in picker_batches(4):
        loss = torch.nn.functional.mse_loss(picker_forward(torch, lin(torch.tensor(x))),
                                            torch.tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(float(loss.detach()))
    got = picker_losses("cpu", steps=4)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert got[-1] != got[0]
