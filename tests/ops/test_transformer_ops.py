"""The transformer ops (embedding, layer_norm, bmm, scaled/causal softmax, slice, arange,
cross-entropy's ignore_index) and the functions and tensor methods built on them.

Each case runs one function on stepgraph's traced tensors and on torch tensors: the forward
and every float input's gradient (through the real autodiff; loss = mse against a random
target for non-scalar outputs) must match torch autograd in float64 and float32, unfused and
through the fusion passes. Finite-difference checks of the VJP rules are in test_ops_fd.py;
the cases here add the shapes and attrs that matter (repeated indices, rows != cols, odd T).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import stepgraph as sg
from stepgraph import nn
from stepgraph.errors import ShapeError, UnsupportedOpError
from stepgraph.ir.trace import Tracer, current_tracer
from stepgraph.nn import functional as F
from stepgraph.ops.softmax import causal_mask
from tests.ops.helpers import (assert_close, build_train_graph, case_arrays, forward_and_grads,
                               op_forward, op_vjp, randn, run_graph, seeded,
                               torch_forward_and_grads, trace_inputs)

DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
FUSED = pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
# float32: sums over a few dozen terms in another order, and attention's two GEMMs and
# softmax chained, stay within a few ulps of each term's size.
RTOL = {np.float64: 1e-10, np.float32: 3e-5}


def idx(gen, *shape, high: int) -> np.ndarray:
    return gen.integers(0, high, shape).astype(np.int64)


def repeated(gen, *shape, high: int) -> np.ndarray:
    """Indices drawn from a few values only, so that most rows repeat (embedding_grad sums)."""
    return gen.integers(0, min(high, 3), shape).astype(np.int64)


def causal_softmax_torch(x, scale):
    """The reference of softmax(scale, causal): PyTorch ops with the contract's mask."""
    mask = torch.from_numpy(causal_mask(*x.shape[-2:]))
    return torch.softmax((x * scale).masked_fill(mask, float("-inf")), dim=-1)


def sdpa(**kw):
    return lambda F, q, k, v: F.scaled_dot_product_attention(q, k, v, **kw)


def qkv(b: tuple, length: int, s: int, e: int, ev: int):
    return lambda g, t: {"q": randn(g, *b, length, e, dtype=t), "k": randn(g, *b, s, e, dtype=t),
                         "v": randn(g, *b, s, ev, dtype=t)}


def ce_inputs(n: int, c: int, ignore: int, ignored: int):
    """(n, c) logits and labels with `ignored` rows labelled `ignore`."""
    def make(g, t):
        y = idx(g, n, high=c)
        y[g.permutation(n)[:ignored]] = ignore
        return {"x": 3 * randn(g, n, c, dtype=t), "y": y}
    return make


