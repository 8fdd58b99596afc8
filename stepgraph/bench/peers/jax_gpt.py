"""The `gpt` workload in plain JAX for the JAX peer: nanoGPT's model written with jax.numpy, as
a JAX user writes a small GPT without a layer library.

Parameters are a dict keyed by nanoGPT's state_dict names; the classifier reuses the token
embedding (`transformer.wte.weight`), so the tied weight is one array and its gradient the sum
of both uses. Attention is written out (scores, causal mask, softmax, dropout, weighted sum):
jax.nn.dot_product_attention has no dropout, and the workload drops attention weights. XLA fuses
the mask, softmax and dropout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stepgraph.bench.workloads import GPT, LayerParams, named_parameters

LAYER_NORM_EPS = 1e-5
TIED = "lm_head.weight"


def initial_params(parameters: list[LayerParams]) -> dict[str, np.ndarray]:
    """The shared parameters by state_dict key, the tied classifier left out."""
    return {key: value for key, value in named_parameters(parameters).items() if key != TIED}


def _dropout(x, rate: float, key):
    if rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype))


def _layer_norm(x, params, name: str):
    xf = x.astype(jnp.float32)
    mean = xf.mean(axis=-1, keepdims=True)
    var = jnp.square(xf - mean).mean(axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS) * params[f"{name}.weight"]
    bias = params.get(f"{name}.bias")
    return (y if bias is None else y + bias).astype(x.dtype)


def _linear(x, params, name: str):
    y = x @ params[f"{name}.weight"].T
    bias = params.get(f"{name}.bias")
    return y if bias is None else y + bias


def _attention(model: GPT, x, params, name: str, key):
    B, T, C = x.shape
    nh, hs = model.n_head, C // model.n_head
    q, k, v = jnp.split(_linear(x, params, f"{name}.c_attn"), 3, axis=-1)
    q, k, v = (t.reshape(B, T, nh, hs).transpose(0, 2, 1, 3) for t in (q, k, v))
    scores = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / np.sqrt(hs))
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    scores = jnp.where(causal, scores, jnp.asarray(-jnp.inf, scores.dtype))
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    y = _dropout(weights, model.dropout, key) @ v
    return _linear(y.transpose(0, 2, 1, 3).reshape(B, T, C), params, f"{name}.c_proj")


def gpt_forward(model: GPT, params, idx, key):
    """Logits (B, T, vocab_size) of token indices idx (B, T), dropout drawn from `key`."""
    keys = iter(jax.random.split(key, 1 + 3 * model.n_layer))
    T = idx.shape[1]
    x = params["transformer.wte.weight"][idx] + params["transformer.wpe.weight"][:T]
    x = _dropout(x, model.dropout, next(keys))
    for i in range(model.n_layer):
        block = f"transformer.h.{i}"
        h = _attention(model, _layer_norm(x, params, f"{block}.ln_1"), params, f"{block}.attn",
                       next(keys))
        x = x + _dropout(h, model.dropout, next(keys))
        h = _linear(_layer_norm(x, params, f"{block}.ln_2"), params, f"{block}.mlp.c_fc")
        h = _linear(jax.nn.gelu(h, approximate=True), params, f"{block}.mlp.c_proj")
        x = x + _dropout(h, model.dropout, next(keys))
    x = _layer_norm(x, params, "transformer.ln_f")
    return x @ params["transformer.wte.weight"].T
