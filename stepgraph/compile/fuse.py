"""Fusion passes: pattern rewrites on a whole train-step graph (forward, backward, update).

Each pass takes a graph and returns a new one; `fuse` runs them in order, then drops dead nodes.
The multi-tensor optimizer update needs no pass: the optimizer emits it as one op.
"""
from __future__ import annotations

import numpy as np

from ..ir.graph import BF16, Graph, Node, Value
from ..ir.ops import OPS
from ..ops.layout import channel_sum_axes, layout_of
from ..ops.loss import IGNORE_INDEX
from ..ops.optim import UPDATE_OPS
from ..ops.pointwise import PROGRAM_OPS
from .attention import pack_attention_heads
from .attention_views import attention_views
from .pointwise import fuse_pointwise
from .pointwise_recompute import recompute_saved_pointwise
from .pointwise_views import read_pointwise_views
from .pointwise_sums import fuse_row_sums
from .pointwise_joins import join_pointwise_results
from .gradient_sums import fuse_cell_grad_sums, fuse_product_sums
from .slice_sums import concat_slice_gradients
from .concat_slices import read_concat_inputs
from .layout_chains import collapse_layout_chains
from .matmul_add import fuse_matmul_add
from .logits_layout import transpose_unaligned_logits
from .norm_casts import (fuse_layer_norm_casts, fuse_norm_grad_bias_sums, fuse_norm_grad_casts,
                         fuse_norm_input_casts)
from .elementwise_reshapes import move_elementwise_before_reshapes
from .rewrite import _copy, _join, _live, _rebuild, sole_chain, sole_reader


def _sole_view(graph: Graph, users, v: Value) -> Node | None:
    """The reshape that is v's only reader, when v is no graph output. A Linear on (..., K)
    inputs traces as reshape -> linear -> reshape (nn.functional.linear), so its activation
    reads the linear's (N, M) output through this view."""
    return sole_reader(graph, users, v, "reshape")


def fuse_linear_activation(graph: Graph) -> Graph:
    """linear(x, w, b) -> z; act(z) -> y   =>   linear(x, w, b, act) -> y [, z].
    z stays an output (save_preact) when something else reads it: act_grad for leaky_relu/gelu.
    Through a view, linear -> z; reshape(z) -> z'; act(z') -> y'   =>   linear(act) -> y [, z];
    reshape(y) -> y' (and reshape(z) -> z' stays for z's other readers)."""
    graph = _copy(graph)
    users = graph.consumers()
    replaced: dict[Node, Node | None] = {}    # absorbed node -> what runs in its place
    for n in graph.nodes:
        if n.op != "linear" or n.attrs.get("act") is not None:
            continue
        z = n.outputs[0]
        view = _sole_view(graph, users, z)
        seen = z if view is None else view.outputs[0]      # what the activation reads
        acts = [u for u in users.get(seen, []) if u.op == "act"]
        if len(acts) != 1:
            continue
        act = acts[0]
        others = [u for u in users[seen] if u is not act]
        save = bool(others) or seen in graph.outputs.values()
        y = act.outputs[0] if view is None else Value(z.shape, act.outputs[0].dtype)
        n.attrs = dict(n.attrs, act=act.attrs["kind"], slope=act.attrs["slope"], save_preact=save)
        n.outputs = [y] + ([z] if save else [])
        n.label = _join(n.label, act.label)
        replaced[act] = None if view is None else Node(
            "reshape", [y], [act.outputs[0]], {"shape": act.outputs[0].shape}, (), act.label)
        if view is not None and not save:
            replaced[view] = None                           # z is no longer written
    nodes = [replaced.get(n, n) for n in graph.nodes]
    return _rebuild(graph, [n for n in nodes if n is not None], {})