# name -> (fn(F, **tensors) -> tensor, inputs(gen, dtype) -> arrays). Every float input is
# differentiated; `fn` sees stepgraph's functional module or torch's as F.
CASES = {
    # embedding: repeated indices sum their rows' gradients; any index shape
    "embedding-2d-repeated": (lambda F, i, w: F.embedding(i, w) * 1.0,
                              lambda g, t: {"i": repeated(g, 3, 5, high=7),
                                            "w": randn(g, 7, 4, dtype=t)}),
    "embedding-1d": (lambda F, i, w: F.embedding(i, w),
                     lambda g, t: {"i": idx(g, 6, high=9), "w": randn(g, 9, 3, dtype=t)}),
    "embedding-int32-3d": (lambda F, i, w: F.embedding(i, w),
                           lambda g, t: {"i": idx(g, 2, 2, 3, high=5).astype(np.int32),
                                         "w": randn(g, 5, 6, dtype=t)}),
    # layer_norm over the last dim, with and without weight / bias
    "layer_norm-affine-3d": (lambda F, x, w, b: F.layer_norm(x, (6,), w, b),
                             lambda g, t: {"x": 2 + 3 * randn(g, 2, 3, 6, dtype=t),
                                           "w": randn(g, 6, dtype=t), "b": randn(g, 6, dtype=t)}),
    "layer_norm-nobias": (lambda F, x, w: F.layer_norm(x, (5,), w),
                          lambda g, t: {"x": randn(g, 4, 5, dtype=t), "w": randn(g, 5, dtype=t)}),
    "layer_norm-bias-only": (lambda F, x, b: F.layer_norm(x, [5], bias=b),
                             lambda g, t: {"x": randn(g, 4, 5, dtype=t),
                                           "b": randn(g, 5, dtype=t)}),
    "layer_norm-plain-eps": (lambda F, x: F.layer_norm(x, (7,), eps=0.1),
                             lambda g, t: {"x": randn(g, 3, 7, dtype=t)}),
    "layer_norm-1d": (lambda F, x, w, b: F.layer_norm(x, (8,), w, b),
                      lambda g, t: {"x": randn(g, 8, dtype=t), "w": randn(g, 8, dtype=t),
                                    "b": randn(g, 8, dtype=t)}),
    # batched matmul through @
    "matmul-3d-3d": (lambda F, a, b: a @ b,
                     lambda g, t: {"a": randn(g, 2, 3, 4, dtype=t),
                                   "b": randn(g, 2, 4, 5, dtype=t)}),
    "matmul-4d-4d": (lambda F, a, b: a @ b,
                     lambda g, t: {"a": randn(g, 2, 3, 5, 4, dtype=t),
                                   "b": randn(g, 2, 3, 4, 2, dtype=t)}),
    "matmul-4d-transposed": (lambda F, q, k: q @ k.transpose(-2, -1),
                             lambda g, t: {"q": randn(g, 2, 2, 5, 3, dtype=t),
                                           "k": randn(g, 2, 2, 4, 3, dtype=t)}),
    # split / chunk (slice)
    "split-size": (lambda F, x: (lambda a, b, c: a * b - c)(*x.split(4, dim=-1)),
                   lambda g, t: {"x": randn(g, 2, 3, 12, dtype=t)}),
    "split-uneven": (lambda F, x: (lambda a, b: a.sum(1) + 2 * b.sum(1))(*x.split(3, dim=1)),
                     lambda g, t: {"x": randn(g, 2, 5, 3, dtype=t)}),
    "split-sections": (lambda F, x: (lambda a, b, c: a.sum(0) * 3 + b.sum(0) - c.sum(0))(
        *x.split([1, 3, 2], 0)), lambda g, t: {"x": randn(g, 6, 4, dtype=t)}),
    "chunk-odd": (lambda F, x: (lambda a, b: a.mean(-1) - b.mean(-1))(*x.chunk(2, -1)),
                  lambda g, t: {"x": randn(g, 3, 7, dtype=t)}),
    "chunk-3-of-6": (lambda F, x: (lambda a, b, c: a * b + c)(*x.chunk(3, dim=0)),
                     lambda g, t: {"x": randn(g, 6, 2, dtype=t)}),
    # scaled dot-product attention: causal or not, odd T, given scale, 3-D and 4-D
    "sdpa-causal-4d-odd-T": (sdpa(is_causal=True), qkv((2, 3), 5, 5, 4, 4)),
    "sdpa-causal-scale": (sdpa(is_causal=True, scale=0.3), qkv((2,), 7, 7, 3, 5)),
    "sdpa-full-L!=S": (sdpa(), qkv((2, 2), 3, 5, 4, 2)),
    "sdpa-full-scale-T1": (sdpa(scale=2.0), qkv((3,), 1, 1, 4, 4)),
    "sdpa-dropout-eval": (lambda F, q, k, v: F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.0, is_causal=True), qkv((1, 2), 4, 4, 2, 2)),
    # cross-entropy with ignore_index (and label smoothing)
    "ce-ignore-default": (lambda F, x, y: F.cross_entropy(x, y), ce_inputs(7, 5, -100, 3)),
    "ce-ignore-minus-one": (lambda F, x, y: F.cross_entropy(x, y, ignore_index=-1),
                            ce_inputs(6, 4, -1, 2)),
    "ce-ignore-class-smooth": (lambda F, x, y: F.cross_entropy(x, y, ignore_index=2,
                                                               label_smoothing=0.2),
                               ce_inputs(8, 5, 2, 1)),
}


def float_inputs(arrays) -> tuple[str, ...]:
    return tuple(k for k, a in arrays.items() if a.dtype.kind == "f" and k != "target")


def check_against_torch(fn, arrays, wrt, fused, rtol, what):
    body = lambda t, ins: fn(F, **{k: v for k, v in ins.items() if k != "target"})  # noqa: E731
    out, grads = forward_and_grads(body, arrays, wrt, fused)
    want, want_grads = torch_forward_and_grads(functools.partial(fn, TF), arrays, wrt)
    assert_close(out, want, rtol, f"{what} forward")
    for name in wrt:
        assert grads[name].dtype == arrays[name].dtype
        assert_close(grads[name], want_grads[name], rtol, f"{what} grad of {name}")
    return out


