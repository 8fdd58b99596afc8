"""Side streams of a step: work forked from ctx.stream at one point of the step and joined
back at a later one, so that the kernels issued on ctx.stream in between run beside it (the
data-parallel all-reduces, collective.py; the optimizer updates that overlap the backward
pass, update_stream.py).

A fork records an event on ctx.stream where the work starts and has the side stream wait for
it; the work goes to the side stream, followed by a second event that the next join makes
ctx.stream wait for. A side stream runs its work in order, so a join waits only for the last
event. Captured, the side stream joins the capture by waiting on an event recorded inside it,
and the two streams become two branches of the step's one CUDA graph; a capture must end
joined.

Nothing is allocated while capturing: a side stream is made at the first eager fork onto it
(ctx.extras[key]), and the events of a forking node are node memory made at its first eager
run (`fork_events`; Executable warms up eagerly before capturing).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import cupy as cp  # imports without a GPU

from ....errors import CaptureError
from .launch import _capturing


@dataclass
class SideStream:
    """A side stream of a context, and its work not yet joined."""

    stream: Any
    pending: Any = None       # the event recorded after the last work forked onto it


def side_stream(ctx, key: str, what: str) -> SideStream:
    """The side stream ctx.extras[key], made now if this is an eager call."""
    side = ctx.extras.get(key)
    if side is None:
        if _capturing(ctx):
            raise CaptureError(f"{what}: its side stream ({key!r}) is made at the first eager "
                               "run; run the step eagerly once before capturing")
        side = ctx.extras[key] = SideStream(cp.cuda.Stream(non_blocking=True))
    return side


def fork_events() -> dict:
    """A forking node's events (keep them as its node memory): "fork", recorded on ctx.stream,
    and "done", recorded on the side stream after its work."""
    return dict(fork=cp.cuda.Event(disable_timing=True), done=cp.cuda.Event(disable_timing=True))


@contextmanager
def forked(ctx, key: str, what: str, events: dict) -> Iterator[Any]:
    """The side stream `key`, after everything issued on ctx.stream so far; the work issued on
    it inside the block is what the next `join` waits for."""
    side = side_stream(ctx, key, what)
    events["fork"].record(ctx.stream)
    side.stream.wait_event(events["fork"])
    yield side.stream
    events["done"].record(side.stream)
    side.pending = events["done"]


def join(ctx, key: str) -> None:
    """ctx.stream waits for the work forked onto side stream `key` since its last join."""
    side = ctx.extras.get(key)
    if side is not None and side.pending is not None:
        ctx.stream.wait_event(side.pending)
        side.pending = None


def join_all(ctx) -> None:
    """ctx.stream waits for every side stream (a capture of one forking op alone must end
    joined: profile.py)."""
    for key, side in list(ctx.extras.items()):
        if isinstance(side, SideStream):
            join(ctx, key)
