"""SyncBatchNorm family: the running-statistics update of nn.SyncBatchNorm (nn/sync_batch_norm.py).

SyncBatchNorm's forward is composed of ordinary ops and all_reduce_sum (ops/collective.py),
so its gradient, the global sums of the backward included, follows from their VJPs. What the
composition cannot say is the in-place update of the running statistics from the global
batch's mean and variance: `running_stats_update`, batch_norm_train's update with the global
count. No VJP: it has no outputs, and the backward never reaches it.
"""
from __future__ import annotations

import numpy as np

from ..ir.ops import _need, defop, impl


@defop("running_stats_update", mutates=lambda attrs: (0, 1, 2))
def _running_stats_update(ins, attrs):
    """ins = running_mean (C,), running_var (C,) (float32), num_batches_tracked (int64
    scalar), mean (C,), var (C,) (the biased variance), count (1,) (the elements each
    channel's statistics were taken over, all ranks): in place, num_batches_tracked += 1; m =
    attrs momentum, or 1/num_batches_tracked (after the increment) when it is None;
    running_mean = (1-m) running_mean + m mean; running_var = (1-m) running_var + m var
    count/(count-1), as batch_norm_train's update. Computed in float64."""
    _need(len(ins) == 6, "running_stats_update", f"takes 6 inputs, got {len(ins)}")
    rm, rv, count, mean, var, total = ins
    c = rm.shape
    _need(len(c) == 1 and rv.shape == c and mean.shape == c and var.shape == c,
          "running_stats_update", f"running statistics {rm.shape} {rv.shape} and batch "
                                  f"statistics {mean.shape} {var.shape} must be one (C,) shape")
    _need(rm.dtype == rv.dtype == "float32", "running_stats_update",
          f"running statistics must be float32, got {rm.dtype} {rv.dtype}")
    _need(count.shape == () and count.dtype == "int64", "running_stats_update",
          f"num_batches_tracked must be an int64 scalar, got {count!r}")
    _need(total.shape == (1,), "running_stats_update", f"count must be (1,), got {total.shape}")
    return []


@impl("running_stats_update")
def _running_stats_update_impl(node, ins, outs, ctx):
    rm, rv, count, mean, var, total = ins
    count[...] += 1
    momentum = node.attrs["momentum"]
    m = momentum if momentum is not None else 1.0 / int(count)
    n = float(np.asarray(total, np.float64).reshape(-1)[0])
    rm[...] = (1 - m) * rm.astype(np.float64) + m * mean.astype(np.float64)
    rv[...] = (1 - m) * rv.astype(np.float64) + m * var.astype(np.float64) * n / (n - 1)