@pytest.mark.parametrize("case", CASES)
@FUSED
@DTYPES
def test_matches_torch(case, fused, dtype):
    fn, make = CASES[case]
    arrays = case_arrays(case, functools.partial(fn, TF), make, dtype)
    out = check_against_torch(fn, arrays, float_inputs(arrays), fused, RTOL[dtype], case)
    assert out.dtype == dtype


@pytest.mark.parametrize("rows, cols", [(4, 4), (3, 6), (1, 5), (5, 5)])
@DTYPES
def test_scaled_causal_softmax_matches_torch(rows, cols, dtype):
    """softmax(scale, causal) with rows != cols: the mask hides column > row + (cols - rows)."""
    gen = seeded(f"causal{rows}{cols}{np.dtype(dtype)}")
    arrays = {"x": 3 * randn(gen, 2, rows, cols, dtype=dtype),
              "target": randn(gen, 2, rows, cols, dtype=dtype)}
    scale = 0.37
    body = lambda t, i: t.op("softmax", [i["x"]], scale=scale, causal=True)  # noqa: E731
    out, grads = forward_and_grads(body, arrays, ("x",), fused=False)
    x = torch.tensor(arrays["x"], requires_grad=True)
    y = causal_softmax_torch(x, scale)
    (gx,) = torch.autograd.grad(TF.mse_loss(y, torch.tensor(arrays["target"])), [x])
    assert_close(out, y.detach().numpy(), RTOL[dtype], "forward")
    assert_close(grads["x"], gx.numpy(), RTOL[dtype], "grad")
    assert np.all(out[:, causal_mask(rows, cols)] == 0)      # masked entries are exactly 0


def test_softmax_without_new_attrs_is_plain_softmax():
    """Nodes made before scale / causal existed keep their meaning, and so does the grad."""
    gen = seeded("plain-softmax")
    x, dy = randn(gen, 3, 5, dtype=np.float64), randn(gen, 3, 5, dtype=np.float64)
    (y,) = op_forward("softmax", {"x": x})
    (y1,) = op_forward("softmax", {"x": x}, scale=1.0, causal=False)
    np.testing.assert_array_equal(y, y1)
    np.testing.assert_allclose(y, torch.softmax(torch.tensor(x), -1).numpy(), rtol=1e-14)
    (dx,) = op_forward("softmax_grad", {"dy": dy, "y": y})
    want = op_vjp("softmax", {"x": x}, dy, ("x",))["x"]
    np.testing.assert_allclose(dx, want, rtol=1e-14)


def test_embedding_grad_sums_repeated_indices():
    idx_ = np.array([[2, 0, 2], [2, 4, 0]])
    dy = np.arange(6 * 3, dtype=np.float64).reshape(2, 3, 3) + 1
    (dw,) = op_forward("embedding_grad", {"dy": dy, "i": idx_}, num_embeddings=6)
    want = np.zeros((6, 3))
    for pos, row in np.ndenumerate(idx_):
        want[row] += dy[pos]
    np.testing.assert_array_equal(dw, want)
    assert not dw[[1, 3, 5]].any()                           # rows never looked up: zero


def test_embedding_index_out_of_range_gives_nan_row():
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    (out,) = op_forward("embedding", {"w": w, "i": np.array([1, 3, -1, 0])})
    np.testing.assert_array_equal(out[[0, 3]], w[[1, 0]])
    assert np.isnan(out[[1, 2]]).all()


def test_layer_norm_saves_float32_statistics():
    gen = seeded("ln-stats")
    x = 5 + randn(gen, 2, 3, 8, dtype=np.float32)
    y, mean, rstd = op_forward("layer_norm", {"x": x}, eps=1e-5)
    assert mean.shape == rstd.shape == (6,) and mean.dtype == rstd.dtype == np.float32
    x64 = x.astype(np.float64).reshape(6, 8)
    np.testing.assert_allclose(mean, x64.mean(1), rtol=1e-6)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x64.var(1) + 1e-5), rtol=1e-6)


