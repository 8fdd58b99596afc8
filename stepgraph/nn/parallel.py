"""torch.nn.parallel for training scripts: DistributedDataParallel.

    dist.init_process_group(backend="nccl")
    model = DistributedDataParallel(model.to(local_rank), device_ids=[local_rank])
    for x, y in loader:                       # the captured loop (stepgraph/loop/)
        optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()

The wrapper holds the model as `.module` (state_dict keys "module.*", as torch's) and calls
it. What makes training data-parallel is the loop capture: a step whose passes call a
DistributedDataParallel is compiled with distributed=DataParallel(bucket_cap_mb,
broadcast_buffers) (api.py, compile/distribute.py), so its gradients are averaged inside
the step (NCCL on CUDA, the store on the CPU) and rank 0's BatchNorm statistics are
broadcast at its end. Rank 0's parameters and buffers are broadcast when the wrapper is made
(init_sync), as torch's. torch.nn.DataParallel (one process, several GPUs) is refused: one
process per GPU under torchrun or `stepgraph launch` is the way.
"""
from __future__ import annotations

from contextlib import contextmanager as _contextmanager

# the module's namespace is torch.nn.parallel's: stepgraph's DataParallel (the step's
# options) must not pass for torch.nn.parallel.DataParallel
from .. import distributed as _distributed
from ..errors import UnsupportedOpError
from .module import Module


class DistributedDataParallel(Module):
    """torch.nn.parallel.DistributedDataParallel over the default process group
    (init_process_group). device_ids / output_device / dim are accepted (each process uses
    its own GPU, LOCAL_RANK's); bucket_cap_mb (default 25) and broadcast_buffers (default
    True: rank 0's running statistics on every rank) are the step's DataParallel options;
    find_unused_parameters, static_graph, gradient_as_bucket_view and check_reduction change
    nothing (a compiled step knows which parameters it uses). mixed_precision and
    device_mesh are refused (use torch.autocast in the script; one default group)."""

    def __init__(self, module: Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers=None, init_sync: bool = True, process_group=None,
                 bucket_cap_mb=None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, delay_all_reduce_named_params=None,
                 param_to_hook_all_reduce=None, mixed_precision=None, device_mesh=None,
                 skip_all_reduce_unused_params: bool = False, bucket_cap_mb_list=None,
                 batched_grad_copy: bool = False, forward_sync_buffers=None):
        super().__init__()
        _refuse(mixed_precision=mixed_precision, device_mesh=device_mesh,
                delay_all_reduce_named_params=delay_all_reduce_named_params,
                param_to_hook_all_reduce=param_to_hook_all_reduce,
                bucket_cap_mb_list=bucket_cap_mb_list)
        group = _distributed.get_group()
        if group is None:
            raise ValueError("Default process group has not been initialized, please make "
                             "sure to call init_process_group.")
        if process_group is not None and process_group is not group:
            raise UnsupportedOpError("torch.nn.parallel.DistributedDataParallel(process_group="
                                     "...) with a group other than the default is not "
                                     "supported by stepgraph: use the default group")
        if not any(p.requires_grad for p in module.parameters()):
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't "
                               "have any parameter that requires a gradient.")
        self.module = module
        self.device_ids, self.output_device, self.dim = device_ids, output_device, dim
        self.broadcast_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
        self.find_unused_parameters, self.static_graph = find_unused_parameters, static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.process_group = group
        # plain attributes (not modules or tensors): DataParallel holds the group
        object.__setattr__(self, "data_parallel", _distributed.DataParallel(
            _distributed.BUCKET_CAP_MB if bucket_cap_mb is None else float(bucket_cap_mb),
            group=group,
            broadcast_buffers=self.broadcast_buffers))
        if init_sync:
            _broadcast_state(module, group)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @_contextmanager
    def no_sync(self):
        """torch's gradient accumulation without all-reduce: in a captured loop the passes
        before optimizer.step() are one compiled step whose gradients are averaged once, so
        there is nothing to skip; accepted as a no-op."""
        yield


def _refuse(**options) -> None:
    for name, value in options.items():
        if value is not None:
            raise UnsupportedOpError(
                f"torch.nn.parallel.DistributedDataParallel({name}=...) is not supported by "
                "stepgraph: leave it None (for mixed precision use torch.autocast in the "
                "loop; one process group)")


def _broadcast_state(module: Module, group) -> None:
    """Rank 0's parameters and buffers into `module` on every rank (host values, through
    the group's store; the step broadcasts again on its device when compiled)."""
    if group.world_size == 1:
        return
    held = [t for t in [*module.parameters(), *module.buffers()] if t is not None]
    values = group.broadcast([t.numpy() for t in held], what="DistributedDataParallel's "
                                                           "parameter broadcast")
    for t, v in zip(held, values):
        t.assign(v)


def __getattr__(name: str):
    """A torch.nn.parallel name stepgraph lacks (DataParallel, ...): UnsupportedOpError."""
    from ..errors import lookup_torch_name
    return lookup_torch_name(__name__, "torch.nn.parallel", name)


__all__ = ["DistributedDataParallel"]
