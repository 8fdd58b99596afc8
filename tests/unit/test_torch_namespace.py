"""`import stepgraph as torch`: factories (values equal torch's), dtypes, device, eager tensors
outside forward against torch, factories and eager tensors inside a traced forward through
compile_predict / compile_train_step on the CPU, a nanoGPT-style constructor, no_grad, the
backends flags, and the errors for torch names stepgraph lacks."""
from __future__ import annotations

import numpy as np
import pytest
import torch as real

import stepgraph as torch
from stepgraph import losses, nn, optim
from stepgraph.errors import UnsupportedOpError
from stepgraph.ir.trace import Tracer
from stepgraph.nn import functional as F


def same(ours, theirs):
    """Equal values, shape and dtype name (ours an eager tensor, theirs a torch tensor)."""
    assert ours.is_eager
    assert tuple(ours.shape) == tuple(theirs.shape)
    assert repr(ours.dtype) == repr(theirs.dtype)
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


# ---- deterministic factories equal torch's -------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda t: t.zeros(2, 3), lambda t: t.zeros((4,)), lambda t: t.ones(3, 1, 2),
    lambda t: t.ones([2, 2], dtype=t.int64), lambda t: t.zeros((), dtype=t.float64),
    lambda t: t.full((2, 3), 1.5), lambda t: t.full((3,), 7), lambda t: t.full((2,), 2,
                                                                               dtype=t.int32),
    lambda t: t.eye(3), lambda t: t.eye(2, 4, dtype=t.long),
    lambda t: t.arange(10), lambda t: t.arange(2, 11, 3), lambda t: t.arange(5, 0, -2),
    lambda t: t.arange(0.0, 1.0, 0.25), lambda t: t.arange(6, dtype=t.float32),
    lambda t: t.arange(1, 4, dtype=t.float64), lambda t: t.linspace(-1, 1, 5),
    lambda t: t.linspace(0, 10, 11), lambda t: t.tensor([[1.5, 2.0], [3.0, -4.25]]),
    lambda t: t.tensor(3), lambda t: t.tensor([1, 2, 3]), lambda t: t.tensor(2.5),
    lambda t: t.tensor([1, 2], dtype=t.float32), lambda t: t.as_tensor([0.5, 1.0]),
    lambda t: t.empty(2, 5).zero_() if t is real else t.empty(2, 5),
])
def test_factories_equal_torch(make):
    same(make(torch), make(real))


def test_like_factories_follow_the_input():
    for ours, theirs in ((torch.arange(6).reshape(2, 3), real.arange(6).reshape(2, 3)),
                         (torch.ones(4, 1), real.ones(4, 1))):
        same(torch.zeros_like(ours), real.zeros_like(theirs))
        same(torch.ones_like(ours), real.ones_like(theirs))
        same(torch.full_like(ours, 3), real.full_like(theirs, 3))
        same(torch.ones_like(ours, dtype=torch.float64),
             real.ones_like(theirs, dtype=real.float64))
        assert torch.empty_like(ours).shape == ours.shape
    same(torch.zeros_like(np.ones((2, 2), np.float32)), real.zeros(2, 2))


def test_from_numpy_and_as_tensor_share_memory_tensor_copies():
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    shared, also, copied = torch.from_numpy(a), torch.as_tensor(a), torch.tensor(a)
    a[0, 0] = 100.0
    assert shared.numpy()[0, 0] == 100.0 and also.numpy()[0, 0] == 100.0
    assert copied.numpy()[0, 0] == 0.0 and copied.dtype == torch.float64
    with pytest.raises(TypeError, match="numpy.ndarray"):
        torch.from_numpy([1, 2])


# ---- random factories ----------------------------------------------------------------------

def test_manual_seed_repeats_random_factories_and_init():
    torch.manual_seed(5)
    a, b, c = torch.randn(3, 4), torch.rand(5), torch.randint(3, 9, (100,))
    w = nn.Linear(3, 2).weight.numpy()
    torch.manual_seed(5)
    np.testing.assert_array_equal(torch.randn(3, 4).numpy(), a.numpy())
    np.testing.assert_array_equal(torch.rand(5).numpy(), b.numpy())
    np.testing.assert_array_equal(torch.randint(3, 9, (100,)).numpy(), c.numpy())
    np.testing.assert_array_equal(nn.Linear(3, 2).weight.numpy(), w)
    torch.cuda.manual_seed_all(5)
    np.testing.assert_array_equal(torch.randn(3, 4).numpy(), a.numpy())
    assert a.dtype == torch.float32 and c.dtype == torch.int64
    assert c.numpy().min() >= 3 and c.numpy().max() < 9 and len(set(c.tolist())) == 6


