"""Launchers of random.cu (the `random` op: uniform and normal draws from the step's Philox
stream, ops/random.py) and their cuda op table. The step counter is read on the device, so a
captured graph draws fresh values at every replay."""
from __future__ import annotations

from typing import Callable

import numpy as np

from .runtime.launch import BLOCK, _check, _check_scalar, _grid, _launch

SOURCE = "random.cu"
KERNELS = {"uniform": "random_uniform_kernel", "normal": "random_normal_kernel"}


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    return {SOURCE: set(KERNELS.values())}


def random_forward(ctx, step, y, kind: str, seed: int, site: int) -> None:
    """y (float32) = Philox draws of `kind` keyed by (seed, site) and the int64 device step
    counter `step` (rng.uniform / rng.normal)."""
    if kind not in KERNELS:
        raise ValueError(f"random: kind must be one of {sorted(KERNELS)}, got {kind!r}")
    if not 0 <= site < 2**32:
        raise ValueError(f"random: site must fit in 32 bits, got {site}")
    _check_scalar("random step", step, "int64")
    _check("random output", y, "float32")
    n = y.size
    if not n:
        return
    work = (n + 3) // 4 if kind == "uniform" else (n + 1) // 2
    _launch(ctx, SOURCE, KERNELS[kind], _grid(work), (BLOCK,),
            (step, y, np.int64(n), np.uint64(seed & (2**64 - 1)), np.uint32(site)))


IMPLS: dict[str, Callable] = {
    "random": lambda node, ins, outs, ctx: random_forward(
        ctx, ins[0], outs[0], node.attrs["kind"], node.attrs["seed"], node.attrs["site"]),
}
