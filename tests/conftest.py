"""Shared pytest setup: the `cuda` marker skips cleanly on machines without a usable GPU, the
`multigpu` marker on machines with fewer than two, and `slow` sweeps unless STEPGRAPH_SLOW=1.
memory_format "auto" is left to its rule (STEPGRAPH_LAYOUT_MEASURE=0) unless a test asks.
Under pytest-xdist each worker's torch (the oracle) takes its share of the host's cores: ten
workers each starting a thread per core oversubscribed a 32-core host until the float64
reference runs of the model files ran past the tests' limits."""
from __future__ import annotations

import functools
import gzip
import os
import platform
import sys
import zlib

# OpenBLAS picks its kernels by CPU (an EPYC Zen 5 took its Haswell kernels, a Zen 4 its
# SkylakeX ones), and those round float32 sums differently: a model file's fourth step of
# float32 training then met a near-tie on one host and not on the other, past the tolerance
# policy's bound. The same kernels on every x86-64 host, set before NumPy loads OpenBLAS.
if platform.machine() in ("x86_64", "AMD64"):
    os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

os.environ.setdefault("MPLBACKEND", "Agg")
# memory_format "auto" by the rule, not by timing the two layouts (compile/layout_choice.py):
# a test's small model takes the same layout on every machine and run; the tests of the
# timing turn it back on.
os.environ.setdefault("STEPGRAPH_LAYOUT_MEASURE", "0")

CUDA_MARKER = "cuda"
MULTIGPU_MARKER = "multigpu"
SLOW_MARKER = "slow"
SLOW_ENV = "STEPGRAPH_SLOW"     # set to 1 to run the `slow` sweeps


def pytest_configure(config):
    _share_cores_among_workers()
    config.addinivalue_line(
        "markers", f"{CUDA_MARKER}: needs an NVIDIA GPU with CuPy; skipped when none is available")
    config.addinivalue_line(
        "markers", f"{MULTIGPU_MARKER}: needs at least two NVIDIA GPUs (data-parallel tests); "
        "skipped with fewer")
    config.addinivalue_line(
        "markers", f"{SLOW_MARKER}: a long sweep, skipped unless {SLOW_ENV}=1")


def _share_cores_among_workers() -> None:
    """torch's intra-op threads: the cores divided among the xdist workers (none: untouched)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        try:
            import torch
        except ImportError:      # the oracle is a test extra; without it nothing needs sharing
            return
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def stepgraph_probe() -> bool | None:
    """stepgraph.cuda_available(), or None when the core cannot answer (not importable yet)."""
    try:
        import stepgraph

        return bool(stepgraph.cuda_available())
    except Exception:   # the core may be missing or mid-edit: fall back to asking CuPy
        return None


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """None when a GPU is usable here, else why not (probed once per session)."""
    usable = stepgraph_probe()
    if usable is not None:
        return None if usable else "stepgraph.cuda_available() is False"
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:    # no cupy, no driver, or no device: all mean "no GPU"
        return f"no usable GPU ({type(err).__name__}: {err})"
    return None if count > 0 else "no CUDA device found"


@functools.cache
def multigpu_unavailable_reason() -> str | None:
    """None when at least two GPUs are usable here, else why not."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        return reason
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:
        return f"cannot count GPUs ({type(err).__name__}: {err})"
    return None if count >= 2 else f"needs 2 GPUs, {count} visible"


def pytest_collection_modifyitems(config, items):
    if not os.environ.get(SLOW_ENV):
        skip_slow = pytest.mark.skip(reason=f"a long sweep: set {SLOW_ENV}=1 to run it")
        for item in items:
            if item.get_closest_marker(SLOW_MARKER):
                item.add_marker(skip_slow)
    for marker, probe in ((CUDA_MARKER, gpu_unavailable_reason),
                          (MULTIGPU_MARKER, multigpu_unavailable_reason)):
        marked = [item for item in items if item.get_closest_marker(marker)]
        reason = probe() if marked else None
        if reason is None:
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in marked:
            item.add_marker(skip)


def write_idx(path, array: np.ndarray) -> None:
    """Write `array` (uint8) as an IDX file; gzipped when the name ends in .gz."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, dtype=">u4").tobytes()
    payload = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(payload)


@pytest.fixture
def fake_mnist(tmp_path):
    """A tiny MNIST-shaped dataset in IDX files (train gzipped, test raw): (dir, arrays).

    Each class lights its own 2-row band of the 28x28 image, so a model can learn it.
    """
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 120), ("t10k", 40)):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        images = rng.integers(0, 60, size=(n, 28, 28)).astype(np.uint8)
        for i, label in enumerate(labels):
            images[i, 2 * label + 4:2 * label + 6, 4:24] = 255
        arrays[split] = (images, labels)
    directory = tmp_path / "mnist"
    directory.mkdir()
    write_idx(directory / "train-images-idx3-ubyte.gz", arrays["train"][0])
    write_idx(directory / "train-labels-idx1-ubyte.gz", arrays["train"][1])
    write_idx(directory / "t10k-images-idx3-ubyte", arrays["t10k"][0])
    write_idx(directory / "t10k-labels-idx1-ubyte", arrays["t10k"][1])
    return directory, arrays


@pytest.fixture(autouse=True)
def seeded_initialisation(request):
    """Seed the generators behind module initialisation (stepgraph's and torch's) from the
    test's id, so that a test's random weights do not depend on which tests ran before it:
    a test either passes every time or fails every time, in any order or subset."""
    seed = zlib.crc32(request.node.nodeid.encode())
    try:
        from stepgraph.nn import init

        init.manual_seed(seed)
    except ImportError:     # the core may be mid-edit: tests of other parts still run
        pass
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


@pytest.fixture(autouse=True)
def fresh_loop_session():
    """Each test starts without a training-loop session (stepgraph/loop): passes, programs
    and compiled loop steps of one test never reach the next."""
    yield
    try:
        from stepgraph.loop import hooks, session
    except ImportError:
        return
    session._SESSION = None
    hooks.SESSION = None
