"""The update stream: an optimizer update with attrs update_stream (compile/overlap.py: one
bucket of the step's parameters, placed inside the backward pass) runs its one multi-tensor
launch (optim.py) forked onto the context's update stream (side_stream.py), so that the
backward kernels after it run beside it; update_join makes ctx.stream wait for every update
forked since the last join. An update without the attr launches on ctx.stream.

Nothing is allocated while capturing: the update stream is made at the first eager forked
update, and each node's fork and done events are its node memory.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ....ir.graph import Node
from .launch import _node_memory
from .side_stream import fork_events, forked, join

EXTRAS_KEY = "update"


def launch_update(ctx, node: Node, ins: list, launch: Callable) -> None:
    """launch(ctx, node, ins), the node's update launch: on ctx.stream, or forked onto the
    update stream when the node has attrs update_stream (its launch, tables and bf16 copies
    all on that stream)."""
    if not node.attrs.get("update_stream"):
        launch(ctx, node, ins)
        return
    events = _node_memory(node, ("update_stream",), ctx, fork_events)
    with forked(ctx, EXTRAS_KEY, node.op, events) as stream:
        launch(replace(ctx, stream=stream), node, ins)


def update_join(ctx) -> None:
    """ctx.stream waits for the updates forked since the last join."""
    join(ctx, EXTRAS_KEY)
