"""Autocast's casts around a normalisation, done by the norm's own kernels (precision="bf16";
"fp16" for the first two).

The LayerNorm's y rounded to bf16 for the GEMM after it, and that GEMM's dx widened back as
the norm gradient's dy, are stored and loaded so by the norm's kernels (fuse_layer_norm_casts).

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
stream's: its dx is also the next block's ds, read in float32), rms_norm_grad and
add_rms_norm_grad alike. Where the half copy's only reader is a dropout's gradient (the
residual branch's dropout, x + dropout(proj(h)): GPT's resid_dropout), the norm gradient
applies the keep mask to the copy as it stores it, and the dropout_grad's pass goes too.

The Linear whose output the norm's input was (a pre-norm block's residual branch ends in its
c_proj: x + c_proj(h) is what the next norm reads) has the copy the norm gradient stores as its
output gradient dz, and that Linear's weight-gradient GEMM took dz's column sum as the bias
gradient (compile/fuse.py fuse_matmul_bias_grad: cuBLASLt's epilogue or a column-sum kernel,
one more pass over dz). The norm gradient sums the copy as it stores it instead
(fuse_norm_grad_bias_sums; its kernels' partial sums beside dweight's, one finalize launch).

The forward's twin: a LayerNorm that reads a bf16 GEMM or convolution output (ConvNeXt's
depthwise convolution, a patch embedding) reads it through autocast's cast to float32, and its
gradient reads that float32 copy again. Both read the bf16 value instead, widened as loaded
(exact), and the cast goes (fuse_norm_input_casts).
"""
from __future__ import annotations

from ..ir.graph import BF16, HALF_DTYPES, Graph, Node, Value
from .rewrite import _copy, _rebuild, sole_reader

NORM_GRADS = ("layer_norm_grad", "add_layer_norm_grad", "rms_norm_grad", "add_rms_norm_grad")
NORM_INPUTS = ("layer_norm",)     # the norms whose kernels read a bf16 x (fuse_norm_input_casts)


def fuse_layer_norm_casts(graph: Graph) -> Graph:
    """precision="bf16": autocast runs layer_norm in float32, so its y reaches the next GEMM
    through a cast to bf16, and that GEMM's float32-cast dx reaches layer_norm_grad as dy:
        layer_norm -> y [-> reshape] -> cast(bf16) -> c
        =>   layer_norm -> y in bf16 [-> reshape] = c   (the kernel rounds y once, as the cast)
        cast(d bf16 -> float32) [-> reshape] -> layer_norm_grad(dy, ...)
        =>   [reshape ->] layer_norm_grad(d in bf16, ...)   (widened as loaded, exactly)
    where each value on the way has that one reader, or every reader of y is such a cast (one
    bf16 y for all). x, the statistics and dx stay float32.
    precision="fp16" alike, with float16 in place of bf16. The residual forms
    (add_layer_norm, add_layer_norm_grad: compile/norm_rewrite.py) alike: their y and dy sit
    where layer_norm's do; s and ds stay float32."""
    graph = _copy(graph)
    users, producers = graph.consumers(), graph.producers()
    drop: set[Node] = set()
    subst: dict[Value, Value] = {}
    for n in graph.nodes:
        if n.op in ("layer_norm", "add_layer_norm"):
            low = _narrowed_y(graph, users, n.outputs[0], subst, drop)
            if low is not None:
                n.outputs = [low, *n.outputs[1:]]
        elif n.op in ("layer_norm_grad", "add_layer_norm_grad"):
            dy = n.inputs[0]
            view = producers.get(dy)
            if view is not None and view.op == "reshape" and \
                    sole_reader(graph, users, dy, n.op) is n:
                wide = view.inputs[0]
            else:
                view, wide = None, dy
            cast = producers.get(wide)
            if cast is None or cast.op != "cast" or cast.inputs[0].dtype not in HALF_DTYPES or \
                    n.inputs[1].dtype != "float32" or \
                    sole_reader(graph, users, wide, view.op if view else n.op) is None:
                continue
            if view is None:
                n.inputs = [cast.inputs[0], *n.inputs[1:]]
            else:
                view.inputs = [cast.inputs[0]]
                view.outputs = [Value(dy.shape, cast.inputs[0].dtype, dy.name)]
                n.inputs = [view.outputs[0], *n.inputs[1:]]
            drop.add(cast)
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], subst)