def test_random_factories_have_torchs_distributions():
    torch.manual_seed(0)
    n = torch.randn(200000).numpy()
    u = torch.rand(200000).numpy()
    assert abs(n.mean()) < 0.01 and abs(n.std() - 1) < 0.01
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    assert torch.randint(4, (2, 3)).shape == (2, 3)
    assert torch.randn(2, 3, dtype=torch.float64).dtype == torch.float64


# ---- dtypes --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["float32", "float", "float64", "double", "float16", "half",
                                  "bfloat16", "int64", "long", "int32", "int", "int16",
                                  "int8", "uint8", "bool"])
def test_dtype_names_match_torch(name):
    ours, theirs = getattr(torch, name), getattr(real, name)
    assert repr(ours) == repr(theirs)
    assert ours.is_floating_point == theirs.is_floating_point
    assert ours == repr(theirs).removeprefix("torch.")          # the stepgraph dtype string
    assert isinstance(ours, torch.dtype)


def test_dtype_comparisons_on_eager_and_traced_tensors():
    assert torch.float is torch.float32 and torch.long is torch.int64
    assert torch.ones(2).dtype == torch.float32 == "float32"
    assert torch.arange(3).dtype == torch.long and torch.arange(3).dtype != torch.float32
    tracer = Tracer()
    x = tracer.input((2, 3), "float32", "x")
    assert x.dtype == torch.float32 and x.dtype is torch.float32
    assert x.is_floating_point() and torch.is_floating_point(x)
    assert not torch.arange(3).is_floating_point()
    assert {torch.float32: 1}["float32"] == 1


def test_finfo_iinfo_and_default_dtype():
    for d in ("float32", "float64", "bfloat16", "float16"):
        ours, theirs = torch.finfo(getattr(torch, d)), real.finfo(getattr(real, d))
        assert (ours.eps, ours.max, ours.min, ours.tiny, ours.bits) == \
            (theirs.eps, theirs.max, theirs.min, theirs.tiny, theirs.bits)
    for d in ("int64", "int32", "int8", "uint8"):
        ours, theirs = torch.iinfo(getattr(torch, d)), real.iinfo(getattr(real, d))
        assert (ours.max, ours.min, ours.bits) == (theirs.max, theirs.min, theirs.bits)
    assert torch.finfo().eps == real.finfo().eps
    assert torch.get_default_dtype() is torch.float32
    torch.set_default_dtype(torch.float32)
    with pytest.raises(UnsupportedOpError, match="default dtype is float32"):
        torch.set_default_dtype(torch.float64)
    with pytest.raises(TypeError, match="not a floating point"):
        torch.finfo(torch.int64)


def test_tensors_of_dtypes_stepgraph_cannot_hold_are_refused():
    with pytest.raises(UnsupportedOpError, match=r"torch\.int16.*not supported"):
        torch.zeros(2, dtype=torch.short)
    assert torch.zeros(2, dtype=torch.half).numpy().dtype == np.float16
    with pytest.raises(TypeError, match="not a dtype"):
        torch.zeros(2, dtype="complex64")


# ---- device, torch.cuda, backends flags ----------------------------------------------------

@pytest.mark.parametrize("args", [("cuda",), ("cuda", 0), ("cuda:1",), ("cpu",)])
def test_device_matches_torch(args):
    ours, theirs = torch.device(*args), real.device(*args)
    assert (ours.type, ours.index, str(ours), repr(ours)) == \
        (theirs.type, theirs.index, str(theirs), repr(theirs))
    assert ours == str(theirs) and ours == torch.device(str(theirs))


def test_device_of_tensors_and_cuda_queries():
    assert torch.ones(1).device == "cpu" and not torch.ones(1).is_cuda
    assert torch.device(0) == "cuda:0" and torch.device(torch.device("cuda"), 1) == "cuda:1"
    assert torch.device("cuda") != torch.device("cuda", 0) and torch.device("cuda") != "cpu"
    torch.zeros(2, device="cuda")                    # accepted: placement is a compile option
    torch.arange(3, device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match="expected one of"):
        torch.ones(2, device="tpu")
    assert torch.cuda.is_available() == torch.cuda_available()
    assert torch.cuda.device_count() >= int(torch.cuda.is_available())
    assert torch.cuda.is_bf16_supported() <= torch.cuda.is_available()
    assert torch.backends.mps.is_available() is False
    torch.cuda.synchronize()


