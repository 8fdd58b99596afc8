"""A token mixer written with the torch names model code reaches for beyond the layers:
causal einsum attention over L2-normalised queries and keys (F.normalize), a causal
depthwise convolution on F.pad's left padding, in-place residuals and masks (`+=`, add_,
relu_, masked_fill_), split and chunk along a dim, a product gate (prod), position features
from torch.outer, and bucket pooling with new_zeros and scatter_add."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MixerBlock(nn.Module):
    def __init__(self, dim, heads, block_size):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.full((heads, 1, 1), 4.0))
        self.conv = nn.Conv1d(dim, dim, 3, groups=dim)
        self.gate = nn.Linear(dim, 2 * dim)
        self.register_buffer("mask", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.shape
        h = self.norm(x)
        q, k, v = self.qkv(h).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        att = torch.einsum("bhqd,bhkd->bhqk", q, k) * self.scale
        att.masked_fill_(self.mask[:, :, :T, :T] == 0, float("-inf"))
        y = torch.einsum("bhqk,bhkd->bhqd", att.softmax(dim=-1), v)
        y = self.proj(y.transpose(1, 2).reshape(B, T, C))
        y += x
        c = self.conv(F.pad(h.transpose(1, 2), (2, 0))).transpose(1, 2)
        a, b = torch.chunk(self.gate(c), 2, dim=-1)
        c = c * torch.stack([torch.sigmoid(a), torch.sigmoid(b)], dim=-1).prod(dim=-1)
        c.relu_()
        return y.add_(c)


class TokenMixer(nn.Module):
    def __init__(self, vocab_size=32, dim=24, heads=3, layers=2, block_size=12, buckets=4):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.register_buffer("freqs", torch.exp(torch.arange(dim // 2) * -0.5))
        # float positions: broadcast as floats, cast to indices where used
        self.register_buffer("bucket", (torch.arange(block_size) * buckets // block_size).float())
        self.buckets = buckets
        self.blocks = nn.ModuleList(MixerBlock(dim, heads, block_size) for _ in range(layers))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        h = self.embed(idx)
        angles = torch.outer(torch.arange(T, dtype=h.dtype, device=h.device), self.freqs)
        h = h + torch.cat([angles.sin(), angles.cos()], dim=-1)
        for block in self.blocks:
            h = block(h)
        where = self.bucket[:T].view(1, T, 1).expand(B, T, h.shape[-1]).long()
        pooled = h.new_zeros(B, self.buckets, h.shape[-1]).scatter_add(1, where, h)
        h = h + pooled.mean(dim=1, keepdim=True) * (self.buckets / T)   # mean over tokens
        logits = self.head(h)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
