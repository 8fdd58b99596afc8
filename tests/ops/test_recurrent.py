"""Recurrent layers (stepgraph/nn/recurrent.py) against torch: RNN, LSTM, GRU and their cells,
forward outputs, final states and the gradients of a scalar loss with respect to the input,
the initial states and every parameter, in float64 and float32 (float32 judged against
torch's float64, within a small multiple of torch float32's own error); the options
(num_layers, bidirectional, batch_first, bias, dropout, given and default states, unbatched
input); the unstack op; packed-sequence refusals; a small LSTM language model trained five
steps against torch; and a cuda-vs-numpy LSTM step (skips without a GPU)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import nn, optim
from stepgraph.autodiff import append_backward
from stepgraph.compile.fuse import fuse
from stepgraph.errors import ShapeError, UnsupportedOpError
from stepgraph.ir.trace import Tracer
from stepgraph.nn import functional as F
from tests.ops.helpers import op_forward, op_vjp, randn, relative_error, run_graph, seeded

DTYPES = pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
F32_EPS = float(np.finfo(np.float32).eps)


def torch_twin(model) -> torch.nn.Module:
    """The torch module of the same class and arguments, holding model's values."""
    cls = getattr(torch.nn, type(model).__name__)
    if isinstance(model, nn.RNNBase):
        kw = dict(num_layers=model.num_layers, bias=model.bias, batch_first=model.batch_first,
                  dropout=model.dropout, bidirectional=model.bidirectional)
        if isinstance(model, nn.RNN):
            kw["nonlinearity"] = model.nonlinearity
    else:
        kw = dict(bias=model.bias)
        if isinstance(model, nn.RNNCell):
            kw["nonlinearity"] = model.nonlinearity
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # dropout with one layer
        twin = cls(model.input_size, model.hidden_size, **kw)
    twin.load_state_dict({k: torch.from_numpy(v.numpy()) for k, v in model.state_dict().items()})
    return twin.train(model.training)


def state_names(model) -> tuple[str, ...]:
    return ("h0", "c0") if model.mode == "LSTM" else ("h0",)


def make_arrays(model, case: str, batch: int | None, steps: int, given_state: bool, dtype):
    """x, the initial states (when given) and the loss weights of each result."""
    gen = seeded(case + str(np.dtype(dtype)))
    cell = not isinstance(model, nn.RNNBase)
    lead = () if batch is None else (batch,)
    if cell:
        x_shape, h_shape = lead + (model.input_size,), lead + (model.hidden_size,)
    else:
        layers = model.num_layers * (2 if model.bidirectional else 1)
        x_shape = (steps,) + lead + (model.input_size,)
        if batch is not None and model.batch_first:
            x_shape = (batch, steps, model.input_size)
        h_shape = (layers,) + lead + (model.hidden_size,)
    arrays = {"x": randn(gen, *x_shape, dtype=dtype)}
    if given_state:
        arrays.update({n: randn(gen, *h_shape, dtype=dtype) for n in state_names(model)})
    probe = run_torch(torch_twin(model).double(), {k: v.astype(np.float64) for k, v in
                                                   arrays.items()}, None)[0]
    for i, result in enumerate(probe):
        arrays[f"w{i}"] = randn(gen, *result.shape, dtype=dtype)
    return arrays


def call(model, x, states: list):
    """model(x, hx) with hx as each layer takes it; the results as a flat list."""
    lstm = model.mode == "LSTM" if hasattr(model, "mode") else isinstance(
        model, (torch.nn.LSTM, torch.nn.LSTMCell))
    hx = None if not states else (tuple(states) if lstm else states[0])
    out = model(x, hx)
    if isinstance(model, (nn.RNNBase, torch.nn.RNNBase)):
        out, final = out
        return [out, *(final if lstm else (final,))]
    return list(out) if lstm else [out]


