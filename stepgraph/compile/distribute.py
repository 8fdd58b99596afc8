"""Data parallelism as a graph transform on a fused train-step graph.

    ... backward ... [all_reduce bucket 0] ... backward ... [all_reduce bucket 1] ...
    all_reduce_join; guard_check; all_reduce_max(flags); ...; update(params, averaged grads)

The gradients are the ones the optimizer's update op reads. They are bucketed in the order
the backward pass finalises them (distributed/buckets.py); each bucket's all_reduce goes right
after the node that finalises its last gradient, so communication overlaps the rest of the
backward pass. One all_reduce_join waits for them all before the first node that reads a
gradient (the guard or the optimizer), and every node from there on reads the averages. A
guard's flags are all-reduced (max) right after guard_check, so that every rank skips the
same steps and the parameters stay identical.

With sharded optimizer state (ZeRO stage 1, `shard_optimizer_state`) each bucket is
reduce-scattered instead: every rank receives the averages of its chunk of the bucket's flat
buffer (distributed/zero.py), runs the one update over its chunks only (optimizer slots the
size of its chunks: 1/world of the state), and all-gathers the updated parameters:

    ... [reduce_scatter bucket 0] ... all_reduce_join; guard_check(shards); all_reduce_max;
    global_norm(shards); all_reduce_norm; zero_shard(params) per bucket;
    update(param shards, gradient shards, shard slots); all_gather(shard, params) per bucket

Buffers the step updates in place (BatchNorm's running statistics and counters) are made
rank 0's on every rank at the end of the step (`broadcast_buffers`): PyTorch DDP's default
(broadcast_buffers=True) broadcasts rank 0's buffers at every forward, so that the statistics
a run keeps are rank 0's; here every rank also holds them between steps, and a state_dict
saved on any rank is the same.

    ... update(params, averaged grads); [guard, history]; broadcast_buffers(running stats)

It runs after fusion: the program order is then final, and no pass moves the collectives.
"""
from __future__ import annotations

import os

from ..distributed.buckets import Bucket, GradientInfo, plan_buckets
from ..distributed.zero import plan_shards
from ..errors import PlanError
from ..ir.graph import STATE, Graph, Node, Value
from ..ir.ops import OPS, infer_outputs
from ..ops.collective import reduce_dtype_of
from ..ops.optim import UPDATE_OPS, hyper_rows
from .rewrite import _copy


# Gradient buckets are filled per dtype (distributed/buckets.py per_dtype), as DDP buckets by
# dtype; STEPGRAPH_BUCKETS_BY_DTYPE=0 closes a bucket wherever the dtype changes instead. A
# bf16 GPT had 25 buckets that way, half of them 3 KiB float32 LayerNorm pairs; per dtype it
# has 2, and on two H200s its step exposed 0.15 ms of communication rather than 0.29 ms (5.54
# against 5.67 ms, 1.94x against 1.90x one GPU; docs/perf-notes.md, 2026-11-29, 12:35-13:20 UTC).
BUCKETS_BY_DTYPE = "STEPGRAPH_BUCKETS_BY_DTYPE"


def gradients_of(graph: Graph) -> tuple[Node, list[Value]]:
    """The step's update node and the gradients it reads, in parameter (forward) order."""
    updates = [n for n in graph.nodes if n.op in UPDATE_OPS]
    if len(updates) != 1:
        raise PlanError(f"a data-parallel step needs exactly one optimizer update op "
                        f"({' or '.join(UPDATE_OPS)}), found {len(updates)}")
    update = updates[0]
    n, k = update.attrs["n_params"], update.attrs["n_scalars"]
    return update, list(update.inputs[k + n:k + 2 * n])


def bucket_gradients(graph: Graph, cap_bytes: int) -> tuple[list[Value], list[Bucket], int]:
    """(gradients, their buckets, position of the first node reading a gradient)."""
    _, grads = gradients_of(graph)
    position = {v: i for i, node in enumerate(graph.nodes) for v in node.outputs}
    missing = [g for g in grads if g not in position]
    if missing:
        raise PlanError(f"gradients {missing} are not computed by the step")
    wanted = set(grads)
    first_read = next((i for i, node in enumerate(graph.nodes)
                       if any(v in wanted for v in node.inputs)), len(graph.nodes))
    late = [g for g in grads if position[g] >= first_read]
    if late:
        raise PlanError(f"gradients {late} are finalised after node {first_read} "
                        f"({graph.nodes[first_read].op}) already reads gradients")
    infos = [GradientInfo(i, g.nbytes, g.dtype, position[g]) for i, g in enumerate(grads)]
    per_dtype = os.environ.get(BUCKETS_BY_DTYPE, "1") != "0"
    return grads, plan_buckets(infos, cap_bytes, per_dtype), first_read


