"""The backend interface: what a device must provide to run a Plan.

A backend owns memory (one arena per plan, fixed buffers for externals) and a table of op
implementations. Every implementation has the signature `impl(node, ins, outs, ctx)`: it reads
`ins` and writes into the preallocated `outs` (and into the inputs the node `mutates`); it never
allocates the result, so the same code runs eagerly and under CUDA-graph capture.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from typing import Any, Callable

import numpy as np

from ..ir.graph import Node

OpImpl = Callable[[Node, list, list, Any], None]


class Backend(ABC):
    name: str
    impls: dict[str, OpImpl]

    @abstractmethod
    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        """A fresh device array (only outside a step: externals, arenas)."""

    @abstractmethod
    def to_numpy(self, array) -> np.ndarray:
        """A host copy of a device array (syncs)."""

    @abstractmethod
    def copy_into(self, dst, src) -> None:
        """Copy a host or device array into the fixed buffer dst (asynchronous where possible)."""

    @abstractmethod
    def view(self, arena, offset: int, shape: tuple[int, ...], dtype: str) -> Any:
        """The array at byte `offset` of `arena` with the given shape and dtype."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued work."""

    @abstractmethod
    def owns(self, array) -> bool:
        """Whether `array` already lives in this backend's memory (else it is copied in)."""

    @abstractmethod
    def copy_result(self, buffer) -> Any:
        """A new array holding `buffer`'s value, which the next step may overwrite."""

    def keep_until_read(self, sources) -> None:
        """Keep the arrays just given to copy_into alive until the copies have read them
        (where copies run asynchronously)."""

    def host_mirror(self, array):
        """A host array that the device side keeps up to date, without a sync, with the value
        a guard's counters (ops/guard.py) hold (on the CPU: the array itself); None where the
        host can only see them by syncing."""
        return None

    def make_context(self, precision: str, deterministic: bool = True):
        """What every op impl receives as `ctx` (None on backends that need nothing).
        deterministic False lets kernel choices include ones whose bits vary between runs."""
        return None

    def capture(self, run, ctx):
        """Record `run()` once for replay (`.launch()`); only backends with graphs can."""
        raise NotImplementedError(f"backend {self.name!r} cannot capture a step")

    def prepare(self, nodes: list[Node], precision: str = "fp32", calls=(), ctx=None) -> None:
        """Called once per executable before its first run: a backend may build ahead what
        the nodes' first launches would otherwise build one by one (CUDA: compile kernels,
        build cuDNN plans). calls: (node, inputs, outputs) on the executable's buffers; ctx:
        the context its runs will get."""

    def annotate(self, name: str):
        """A named range around device work (NVTX on CUDA), for profilers."""
        return nullcontext()

    def run_node(self, node: Node, ins: list, outs: list, ctx=None) -> None:
        impl = self.impls.get(node.op)
        if impl is None:
            raise NotImplementedError(f"backend {self.name!r} has no implementation of op {node.op!r}")
        impl(node, ins, outs, ctx)
