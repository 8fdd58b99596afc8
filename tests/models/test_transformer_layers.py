"""torch.nn's Transformer family (stepgraph/nn/transformer.py) against torch's: the same
state_dict keys and shapes for each option, torch's initial structure (a stack's layers start
equal; nn.Transformer's matrices drawn again, its biases zero), and training: a compiled step
and a training loop of an encoder-decoder with a causal target mask and a key padding mask,
judged by the tolerance policy against torch float64 from the same start."""
from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
import torch

import stepgraph as sg
from stepgraph import nn as snn
from stepgraph import optim
from tests.reference import assert_close_to_reference, assert_state_changes_close

D, HEADS, FF, SRC, TGT, BATCH, VOCAB = 16, 4, 24, 7, 5, 3, 11

OPTIONS = [dict(), dict(norm_first=True), dict(bias=False), dict(activation="gelu"),
           dict(batch_first=True, layer_norm_eps=1e-6)]


def shapes(model) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "default")
def test_state_dict_keys_and_shapes_are_torchs(options):
    for make in (lambda nn: nn.TransformerEncoder(
                     nn.TransformerEncoderLayer(D, HEADS, FF, **options), 2, nn.LayerNorm(D)),
                 lambda nn: nn.TransformerDecoder(
                     nn.TransformerDecoderLayer(D, HEADS, FF, **options), 2),
                 lambda nn: nn.Transformer(D, HEADS, 2, 1, FF, **options)):
        ours, theirs = make(snn), make(torch.nn)
        assert shapes(ours) == shapes(theirs)
        assert [n for n, _ in ours.named_modules()] == [n for n, _ in theirs.named_modules()]


def test_a_stacks_layers_start_equal_and_a_transformer_draws_its_matrices_again():
    encoder = snn.TransformerEncoder(snn.TransformerEncoderLayer(D, HEADS, FF), 3)
    first, third = (encoder.layers[i].state_dict() for i in (0, 2))
    assert all(np.array_equal(first[k], third[k]) for k in first)
    model = snn.Transformer(D, HEADS, 2, 2, FF)
    state = model.state_dict()
    # the deep copies differ once xavier_uniform_ has drawn every matrix again
    for k in ("self_attn.in_proj_weight", "linear1.weight", "linear2.weight"):
        assert not np.array_equal(state[f"encoder.layers.0.{k}"], state[f"encoder.layers.1.{k}"])
    bound = np.sqrt(6 / (D + FF))                      # xavier_uniform_ of linear1 (FF, D)
    assert np.abs(state["decoder.layers.0.linear1.weight"]).max() <= bound
    assert not state["encoder.layers.0.self_attn.in_proj_bias"].any()
    assert (state["decoder.norm.weight"] == 1).all()


def test_the_causal_mask_and_mistakes_are_torchs():
    np.testing.assert_array_equal(snn.Transformer.generate_square_subsequent_mask(4).numpy(),
                                  torch.nn.Transformer.generate_square_subsequent_mask(4).numpy())
    with pytest.raises(RuntimeError, match="activation should be relu/gelu, not tanh"):
        snn.TransformerEncoderLayer(D, HEADS, activation="tanh")
    model = snn.Transformer(D, HEADS, 1, 1, FF)
    with pytest.raises(RuntimeError, match="batch number of src and tgt"):
        model(sg.zeros(SRC, 2, D), sg.zeros(TGT, 3, D))


def make_seq2seq(nn, options):
    """Embeddings, nn.Transformer (dropout 0) and a head: (src ids, tgt ids) -> logits."""

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D)
            self.core = nn.Transformer(D, HEADS, 2, 2, FF, dropout=0.0, batch_first=True,
                                       **options)
            self.head = nn.Linear(D, VOCAB)
            self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(TGT))

        def forward(self, src, tgt):
            padding = src == 0
            h = self.core(self.embed(src), self.embed(tgt), tgt_mask=self.causal,
                          src_key_padding_mask=padding, memory_key_padding_mask=padding)
            return self.head(h)

    return Seq2Seq()


def batches(steps: int):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        src = rng.integers(1, VOCAB, (BATCH, SRC))
        src[:, -2:] *= rng.integers(0, 2, (BATCH, 2))       # some padding (id 0) at the end
        tgt = rng.integers(1, VOCAB, (BATCH, TGT + 1))
        out.append((src.astype(np.int64), tgt[:, :-1].astype(np.int64),
                    tgt[:, 1:].astype(np.int64)))
    return out


def train_script(ns, model, data) -> list[float]:
    """A torch-style training loop written once, run with `ns` = torch or stepgraph (under
    loop capture): zero_grad, forward, loss, backward, step; each loss read after its step."""
    opt = ns.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for src, tgt, y in data:
        opt.zero_grad()
        logits = model(ns.from_numpy(src), ns.from_numpy(tgt))
        loss = ns.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                              ns.from_numpy(y).reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def start(options):
    """torch's model, the batches, torch's float64 and float32 runs (losses, final states),
    and stepgraph's model from torch's initial state with that state."""
    ref, data = make_seq2seq(torch.nn, options), batches(4)
    runs = {}
    for dtype in (torch.float64, torch.float32):
        twin = copy.deepcopy(ref).to(dtype)
        runs[dtype] = (train_script(torch, twin, data),
                       {k: v.double().numpy() for k, v in twin.state_dict().items()})
    model = make_seq2seq(snn, options)
    model.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    return model, before, data, runs[torch.float64], runs[torch.float32]


def assert_trained_like_torch(got, model, before, run64, run32, what):
    """Losses and every parameter's change judged by the policy; the causal mask buffer
    (its -inf has no finite change) kept as it was."""
    assert_close_to_reference(got, run64[0], run32[0], what)
    after = model.state_dict()
    np.testing.assert_array_equal(after["causal"], before["causal"])
    states = [{k: v for k, v in d.items() if k != "causal"}
              for d in (before, after, run64[1], run32[1])]
    assert_state_changes_close(*states)


@pytest.mark.parametrize("options", [dict(), dict(norm_first=True, activation="gelu")],
                         ids=["post-norm", "pre-norm-gelu"])
def test_an_encoder_decoder_trains_like_torch(options):
    """Four SGD steps of a compiled train step; losses and every parameter's change against
    torch float64."""
    model, before, data, run64, run32 = start(options)

    def loss(logits, y):
        return sg.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    step = sg.compile_train_step(model, loss, optim.SGD(lr=0.1, momentum=0.9),
                                 example_inputs=data[0], device="cpu")
    got = [float(step(*batch)) for batch in data]
    # each of the six attentions (encoder, masked decoder, cross) runs as the fused op
    ops = Counter(n.op for n in next(iter(step.executables.values())).plan.steps)
    assert ops["sdpa"] == ops["sdpa_grad"] == 6
    assert_trained_like_torch(got, model, before, run64, run32, "compiled step losses")


def test_an_encoder_decoder_trains_like_torch_in_a_captured_loop():
    """The same model trained by the torch-style loop itself, run with stepgraph."""
    model, before, data, run64, run32 = start({})
    got = train_script(sg, model, data)
    assert_trained_like_torch(got, model, before, run64, run32, "captured loop losses")
