"""The optimizer's update overlapping the backward pass, as a graph transform on a fused
train-step graph (compile_train_step's overlap_update).

    before:  forward  loss  backward ...................  advance_step  update(all)
    after:   forward  loss  advance_step  backward [update bucket 0] backward
             [update bucket 1] ... backward [update bucket k]  update_join

The step's one multi-tensor update (sgd_update, adam_update, ...) becomes one update of the
same op per bucket of parameters, each a multi-tensor launch over its own slice of the
parameters, gradients, optimizer slots and bf16 weight copies, reading the same hyperparameter
rows (attrs hyper_rows: each parameter's row of the step's hyperparameters; per-parameter
attrs sliced alike). A parameter's update is safe right after the last
node that conflicts with it: the node that finalises its gradient, and the last node that reads
the parameter, its slots or its bf16 copy (a product's backward may finalise dW before it
reads W again for dx), views included. Parameters are bucketed in the order they become safe, about
UPDATE_BUCKET_CAP_MB of parameters a bucket (distributed/buckets.py, as the data-parallel
all-reduces are), and each bucket's update goes right after its last parameter's safe point.
Its attrs update_stream has the CUDA backend fork it onto a side stream there
(backends/cuda/runtime/update_stream.py), beside the backward kernels after it; the numpy
backend runs it in program order. One update_join, where the single update was, waits for
them all before anything later; its inputs are the temporaries the updates read (gradients,
lr), so the planner keeps their memory until then.

The step counter. Every update reads the counter after this step's increment (Adam's bias
corrections, SGD's first-step momentum) and the lr computed from it, so the bookkeeping that
computes them (advance_step: increment, lr, loss record) must run before the first update.
It moves to the earliest point that changes no result: after the last earlier node that reads
the counter (dropout draws its masks from it) and after the loss. Leaving the increment at the
join would need update kernels that add one to the counter they read; moving it up needs
nothing new. Dropout's backward reads the saved mask, so in most models the bookkeeping moves
up to just after the loss and nothing holds the updates back; a node that reads the counter
late (an attention's backward with dropout regenerates its mask) keeps the bookkeeping, and
therefore every update, after it.

Where it does not apply (`overlap_blocker`): a guard (on_bad_batch "raise" or "skip": its
check reads every gradient, and a bad batch skips the whole update), gradient clipping (the
global norm needs every gradient), and a data-parallel step (its all-reduce join already sits
before the update; not combined yet).

It runs after fusion, when the program order is final.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..distributed.buckets import GradientInfo, cap_bytes_of, plan_buckets
from ..errors import PlanError
from ..ir.graph import Graph, Node, Value
from ..ir.ops import OPS
from ..ops.collective import COLLECTIVE_OPS
from ..ops.optim import UPDATE_OPS, UPDATE_SCALARS, hyper_rows, update_weight_copies
from .plan import _view_roots
from .rewrite import _copy

# MiB of parameters an update launch covers: a step makes a few large launches, not one per
# tensor (each costs a launch and a fork), while the first buckets still start early in the
# backward pass. A parameter larger than this is a bucket of its own.
UPDATE_BUCKET_CAP_MB = 32.0
# attrs of an update that list one entry per bf16 weight copy; every other tuple-valued attr
# lists one entry per parameter (the optimizer's parameter groups, optim/optimizer.py).
COPY_ATTRS = ("copies", "copy_dims")


def check_option(value) -> bool | str:
    """compile_train_step's overlap_update: "auto", True or False."""
    if not (value is True or value is False or value == "auto"):
        raise ValueError(f"overlap_update must be 'auto', True or False, got {value!r}")
    return value