def run_torch(twin, arrays: dict, wrt):
    """The results and the gradients of sum_i (result_i * w_i) (wrt: input names, plus
    every parameter), torch autograd."""
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in arrays.items()}
    states = [ts[n] for n in ("h0", "c0") if n in ts]
    results = call(twin, ts["x"], states)
    if wrt is None:
        return [r.detach().numpy() for r in results], {}
    loss = sum((r * ts[f"w{i}"]).sum() for i, r in enumerate(results))
    params = dict(twin.named_parameters())
    grads = torch.autograd.grad(loss, [ts[n] for n in wrt] + list(params.values()))
    names = list(wrt) + list(params)
    return [r.detach().numpy() for r in results], {n: g.numpy() for n, g in zip(names, grads)}


def run_stepgraph(model, arrays: dict, wrt, fused: bool = False):
    """run_torch on stepgraph: the model traced (parameters in the arrays' dtype), the
    backward appended, run on the numpy backend."""
    dtype = arrays["x"].dtype
    model.name_parameters()
    params = dict(model.named_parameters())
    for p in params.values():
        p.storage = p.storage.astype(dtype)
    tracer = Tracer(training=model.training)
    ins = {k: tracer.input(v.shape, str(v.dtype), k) for k, v in arrays.items()}
    states = [ins[n] for n in ("h0", "c0") if n in ins]
    results = call(model, ins["x"], states)
    loss = None
    for i, r in enumerate(results):
        term = (r * ins[f"w{i}"]).sum()
        loss = term if loss is None else loss + term
    values = [ins[n].value for n in wrt] + list(tracer.graph.params)
    grads = append_backward(tracer, loss.value, values)
    names = list(wrt) + [v.name for v in tracer.graph.params]
    tracer.graph.outputs = {**{f"r{i}": r.value for i, r in enumerate(results)},
                            **{f"grad:{n}": g for n, g in zip(names, grads)}}
    graph = fuse(tracer.graph) if fused else tracer.graph
    out = run_graph(graph, arrays, {n: p.storage for n, p in params.items()})
    for p in params.values():
        p.storage = p.storage.astype(np.float32)
    return [out[f"r{i}"] for i in range(len(results))], \
        {n: out[f"grad:{n}"] for n in names}


def assert_like_torch(model, arrays: dict, fused: bool = False) -> None:
    """Results and gradients agree with torch: float64 to 1e-10; float32 within 8 times
    torch float32's own error against float64 (and at most a few float32 ulps of it)."""
    wrt = tuple(k for k in arrays if not k.startswith("w"))
    twin = torch_twin(model)
    ref, ref_grads = run_torch(twin.double(), {k: v.astype(np.float64) for k, v in
                                               arrays.items()}, wrt)
    got, grads = run_stepgraph(model, arrays, wrt, fused)
    assert set(grads) == set(ref_grads)
    if arrays["x"].dtype == np.float64:
        bound = lambda name, want: 1e-10  # noqa: E731
    else:
        t32, t32_grads = run_torch(twin.float(), arrays, wrt)
        t32_all = {**{f"r{i}": r for i, r in enumerate(t32)}, **t32_grads}
        bound = lambda name, want: 8 * max(relative_error(t32_all[name], want),  # noqa: E731
                                           4 * F32_EPS)
    checks = [(f"r{i}", g, w) for i, (g, w) in enumerate(zip(got, ref))] + \
        [(n, grads[n], ref_grads[n]) for n in ref_grads]
    for name, g, want in checks:
        assert g.shape == want.shape, (name, g.shape, want.shape)
        assert g.dtype == arrays["x"].dtype, name
        if not np.abs(want).any():         # weight_hh of a cell from zero state
            assert not np.abs(g).any(), name
            continue
        err = relative_error(g, want)
        assert err <= bound(name, want), (name, err, bound(name, want))


