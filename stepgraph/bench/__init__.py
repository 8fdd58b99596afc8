"""`stepgraph bench`: training-step time of stepgraph against PyTorch, JAX and tinygrad."""

from stepgraph.bench.harness import BenchConfig, NoGpuError, PeerResult, main, run_benchmark

__all__ = ["BenchConfig", "NoGpuError", "PeerResult", "main", "run_benchmark"]