def _flat_source(producers, v: Value, shape: tuple, label: str) -> tuple[Value, Node | None]:
    """v viewed as `shape`: the value v is a view of when it has that shape, else a new
    reshape node (returned, to be placed before the reader)."""
    p = producers.get(v)
    if p is not None and p.op == "reshape" and p.inputs[0].shape == shape:
        return p.inputs[0], None
    flat = Value(shape, v.dtype)
    return flat, Node("reshape", [v], [flat], {"shape": shape}, (), label)


def fuse_activation_bias_grad(graph: Graph) -> Graph:
    """act_grad(dy, s) -> dz; reduce_sum(dz, axes=(0,)) -> db   =>   act_bias_grad -> (dz, db).
    An act_grad on (..., M) values whose result is read only as the (N, M) view the Linear's
    backward sums (reshape -> reduce_sum) runs on (N, M) views of dy and s instead."""
    graph = _copy(graph)
    users = graph.consumers()
    producers = graph.producers()
    drop: set[Node] = set()
    before: dict[Node, list[Node]] = {}       # node -> new reshapes to place before it
    for n in graph.nodes:
        if n.op != "act_grad":
            continue
        dz, view = n.outputs[0], None
        if len(dz.shape) != 2:
            view = _sole_view(graph, users, dz)
            rows = int(np.prod(dz.shape[:-1], dtype=np.int64)) if dz.shape else 0
            if view is None or len(dz.shape) < 2 or \
                    view.outputs[0].shape != (rows, dz.shape[-1]):
                continue
            dz = view.outputs[0]
        sums = [u for u in users.get(dz, [])
                if u.op == "reduce_sum" and tuple(u.attrs["axes"]) == (0,)]
        if not sums:
            continue
        if view is not None:
            flat = [_flat_source(producers, v, dz.shape, n.label) for v in n.inputs]
            n.inputs = [v for v, _ in flat]
            before[n] = [r for _, r in flat if r is not None]
            drop.add(view)
        n.op = "act_bias_grad"
        n.outputs = [dz, sums[0].outputs[0]]
        drop.add(sums[0])
    nodes = [m for n in graph.nodes if n not in drop for m in (*before.get(n, ()), n)]
    return _rebuild(graph, nodes, {})


def fuse_conv_bias_grad(graph: Graph) -> Graph:
    """conv2d_grad_weight(dy, x) -> dw; reduce_sum(dy, axes=(N, H, W)) -> db
    =>   conv2d_grad_weight(dy, x, bias) -> (dw, db): the weight gradient reads dy anyway.
    (N, H, W) are the axes of the node's layout (ops.layout.channel_sum_axes)."""
    graph = _copy(graph)
    users = graph.consumers()
    order = {n: i for i, n in enumerate(graph.nodes)}
    drop: set[Node] = set()
    for n in graph.nodes:
        if n.op != "conv2d_grad_weight" or n.attrs.get("bias"):
            continue
        # A later sum only: db then comes earlier than before, never later than a reader.
        axes = channel_sum_axes(layout_of(n.op, n.attrs))
        sums = [u for u in users.get(n.inputs[0], []) if u.op == "reduce_sum"
                and tuple(u.attrs["axes"]) == axes and order[u] > order[n]]
        if not sums:
            continue
        n.attrs = dict(n.attrs, bias=True)
        n.outputs = [n.outputs[0], sums[0].outputs[0]]     # both labelled "<Conv2d> bwd"
        drop.add(sums[0])
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], {})


def fuse_matmul_bias_grad(graph: Graph) -> Graph:
    """matmul(dz, x, trans_a) -> dw; reduce_sum(dz, axes=(0,)) -> db   =>
    matmul(dz, x, trans_a, bias_grad) -> (dw, db): a Linear's weight and bias gradients from
    one node, which on CUDA times cuBLASLt's bias-gradient epilogue (the sums taken while the
    GEMM reads dz) against the GEMM and a column-sum kernel (backends/cuda/matmul/linear.py)."""
    graph = _copy(graph)
    users = graph.consumers()
    order = {n: i for i, n in enumerate(graph.nodes)}
    drop: set[Node] = set()
    for n in graph.nodes:
        if n.op != "matmul" or not n.attrs.get("trans_a") or n.attrs.get("bias_grad"):
            continue
        dz = n.inputs[0]
        # A later sum only, as in fuse_conv_bias_grad: db is then written before any reader.
        sums = [u for u in users.get(dz, []) if u.op == "reduce_sum" and u not in drop
                and {a % 2 for a in u.attrs["axes"]} == {0} and order[u] > order[n]]
        if not sums:
            continue
        n.attrs = dict(n.attrs, bias_grad=True)
        n.outputs = [n.outputs[0], sums[0].outputs[0]]
        drop.add(sums[0])
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], {})


