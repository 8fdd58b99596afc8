"""Launcher of sync_batch_norm.cu (nn.SyncBatchNorm's running-statistics update,
ops/sync_batch_norm.py) and its cuda op table. The rest of SyncBatchNorm is ordinary ops and
all_reduce_sum (collective.py). One block on ctx.stream: no host sync, no allocation."""
from __future__ import annotations

from typing import Callable

import numpy as np

from .runtime.launch import BLOCK, _check, _check_scalar, _launch

SOURCE = "sync_batch_norm.cu"


def kernel_names() -> dict[str, set[str]]:
    """{.cu file: every kernel name this module may launch} (the NVRTC compile test)."""
    return {SOURCE: {"running_stats_update_kernel"}}


def running_stats_update(ctx, node, ins: list) -> None:
    running_mean, running_var, tracked, mean, var, total = ins
    c = running_mean.size
    for what, a in (("running_mean", running_mean), ("running_var", running_var),
                    ("mean", mean), ("var", var)):
        _check(f"running_stats_update {what}", a, "float32", (c,))
    _check_scalar("running_stats_update num_batches_tracked", tracked, "int64")
    _check("running_stats_update count", total, "float32", (1,))
    momentum = node.attrs["momentum"]
    _launch(ctx, SOURCE, "running_stats_update_kernel", (1,), (BLOCK,),
            (running_mean, running_var, tracked, mean, var, total,
             np.float64(0.0 if momentum is None else momentum), np.int32(momentum is None),
             np.int32(c)))


IMPLS: dict[str, Callable] = {
    "running_stats_update": lambda node, ins, outs, ctx: running_stats_update(ctx, node, ins),
}
