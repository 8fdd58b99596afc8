"""A channels-last step's float32 conv weights, written transposed by the update.

compile/layout.py feeds each convolution its weight as a permute of the parameter to (O, kh,
kw, C/groups), cuDNN's KRSC filter order. At fp32 and tf32 that is a permute of every conv
weight every step: read and written once each (a U-Net's 31M weights, 92 µs a step on an
H200). The update holds every new weight value in registers as it writes the parameter;
storing it a second time, transposed, into a float32 `state` copy that the convolutions read
instead costs one write where the permute cost a read and a write.

The float32 form of the bf16 weight copies (compile/autocast.py bind_weight_copies), with the
same life: the copy is made when the step binds its state (api.py) and again whenever the
parameters are written from outside the step; the update's attrs copies / copy_dims write it.
Only permutes of a float32 parameter whose transpose the update writes itself are taken
(ops/optim.py update_transposes: axis-0 slices kept whole, each fitting its tile); any other
stays a permute. Runs after bind_weight_copies, so the permutes a bf16 copy took are gone."""
from __future__ import annotations

from ..ir.graph import PARAM, STATE, Graph
from ..ops.optim import update_transposes
from .autocast import PERMUTED_WEIGHT_PREFIX, WeightCopy, weight_copy_name


def bind_permuted_weights(graph: Graph, copied=frozenset()) -> list[WeightCopy]:
    """Each permute of a float32 parameter that the update can write becomes a `state` value
    (`layout.float32@<dims>.<param>`) read by the permute's readers; the permute is dropped.
    A parameter gets one copy at most (the update's table has one a parameter): none for those
    in `copied` (a bf16 copy's) or a second permute of one. Returns the copies, for
    Optimizer.emit's weight_copies."""
    outputs = set(graph.outputs.values())
    copies: list[WeightCopy] = []
    dropped, taken = set(), set(copied)
    for n in graph.nodes:
        if n.op != "permute":
            continue
        param, copy = n.inputs[0], n.outputs[0]
        dims = tuple(int(d) for d in n.attrs["dims"])
        if param.role != PARAM or param.dtype != "float32" or param in taken or \
                copy in outputs or not update_transposes(dims, param.shape):
            continue
        taken.add(param)
        copy.role = STATE
        copy.name = weight_copy_name(param.name, dims, prefix=PERMUTED_WEIGHT_PREFIX)
        graph.state.append(copy)
        copies.append(WeightCopy(param, copy, dims))
        dropped.add(n)
    graph.nodes = [n for n in graph.nodes if n not in dropped]
    return copies