LAYERS = {
    "lstm": lambda: nn.LSTM(3, 5),
    "gru": lambda: nn.GRU(3, 5),
    "rnn_tanh": lambda: nn.RNN(3, 5),
    "rnn_relu": lambda: nn.RNN(3, 5, nonlinearity="relu"),
    "lstm_2_layers_bidirectional": lambda: nn.LSTM(3, 4, num_layers=2, bidirectional=True),
    "gru_2_layers_bidirectional_batch_first": lambda: nn.GRU(3, 4, 2, batch_first=True,
                                                             bidirectional=True),
    "rnn_2_layers_no_bias": lambda: nn.RNN(3, 4, 2, bias=False),
    "lstm_batch_first_no_bias": lambda: nn.LSTM(3, 4, batch_first=True, bias=False),
    "lstm_eval_dropout": lambda: nn.LSTM(3, 4, 2, dropout=0.5).eval(),
}


@DTYPES
@pytest.mark.parametrize("given_state", [True, False], ids=["hx", "zeros"])
@pytest.mark.parametrize("case", list(LAYERS))
def test_layer_matches_torch(case, given_state, dtype):
    nn.manual_seed(0)
    model = LAYERS[case]()
    assert_like_torch(model, make_arrays(model, case, 3, 6, given_state, dtype))


@DTYPES
@pytest.mark.parametrize("case", ["lstm_2_layers_bidirectional", "gru", "rnn_tanh"])
def test_unbatched_input_matches_torch(case, dtype):
    nn.manual_seed(1)
    model = LAYERS[case]()
    for given_state in (True, False):
        assert_like_torch(model, make_arrays(model, case + "u", None, 4, given_state, dtype))


@pytest.mark.parametrize("case", ["lstm_2_layers_bidirectional",
                                  "gru_2_layers_bidirectional_batch_first"])
def test_fused_graph_matches_torch(case):
    nn.manual_seed(2)
    model = LAYERS[case]()
    assert_like_torch(model, make_arrays(model, case, 3, 5, True, np.float32), fused=True)


CELLS = {
    "lstm_cell": lambda: nn.LSTMCell(3, 5),
    "gru_cell": lambda: nn.GRUCell(3, 5),
    "rnn_cell": lambda: nn.RNNCell(3, 5),
    "rnn_cell_relu_no_bias": lambda: nn.RNNCell(3, 5, bias=False, nonlinearity="relu"),
    "gru_cell_no_bias": lambda: nn.GRUCell(3, 5, bias=False),
}


@DTYPES
@pytest.mark.parametrize("batch", [4, None], ids=["batched", "unbatched"])
@pytest.mark.parametrize("case", list(CELLS))
def test_cell_matches_torch(case, batch, dtype):
    nn.manual_seed(3)
    model = CELLS[case]()
    for given_state in (True, False):
        assert_like_torch(model, make_arrays(model, case, batch, 1, given_state, dtype))


# ---- construction: torch's parameters, keys, initialisation and checks ---------------------

def test_parameters_keys_shapes_and_initialisation_are_torchs():
    for make in (lambda m: m.LSTM(7, 16, 2, bidirectional=True),
                 lambda m: m.GRU(7, 16, 3, bias=False), lambda m: m.RNN(7, 16),
                 lambda m: m.LSTMCell(7, 16), lambda m: m.GRUCell(7, 16, bias=False)):
        ours, theirs = make(nn), make(torch.nn)
        sd, tsd = ours.state_dict(), theirs.state_dict()
        assert list(sd) == list(tsd)
        assert [v.shape for v in sd.values()] == [tuple(v.shape) for v in tsd.values()]
        assert all(v.dtype == sg.float32 for v in sd.values())
        ours.load_state_dict({k: v.numpy() for k, v in tsd.items()})   # loads as it is
        bound = 1 / np.sqrt(16)
        for k, v in sd.items():                # U(-1/sqrt(H), 1/sqrt(H)), not constant
            assert np.abs(v).max() <= bound and np.abs(v).max() > 0.8 * bound, k
            assert abs(v.mean()) < 0.2 * bound and v.std() > 0.4 * bound, k
        assert repr(ours) == repr(theirs)
    lstm = nn.LSTM(2, 3, 2, bidirectional=True)
    assert [len(w) for w in lstm.all_weights] == [4] * 4
    assert lstm.all_weights[1][0] is lstm.weight_ih_l0_reverse
    lstm.flatten_parameters()


