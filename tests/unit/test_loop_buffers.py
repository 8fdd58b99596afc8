"""A model whose forward reads a buffer registered in __init__ (minGPT's causal mask), trained
by a plain captured loop with no state_dict loaded and no compile call before it: the loop
names the module's parameters and buffers before it traces the first forward. Judged against
torch float32 / float64 by the tolerance policy (parameter changes against float64)."""
from __future__ import annotations

import math

import numpy as np
import torch

import stepgraph as sg
from tests.reference import assert_changes_close

VOCAB, BLOCK, EMBD, HEADS, BATCH, STEPS = 13, 8, 16, 2, 4, 4


def mingpt(fw):
    """minGPT's CausalSelfAttention (its registered `bias` mask) in a one-block model."""
    nn, F = fw.nn, fw.nn.functional

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(EMBD, 3 * EMBD)
            self.c_proj = nn.Linear(EMBD, EMBD)
            self.register_buffer("bias", fw.tril(fw.ones(BLOCK, BLOCK))
                                 .view(1, 1, BLOCK, BLOCK))

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(EMBD, dim=2)
            k = k.view(B, T, HEADS, C // HEADS).transpose(1, 2)
            q = q.view(B, T, HEADS, C // HEADS).transpose(1, 2)
            v = v.view(B, T, HEADS, C // HEADS).transpose(1, 2)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, EMBD)
            self.ln = nn.LayerNorm(EMBD)
            self.attn = CausalSelfAttention()
            self.head = nn.Linear(EMBD, VOCAB)

        def forward(self, idx):
            x = self.wte(idx)
            return self.head(x + self.attn(self.ln(x)))

    return GPT()


def batches():
    gen = np.random.default_rng(1)
    return [(gen.integers(0, VOCAB, (BATCH, BLOCK)), gen.integers(0, VOCAB, (BATCH, BLOCK)))
            for _ in range(STEPS)]


def train(fw, model):
    opt = fw.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in batches():
        opt.zero_grad()
        logits = model(fw.from_numpy(x))
        loss = fw.nn.functional.cross_entropy(logits.view(-1, VOCAB), fw.from_numpy(y).view(-1))
        loss.backward()
        opt.step()


def params(model) -> dict[str, np.ndarray]:
    return {n: np.array(p.detach().numpy() if hasattr(p, "detach") else p.numpy(), np.float64)
            for n, p in model.named_parameters()}


def test_mingpt_buffer_trains_in_a_plain_loop_as_torch():
    torch.manual_seed(0)
    t32 = mingpt(torch)
    t64 = mingpt(torch).double()
    t64.load_state_dict({k: v.double() for k, v in t32.state_dict().items()})
    ours = mingpt(sg)
    # weights copied in by value: no load_state_dict, which would name the buffers first
    for (_, p), (_, q) in zip(ours.named_parameters(), t32.named_parameters()):
        p.data = q.detach().numpy()
    assert ours.attn.bias.name == ""
    start = params(t32)
    train(torch, t32)
    train(torch, t64)
    train(sg, ours)
    assert ours.attn.bias.name == "attn.bias"
    s32, s64, got = params(t32), params(t64), params(ours)
    for k in s64:
        assert_changes_close(start[k], got[k], s64[k], s32[k], f"change of {k}")
    np.testing.assert_array_equal(ours.attn.bias.numpy(), t32.attn.bias.numpy())


def scaled_linear_loop(fw):
    model = fw.nn.Linear(3, 1)
    model.weight.data = fw.tensor(np.array([[0.5, -1.0, 0.25]], np.float32))
    model.bias.data = fw.zeros(1)
    model.register_buffer("scale", fw.tensor(2.0))
    opt = fw.optim.SGD(model.parameters(), lr=0.1)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for _ in range(2):
        opt.zero_grad()
        loss = (model(fw.from_numpy(x)) * model.scale).sum()
        loss.backward()
        opt.step()
    return model, loss.item()


def test_a_buffer_read_at_script_level_is_named():
    """A buffer the script reads itself, outside any forward, is a state of the step too."""
    ours, loss = scaled_linear_loop(sg)
    ref, ref_loss = scaled_linear_loop(torch)
    assert ours.scale.name
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for k, v in ref.state_dict().items():
        np.testing.assert_allclose(ours.state_dict()[k], v.numpy(), rtol=1e-6, atol=1e-7)
