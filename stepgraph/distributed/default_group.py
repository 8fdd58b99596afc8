"""The run's default process group (init() makes it, destroy() ends it) and what asks for it:
its own module, so that torch_api.py (torch.distributed's names) reaches it without importing
the package that re-exports both."""
from __future__ import annotations

from .detect import DistEnv, detect_launch
from .group import ProcessGroup, rendezvous

_group: ProcessGroup | None = None


def init(timeout: float | None = None, env: DistEnv | None = None) -> ProcessGroup:
    """The process group of this run, made on the first call: from the launcher's variables
    (detect_launch(); a world of one without them). Waits at most `timeout` seconds (default
    $STEPGRAPH_DIST_TIMEOUT or 120) for every rank to arrive. Where CuPy sees GPUs, GPU
    LOCAL_RANK becomes the current device (as torch.cuda.set_device(local_rank))."""
    global _group
    if _group is not None and not _group._closed:
        return _group
    env = env or detect_launch() or DistEnv(0, 1, 0, "127.0.0.1", 1, "single", "none")
    _use_local_gpu()
    _group = rendezvous(env, timeout)
    return _group


def _use_local_gpu() -> None:
    """Make this rank's GPU (LOCAL_RANK) CuPy's current device, so arrays made before the
    step is compiled (the loader's) land on it; nothing without CuPy or a GPU."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return
    except Exception:       # no CuPy, no driver, no device: a CPU run
        return
    from ..backends import local_gpu

    cupy.cuda.Device(local_gpu()).use()


def get_group() -> ProcessGroup | None:
    """init()'s group, or None before init()."""
    return _group if _group is not None and not _group._closed else None


def is_initialized() -> bool:
    return get_group() is not None


def get_rank(group=None) -> int:
    """This process's rank (0 without init()); torch's `group` may only be the default."""
    found = get_group()
    return 0 if found is None else found.rank


def get_world_size(group=None) -> int:
    """The number of processes (1 without init()); torch's `group` may only be the default."""
    found = get_group()
    return 1 if found is None else found.world_size


def destroy() -> None:
    """Destroy init()'s group now (it is destroyed at exit anyway)."""
    global _group
    if _group is not None:
        _group.destroy()
        _group = None
