"""The fused `pointwise` op: a straight-line program of elementwise ops over one output shape.

Made only by the fusion pass (compile/pointwise.py), after autodiff, so it has no VJP. Its
program reads the node's inputs (broadcast to attrs shape) as registers 0..k-1; instruction j
writes register k + j; attrs results name the registers the node's outputs hold. The NumPy
reference runs each instruction through the op's own reference implementation, so a fused
graph computes exactly what the unfused one did.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends.numpy.kernels import IMPLS, impl
from ..ir.graph import Node, Value
from ..ir.ops import _need, defop

# Elementwise ops a program may hold: one output, the output's shape is the broadcast shape
# of the inputs, every element depends only on the same (broadcast) element of each input.
PROGRAM_OPS = ("add", "binary", "scalar", "act", "act_grad", "expand")


@dataclass(frozen=True)
class Instr:
    op: str                        # one of PROGRAM_OPS
    args: tuple[int, ...]          # registers read
    attrs: tuple[tuple[str, Any], ...] = ()   # the original node's attrs, sorted

    @property
    def attr(self) -> dict:
        return dict(self.attrs)


@defop("pointwise")
def _pointwise(ins, attrs):
    """outs = the registers attrs results of attrs program run elementwise over attrs shape,
    every input broadcast to that shape (see ops/pointwise.py)."""
    shape = tuple(attrs["shape"])
    for v in ins:
        _need(len(v.shape) <= len(shape) and all(
            d in (1, s) for d, s in zip(v.shape[::-1], shape[::-1])),
            "pointwise", f"input {v.shape} does not broadcast to {shape}")
    return [(shape, ins[0].dtype)] * len(attrs["results"])


@impl("pointwise")
def _pointwise_impl(node: Node, ins, outs, ctx):
    shape = tuple(node.attrs["shape"])
    regs = list(ins)
    for instr in node.attrs["program"]:
        args = [regs[r] for r in instr.args]
        step = Node(instr.op, [Value(np.shape(a), str(a.dtype)) for a in args],
                    [Value(shape, str(args[0].dtype))], instr.attr)
        out = np.empty(shape, dtype=args[0].dtype)
        IMPLS[instr.op](step, args, [out], ctx)
        regs.append(out)
    for out, r in zip(outs, node.attrs["results"]):
        out[...] = regs[r]
