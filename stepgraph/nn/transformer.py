"""torch.nn's Transformer family, composed of MultiheadAttention, Linear, LayerNorm and Dropout:
the same submodules, state_dict keys, initial values (up to the random draws) and forward
arithmetic as torch's, post-norm by default and pre-norm with norm_first=True.

A stack (TransformerEncoder, TransformerDecoder) holds deep copies of the layer it is given,
so its layers start equal, as torch's do; nn.Transformer then draws every matrix again
(xavier_uniform_), as torch's _reset_parameters does. The masks are MultiheadAttention's
(bool True: not attended, or additive float; attn masks (L, S) or (N * heads, L, S), key
padding masks (N, S)). `is_causal` is a hint that the mask given is the causal one, as in
torch: with it and no mask MultiheadAttention raises; with a mask, the mask is what is applied
(the attention rewrite recognises a causal mask whose values are known when the step
compiles), so a stack does not compare its mask with the causal one as torch's does. torch's
fast paths (nested tensors, the fused encoder kernel) are not taken: `enable_nested_tensor`
and `mask_check` are accepted and change nothing.
"""
from __future__ import annotations

import copy
import math
from typing import Callable

import numpy as np

from ..functions import factories
from . import functional as F
from . import init
from .container import ModuleList
from .layers import Dropout, LayerNorm, Linear, MultiheadAttention
from .module import Module

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


def _activation(activation: str | Callable) -> Callable:
    if isinstance(activation, str):
        if activation not in ACTIVATIONS:
            raise RuntimeError(f"activation should be relu/gelu, not {activation}")
        return ACTIVATIONS[activation]
    return activation


def _clones(layer: Module, n: int) -> ModuleList:
    return ModuleList([copy.deepcopy(layer) for _ in range(n)])


class _Block(Module):
    """What an encoder and a decoder layer share, under torch's names and in its order: the
    attentions, the feed-forward block (linear1, dropout, linear2), one LayerNorm and one
    Dropout per sublayer, and the residual arrangement (post-norm, or pre-norm when
    norm_first)."""

    def __init__(self, attentions: tuple[str, ...], d_model, nhead, dim_feedforward, dropout,
                 activation, layer_norm_eps, batch_first, norm_first, bias):
        super().__init__()
        for name in attentions:
            setattr(self, name, MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                                   batch_first=batch_first))
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias)
        self.norm_first = norm_first
        sublayers = range(1, len(attentions) + 2)
        for i in sublayers:
            setattr(self, f"norm{i}", LayerNorm(d_model, eps=layer_norm_eps, bias=bias))
        for i in sublayers:
            setattr(self, f"dropout{i}", Dropout(dropout))
        self.activation = _activation(activation)

    def _ff_block(self, x, dropout: Dropout):
        return dropout(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def _residual(self, x, norm: LayerNorm, block: Callable):
        """x + block(norm(x)) with norm_first, else norm(x + block(x))."""
        return x + block(norm(x)) if self.norm_first else norm(x + block(x))


class TransformerEncoderLayer(_Block):
    """torch.nn.TransformerEncoderLayer: self-attention, then the feed-forward block."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: str | Callable = F.relu,
                 layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None):
        super().__init__(("self_attn",), d_model, nhead, dim_feedforward, dropout, activation,
                         layer_norm_eps, batch_first, norm_first, bias)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):
        def attend(x):
            return self.dropout1(self.self_attn(x, x, x, attn_mask=src_mask,
                                                key_padding_mask=src_key_padding_mask,
                                                need_weights=False, is_causal=is_causal)[0])

        x = self._residual(src, self.norm1, attend)
        return self._residual(x, self.norm2, lambda h: self._ff_block(h, self.dropout2))


class TransformerDecoderLayer(_Block):
    """torch.nn.TransformerDecoderLayer: self-attention, attention over the encoder's
    memory, then the feed-forward block."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: str | Callable = F.relu,
                 layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None):
        super().__init__(("self_attn", "multihead_attn"), d_model, nhead, dim_feedforward,
                         dropout, activation, layer_norm_eps, batch_first, norm_first, bias)

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal: bool = False,
                memory_is_causal: bool = False):
        def attend(x):
            return self.dropout1(self.self_attn(x, x, x, attn_mask=tgt_mask,
                                                key_padding_mask=tgt_key_padding_mask,
                                                need_weights=False, is_causal=tgt_is_causal)[0])

        def attend_memory(x):
            return self.dropout2(self.multihead_attn(
                x, memory, memory, attn_mask=memory_mask,
                key_padding_mask=memory_key_padding_mask, need_weights=False,
                is_causal=memory_is_causal)[0])

        x = self._residual(tgt, self.norm1, attend)
        x = self._residual(x, self.norm2, attend_memory)
        return self._residual(x, self.norm3, lambda h: self._ff_block(h, self.dropout3))