@pytest.mark.parametrize("labels", [[-100, -100, -100], [4, 4, 4]], ids=["default", "four"])
def test_cross_entropy_every_row_ignored_is_nan_with_zero_grad(labels):
    ignore = labels[0]
    arrays = {"x": randn(seeded("ce-all"), 3, 5, dtype=np.float64),
              "y": np.array(labels, np.int64)}
    loss, _ = op_forward("cross_entropy", arrays, ignore_index=ignore)
    assert np.isnan(loss)
    grads = op_vjp("cross_entropy", arrays, np.float64(1.0), ("x",), ignore_index=ignore)
    assert not grads["x"].any()
    fused_loss, dlogits = op_forward("cross_entropy_train", arrays, ignore_index=ignore)
    assert np.isnan(fused_loss) and not dlogits.any()


def test_fused_cross_entropy_keeps_ignore_index():
    gen = seeded("ce-fuse")
    arrays = {"x": randn(gen, 6, 4, dtype=np.float64),
              "y": np.array([0, -1, 3, -1, 2, 1], np.int64)}
    body = lambda t, i: F.cross_entropy(i["x"], i["y"], ignore_index=-1)  # noqa: E731
    graph = build_train_graph(body, arrays, ("x",), fused=True)
    (train,) = [n for n in graph.nodes if n.op == "cross_entropy_train"]
    assert train.attrs["ignore_index"] == -1
    result = run_graph(graph, arrays)
    x = torch.tensor(arrays["x"], requires_grad=True)
    loss = TF.cross_entropy(x, torch.tensor(arrays["y"]), ignore_index=-1)
    loss.backward()
    np.testing.assert_allclose(result["loss"], loss.item(), rtol=1e-14)
    np.testing.assert_allclose(result["grad:x"], x.grad.numpy(), rtol=1e-14)


# ---- modules -------------------------------------------------------------------------------

class PositionalEmbedding(nn.Module):
    """x (B, T) token indices -> wte(x) + wpe(arange(T)), with sg.arange in the forward."""

    def __init__(self, vocab: int, block: int, dim: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.ln = nn.LayerNorm(dim)

    def forward(self, x):
        return self.ln(self.wte(x) + self.wpe(sg.arange(x.size(1))))


def torch_module_like(model: PositionalEmbedding):
    t = torch.nn.ModuleDict(dict(wte=torch.nn.Embedding(*model.wte.weight.shape),
                                 wpe=torch.nn.Embedding(*model.wpe.weight.shape),
                                 ln=torch.nn.LayerNorm(model.ln.weight.shape[0]))).double()
    t.load_state_dict({k: torch.tensor(v.numpy(), dtype=torch.float64)
                       for k, v in model.state_dict().items()})
    return t


def test_module_with_arange_matches_torch():
    model = PositionalEmbedding(11, 8, 6)
    model.name_parameters()
    tokens = idx(seeded("arange"), 3, 5, high=11)
    tracer = Tracer()
    x = tracer.input(tokens.shape, "int64", "x")
    assert current_tracer() is None
    y = model(x)
    assert current_tracer() is None                          # only while the forward runs
    assert [n.op for n in tracer.graph.nodes].count("arange") == 1
    tracer.graph.outputs = {"y": y.value}
    bound = {v.name: p.storage.astype(np.float32) for v, p in
             zip(tracer.graph.params, tracer.parameters)}
    out = run_graph(tracer.graph, {"x": tokens}, bound)["y"]
    t = torch_module_like(model)
    ids = torch.tensor(tokens)
    want = t["ln"](t["wte"](ids) + t["wpe"](torch.arange(5)))
    assert_close(out, want.detach().numpy(), 1e-5, "forward")


def test_arange_outside_tracing_is_eager():
    a = sg.arange(4)
    assert a.is_eager and a.dtype == sg.int64 and a.tolist() == [0, 1, 2, 3]
    assert np.asarray(sg.arange(3, dtype="float32")).dtype == np.float32


def test_arange_op():
    tracer = Tracer()
    y = tracer.op("arange", [], n=5, dtype="int64")
    tracer.graph.outputs = {"y": y.value}
    np.testing.assert_array_equal(run_graph(tracer.graph, {})["y"], np.arange(5))


def test_module_initialisation_and_keys():
    emb, ln = nn.Embedding(50, 40), nn.LayerNorm(7, bias=False)
    w = emb.weight.numpy()
    assert w.shape == (50, 40) and abs(w.mean()) < 0.05 and abs(w.std() - 1) < 0.05
    assert list(ln.state_dict()) == ["weight"] and (ln.weight.numpy() == 1).all()
    assert list(nn.LayerNorm((7,)).state_dict()) == ["weight", "bias"]
    assert list(nn.LayerNorm(7, elementwise_affine=False).state_dict()) == []
    assert list(torch.nn.LayerNorm(7, bias=False).state_dict()) == ["weight"]


@DTYPES
def test_gelu_tanh_and_linear_on_btc_inputs(dtype):
    gen = seeded(f"mlp{np.dtype(dtype)}")
    arrays = {"x": randn(gen, 2, 3, 4, dtype=dtype), "w1": randn(gen, 8, 4, dtype=dtype),
              "b1": randn(gen, 8, dtype=dtype), "w2": randn(gen, 4, 8, dtype=dtype),
              "target": randn(gen, 2, 3, 4, dtype=dtype)}

    def fn(F, x, w1, b1, w2):
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2) + x

    check_against_torch(fn, arrays, ("x", "w1", "b1", "w2"), True, RTOL[dtype], "mlp")