@dataclass(frozen=True)
class UpdateInputs:
    """An update node's inputs by role (ops/optim.py sgd_update), one list entry a parameter."""

    scalars: list[Value]            # lr, step, hyperparameters (a clipped update adds the norm)
    params: list[Value]
    grads: list[Value]
    slots: list[list[Value]]        # per slot (momentum; exp_avg, exp_avg_sq): per parameter
    copies: dict[int, int]          # parameter index -> position of its bf16 copy in attrs

    @classmethod
    def of(cls, node: Node) -> "UpdateInputs":
        a, ins = node.attrs, node.inputs
        n, k = a["n_params"], a["n_scalars"]
        slots = [ins[k + (2 + s) * n:k + (3 + s) * n] for s in range(a["n_slots"])]
        copies = {i: j for j, i in enumerate(a.get("copies", ()))}
        return cls(ins[:k], ins[k:k + n], ins[k + n:k + 2 * n], slots, copies)

    def copy_value(self, node: Node, i: int) -> Value:
        _, at, _ = update_weight_copies(node.attrs)[self.copies[i]]
        return node.inputs[at]

    def of_param(self, node: Node, i: int) -> tuple[list[Value], list[Value]]:
        """(what parameter i's update reads, what it writes)."""
        written = [self.params[i]] + [slot[i] for slot in self.slots]
        if i in self.copies:
            written.append(self.copy_value(node, i))
        return self.scalars + [self.grads[i]] + written, written


def overlap_blocker(graph: Graph) -> str | None:
    """Why the update of this fused train-step graph cannot overlap its backward pass, or
    None when it can."""
    updates = [n for n in graph.nodes if n.op in UPDATE_OPS]
    if len(updates) != 1:
        return (f"the step has {len(updates)} optimizer update ops "
                f"({' or '.join(UPDATE_OPS)}), not exactly one")
    update = updates[0]
    if update.attrs.get("guard"):
        return ("on_bad_batch='raise' or 'skip' adds a guard whose check reads every gradient "
                "before any update and skips the whole update on a bad batch; compile with "
                "on_bad_batch='ignore'")
    if update.attrs["n_scalars"] != UPDATE_SCALARS or update.attrs.get("max_norm") is not None:
        return ("gradient clipping (the optimizer's max_grad_norm) scales every gradient by "
                "their global norm, known only once the last one is final; use "
                "max_grad_norm=None")
    if any(n.op in COLLECTIVE_OPS for n in graph.nodes):
        return ("a data-parallel step (distributed=...) averages the gradients before the "
                "update; overlapping its update is not supported yet")
    if not update.attrs["n_params"]:
        return "the step has no parameters to update"
    return None


def resolve(option, graph: Graph, device: str) -> Graph:
    """`graph`, with its update overlapped as overlap_update asks: True always (a PlanError
    saying why when it cannot apply), False never, "auto" on CUDA when it applies and makes
    more than one bucket (one bucket would only move the update, not split it)."""
    check_option(option)
    if option is False:
        return graph
    reason = overlap_blocker(graph)
    if option is True:
        if reason is not None:
            raise PlanError(f"overlap_update=True cannot apply: {reason}")
        return overlap_update(graph, cap_bytes_of(UPDATE_BUCKET_CAP_MB))
    if reason is not None or device != "cuda":
        return graph
    overlapped = overlap_update(graph, cap_bytes_of(UPDATE_BUCKET_CAP_MB))
    return overlapped if sum(n.op in UPDATE_OPS for n in overlapped.nodes) > 1 else graph


