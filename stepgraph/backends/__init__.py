"""Backends run a Plan. They are passed explicitly: `get_backend("cpu" | "cuda")`.

As torch.backends, this package also holds the flags model code sets (`cudnn.benchmark`,
`cuda.matmul.allow_tf32`, ...): see flags.py."""
from __future__ import annotations

from ..errors import BackendUnavailableError
from . import cuda  # noqa: F401  (light: only torch.backends.cuda's flags)
from .base import Backend
from .flags import cudnn, mps  # noqa: F401

_instances: dict[str, Backend] = {}


def get_backend(device: str) -> Backend:
    """The backend for a device name; one instance per process (it owns a stream and caches)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device not in _instances:
        if device == "cpu":
            from .numpy import NumpyBackend
            _instances[device] = NumpyBackend()
        else:
            try:
                from .cuda.backend import CudaBackend
            except ImportError as err:
                raise BackendUnavailableError(
                    f"device='cuda' needs CuPy and nvmath-python: pip install -e '.[cuda]' ({err})"
                ) from err
            _instances[device] = CudaBackend(local_gpu())
    return _instances[device]


def local_gpu() -> int:
    """The GPU of this process: its local rank in a data-parallel run (LOCAL_RANK under
    torchrun and `stepgraph launch`, SLURM_LOCALID under srun, ...: distributed.detect_launch),
    unless the launcher left each process one visible GPU; else 0."""
    from ..distributed.detect import detect_launch

    env = detect_launch()
    if env is None or env.world_size <= 1:
        return 0
    local = env.local_rank
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:     # CudaBackend reports a missing GPU itself
        return local
    return local if local < count or count != 1 else 0


def cuda_available() -> bool:
    """True when CuPy is installed and sees a GPU."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "no"
        return False


def __getattr__(name: str):
    """A torch.backends name stepgraph lacks: UnsupportedOpError (an AttributeError)."""
    import importlib
    import importlib.util

    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")     # a submodule not loaded yet
    from ..errors import UnsupportedOpError
    raise UnsupportedOpError(f"torch.backends.{name} is not supported by stepgraph (see "
                             "docs/TORCH_COMPAT.md for the torch names it has)")
