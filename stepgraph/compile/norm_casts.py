"""Autocast's casts around a normalisation, done by the norm's own kernels (precision="bf16";
"fp16" for the first).

Autocast runs LayerNorm and RMSNorm in float32, so their gradient's dx is float32, and the
GEMM that reads it next (the backward of the Linear or convolution before the norm) reads it
through a cast to bf16: one more pass over a (tokens, C) tensor per norm and step. The
gradient kernel holds dx in registers when it stores it, so it rounds and stores the half copy
as well:

    layer_norm_grad -> dx (float32) -> cast(bf16) -> d16          (dx read elsewhere too)
    =>   layer_norm_grad(dx_half=bf16) -> (dx, ..., d16)

and where the cast is dx's only reader, dx itself is stored in bf16 (the float32 store goes):

    layer_norm_grad -> dx -> cast(bf16) -> d16    =>    layer_norm_grad -> d16 (as dx)

Both are the cast's bits: the float32 dx rounded once. add_layer_norm_grad (the residual
stream's: its dx is also the next block's ds, read in float32) and rms_norm_grad alike.

The forward's twin: a LayerNorm that reads a bf16 GEMM or convolution output (ConvNeXt's
depthwise convolution, a patch embedding) reads it through autocast's cast to float32, and its
gradient reads that float32 copy again. Both read the bf16 value instead, widened as loaded
(exact), and the cast goes (fuse_norm_input_casts).
"""
from __future__ import annotations

from ..ir.graph import BF16, HALF_DTYPES, Graph, Node
from .rewrite import _copy, _rebuild

NORM_GRADS = ("layer_norm_grad", "add_layer_norm_grad", "rms_norm_grad")
NORM_INPUTS = ("layer_norm",)     # the norms whose kernels read a bf16 x (fuse_norm_input_casts)


def fuse_norm_grad_casts(graph: Graph) -> Graph:
    """`graph` with each float32 dx's cast to a half dtype stored by its norm gradient
    (module docstring); every other node as it was."""
    graph = _copy(graph)
    users = graph.consumers()
    outputs = set(graph.outputs.values())
    drop: set[Node] = set()
    for n in graph.nodes:
        if n.op not in NORM_GRADS or n.attrs.get("dx_half"):
            continue
        dx = n.outputs[0]
        readers = users.get(dx, [])
        casts = [r for r in readers if r.op == "cast" and r.attrs["dtype"] in HALF_DTYPES]
        if not casts or dx.dtype != "float32":
            continue
        cast = casts[0]
        if len(readers) == 1 and dx not in outputs:
            n.outputs = [cast.outputs[0], *n.outputs[1:]]
        else:
            n.attrs["dx_half"] = cast.attrs["dtype"]
            n.outputs = [*n.outputs, cast.outputs[0]]
        drop.add(cast)
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], {})


def fuse_norm_input_casts(graph: Graph) -> Graph:
    """`graph` with each layer_norm that reads a bf16 value through a cast to float32 read by
    nothing else than it and its layer_norm_grad (as x) reading the bf16 value itself."""
    graph = _copy(graph)
    users, producers = graph.consumers(), graph.producers()
    outputs = set(graph.outputs.values())
    subst, drop = {}, set()
    for n in graph.nodes:
        if n.op not in NORM_INPUTS:
            continue
        x = n.inputs[0]
        cast = producers.get(x)
        if cast is None or cast.op != "cast" or cast.inputs[0].dtype != BF16 or \
                x.dtype != "float32" or x in outputs:
            continue
        if all(r is n or (r.op == "layer_norm_grad" and r.inputs[1] is x and
                          x not in (r.inputs[0], *r.inputs[2:])) for r in users[x]):
            subst[x] = cast.inputs[0]
            drop.add(cast)
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], subst)
