"""torch.cuda as model and training code calls it: is_available, device_count, manual_seed,
manual_seed_all, synchronize, current_device, set_device, is_bf16_supported. Where a step
runs is `compile_train_step(device=...)`; these answer questions about the machine and never
move tensors."""
from __future__ import annotations

import sys

from . import amp
from .backends import cuda_available

sys.modules[__name__ + ".amp"] = amp        # `from torch.cuda.amp import GradScaler`


def is_available() -> bool:
    """True when CuPy is installed and sees a GPU (what device="cuda" needs)."""
    return cuda_available()


def device_count() -> int:
    """The number of GPUs CuPy sees; 0 without CuPy or a driver."""
    if not cuda_available():
        return 0
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def current_device() -> int:
    """The GPU this process's steps run on (LOCAL_RANK in a data-parallel run, else 0)."""
    from .backends import local_gpu
    return local_gpu()


def set_device(device) -> None:
    """torch.cuda.set_device, as a DDP script calls it with its LOCAL_RANK: each process's
    steps run on its LOCAL_RANK's GPU (current_device(); distributed.init() makes it CuPy's
    current device), so naming that GPU is accepted; another one is refused. Nothing
    without a GPU."""
    from .devices import as_device
    from .errors import UnsupportedOpError

    index = as_device(device).index or 0
    if cuda_available() and index != current_device():
        raise UnsupportedOpError(f"torch.cuda.set_device({index}) is not supported by "
                                 f"stepgraph: this process runs on GPU {current_device()} "
                                 "(LOCAL_RANK); start one process per GPU with torchrun or "
                                 "`stepgraph launch --gpus N`")


def synchronize(device=None) -> None:
    """Wait for every kernel on the current GPU; nothing to wait for without one."""
    if cuda_available():
        import cupy
        cupy.cuda.Device().synchronize()


def manual_seed(seed: int) -> None:
    """As torch.manual_seed: the random factories and initialisation share one host generator
    (a step's dropout is seeded by compile_train_step(seed=...))."""
    from .functions.factories import manual_seed as seed_all
    seed_all(seed)


manual_seed_all = manual_seed


def is_bf16_supported() -> bool:
    """True on a GPU of compute capability 8.0 or newer (bf16 tensor cores: what
    compile_train_step(precision="bf16") is made for)."""
    if not cuda_available():
        return False
    import cupy
    return int(cupy.cuda.Device().compute_capability) >= 80


def __getattr__(name: str):
    """A torch.cuda name stepgraph lacks: UnsupportedOpError (an AttributeError)."""
    from .errors import missing_torch_name
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    raise missing_torch_name(f"torch.cuda.{name}")