def average_gradients(graph: Graph, group: str, world_size: int, cap_bytes: int,
                      strategy: str = "flat", bf16_communication: bool = False) -> Graph:
    """`graph` with its gradients averaged across the ranks of process group `group`; bf16
    gradients summed in float32 unless `bf16_communication` (DataParallel.reduce_dtype)."""
    graph = _copy(graph)
    grads, buckets, join_at = bucket_gradients(graph, cap_bytes)
    common = {"group": group, "world_size": world_size}
    launches: dict[int, list[Node]] = {}
    mean: dict[Value, Value] = {}
    for b, bucket in enumerate(buckets):
        ins = [grads[i] for i in bucket.indices]
        attrs = dict(common, bucket=b, strategy=strategy,
                     reduce_dtype=reduce_dtype_of(bucket.dtype, bf16_communication))
        outs = [Value(shape, dtype, name=f"{v.name}.mean" if v.name else "")
                for v, (shape, dtype) in zip(ins, infer_outputs("all_reduce", ins, attrs))]
        mean.update(zip(ins, outs))
        launches.setdefault(bucket.ready, []).append(
            Node("all_reduce", ins, outs, attrs, (), f"all_reduce bucket {b} bwd"))
    held = [v for nodes in launches.values() for n in nodes for v in n.inputs + n.outputs]
    join = Node("all_reduce_join", held, [], dict(common), (), "all_reduce join bwd")
    nodes: list[Node] = []
    for i, node in enumerate(graph.nodes):
        if i == join_at:
            nodes.append(join)
        if i >= join_at:
            node.inputs = [mean.get(v, v) for v in node.inputs]
        nodes.append(node)
        if node.op == "guard_check":      # its flags: input 0, written in place
            nodes.append(Node("all_reduce_max", [node.inputs[0]], [], dict(common, n=1), (0,),
                              "guard all_reduce"))
        nodes.extend(launches.get(i, []))
    if join_at == len(graph.nodes):
        nodes.append(join)
    return Graph(nodes, graph.inputs, graph.params, graph.state, dict(graph.outputs))


def shard_optimizer_state(graph: Graph, group: str, world_size: int, cap_bytes: int) -> Graph:
    """`graph` with ZeRO-1: gradients reduce-scattered per bucket, the update run over this
    rank's chunks with optimizer slots of the chunks' size, parameters all-gathered."""
    graph = _copy(graph)
    update, _ = gradients_of(graph)
    _check_shardable(update)
    grads, buckets, join_at = bucket_gradients(graph, cap_bytes)
    n, k = update.attrs["n_params"], update.attrs["n_scalars"]
    params = update.inputs[k:k + n]
    shards = plan_shards(buckets, {i: g.size for i, g in enumerate(grads)}, world_size)
    common = {"group": group, "world_size": world_size}
    launches: dict[int, list[Node]] = {}
    grad_shards = []
    for b, (bucket, shard) in enumerate(zip(buckets, shards)):
        ins = [grads[i] for i in bucket.indices]
        out = Value((shard.chunk,), bucket.dtype, name=f"grad.shard{b}")
        grad_shards.append(out)
        launches.setdefault(bucket.ready, []).append(
            Node("reduce_scatter", ins, [out], dict(common, bucket=b, chunk=shard.chunk), (),
                 f"reduce_scatter bucket {b} bwd"))
    held = [v for nodes in launches.values() for n_ in nodes for v in n_.inputs + n_.outputs]
    wanted = set(grads)
    nodes: list[Node] = []
    for i, node in enumerate(graph.nodes):
        if i == join_at:
            nodes.append(Node("all_reduce_join", held, [], dict(common), (), "reduce join bwd"))
        if node is update:
            nodes.extend(_sharded_update(graph, node, params, buckets, shards, grad_shards,
                                         common))
        elif i >= join_at and node.op == "global_norm":
            local = Value((), node.outputs[0].dtype, name="grad.shard_norm")
            nodes.append(Node("global_norm", grad_shards, [local], {}, (), node.label))
            nodes.append(Node("all_reduce_norm", [local], node.outputs, dict(common), (),
                              "grad norm all_reduce"))
        elif i >= join_at and node.op == "guard_check":
            node.inputs = [v for v in node.inputs if v not in wanted] + grad_shards
            nodes += [node, Node("all_reduce_max", [node.inputs[0]], [], dict(common, n=1),
                                 (0,), "guard all_reduce")]
        elif i >= join_at and wanted.intersection(node.inputs):
            raise PlanError(f"shard_optimizer: node {i} ({node.op}) reads whole gradients; "
                            "only the guard, the gradient norm and the update may")
        else:
            nodes.append(node)
        nodes.extend(launches.get(i, []))
    return Graph(nodes, graph.inputs, graph.params, graph.state, dict(graph.outputs))


