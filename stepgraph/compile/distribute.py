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

It runs after fusion: the program order is then final, and no pass moves the collectives.
"""
from __future__ import annotations

from ..distributed.buckets import Bucket, GradientInfo, plan_buckets
from ..errors import PlanError
from ..ir.graph import Graph, Node, Value
from ..ir.ops import infer_outputs
from ..ops.collective import reduce_dtype_of
from .rewrite import _copy

UPDATE_OPS = ("sgd_update", "adam_update")


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
    return grads, plan_buckets(infos, cap_bytes), first_read


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