def _sole_relu(graph: Graph, users, v: Value) -> Node | None:
    """The act(relu) node that is v's only reader, when v is no graph output: a producer of
    v can then write the ReLU's output instead of v."""
    act = sole_reader(graph, users, v, "act")
    return act if act is not None and act.attrs["kind"] == "relu" else None


def fuse_pool_relu(graph: Graph) -> Graph:
    """maxpool2d -> y; act(relu)(y) -> r   =>   maxpool2d(relu) -> r (a max is taken before
    the clamp either way), and in the backward act_grad(relu)(dr, r) -> g;
    maxpool2d_grad(g, idx)   =>   maxpool2d_grad(dr, idx, r, relu): two passes fewer."""
    graph = _copy(graph)
    users = graph.consumers()
    producers = graph.producers()
    drop: set[Node] = set()
    for pool in graph.nodes:
        if pool.op != "maxpool2d" or pool.attrs.get("relu"):
            continue
        relu = _sole_relu(graph, users, pool.outputs[0])
        if relu is None:
            continue
        pool.attrs = dict(pool.attrs, relu=True)
        pool.outputs = [relu.outputs[0], pool.outputs[1]]
        pool.label = _join(pool.label, relu.label)
        drop.add(relu)
        for grad in users.get(pool.outputs[1], []):       # maxpool2d_grad reads idx
            g = producers.get(grad.inputs[0])
            if g is not None and g.op == "act_grad" and g.inputs[1] is relu.outputs[0] \
                    and len(users[g.outputs[0]]) == 1:
                grad.inputs = [g.inputs[0], grad.inputs[1], relu.outputs[0]]
                grad.attrs = dict(grad.attrs, relu=True)
                grad.label = pool.label + " bwd"
                drop.add(g)
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], {})


def fuse_conv_relu(graph: Graph) -> Graph:
    """conv2d -> z; act(relu)(z) -> y, the ReLU z's only reader   =>   conv2d(act="relu") -> y:
    every CUDA path stores it with the convolution's output (the cuDNN graph, the depthwise,
    tiled and direct kernels, cuBLASLt's RELU epilogue; in place after plain cuDNN plans and
    GEMM chunks cuBLASLt has no RELU algorithm for), so one pass over the activations goes
    and z is never stored. The backward's act_grad reads y as before. ReLU commutes with a bf16
    rounding: the fused result is the same bits. Left alone where elementwise code reads y
    (a dropout, a residual add): the ReLU then joins that code's kernel at no cost, where an
    own convolution kernel would apply it in a pass of its own."""
    graph = _copy(graph)
    users = graph.consumers()
    drop: set[Node] = set()
    for conv in graph.nodes:
        if conv.op != "conv2d" or conv.attrs.get("act") not in (None, "none"):
            continue
        relu = _sole_relu(graph, users, conv.outputs[0])
        if relu is None or any(u.op in PROGRAM_OPS and u.op != "act_grad"
                               for u in users.get(relu.outputs[0], [])):
            continue
        conv.attrs = dict(conv.attrs, act="relu")
        conv.outputs = [relu.outputs[0]]
        conv.label = _join(conv.label, relu.label)
        drop.add(relu)
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], {})


