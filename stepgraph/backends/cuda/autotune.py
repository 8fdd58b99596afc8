"""Choosing among interchangeable kernels for one problem by timing them.

Several ops have more than one implementation whose speed no size rule predicts (conv paths,
cuBLASLt against the tiled GEMM): each candidate is timed on the real buffers as a captured
graph replay (graph.time_on_device) and the fastest is kept. The choice is keyed by the problem
(op, shapes, options, candidates) and shared by every context of the backend, like cuBLASLt's
algorithm choices in GemmCache: two steps compiled from the same model run the same kernels,
so their results agree bit for bit.
"""
from __future__ import annotations

from typing import Callable, Hashable

from .graph import time_on_device


def run_fastest(ctx, key: Hashable, paths: dict[str, Callable[[], None]], default: str) -> None:
    """Run the fastest of `paths` (name -> launch) for problem `key`, timing every candidate at
    the first eager call with that key; during a capture with no choice yet, `default`."""
    chosen = ctx.paths
    if key not in chosen and not ctx.stream.is_capturing() and len(paths) > 1:
        chosen[key] = min(paths, key=lambda name: time_on_device(ctx, paths[name]))
    paths[chosen.get(key, default)]()


def run_family(paths: dict[str, Callable[[], None]], family: str, fallback: str) -> None:
    """Run the first path of `family` (named `family` or `family:variant`), else `fallback`:
    how tests force one implementation."""
    paths[next((name for name in paths if name.split(":")[0] == family), fallback)]()
