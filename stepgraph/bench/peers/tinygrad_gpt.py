"""The `gpt` workload with tinygrad.nn layers for the tinygrad peer: nanoGPT's model, attribute
names as its state_dict keys (so the shared parameters load by key), the classifier tied to
the token embedding, attention through Tensor.scaled_dot_product_attention(is_causal=True,
dropout_p), and nanoGPT's clipping of the gradients' global norm.
"""

from __future__ import annotations

from stepgraph.bench.workloads import GPT

TIED = "lm_head.weight"  # the classifier's key: the token embedding's weight, loaded once


class _CausalSelfAttention:
    def __init__(self, config: GPT):
        from tinygrad import nn
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.config = config

    def __call__(self, x):
        B, T, C = x.shape
        nh, p = self.config.n_head, self.config.dropout
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.reshape(B, T, nh, C // nh).transpose(1, 2) for t in (q, k, v))
        y = q.scaled_dot_product_attention(k, v, dropout_p=p, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C)).dropout(p)


class _MLP:
    def __init__(self, config: GPT):
        from tinygrad import nn
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.p = config.dropout

    def __call__(self, x):
        return self.c_proj(self.c_fc(x).gelu(approximate="tanh")).dropout(self.p)


class _Block:
    def __init__(self, config: GPT):
        from tinygrad import nn
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = _CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = _MLP(config)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTModel:
    """nanoGPT's GPT: (B, T) token indices -> (B, T, vocab_size) logits."""

    def __init__(self, config: GPT):
        from tinygrad import nn
        if not config.bias:
            raise ValueError("the tinygrad GPT keeps nanoGPT's biases (bias=True)")
        self.config = config
        self.transformer = {"wte": nn.Embedding(config.vocab_size, config.n_embd),
                            "wpe": nn.Embedding(config.block_size, config.n_embd),
                            "h": [_Block(config) for _ in range(config.n_layer)],
                            "ln_f": nn.LayerNorm(config.n_embd)}
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """The classifier uses the token embedding's weight tensor; again after loading a
        state_dict, which replaces that tensor."""
        self.lm_head.weight = self.transformer["wte"].weight

    def __call__(self, idx):
        from tinygrad import Tensor
        t = self.transformer
        pos = Tensor.arange(idx.shape[1]).to(idx.device)
        x = (t["wte"](idx) + t["wpe"](pos)).dropout(self.config.dropout)
        for block in t["h"]:
            x = block(x)
        return self.lm_head(t["ln_f"](x))


def parameters_of(model: GPTModel) -> list:
    """Every parameter once (the tied weight is one tensor)."""
    from tinygrad.nn.state import get_parameters
    seen, params = set(), []
    for p in get_parameters(model):
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def clip_grad_norm(params: list, max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_: scale every gradient by min(1, max_norm / (norm +
    1e-6)), norm the global L2 norm of all gradients (lazy tensors: no sync)."""
    from tinygrad import Tensor
    norm = Tensor.stack(*[p.grad.float().square().sum() for p in params]).sum().sqrt()
    scale = (max_norm / (norm + 1e-6)).minimum(1.0)
    for p in params:
        p.grad = p.grad * scale.cast(p.grad.dtype)