def fuse_batch_norm_relu(graph: Graph) -> Graph:
    """batch_norm_train -> y; act(relu)(y) -> r, the ReLU y's only reader   =>
    batch_norm_train(act="relu") -> r; and in the backward act_grad(relu)(dr, r) -> g;
    batch_norm_grad(g, x, ...)   =>   batch_norm_grad(dr, x, ..., [bias], act="relu"), which
    masks dr itself where the pre-activation it recomputes from x is not positive: one pass
    over the activations fewer forward, and the backward's passes read no r."""
    graph = _copy(graph)
    users = graph.consumers()
    producers = graph.producers()
    drop: set[Node] = set()
    for bn in graph.nodes:
        if bn.op != "batch_norm_train" or bn.attrs.get("act", "none") != "none":
            continue
        relu = _sole_relu(graph, users, bn.outputs[0])
        if relu is None:
            continue
        bn.attrs = dict(bn.attrs, act="relu")
        bn.outputs = [relu.outputs[0], *bn.outputs[1:]]
        bn.label = _join(bn.label, relu.label)
        drop.add(relu)
        for grad in users.get(bn.outputs[1], []):        # batch_norm_grad reads save_mean
            g = producers.get(grad.inputs[0])
            if grad.op == "batch_norm_grad" and grad.attrs.get("act", "none") == "none" \
                    and g is not None and g.op == "act_grad" and g.attrs["kind"] == "relu" \
                    and g.inputs[1] is relu.outputs[0] and len(users[g.outputs[0]]) == 1 \
                    and g.outputs[0] not in graph.outputs.values():
                bias = [bn.inputs[2]] if bn.attrs["affine"] else []
                grad.inputs = [g.inputs[0], *grad.inputs[1:], *bias]
                grad.attrs = dict(grad.attrs, act="relu")
                grad.label = bn.label + " bwd"
                drop.add(g)
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], {})


def _is_add(node: Node) -> bool:
    """node is an elementwise sum of two values (op add, or binary kind add)."""
    return (node.op == "add" or (node.op == "binary" and node.attrs["kind"] == "add")) \
        and len(node.inputs) == 2


def _residual_add(graph: Graph, users, y: Value) -> tuple[Node, Value] | None:
    """(add, r): the elementwise sum y + r (or r + y) that is y's only reader, r of y's shape
    and dtype (no broadcasting), when y is no graph output."""
    readers = users.get(y, [])
    if len(readers) != 1 or y in graph.outputs.values():
        return None
    add = readers[0]
    if not _is_add(add):
        return None
    a, b = add.inputs
    r = b if a is y else a
    if r is y or r.shape != y.shape or r.dtype != y.dtype:
        return None
    return add, r


def _normalises_only_for(node: Node | None, r: Value, add: Node, users, graph: Graph) -> bool:
    """True when `node` is a batch_norm_train without activation or residual whose output r
    only `add` reads (and no graph output is)."""
    return node is not None and node.op == "batch_norm_train" \
        and node.attrs.get("act", "none") == "none" and not node.attrs.get("residual") \
        and users.get(r) == [add] and r not in graph.outputs.values()