def test_constructor_checks():
    with pytest.raises(UnsupportedOpError, match="proj_size"):
        nn.LSTM(3, 8, proj_size=4)
    with pytest.raises(ValueError, match="only supported for LSTM"):
        nn.RNNBase("GRU", 3, 8, proj_size=4)
    with pytest.raises(ValueError, match="Unknown nonlinearity"):
        nn.RNN(3, 4, nonlinearity="sigmoid")
    with pytest.raises(ValueError, match="dropout should be a number"):
        nn.GRU(3, 4, 2, dropout=1.5)
    with pytest.raises(ValueError, match="hidden_size must be greater than zero"):
        nn.LSTM(3, 0)
    with pytest.warns(UserWarning, match="num_layers greater than 1"):
        nn.LSTM(3, 4, dropout=0.2)
    with pytest.raises(UnsupportedOpError, match="float32"):
        nn.GRU(3, 4, dtype=sg.float64)
    nn.RNN(3, 4, 1, "relu", True, True)      # torch's positional order, nonlinearity fourth


def test_forward_shape_checks():
    lstm, tracer = nn.LSTM(3, 4, 2), Tracer()
    x = tracer.input((5, 2, 3), "float32", "x")
    with pytest.raises(ShapeError, match="input_size"):
        lstm(tracer.input((5, 2, 6), "float32", "bad"))
    with pytest.raises(ShapeError, match="2D or 3D"):
        lstm(tracer.input((5, 2, 1, 3), "float32", "bad4"))
    h = tracer.input((2, 2, 4), "float32", "h")
    with pytest.raises(ShapeError, match="tuple"):
        lstm(x, h)
    with pytest.raises(ShapeError, match="Expected hidden size"):
        lstm(x, (h, tracer.input((1, 2, 4), "float32", "c")))
    with pytest.raises(ShapeError, match="Expected hidden size"):
        nn.GRU(3, 4)(x, tracer.input((1, 3, 4), "float32", "h1"))


# ---- dropout between layers ----------------------------------------------------------------

def traced_output(model, x: np.ndarray, seed: int = 0):
    model.name_parameters()
    tracer = Tracer(seed=seed, training=model.training)
    out, _ = model(tracer.input(x.shape, "float32", "x"))
    tracer.graph.outputs = {"y": out.value}
    bound = {n: p.storage for n, p in model.named_parameters()}
    if tracer._rng_step is not None:
        bound["optimizer.step"] = np.zeros((), np.int64)
    return tracer.graph, run_graph(tracer.graph, {"x": x}, bound)["y"]


def test_dropout_applies_between_layers_in_training_only():
    nn.manual_seed(4)
    model = nn.GRU(3, 16, num_layers=3, dropout=0.5, bidirectional=True)
    x = randn(seeded("dropout"), 7, 2, 3)
    train_graph, train = traced_output(model, x)
    assert [n.op for n in train_graph.nodes].count("dropout") == 2     # not after the last
    model.eval()
    eval_graph, evaluated = traced_output(model, x)
    assert "dropout" not in [n.op for n in eval_graph.nodes]
    want = torch_twin(model).eval()(torch.from_numpy(x))[0].detach().numpy()
    np.testing.assert_allclose(evaluated, want, rtol=1e-5, atol=1e-6)
    assert relative_error(train, want) > 1e-2            # masks changed the output
    model.train()
    assert np.array_equal(traced_output(model, x)[1], train)           # same seed, same masks
    assert not np.array_equal(traced_output(model, x, seed=1)[1], train)


# ---- the unstack op ------------------------------------------------------------------------