def _narrowed_y(graph: Graph, users, y: Value, subst: dict, drop: set) -> Value | None:
    """y in bf16 (or float16) when every reader of y casts it to that dtype, directly or
    through a reshape that the cast alone reads (a Linear on (B, T, C) reads it through its
    (B * T, C) view), and y is no step output; several readers each cast it (autocast casts
    for each op: mixer.py's Linear and its padded convolution input, which concat_casts.py
    narrowed). The casts go into `drop`, their outputs renamed to it in `subst`, and each
    reshape reads it. None otherwise."""
    readers = users.get(y, [])
    casts = [r if r.op == "cast" else
             sole_reader(graph, users, r.outputs[0], "cast") if r.op == "reshape" else None
             for r in readers]
    if not readers or y in graph.outputs.values() or y.dtype != "float32" or \
            any(c is None or c.attrs["dtype"] != casts[0].attrs["dtype"] for c in casts) or \
            casts[0].attrs["dtype"] not in HALF_DTYPES:
        return None
    low = Value(y.shape, casts[0].attrs["dtype"], y.name)
    for reader, cast in zip(readers, casts):
        if reader is cast:
            subst[cast.outputs[0]] = low
        else:
            reader.inputs, reader.outputs = [low], [cast.outputs[0]]
        drop.add(cast)
    return low


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
            n.outputs = [*n.outputs, _dropped_half(n, cast.outputs[0], users, outputs, drop)]
        drop.add(cast)
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], {})


def _dropped_half(n: Node, half: Value, users, outputs, drop: set) -> Value:
    """The value norm gradient n stores as its dx_half copy: the half dx itself, or, where an
    elementwise dropout_grad is its only reader (the residual branch's x + dropout(h) under
    precision="bf16": ops/layer_norm.py add_layer_norm's VJP), that dropout_grad's output,
    which n then computes as it stores the copy (attrs dx_half_dropout, its keep mask n's
    last input; the dropout_grad goes into `drop`). The same bits: the copy rounded once,
    then times mask and scale rounded once, as the dropout_grad kernel did."""
    readers = users.get(half, [])
    grad = readers[0] if len(readers) == 1 else None
    if grad is None or grad.op != "dropout_grad" or grad.attrs.get("per_channel") or \
            grad.inputs[0] is not half or half in outputs:
        return half
    n.attrs["dx_half_dropout"] = grad.attrs["p"]
    n.inputs = [*n.inputs, grad.inputs[1]]
    drop.add(grad)
    return grad.outputs[0]


def fuse_norm_grad_bias_sums(graph: Graph) -> Graph:
    """A Linear's bias gradient summed by the norm gradient that stores the Linear's dz:
        norm_grad -> d [-> reshape (rows, C)] -> matmul(dz, x, trans_a, bias_grad) -> (dw, db)
        =>   norm_grad(dx_sum) -> (..., d, db);  matmul(dz, x, trans_a) -> dw
    where d is the dx copy the norm gradient stores last (its dx_half copy where it has one,
    else dx) and db is of d's dtype. The same sum of the same stored values, taken while they
    are in registers: dz is not read again for it."""
    graph = _copy(graph)
    producers = graph.producers()
    for n in graph.nodes:
        if n.op != "matmul" or not n.attrs.get("bias_grad"):
            continue
        dz, db = n.inputs[0], n.outputs[1]
        view = producers.get(dz)
        d = view.inputs[0] if view is not None and view.op == "reshape" else dz
        norm = producers.get(d)
        if norm is None or norm.op not in NORM_GRADS or norm.attrs.get("dx_sum") or \
                d is not norm.outputs[-1 if norm.attrs.get("dx_half") else 0] or \
                d.shape[-1] != dz.shape[-1] or db.dtype != d.dtype:
            continue
        norm.attrs["dx_sum"] = True
        norm.outputs.append(db)
        n.attrs = {k: v for k, v in n.attrs.items() if k != "bias_grad"}
        n.outputs = [n.outputs[0]]
    return graph


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