# ---- errors --------------------------------------------------------------------------------

def traced(**shapes):
    tracer = Tracer()
    arrays = {k: np.ones(s, np.float32) for k, s in shapes.items()}
    return tracer, trace_inputs(tracer, arrays)


def test_unsupported_and_bad_shapes():
    _, t = traced(a=(2, 3, 4), b=(1, 4, 5), c=(4, 5), q=(2, 3, 4), k=(2, 5, 4), m=(3, 5))
    with pytest.raises(UnsupportedOpError, match="same batch dims"):
        t["a"] @ t["b"]                                      # would broadcast the batch
    with pytest.raises(UnsupportedOpError, match="matmul"):
        t["c"] @ t["b"]
    with pytest.raises(ValueError, match="not both"):
        F.scaled_dot_product_attention(t["q"], t["k"], t["k"], attn_mask=t["m"], is_causal=True)
    with pytest.raises(ShapeError, match="normalized_shape"):
        F.layer_norm(t["a"], (4, 4))
    with pytest.raises(ShapeError, match="normalized_shape"):
        F.layer_norm(t["a"], 3)
    with pytest.raises(ShapeError, match="rows <= cols"):
        t["a"].tracer.op("softmax", [t["k"]], causal=True)
    with pytest.raises(ShapeError, match="add up"):
        t["a"].split([1, 1], dim=1)
    with pytest.raises(ShapeError, match="indices"):
        F.embedding(t["a"], nn.Embedding(3, 2).weight)


def test_split_of_the_whole_axis_records_nothing():
    tracer, t = traced(x=(2, 6))
    (whole,) = t["x"].split(6, dim=1)
    assert whole is t["x"] and not tracer.graph.nodes
    a, b = t["x"].chunk(2, dim=-1)
    assert [n.op for n in tracer.graph.nodes] == ["slice", "slice"]
    assert [n.attrs for n in tracer.graph.nodes] == [dict(dim=1, start=0, stop=3),
                                                     dict(dim=1, start=3, stop=6)]


def test_sdpa_records_one_op_with_dropout_only_in_training():
    for training in (True, False):
        tracer = Tracer(seed=9, training=training)
        q = tracer.input((2, 2, 5, 4), "float32", "q")
        y = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
        assert y.shape == (2, 2, 5, 4)
        (node,) = tracer.graph.nodes
        assert node.op == "sdpa" and node.inputs[:3] == [q.value] * 3
        attrs = dict(scale=1 / math.sqrt(4), causal=True, dropout_p=0.1 if training else 0.0)
        if training:       # the site and step counter the dropout op would have used
            attrs.update(seed=9, site=0)
            assert node.inputs[3] is tracer.rng_step()
        assert node.attrs == attrs and len(node.inputs) == 3 + training


def test_sdpa_beyond_the_kernels_head_dims_records_the_composed_ops():
    for training, want in ((True, ["bmm", "softmax", "dropout", "bmm"]),
                           (False, ["bmm", "softmax", "bmm"])):
        tracer = Tracer(training=training)
        q = tracer.input((2, 5, 130), "float32", "q")
        y = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
        assert y.shape == (2, 5, 130)
        assert [n.op for n in tracer.graph.nodes if n.op != "reshape"] == want
        (soft,) = [n for n in tracer.graph.nodes if n.op == "softmax"]
        assert soft.attrs == dict(scale=1 / math.sqrt(130), causal=True)
