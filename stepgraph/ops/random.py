"""Random family: `random`, draws made inside the step from the step's Philox stream (the
one dropout draws its masks from, rng.py), so each step draws fresh values and a replayed CUDA
graph draws what an eager run of the same step draws. The torch-level random tensors
(torch.rand / randn / randint / bernoulli / rand_like / randn_like, Tensor.bernoulli_ /
uniform_ / normal_ / exponential_ inside a traced forward: ir/tensor_random.py) are this op
followed by ordinary elementwise ops. It has no gradient: its only input is the step counter."""
from __future__ import annotations

import math

from .. import rng
from ..ir.graph import Node
from ..ir.ops import _need, defop, impl

KINDS = ("uniform", "normal")


@defop("random")
def _random(ins, attrs):
    """y (float32, attrs shape): Philox draws keyed by attrs seed, attrs site and the int64
    step counter ins[0]; kind "uniform": on [0, 1) in steps of 2^-24 (rng.uniform), kind
    "normal": standard normal (Box-Muller, rng.normal)."""
    _need(attrs["kind"] in KINDS, "random", f"kind must be one of {KINDS}, got {attrs['kind']}")
    _need(ins[0].shape == () and ins[0].dtype == "int64", "random",
          f"the step counter must be an int64 scalar, got {ins[0]!r}")
    return [(tuple(attrs["shape"]), "float32")]


@impl("random")
def random(node: Node, ins, outs, ctx):
    a = node.attrs
    draw = rng.uniform if a["kind"] == "uniform" else rng.normal
    y = outs[0]
    y[...] = draw(math.prod(y.shape), a["seed"], a["site"], int(ins[0])).reshape(y.shape)