def fuse_batch_norm_residual(graph: Graph) -> Graph:
    """batch_norm_train -> y; y + r -> s; act(relu)(s) -> out, each value's only reader   =>
    batch_norm_train(x, ..., r, residual=True, act="relu") -> out: a residual block's second
    BatchNorm, shortcut add and ReLU in one pass that writes out alone (neither y nor s reaches
    memory). The fused node runs where the ReLU ran: r (a downsampling shortcut's own
    BatchNorm) may be made after the BatchNorm. The backward is unchanged: act_grad(relu)
    reads out, which the fused node writes as the ReLU did.
    When r is the output of a shortcut's batch_norm_train (no activation) that nothing else
    reads, that node keeps only its statistics (batch_norm_stats) and the fused node applies
    it to the shortcut's raw value d as it reads it (residual_norm): r never reaches memory
    either. Its gradient reads d and the statistics, not r."""
    graph = _copy(graph)
    users, producers = graph.consumers(), graph.producers()
    replaced: dict[Node, Node | None] = {}
    for bn in graph.nodes:
        if bn.op != "batch_norm_train" or bn.attrs.get("act", "none") != "none" \
                or bn.attrs.get("residual") or bn in replaced:
            continue
        found = _residual_add(graph, users, bn.outputs[0])
        if found is None:
            continue
        add, r = found
        relu = _sole_relu(graph, users, add.outputs[0])
        if relu is None or add in replaced:     # a sum of two BatchNorms: the first takes it
            continue
        attrs, extra = dict(bn.attrs, act="relu", residual=True), [r]
        shortcut = producers.get(r)
        if _normalises_only_for(shortcut, r, add, users, graph) and shortcut not in replaced:
            sa = shortcut.attrs
            running = shortcut.inputs[1 + 2 * bool(sa["affine"]):] if sa["track"] else []
            stats_attrs = {k: sa[k] for k in ("eps", "momentum", "track", "layout") if k in sa}
            stats = Node("batch_norm_stats", [shortcut.inputs[0], *running],
                         list(shortcut.outputs[1:]), stats_attrs,
                         OPS["batch_norm_stats"].mutates(stats_attrs), shortcut.label)
            extra = [shortcut.inputs[0], *shortcut.outputs[1:],
                     *(shortcut.inputs[1:3] if sa["affine"] else [])]
            attrs.update(residual_norm=True, residual_affine=bool(sa["affine"]),
                         residual_eps=sa["eps"])
            replaced[shortcut] = stats
        fused = Node(bn.op, [*bn.inputs, *extra], [relu.outputs[0], *bn.outputs[1:]], attrs,
                     bn.mutates, _join(bn.label, relu.label))
        replaced.update({bn: None, add: None, relu: fused})
    nodes = [replaced.get(n, n) for n in graph.nodes]
    return _rebuild(graph, [n for n in nodes if n is not None], {})


def fuse_batch_norm_grad_sum(graph: Graph) -> Graph:
    """a + b -> g, g read only by batch_norm_grad(g, x, ...)   =>   batch_norm_grad(a, x, ...,
    b, dy_sum=True): a gradient that two paths sum (a block's input, read by a convolution and
    by the shortcut) is added inside the BatchNorm gradient's two passes, rounded as the add
    stores it. g never reaches memory: one pass over the activation and one launch fewer."""
    graph = _copy(graph)
    users, producers = graph.consumers(), graph.producers()
    drop: set[Node] = set()
    for grad in graph.nodes:
        if grad.op != "batch_norm_grad" or grad.attrs.get("dy_sum"):
            continue
        g = grad.inputs[0]
        add = producers.get(g)
        if add is None or add in drop or g in graph.outputs.values() or users[g] != [grad] \
                or grad.inputs[1:].count(g) or not _is_add(add) \
                or any(v.shape != g.shape or v.dtype != g.dtype for v in add.inputs):
            continue
        a, b = add.inputs
        grad.inputs = [a, *grad.inputs[1:], b]
        grad.attrs = dict(grad.attrs, dy_sum=True)
        grad.label = _join(add.label, grad.label)
        drop.add(add)
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], {})


def fuse_step_bookkeeping(graph: Graph) -> Graph:
    """step_increment(step); lr_schedule(step, schedule) -> lr; ... record_loss(loss, step, h)
    =>   advance_step(step, schedule, loss, h) -> lr: one launch instead of three. The loss is
    final before the update starts, so recording it early changes nothing."""
    graph = _copy(graph)
    nodes = graph.nodes
    inc = next((n for n in nodes if n.op == "step_increment"), None)
    sched = next((n for n in nodes if n.op == "lr_schedule"), None)
    rec = next((n for n in nodes if n.op == "record_loss"), None)
    if inc is None or sched is None or rec is None or \
            not (sched.inputs[0] is inc.inputs[0] is rec.inputs[1]) or \
            not nodes.index(inc) < nodes.index(sched) < nodes.index(rec):
        return graph
    step, schedule = sched.inputs
    loss, _, history_loss, history_step = rec.inputs
    fused = Node("advance_step", [step, schedule, loss, history_loss, history_step],
                 sched.outputs, {}, (0, 3, 4), sched.label)
    kept = [fused if n is sched else n for n in nodes if n is not inc and n is not rec]
    return _rebuild(graph, kept, {})