class TransformerEncoder(Module):
    """torch.nn.TransformerEncoder: num_layers copies of encoder_layer, then `norm` if given."""

    def __init__(self, encoder_layer: TransformerEncoderLayer, num_layers: int, norm=None,
                 enable_nested_tensor: bool = True, mask_check: bool = True):
        super().__init__()
        self.layers = _clones(encoder_layer, num_layers)
        self.num_layers, self.norm = num_layers, norm

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal: bool | None = None):
        for layer in self.layers:
            src = layer(src, src_mask=mask, src_key_padding_mask=src_key_padding_mask,
                        is_causal=bool(is_causal))
        return src if self.norm is None else self.norm(src)


class TransformerDecoder(Module):
    """torch.nn.TransformerDecoder: num_layers copies of decoder_layer, then `norm` if given."""

    def __init__(self, decoder_layer: TransformerDecoderLayer, num_layers: int, norm=None):
        super().__init__()
        self.layers = _clones(decoder_layer, num_layers)
        self.num_layers, self.norm = num_layers, norm

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal: bool | None = None,
                memory_is_causal: bool = False):
        for layer in self.layers:
            tgt = layer(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                        tgt_key_padding_mask=tgt_key_padding_mask,
                        memory_key_padding_mask=memory_key_padding_mask,
                        tgt_is_causal=bool(tgt_is_causal), memory_is_causal=memory_is_causal)
        return tgt if self.norm is None else self.norm(tgt)


class Transformer(Module):
    """torch.nn.Transformer: an encoder and a decoder stack, each ending in a LayerNorm, every
    matrix drawn again by xavier_uniform_ (torch's _reset_parameters)."""

    def __init__(self, d_model: int = 512, nhead: int = 8, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str | Callable = F.relu, custom_encoder=None, custom_decoder=None,
                 layer_norm_eps: float = 1e-5, batch_first: bool = False,
                 norm_first: bool = False, bias: bool = True, device=None, dtype=None):
        super().__init__()
        common = dict(dim_feedforward=dim_feedforward, dropout=dropout, activation=activation,
                      layer_norm_eps=layer_norm_eps, batch_first=batch_first,
                      norm_first=norm_first, bias=bias)
        self.encoder = custom_encoder if custom_encoder is not None else TransformerEncoder(
            TransformerEncoderLayer(d_model, nhead, **common), num_encoder_layers,
            LayerNorm(d_model, eps=layer_norm_eps, bias=bias))
        self.decoder = custom_decoder if custom_decoder is not None else TransformerDecoder(
            TransformerDecoderLayer(d_model, nhead, **common), num_decoder_layers,
            LayerNorm(d_model, eps=layer_norm_eps, bias=bias))
        self.d_model, self.nhead, self.batch_first = d_model, nhead, batch_first
        for p in self.parameters():
            if p.ndim > 1:
                init.xavier_uniform_(p)

    def forward(self, src, tgt, src_mask=None, tgt_mask=None, memory_mask=None,
                src_key_padding_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, src_is_causal: bool | None = None,
                tgt_is_causal: bool | None = None, memory_is_causal: bool = False):
        batch_axis = 0 if self.batch_first else 1
        if src.ndim == 3 and src.shape[batch_axis] != tgt.shape[batch_axis]:
            raise RuntimeError("the batch number of src and tgt must be equal")
        if src.shape[-1] != self.d_model or tgt.shape[-1] != self.d_model:
            raise RuntimeError("the feature number of src and tgt must be equal to d_model")
        memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                              is_causal=src_is_causal)
        return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                            tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask,
                            tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)

    @staticmethod
    def generate_square_subsequent_mask(sz: int, device=None, dtype=None):
        """The causal mask: -inf above the diagonal, 0 on and below it (float32 by default)."""
        return factories.tensor(np.triu(np.full((sz, sz), -math.inf, np.float32), 1),
                                dtype=dtype)