def test_backends_flags_are_settable():
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = True
    assert torch.backends.cudnn.benchmark and torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cudnn.enabled
    torch.set_float32_matmul_precision("high")
    assert torch.get_float32_matmul_precision() == "high"
    with pytest.raises(ValueError, match="highest"):
        torch.set_float32_matmul_precision("fastest")
    from stepgraph.backends import get_backend        # the internal package still works
    assert get_backend("cpu").name == "numpy"


# ---- eager tensors against torch -----------------------------------------------------------

def test_eager_tensor_ops_match_torch():
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 4)).astype("float32"), rng.standard_normal((4, 5))
    b = b.astype("float32")
    x, y = torch.tensor(a), torch.tensor(b)
    xa, ya = real.tensor(a), real.tensor(b)
    cases = [(x @ y, xa @ ya), (x * 2 - 1, xa * 2 - 1), ((x + 3) / 2, (xa + 3) / 2),
             (2 / (x * x + 1), 2 / (xa * xa + 1)), (x.sum(1), xa.sum(1)), (x.mean(), xa.mean()),
             (x.T.reshape(2, 6), xa.T.reshape(2, 6)), (x.softmax(-1), xa.softmax(-1)),
             (x.relu() + x.sigmoid(), xa.relu() + xa.sigmoid()),
             (x.permute(1, 0).flatten(), xa.permute(1, 0).flatten()),
             (-x ** 2, -xa ** 2), (x.view(4, 3).sum(0, keepdim=True),
                                   xa.view(4, 3).sum(0, keepdim=True))]
    for ours, theirs in cases:
        assert ours.is_eager and tuple(ours.shape) == tuple(theirs.shape)
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6)
    same(torch.arange(5) * 3 - 1, real.arange(5) * 3 - 1)         # int with int stays int
    same(torch.arange(4) * 0.5, real.arange(4) * 0.5)             # ... with a float: float32
    same(torch.arange(1, 5) / 2, real.arange(1, 5) / 2)
    same(1 / torch.arange(1, 4), 1 / real.arange(1, 4))
    same(torch.arange(3) + torch.ones(3), real.arange(3) + real.ones(3))
    same(torch.arange(3) ** 2.0, real.arange(3) ** 2.0)
    same(torch.arange(3).float(), real.arange(3).float())
    same(-torch.arange(3) + torch.arange(3), -real.arange(3) + real.arange(3))
    parts = x.split(3, dim=1)
    assert [tuple(p.shape) for p in parts] == [(3, 3), (3, 1)]
    np.testing.assert_array_equal(parts[1].numpy(), a[:, 3:])


def test_eager_tensor_reads_back():
    x = torch.arange(6).reshape(2, 3)
    assert x.tolist() == [[0, 1, 2], [3, 4, 5]] and np.asarray(x).dtype == np.int64
    assert torch.tensor([2.5]).item() == 2.5 and float(torch.tensor(4.0)) == 4.0
    assert int(torch.tensor(7)) == 7 and [10, 20, 30][torch.tensor(1)] == 20
    assert bool(torch.ones(1)) and not bool(torch.zeros(()))
    assert x.numel() == 6 == torch.numel(x) and x.dim() == 2 and x.element_size() == 8
    assert x.shape == (2, 3) and isinstance(x.shape, torch.Size)
    assert x.shape.numel() == 6 and repr(x.shape) == repr(real.Size([2, 3]))
    assert x.size() == (2, 3) and x.size(-1) == 3 and len(x) == 2
    assert repr(x) == repr(real.arange(6).reshape(2, 3))
    assert torch.is_tensor(x) and isinstance(x, torch.Tensor) and not torch.is_tensor(3)
    c = x.clone()
    x.array[0, 0] = 9                                     # the clone holds its own copy
    assert c.tolist()[0][0] == 0 and x.cpu() is x and x.cuda() is x and x.is_contiguous()
    with pytest.raises(torch.ShapeError, match="6 elements"):
        x.item()


