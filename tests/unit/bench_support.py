"""What the `stepgraph bench` tests share: the CPU smoke-test configuration and which peers can
train here (a peer's test skips when its library, or the compiler its CPU device needs, is
missing)."""
from __future__ import annotations

import importlib.util
import shutil

import pytest

from stepgraph.bench import harness
from stepgraph.bench.peers import PeerInfo, select_peers


def bench_config(**overrides) -> harness.BenchConfig:
    """Tiny models on the CPU, short timed runs, two batches, unless overridden."""
    settings = {"device": "cpu", "tiny": True, "repeats": 2, "target_seconds": 0.01,
                "warmup_steps": 2, "warmup_seconds": 0.0, "batches": 2}
    settings.update(overrides)
    return harness.BenchConfig(**settings)


def have(*modules: str) -> bool:
    """Whether every one of `modules` is installed."""
    return all(importlib.util.find_spec(module) is not None for module in modules)


CPU_PEER_REQUIREMENTS = {
    "stepgraph eager": lambda: True,
    "torch eager": lambda: have("torch"),
    "jax jit": lambda: have("jax", "optax"),
    # tinygrad's CPU device compiles its kernels with clang.
    "tinygrad jit": lambda: have("tinygrad") and shutil.which("clang") is not None,
    # Inductor compiles its CPU kernels with the system C compiler.
    "torch compile": lambda: have("torch") and shutil.which("cc") is not None,
}


def can_run(peer_name: str) -> bool:
    """Whether the peer called `peer_name` can train on the CPU here."""
    return CPU_PEER_REQUIREMENTS[peer_name]()


def peer_or_skip(peer_name: str) -> PeerInfo:
    """The peer called `peer_name`; skips the test when it cannot run here."""
    if not can_run(peer_name):
        pytest.skip(f"{peer_name}: library (or its CPU compiler) not installed")
    return select_peers([peer_name])[0]
