"""The optimizer updates' entries of the backend's op table: an sgd_update or adam_update node
with attrs update_stream (compile/overlap.py: one bucket of the step's parameters, placed
inside the backward pass) runs its one multi-tensor launch (launchers.py) forked onto the
context's update stream (side_stream.py), so that the backward kernels after it run beside
it; update_join makes ctx.stream wait for every update forked since the last join. An update
without the attr launches exactly as launchers.py's entry does, on ctx.stream.

These entries take the place of launchers.py's in the backend's op table (IMPL_MODULES lists
this family after launchers); launchers.IMPLS keeps the plain launches.

Nothing is allocated while capturing: the update stream is made at the first eager forked
update, and each node's fork and done events are its node memory.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ...ir.graph import Node
from .launchers import _node_memory, adam_update, sgd_update
from .side_stream import fork_events, forked, join

EXTRAS_KEY = "update"
LAUNCHERS: dict[str, Callable] = {"sgd_update": sgd_update, "adam_update": adam_update}
# update_join runs no kernel: its (held) operands may be of any dtype.
BF16_OPS = frozenset({"update_join"})


def launch_update(ctx, node: Node, ins: list) -> None:
    """The node's update launch: on ctx.stream, or forked onto the update stream when the
    node has attrs update_stream (its launch, tables and bf16 copies all on that stream)."""
    launch = LAUNCHERS[node.op]
    if not node.attrs.get("update_stream"):
        launch(ctx, node, ins)
        return
    events = _node_memory(node, ("update_stream",), ctx, fork_events)
    with forked(ctx, EXTRAS_KEY, node.op, events) as stream:
        launch(replace(ctx, stream=stream), node, ins)


def update_join(ctx, node: Node) -> None:
    """ctx.stream waits for the updates forked since the last join."""
    join(ctx, EXTRAS_KEY)


IMPLS: dict[str, Callable] = {
    "sgd_update": lambda node, ins, outs, ctx: launch_update(ctx, node, ins),
    "adam_update": lambda node, ins, outs, ctx: launch_update(ctx, node, ins),
    "update_join": lambda node, ins, outs, ctx: update_join(ctx, node),
}