def _reads_gradient(reader: Node, v: Value) -> bool:
    """Whether `reader` reads v only as a gradient it may take in bf16: an update's, the
    clipping norm's, or the guard's check (any input but its float32 loss)."""
    return reader.op in UPDATE_OPS + ("global_norm",) or \
        (reader.op == "guard_check" and v is not reader.inputs[1])


def fuse_gradient_casts(graph: Graph) -> Graph:
    """cast(g bf16 -> float32) -> g32, read only by the update, the clipping norm and the
    guard's check   =>   they read g: the update and the norm widen each bf16 gradient as
    they load it, exactly as the cast did (bf16 -> float32 is exact), and a NaN or Inf shows in
    g as in g32. precision="bf16": the gradient of every weight's bf16 copy reaches its float32
    master through such a cast (autocast.bind_weight_copies), a launch a parameter before.
    Where g32 reaches those readers through reshapes and permutes (a conv weight's gradient,
    KRSC under channels-last, back to OIHW), each with that one reader, they move before the
    cast and run on g: a copy moves bits, so it gives the same values at half the bytes."""
    graph = _copy(graph)
    users = graph.consumers()
    outputs = set(graph.outputs.values())
    subst: dict[Value, Value] = {}
    narrowed: dict[Node, Node] = {}          # a view or permute -> its twin on bf16 values
    dropped: set[Node] = set()
    for n in graph.nodes:
        if n.op != "cast" or n.attrs["dtype"] != "float32" or n.inputs[0].dtype != BF16:
            continue
        chain, wide = sole_chain(graph, users, n.outputs[0], ("reshape", "permute"))
        readers = users.get(wide, [])
        if not readers or wide in outputs or not all(_reads_gradient(r, wide) for r in readers):
            continue
        low = n.inputs[0]
        for layout in chain:
            narrow = Value(layout.outputs[0].shape, BF16)
            narrowed[layout] = Node(layout.op, [low], [narrow], dict(layout.attrs), (),
                                    layout.label)
            low = narrow
        subst[wide] = low
        dropped.add(n)
    kept = [narrowed.get(n, n) for n in graph.nodes if n not in dropped]
    return _rebuild(graph, kept, subst)


def fuse_loss_casts(graph: Graph) -> Graph:
    """cast(logits bf16 -> float32) -> x; cross_entropy_train(x, labels) -> (loss, dx);
    cast(dx -> bf16) -> d16, where x and dx have no other reader
    =>   cross_entropy_train(logits, labels) -> (loss, d16): the kernel widens the logits as it
    loads them (exact) and rounds dlogits once as it stores them, as the casts did; the loss
    stays float32. precision="bf16": autocast runs the loss in float32 on the bf16 logits of
    the last GEMM, and the cast's gradient rounds dlogits back for that GEMM's backward."""
    graph = _copy(graph)
    users, producers = graph.consumers(), graph.producers()
    drop: set[Node] = set()
    for n in graph.nodes:
        if n.op != "cross_entropy_train":
            continue
        widen = producers.get(n.inputs[0])
        narrow = sole_reader(graph, users, n.outputs[1], "cast")
        if widen is None or widen.op != "cast" or widen.inputs[0].dtype != BF16 or \
                sole_reader(graph, users, n.inputs[0], n.op) is not n or narrow is None or \
                narrow.attrs["dtype"] != BF16:
            continue
        n.inputs = [widen.inputs[0], *n.inputs[1:]]
        n.outputs = [n.outputs[0], narrow.outputs[0]]
        drop.update((widen, narrow))
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], {})


