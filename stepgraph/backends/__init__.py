"""Backends run a Plan. They are passed explicitly: `get_backend("cpu" | "cuda")`.

As torch.backends, this package also holds the flags model code sets (`cudnn.benchmark`,
`cuda.matmul.allow_tf32`, ...): see flags.py."""
from __future__ import annotations

from ..errors import BackendUnavailableError
from ..errors import lookup_torch_name as _lookup_torch_name
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


DEVICES = ("auto", "cpu", "cuda")   # what compile_train_step(device=...) accepts


def resolve_device(device: str) -> str:
    """`device` as a backend's name: "auto" is "cuda" when a GPU backend is usable here
    (cuda_available), else "cpu"; "cpu" and "cuda" stay as they are."""
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    return device


def __getattr__(name: str):
    """A torch.backends name stepgraph lacks: UnsupportedOpError (an AttributeError)."""
    return _lookup_torch_name(__name__, "torch.backends", name)