def overlap_update(graph: Graph, cap_bytes: int) -> Graph:
    """`graph` with its update split into buckets placed at their safe points and joined
    where the update was (the module docstring)."""
    reason = overlap_blocker(graph)
    if reason is not None:
        raise PlanError(f"the update cannot overlap the backward pass: {reason}")
    graph = _copy(graph)
    update = next(n for n in graph.nodes if n.op in UPDATE_OPS)
    inputs = UpdateInputs.of(update)
    join_at = graph.nodes.index(update)
    nodes = graph.nodes[:join_at] + graph.nodes[join_at + 1:]
    roots = _view_roots(nodes)
    scalars = _roots(inputs.scalars, roots)
    for node in [n for n in nodes[:join_at] if _writes(n, roots) & scalars]:
        nodes = _hoisted(nodes, node, roots)    # the step's bookkeeping: advance_step
    touched = [_touches(n, roots) for n in nodes[:join_at]]
    infos = []
    for i, p in enumerate(inputs.params):
        reads, writes = inputs.of_param(update, i)
        safe = _last_conflict(touched, _roots(reads, roots), _roots(writes, roots))
        infos.append(GradientInfo(i, p.nbytes, inputs.grads[i].dtype, safe))
    launches: dict[int, list[Node]] = {}
    for b, bucket in enumerate(plan_buckets(infos, cap_bytes)):
        launches.setdefault(bucket.ready, []).append(
            _bucket_update(update, inputs, sorted(bucket.indices), b))
    held = [v for ns in launches.values() for n in ns for v in n.inputs if not v.is_external]
    join = Node("update_join", list(dict.fromkeys(held)), [], {}, (), f"{update.label} join")
    out = list(launches.get(-1, []))
    for i, node in enumerate(nodes):
        if i == join_at:
            out.append(join)
        out.append(node)
        out.extend(launches.get(i, []))
    if join_at == len(nodes):
        out.append(join)
    return Graph(out, graph.inputs, graph.params, graph.state, dict(graph.outputs))


def _roots(values, roots: dict[Value, Value]) -> set[Value]:
    """The values whose memory `values` are (a view's is its source's)."""
    return {roots.get(v, v) for v in values}


def _writes(node: Node, roots: dict[Value, Value]) -> set[Value]:
    return _roots(node.outputs + [node.inputs[i] for i in node.mutates], roots)


def _touches(node: Node, roots: dict[Value, Value]) -> tuple[set[Value], set[Value]]:
    """(memory the node reads, memory it writes)."""
    return _roots(node.inputs, roots), _writes(node, roots)


def _last_conflict(touched: list[tuple[set[Value], set[Value]]], reads: set[Value],
                   writes: set[Value]) -> int:
    """The position of the last node (by its `_touches`) that work reading `reads` and writing
    `writes` may not be moved in front of: one that writes what it reads, or reads or writes
    what it writes. -1 when there is none."""
    for i in range(len(touched) - 1, -1, -1):
        r, w = touched[i]
        if w & (reads | writes) or r & writes:
            return i
    return -1


def _hoisted(nodes: list[Node], node: Node, roots: dict[Value, Value]) -> list[Node]:
    """`nodes` with `node` moved up to just after the last earlier node it conflicts with."""
    j = nodes.index(node)
    at = _last_conflict([_touches(n, roots) for n in nodes[:j]], *_touches(node, roots)) + 1
    return nodes[:at] + [node] + nodes[at:j] + nodes[j + 1:]


def _bucket_update(update: Node, inputs: UpdateInputs, indices: list[int], b: int) -> Node:
    """The update of parameters `indices` (ascending) alone: the same op and hyperparameters,
    per-parameter attrs and inputs sliced, forked onto the update stream (attrs update_stream)."""
    n = update.attrs["n_params"]
    rows = hyper_rows(update.attrs)
    attrs = {}
    for key, value in update.attrs.items():
        if isinstance(value, (tuple, list)) and key not in COPY_ATTRS:
            if len(value) != n:
                raise PlanError(f"{update.op}: attrs {key} has {len(value)} entries for {n} "
                                "parameters")
            value = tuple(value[i] for i in indices)
        if key not in COPY_ATTRS:
            attrs[key] = value
    copied = [j for j, i in enumerate(indices) if i in inputs.copies]
    if copied:
        attrs["copies"] = tuple(copied)
        if "copy_dims" in update.attrs:
            attrs["copy_dims"] = tuple(update.attrs["copy_dims"][inputs.copies[indices[j]]]
                                       for j in copied)
    attrs.update(n_params=len(indices), update_stream=True,
                 hyper_rows=tuple(rows[i] for i in indices))
    ins = list(inputs.scalars) + [inputs.params[i] for i in indices] \
        + [inputs.grads[i] for i in indices] \
        + [slot[i] for slot in inputs.slots for i in indices] \
        + [inputs.copy_value(update, indices[j]) for j in copied]
    return Node(update.op, ins, [], attrs, OPS[update.op].mutates(attrs),
                f"{update.label} bucket {b}")