def test_eager_tensors_iterate_as_torch():
    """Iteration yields the slices along the first axis (ConvNeXt's drop rates are
    `[x.item() for x in torch.linspace(0, rate, n)]` in a constructor); a 0-d tensor refuses."""
    rates = [v.item() for v in torch.linspace(0, 0.1, 4)]
    assert rates == pytest.approx([v.item() for v in real.linspace(0, 0.1, 4)], rel=1e-6)
    assert all(isinstance(r, float) for r in rates)
    for ours, theirs in zip(torch.arange(6).reshape(3, 2), real.arange(6).reshape(3, 2)):
        same(ours, theirs)
    assert len(list(torch.ones(3, 2))) == 3
    with pytest.raises(TypeError, match="0-d"):
        iter(torch.tensor(1.5))



def test_eager_in_place_writes():
    x = torch.ones(2, 3)
    assert x.fill_(2.5) is x and x.tolist() == [[2.5] * 3] * 2
    assert x.zero_().tolist() == [[0.0] * 3] * 2
    same(torch.zeros(2, 3).copy_(torch.arange(3)), real.zeros(2, 3).copy_(real.arange(3)))
    b = torch.zeros(3, dtype=torch.bfloat16).fill_(1 / 3)
    np.testing.assert_array_equal(b.numpy(), real.full((3,), 1 / 3, dtype=real.bfloat16).float())
    tracer = Tracer()
    t = tracer.input((2,), "float32", "x")
    assert t.fill_(0) is t and tracer.graph.nodes[-1].op == "fill"   # rebound, not written