@pytest.mark.parametrize("reverse", [False, True])
def test_unstack_op_and_its_gradient(reverse):
    x = randn(seeded("unstack"), 2, 4, 3, dtype=np.float64)
    outs = op_forward("unstack", {"x": x}, dim=1, reverse=reverse)
    positions = [3, 2, 1, 0] if reverse else [0, 1, 2, 3]
    assert len(outs) == 4
    for out, k in zip(outs, positions):
        np.testing.assert_array_equal(out, x[:, k])
    dy = randn(seeded("unstack dy"), 2, 3, dtype=np.float64)   # on the first output only
    dx = op_vjp("unstack", {"x": x}, dy, ("x",), dim=1, reverse=reverse)["x"]
    want = np.zeros_like(x)
    want[:, positions[0]] = dy
    np.testing.assert_array_equal(dx, want)



@pytest.mark.parametrize("dim,reverse", [(0, False), (0, True), (1, True)])
def test_unstack_cuda_launcher_slices_each_position_into_its_output(monkeypatch, dim, reverse):
    """The cuda unstack writes output k through shape.cu's slice of position k (reversed
    when asked), viewed with the unit axis; the slice launcher is stood in for by NumPy."""
    from stepgraph.backends.cuda import recurrent as launchers

    def numpy_slice(ctx, x, y, d, start, stop, step=1):
        assert y.shape == x.shape[:d] + (1,) + x.shape[d + 1:]
        y[...] = x[(slice(None),) * d + (slice(start, stop, step),)]

    monkeypatch.setattr(launchers, "_check", lambda *a, **k: None)
    monkeypatch.setattr(launchers, "slice_forward", numpy_slice)
    x = randn(seeded("unstack cuda"), 3, 4, 2)
    want = op_forward("unstack", {"x": x}, dim=dim, reverse=reverse)
    outs = [np.full(w.shape, np.nan, np.float32) for w in want]     # poisoned
    node = type("Node", (), {"attrs": {"dim": dim, "reverse": reverse}})()
    launchers.IMPLS["unstack"](node, [x], outs, None)
    for got, w in zip(outs, want):
        np.testing.assert_array_equal(got, w)

def test_graph_holds_one_unstack_per_walk_and_no_slice_grad():
    """The steps come from one unstack per layer and direction, so the backward sums no
    zero-filled slice gradients of the whole sequence."""
    model = nn.LSTM(3, 4, num_layers=2, bidirectional=True)
    model.name_parameters()
    tracer = Tracer()
    out, (h, c) = model(tracer.input((9, 2, 3), "float32", "x"))
    loss = out.sum() + h.sum() + c.sum()
    append_backward(tracer, loss.value, list(tracer.graph.params))
    ops = [n.op for n in tracer.graph.nodes]
    walks = [n for n in tracer.graph.nodes if n.op == "unstack" and n.attrs["dim"] == 0]
    assert len(walks) == 4 and sum(n.attrs["reverse"] for n in walks) == 2
    assert "slice_grad" not in ops
    assert ops.count("matmul") + ops.count("linear") >= 4 * 9


# ---- packed sequences and pad_sequence -----------------------------------------------------

def test_packed_sequences_are_refused_naming_the_alternative():
    from stepgraph.nn.utils import rnn

    for fn in (rnn.pack_padded_sequence, rnn.pad_packed_sequence, rnn.pack_sequence):
        with pytest.raises(UnsupportedOpError, match="pad the sequences to one length"):
            fn(None, [3, 2])
    with pytest.raises(UnsupportedOpError, match="mask"):
        rnn.PackedSequence(None)
    packed = torch.nn.utils.rnn.pack_sequence([torch.zeros(3, 2), torch.zeros(1, 2)])
    with pytest.raises(UnsupportedOpError, match="PackedSequence input"):
        nn.LSTM(2, 3)(packed)


