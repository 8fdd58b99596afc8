"""nn.SyncBatchNorm: BatchNorm whose training statistics are those of the global batch, every
rank's samples together (torch.nn.SyncBatchNorm).

Inside the step's graph, per channel: each rank sums its x and its element count, one
all_reduce_sum (ops/collective.py) makes the global sums, mean = sum / count; each rank sums
its (x - mean)^2, a second all_reduce_sum makes the global biased variance (two passes: no
cancellation of E[x^2] - mean^2). y = (x - mean) / sqrt(var + eps) * weight + bias. The
backward follows from the ops' VJPs: all_reduce_sum's VJP is itself, so each BatchNorm's
backward all-reduces the per-channel sums of its cotangents (torch's sum_dy and sum_dy_xmu).
The running statistics are updated from the global mean and the unbiased global variance
(running_stats_update, ops/sync_batch_norm.py). With a world of one, in eval mode or without a
process group, it is BatchNorm itself (batch_norm_train), as torch falls back to
F.batch_norm.

Under a data-parallel step the gradients of weight and bias are then averaged as any other's:
the same gradients as one process over the global batch (equal shards, a mean loss).
"""
from __future__ import annotations

from ..errors import ShapeError, UnsupportedOpError
from ..ir.trace import Tensor
from .functional import _channel_shape, _traced
from .layers import _BatchNorm
from .module import Module


class SyncBatchNorm(_BatchNorm):
    """torch.nn.SyncBatchNorm over (N, C, *spatial) inputs (any rank >= 2), statistics of the
    global batch in training mode (the module docstring). process_group: a
    stepgraph.distributed.ProcessGroup, or None for the default group (init_process_group /
    distributed.init()); device and dtype are accepted as torch's (float32 weights)."""

    ranks = (2, 3, 4, 5)

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None, *, bias: bool = True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, bias=bias)
        self.process_group = process_group

    def _group(self):
        if self.process_group is not None:
            return self.process_group
        from ..distributed import get_group

        return get_group()

    def forward(self, x):
        if x.ndim < 2:
            raise ValueError(f"expected at least 2D input (got {x.ndim}D input)")
        if x.shape[1] == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")
        group = self._group()
        if not self.training or group is None or group.world_size == 1:
            return super().forward(x)
        track = self.track_running_stats and self.running_mean is not None
        return sync_batch_norm(x, self.running_mean if track else None,
                               self.running_var if track else None,
                               self.num_batches_tracked if track else None, self.weight,
                               self.bias, self.momentum, self.eps, group)

    @classmethod
    def convert_sync_batchnorm(cls, module: Module, process_group=None) -> Module:
        """`module` with every BatchNorm1d/2d/3d (any _BatchNorm) replaced by a SyncBatchNorm
        holding the same Parameters and Buffers (the same objects, as torch's), its training
        flag kept; a BatchNorm `module` itself comes back converted. Recursive, as torch's."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_group, bias=module.bias is not None)
            for name in ("weight", "bias"):
                if getattr(module, name) is not None:
                    setattr(out, name, getattr(module, name))
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                setattr(out, name, getattr(module, name))
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in list(module.named_children()):
            setattr(out, name, cls.convert_sync_batchnorm(child, process_group))
        return out


def sync_batch_norm(x: Tensor, running_mean, running_var, num_batches_tracked, weight, bias,
                    momentum, eps: float, group) -> Tensor:
    """Training-mode BatchNorm of x with the statistics of every rank's x together (the module
    docstring); the running statistics (when given) updated in place from them."""
    if not isinstance(x, Tensor):
        raise ShapeError(f"SyncBatchNorm takes a tensor, got {type(x).__name__}")
    if x.dtype not in ("float32", "float64"):
        raise UnsupportedOpError(f"torch.nn.SyncBatchNorm on {x.dtype} inputs is not supported "
                                 "by stepgraph: use float32 (precision='fp32'), or "
                                 "torch.nn.BatchNorm2d (statistics of each rank's batch)")
    from ..functions.tensors import cat

    t, c = x.tracer, x.shape[1]
    axes = (0,) + tuple(range(2, x.ndim))
    channel = _channel_shape(x)
    attrs = {"group": group.id, "world_size": group.world_size}
    count = t.op("fill", [], value=float(x.numel() // c), shape=(1,), dtype=x.dtype)
    sums = t.op("all_reduce_sum", [cat([x.sum(axes), count])], **attrs)
    total = sums[c:]
    mean = sums[:c] / total
    centred = x - mean.reshape(channel)
    var = t.op("all_reduce_sum", [centred.square().sum(axes)], **attrs) / total
    y = centred * (var + float(eps)).rsqrt().reshape(channel)
    w, b = _traced(x, weight), _traced(x, bias)
    y = y if w is None else y * w.reshape(channel)
    y = y if b is None else y + b.reshape(channel)
    if running_mean is not None:
        if momentum is None and num_batches_tracked is None:
            raise ValueError("SyncBatchNorm with momentum=None (cumulative average) needs the "
                             "num_batches_tracked counter")
        t.op_all("running_stats_update", [_traced(x, running_mean), _traced(x, running_var),
                                          _traced(x, num_batches_tracked), mean, var, total],
                 momentum=momentum)
    return y