def _check_shardable(update: Node) -> None:
    """One update over flat chunks mixes parameters: hyperparameters must be the same for all
    of them (one parameter group: the optimizer marks several with attrs param_group), and
    there can be no per-parameter bf16 weight copies."""
    per_param = [key for key, v in update.attrs.items() if isinstance(v, (tuple, list))
                 and key not in ("copies", "copy_dims", "hyper_rows")]
    if per_param:
        raise PlanError(f"shard_optimizer: parameter groups ({', '.join(sorted(per_param))} "
                        "per parameter) are not supported; one group only")
    if update.attrs.get("copies"):
        raise PlanError("shard_optimizer: precision='bf16' (bf16 weight copies) is not "
                        "supported; use precision='fp32'")


def _sharded_update(graph: Graph, update: Node, params, buckets, shards, grad_shards,
                    common) -> list[Node]:
    """zero_shard per bucket, the update over the chunks (new shard-sized slot states in
    place of the per-parameter ones), all_gather per bucket."""
    a = update.attrs
    n, k, n_slots = a["n_params"], a["n_scalars"], a["n_slots"]
    old_slots = update.inputs[k + 2 * n:k + (2 + n_slots) * n]
    slot_names = [v.name.split(".")[1] for v in old_slots[::n]] if n_slots else []
    flags = update.inputs[k + (2 + n_slots) * n:]
    param_shards, slots, before, after = [], [], [], []
    for b, (bucket, shard) in enumerate(zip(buckets, shards)):
        bucket_params = [params[i] for i in bucket.indices]
        attrs = dict(common, bucket=b, chunk=shard.chunk)
        value = Value((shard.chunk,), bucket.dtype, name=f"param.shard{b}")
        param_shards.append(value)
        before.append(Node("zero_shard", bucket_params, [value], attrs, (), update.label))
        after.append(Node("all_gather", [value] + bucket_params, [], dict(attrs, n=len(
            bucket_params)), tuple(range(1, len(bucket_params) + 1)), "all_gather params"))
    for name in slot_names:
        for b, v in enumerate(param_shards):
            slots.append(Value(v.shape, v.dtype, STATE, f"optimizer.{name}.zero.bucket{b}"))
    dropped = set(old_slots)
    graph.state = [v for v in graph.state if v not in dropped] + slots
    m = len(param_shards)
    # Every chunk reads the hyperparameter row of the bucket's first parameter (one group:
    # every row holds the same values).
    rows = tuple(hyper_rows(a)[bucket.indices[0]] for bucket in buckets)
    attrs = dict(a, n_params=m, hyper_rows=rows)
    inputs = update.inputs[:k] + param_shards + grad_shards + slots + flags
    sharded = Node(update.op, inputs, [], attrs, OPS[update.op].mutates(attrs), update.label)
    return before + [sharded] + after


def broadcast_buffers(graph: Graph, group: str, world_size: int, buffers) -> Graph:
    """`graph` with rank 0's values of the buffers it writes in place (those named in
    `buffers`: the model's, not the optimizer's state) broadcast to every rank as its last
    node, after anything (the guard's restore) that may still write them."""
    graph = _copy(graph)
    names, written = set(buffers), []
    for node in graph.nodes:
        for i in node.mutates:
            v = node.inputs[i]
            if v.role == STATE and v.name in names and v not in written:
                written.append(v)
    if written:
        graph.nodes.append(Node("broadcast_buffers", written, [],
                                {"group": group, "world_size": world_size, "n": len(written)},
                                tuple(range(len(written))), "buffer broadcast"))
    return graph