def test_eager_modules_and_functional():
    torch.manual_seed(1)
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    want = x.numpy() @ lin.weight.numpy().T + lin.bias.numpy()
    np.testing.assert_allclose(lin(x).numpy(), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(F.relu(lin(x)).numpy(), np.maximum(want, 0), atol=1e-6)
    ones = torch.ones(4000)
    a, b = F.dropout(ones, 0.25).numpy(), F.dropout(ones, 0.25).numpy()
    assert set(np.unique(a)) == {0.0, np.float32(1 / 0.75)} and abs((a == 0).mean() - 0.25) < 0.03
    assert (a != b).any()                                  # a fresh mask per call
    np.testing.assert_array_equal(F.dropout(ones, 0.25, training=False).numpy(), ones.numpy())


def test_parameters_and_buffers_take_eager_tensors():
    p = nn.Parameter(torch.zeros(1, 1, 4))
    q = nn.Parameter(torch.randn(3, 4) * 0.02)
    assert p.shape == (1, 1, 4) and not p.numpy().any()
    assert q.numpy().std() < 0.1 and q.numpy().dtype == np.float32
    m = nn.Module()
    m.register_buffer("steps", torch.arange(3))
    assert m.steps.dtype == "int64" and m.state_dict()["steps"].tolist() == [0, 1, 2]


# ---- inside a traced forward ---------------------------------------------------------------

class Shifted(nn.Module):
    """Factories inside forward (fill, arange, a constant), an eager attribute made in the
    constructor and an eager buffer."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = torch.linspace(0.5, 1.5, 3)                  # a plain eager attribute
        self.register_buffer("shift", torch.full((1, 3), 0.25))

    def forward(self, x):
        y = self.lin(x) * self.scale + self.shift + torch.ones(3)
        y = y + torch.zeros_like(y) + torch.arange(3, dtype=torch.float32)
        return y - torch.tensor([0.5, 1.0, 2.0]) + torch.arange(1.0, 6.0, 2)


def shifted_reference(model, x):
    w, b = model.lin.weight.numpy(), model.lin.bias.numpy()
    y = (x @ w.T + b) * np.linspace(0.5, 1.5, 3) + 0.25 + 1 + np.arange(3)
    return y - np.array([0.5, 1.0, 2.0]) + np.arange(1, 7, 2)


def test_factories_in_forward_record_graph_values():
    tracer = Tracer()
    x = tracer.input((2, 4), "float32", "x")
    model = Shifted()
    model.name_parameters()
    model(x)
    ops = [n.op for n in tracer.graph.nodes]
    assert ops.count("fill") == 2 and ops.count("arange") == 1
    assert ops.count("constant") == 3       # scale, tensor([...]) and arange(1.0, 6.0, 2)
    assert ops.count("reshape") == 0 and len(tracer.graph.state) == 1       # the buffer


def test_factories_in_forward_through_compile_predict():
    torch.manual_seed(2)
    model = Shifted()
    x = np.random.default_rng(4).standard_normal((5, 4)).astype("float32")
    out = torch.compile_predict(model, example_inputs=(x,), device="cpu")(x)
    np.testing.assert_allclose(np.asarray(out), shifted_reference(model, x), rtol=1e-5,
                               atol=1e-6)


def test_factories_in_forward_through_compile_train_step():
    torch.manual_seed(3)
    model = Shifted()
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((8, 4)).astype("float32"), rng.integers(0, 3, 8)
    logits = shifted_reference(model, x)
    want = real.nn.functional.cross_entropy(real.tensor(logits), real.tensor(y)).item()
    step = torch.compile_train_step(model, loss=losses.cross_entropy,
                                    optimizer=optim.SGD(lr=0.1), example_inputs=(x, y),
                                    device="cpu")
    assert float(step(x, y)) == pytest.approx(want, rel=1e-5)
    assert model.state_dict()["shift"].tolist() == [[0.25] * 3]   # buffers are not trained


def test_random_factories_inside_forward_draw_in_the_step():
    class Noisy(nn.Module):
        def forward(self, x):
            return x + torch.randn(3)

    tracer = Tracer()
    Noisy()(tracer.input((2, 3), "float32", "x"))
    assert [n.op for n in tracer.graph.nodes] == ["random", "binary"]
    predict = Tracer(training=False)            # a predict trace draws the same way
    Noisy()(predict.input((2, 3), "float32", "x"))
    assert [n.op for n in predict.graph.nodes] == ["random", "binary"]


# ---- a nanoGPT-style model -----------------------------------------------------------------

B, T, C, H, V = 2, 5, 8, 2, 11


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(C, 3 * C)
        self.c_proj = nn.Linear(C, C)
        mask = torch.tensor(np.tril(np.ones((T, T), np.float32)))
        self.register_buffer("bias", mask.view(1, 1, T, T))

    def forward(self, x):
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (C // H) ** 0.5)
        above = (torch.zeros_like(att) + 1e9) * self.bias - 1e9   # -1e9 above the diagonal
        att = att * self.bias + above
        y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y)


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.wpe = nn.Parameter(torch.zeros(1, T, C))
        self.attn = CausalSelfAttention()
        self.head = nn.Linear(C, V, bias=False)
        self.head.weight = nn.Parameter(torch.randn(V, C) * 0.02)

    def forward(self, idx):
        return self.head(self.attn(self.wte(idx) + self.wpe))


def torch_gpt(model):
    """The same model in torch, with model's state_dict loaded."""
    t = real.nn.Module()
    t.wte, t.head = real.nn.Embedding(V, C), real.nn.Linear(C, V, bias=False)
    t.c_attn, t.c_proj = real.nn.Linear(C, 3 * C), real.nn.Linear(C, C)
    t.wpe = real.nn.Parameter(real.zeros(1, T, C))
    sd = {k.removeprefix("attn."): real.tensor(v.numpy())
          for k, v in model.state_dict().items()}
    mask = sd.pop("bias")
    t.load_state_dict(sd)

    def forward(idx):
        q, k, v = t.c_attn(t.wte(idx) + t.wpe).split(C, dim=2)
        q, k, v = (a.view(B, T, H, C // H).transpose(1, 2) for a in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (C // H) ** 0.5)
        att = att.masked_fill(mask[:, :, :T, :T] == 0, float("-inf")).softmax(-1)
        return t.head(t.c_proj((att @ v).transpose(1, 2).reshape(B, T, C)))
    return forward


def test_nanogpt_style_constructor_and_forward():
    torch.manual_seed(7)
    model = TinyGPT()
    sd = model.state_dict()
    assert list(sd) == ["wpe", "wte.weight", "attn.bias", "attn.c_attn.weight",
                        "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
                        "head.weight"]                       # torch's order
    np.testing.assert_array_equal(sd["attn.bias"][0, 0], np.tril(np.ones((T, T))))
    assert sd["head.weight"].std() < 0.05
    idx = np.random.default_rng(8).integers(0, V, (B, T))
    out = torch.compile_predict(model, example_inputs=(idx,), device="cpu")(idx)
    want = torch_gpt(model)(real.tensor(idx)).detach().numpy()
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)
    eager = model(torch.tensor(idx))                       # the same forward, run eagerly
    np.testing.assert_allclose(eager.numpy(), want, rtol=1e-4, atol=1e-5)


# ---- no_grad and friends -------------------------------------------------------------------

def test_no_grad_forms():
    class M(nn.Module):
        @torch.no_grad()
        def init_weights(self, v):
            return v + 1

        @torch.no_grad
        def bare(self, v):
            return v * 2

    m = M()
    assert m.init_weights(1) == 2 and m.bare(3) == 6 and M.bare.__name__ == "bare"
    with torch.no_grad():
        assert torch.ones(1).item() == 1.0
    with torch.inference_mode(), torch.enable_grad(), torch.set_grad_enabled(False):
        pass

    @torch.inference_mode()
    def f(v):
        return -v

    @torch.set_grad_enabled(False)
    def g(v):
        return v + 10

    assert f(4) == -4 and g(1) == 11 and torch.is_grad_enabled()
    tracer = Tracer()
    x = tracer.input((2,), "float32", "x")
    with torch.no_grad():
        assert not torch.is_grad_enabled()
        y = x * 2
        with torch.enable_grad():
            z = x * 3
    assert [n.op for n in tracer.graph.nodes] == ["scalar", "stop_gradient", "scalar"]
    assert y.value is tracer.graph.nodes[1].outputs[0] and z.value.shape == (2,)
    predict = Tracer(training=False)                  # no backward: nothing to cut
    with torch.no_grad():
        predict.input((2,), "float32", "x") * 2
    assert [n.op for n in predict.graph.nodes] == ["scalar"]


class Gated(nn.Module):
    """lin's output gated by a copy of itself computed under no_grad, plus a detached term:
    the gradient reaches lin through `h` alone."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        h = self.lin(x)
        with torch.no_grad():
            gate = self.lin(x).sigmoid()
        return h * gate + h.detach() * 0.5


def test_no_grad_and_detach_cut_the_backward_as_torch():
    torch.manual_seed(11)
    model = Gated()
    rng = np.random.default_rng(12)
    x, y = rng.standard_normal((6, 4)).astype("float32"), rng.integers(0, 3, 6)
    t = real.nn.Linear(4, 3)
    t.load_state_dict({k.removeprefix("lin."): real.tensor(v.numpy())
                       for k, v in model.state_dict().items()})
    h = t(real.tensor(x))
    with real.no_grad():
        gate = t(real.tensor(x)).sigmoid()
    out = h * gate + h.detach() * 0.5
    real.nn.functional.cross_entropy(out, real.tensor(y)).backward()
    before = model.state_dict()
    step = torch.compile_train_step(model, loss=losses.cross_entropy,
                                    optimizer=optim.SGD(lr=1.0), example_inputs=(x, y),
                                    device="cpu")
    step(x, y)
    after = model.state_dict()
    for name, p in (("lin.weight", t.weight), ("lin.bias", t.bias)):
        np.testing.assert_allclose(before[name] - after[name], p.grad.numpy(), rtol=1e-4,
                                   atol=1e-6)


# ---- names stepgraph lacks -----------------------------------------------------------------

@pytest.mark.parametrize("module,path", [(torch, "torch"), (nn, "torch.nn"),
                                         (F, "torch.nn.functional"), (torch.cuda, "torch.cuda"),
                                         (torch.backends, "torch.backends")])
def test_missing_names_raise_unsupported_op_error(module, path):
    with pytest.raises(UnsupportedOpError, match=rf"^{path}\.frobnicate is not supported by "
                                                 "stepgraph"):
        module.frobnicate
    with pytest.raises(AttributeError):
        module.frobnicate
    assert not hasattr(module, "frobnicate")
    assert getattr(module, "frobnicate", 42) == 42
    with pytest.raises(AttributeError) as err:
        module._private_thing
    assert not isinstance(err.value, UnsupportedOpError)


def test_refusals_say_what_to_use():
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        torch.randn(2, generator=object())
    tracer = Tracer()
    x = tracer.input((2,), "float32", "x")
    with pytest.raises(UnsupportedOpError, match="values of a traced tensor"):
        x.item()
    with pytest.raises(UnsupportedOpError, match="truth value"):
        bool(x)
    from stepgraph import data, train  # noqa: F401  (submodules still import lazily)


def test_unknown_names_of_plain_namespace_modules_are_attribute_errors():
    """pickle's whichmodule (torch.compile's inductor hashes graphs with pickle) asks every
    loaded module for a name and skips those raising AttributeError: a plain module such as
    stepgraph.amp must not raise another error (it once raised ModuleNotFoundError, looking
    for a submodule of a module that is no package)."""
    import pickle

    import stepgraph.amp

    with pytest.raises(AttributeError):
        stepgraph.amp.no_such_name
    assert pickle.whichmodule(object(), "no_such_global") == "__main__"   # asks every module


def test_use_deterministic_algorithms_is_kept_and_read_back():
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(False)
        assert not torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