def test_pad_sequence_matches_torch():
    from stepgraph.nn.utils.rnn import pad_sequence

    gen = seeded("pad")
    seqs = [randn(gen, n, 2) for n in (3, 1, 4)]
    for batch_first in (False, True):
        for side in ("right", "left"):
            got = pad_sequence([sg.tensor(s) for s in seqs], batch_first, -1.0, side)
            want = torch.nn.utils.rnn.pad_sequence([torch.from_numpy(s) for s in seqs],
                                                   batch_first, -1.0, side)
            np.testing.assert_array_equal(np.asarray(got), want.numpy())


# ---- a small LSTM language model trained against torch -------------------------------------

def make_language_model(m, vocab: int = 13, dim: int = 8, hidden: int = 12):
    class LanguageModel(m.Module):
        def __init__(self):
            super().__init__()
            self.embed = m.Embedding(vocab, dim)
            self.lstm = m.LSTM(dim, hidden, num_layers=2, batch_first=True)
            self.head = m.Linear(hidden, vocab)

        def forward(self, tokens):
            out, _ = self.lstm(self.embed(tokens))
            return self.head(out)

    return LanguageModel()


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_lstm_language_model_trains_like_torch(opt):
    torch.manual_seed(5)
    model, ref = make_language_model(nn), make_language_model(torch.nn)
    model.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
    ref64 = make_language_model(torch.nn).double()
    ref64.load_state_dict(ref.state_dict())
    gen = seeded("lm" + opt)
    batches = [(x, (x + 1) % 13) for x in (gen.integers(0, 13, (4, 7)) for _ in range(5))]
    make_opt = {"sgd": (lambda: optim.SGD(lr=1.0, momentum=0.5),
                        lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.5)),
                "adam": (lambda: optim.Adam(lr=3e-2),
                         lambda ps: torch.optim.Adam(ps, lr=3e-2))}[opt]
    step = sg.compile_train_step(model, loss=lm_loss, optimizer=make_opt[0](),
                                 example_inputs=batches[0], device="cpu")
    before = {k: v.numpy() for k, v in model.state_dict().items()}
    torch_runs = []
    for net in (ref, ref64):
        topt, losses = make_opt[1](net.parameters()), []
        for x, y in batches:
            topt.zero_grad()
            logits = net(torch.from_numpy(x))
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 13),
                                                     torch.from_numpy(y).reshape(-1))
            loss.backward()
            topt.step()
            losses.append(loss.item())
        torch_runs.append(losses)
    got = [float(step(x, y)) for x, y in batches]
    t32, t64 = np.array(torch_runs[0]), np.array(torch_runs[1])
    assert np.abs(np.array(got) - t64).max() <= 8 * max(np.abs(t32 - t64).max(), 1e-6)
    after, a32, a64 = model.state_dict(), ref.state_dict(), ref64.state_dict()
    for k in before:
        change = after[k].numpy() - before[k]
        want = a64[k].numpy() - before[k]
        t_err = relative_error(a32[k].numpy() - before[k], want)
        assert np.abs(want).max() > 0, k
        assert relative_error(change, want) <= 8 * max(t_err, 1e-6), (k, t_err)


# ---- cuda against numpy --------------------------------------------------------------------

@pytest.mark.cuda
def test_lstm_step_cuda_matches_numpy():
    pytest.importorskip("cupy")
    if not sg.cuda.is_available():
        pytest.skip("no GPU")
    gen = seeded("lm cuda")
    batches = [(x, (x + 1) % 13) for x in (gen.integers(0, 13, (4, 7)) for _ in range(5))]
    states, losses = [], []
    for device in ("cpu", "cuda"):
        nn.manual_seed(6)
        model = make_language_model(nn)
        step = sg.compile_train_step(model, loss=lm_loss, optimizer=optim.Adam(lr=3e-2),
                                     example_inputs=batches[0], device=device)
        losses.append([float(step(x, y)) for x, y in batches])
        states.append(model.state_dict())
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)
    for k in states[0]:
        assert relative_error(states[1][k], states[0][k]) < 1e-4, k
