"""Dropout family: dropout (elementwise, or per channel: Dropout2d) and its gradient.
`keep_mask` is the one Philox keep mask every op that drops draws (dropout, the pointwise
programs, attention)."""
from __future__ import annotations

import math

import numpy as np

from .. import rng
from ..ir.graph import Node
from ..ir.ops import defop, impl, vjp


@defop("dropout")
def _dropout(ins, attrs):
    """y = x * mask / (1 - p); mask (uint8) keeps an element when its Philox4x32-10 uniform
    >= p (see rng.py: key = attrs seed, counter = (index >> 2, site, step lo, step hi)).
    ins = (x, step); with attrs per_channel the mask is (N, C) and spans each plane."""
    x = ins[0]
    mshape = x.shape[:2] if attrs.get("per_channel") else x.shape
    return [(x.shape, x.dtype), (mshape, "uint8")]


@defop("dropout_grad")
def _dropout_grad(ins, attrs):
    """dx = dy * mask / (1 - p), mask broadcast over planes when per_channel."""
    return [(ins[0].shape, ins[0].dtype)]


@vjp("dropout")
def _dropout_vjp(emit, node: Node, dy: list, wants) -> list:
    dx = emit("dropout_grad", [dy[0], node.outputs[1]], p=node.attrs["p"],
              per_channel=node.attrs["per_channel"])[0]
    return [dx, None]


def keep_mask(shape: tuple, p: float, attrs, step) -> np.ndarray:
    """The dropout op's uint8 keep mask of a `shape` tensor: Philox at each element's flat
    index, keyed by attrs seed and site and the step counter (rng.py). Every op that drops
    (dropout, the pointwise programs, attention) draws it here."""
    return rng.dropout_keep_mask(math.prod(shape), p, attrs["seed"], attrs["site"],
                                 int(step)).reshape(shape)


def _broadcast_mask(mask: np.ndarray, like: np.ndarray) -> np.ndarray:
    return mask.reshape(mask.shape + (1,) * (like.ndim - mask.ndim))


def dropped(x: np.ndarray, mask: np.ndarray, p: float) -> np.ndarray:
    """x * mask * float32(1 / (1 - p)) in x's dtype, mask broadcast over planes: the dropout
    op's and its gradient's arithmetic, which the norms that fold a dropout in
    (ops/layer_norm.py) share."""
    return x * _broadcast_mask(mask, x) * x.dtype.type(1.0 / (1.0 - p))


@impl("dropout")
def dropout(node: Node, ins, outs, ctx):
    x, step = ins
    a = node.attrs
    y, mask = outs
    mask[...] = keep_mask(mask.shape, a["p"], a, step)
    y[...] = dropped(x, mask, a["p"])


@impl("dropout_grad")
def dropout_grad(node: Node, ins, outs, ctx):
    dy, mask = ins
    outs[0][...] = dropped(dy, mask, node.attrs["p"])