def _is_unit_seed(graph: Graph, v: Value) -> bool:
    p = graph.producers().get(v)
    return p is not None and p.op == "fill" and p.attrs["value"] == 1.0


def fuse_cross_entropy(graph: Graph) -> Graph:
    """cross_entropy fwd + its grad seeded with 1   =>   cross_entropy_train -> (loss, dlogits),
    keeping the forward's attrs (label_smoothing, ignore_index)."""
    graph = _copy(graph)
    users = graph.consumers()
    drop: set[Node] = set()
    for n in graph.nodes:
        if n.op != "cross_entropy":
            continue
        grads = [u for u in users.get(n.outputs[1], []) if u.op == "cross_entropy_grad"]
        if len(grads) != 1 or not _is_unit_seed(graph, grads[0].inputs[0]) or any(
                grads[0].attrs.get(k, d) != n.attrs.get(k, d)
                for k, d in (("label_smoothing", 0.0), ("ignore_index", IGNORE_INDEX))):
            continue
        n.op = "cross_entropy_train"
        n.outputs = [n.outputs[0], grads[0].outputs[0]]
        drop.add(grads[0])
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], {})


def fuse_log_softmax_nll(graph: Graph) -> Graph:
    """log_softmax -> nll_loss, with nll_loss_grad (seed 1) -> log_softmax_grad, where nothing
    else reads the log-probabilities   =>   cross_entropy_train (the same function)."""
    graph = _copy(graph)
    users = graph.consumers()
    producers = graph.producers()
    drop: set[Node] = set()
    for nll in graph.nodes:
        if nll.op != "nll_loss":
            continue
        ls = producers.get(nll.inputs[0])
        if ls is None or ls.op != "log_softmax" or nll.inputs[0] in graph.outputs.values():
            continue
        logp_users = users[nll.inputs[0]]
        back = [u for u in logp_users if u.op == "log_softmax_grad"]
        if len(logp_users) != 2 or len(back) != 1:
            continue
        seed_grad = producers.get(back[0].inputs[0])
        if seed_grad is None or seed_grad.op != "nll_loss_grad" or \
                not _is_unit_seed(graph, seed_grad.inputs[0]):
            continue
        nll.op = "cross_entropy_train"
        nll.inputs = [ls.inputs[0], nll.inputs[1]]
        nll.outputs = [nll.outputs[0], back[0].outputs[0]]
        nll.label = _join(ls.label, nll.label)
        drop.update((ls, back[0], seed_grad))
    return _rebuild(graph, [n for n in graph.nodes if n not in drop], {})


def eliminate_dead_code(graph: Graph) -> Graph:
    """Drop nodes whose outputs nobody reads (nodes that mutate state are always live)."""
    graph = _copy(graph)
    return _rebuild(graph, _live(graph.nodes, graph.outputs.values()), {})


PASSES = (pack_attention_heads, fuse_product_sums, fuse_cell_grad_sums, concat_slice_gradients,
          read_concat_inputs, collapse_layout_chains, fuse_linear_activation,
          fuse_pool_relu, fuse_conv_relu, fuse_batch_norm_residual, fuse_batch_norm_relu,
          fuse_batch_norm_grad_sum, fuse_activation_bias_grad, fuse_conv_bias_grad,
          fuse_matmul_bias_grad, fuse_matmul_add, fuse_cross_entropy,
          fuse_log_softmax_nll, fuse_loss_casts, fuse_layer_norm_casts, fuse_norm_grad_casts,
          fuse_norm_grad_bias_sums, fuse_norm_input_casts, fuse_step_bookkeeping,
          fuse_gradient_casts, move_elementwise_before_reshapes, transpose_unaligned_logits,
          recompute_saved_pointwise, fuse_pointwise, attention_views, read_pointwise_views,
          fuse_row_sums, join_pointwise_results, eliminate_dead_code)


def fuse(graph: Graph, passes=PASSES) -> Graph:
    for p in passes:
        graph = p(graph)
    return graph
