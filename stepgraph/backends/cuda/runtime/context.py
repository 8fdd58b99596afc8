"""What every CUDA launcher receives: the stream, the precision, the GEMM machinery and the
kernel choices (both shared by the backend's contexts)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# bf16: the step's GEMMs take bf16 operands (compile/autocast.py); float32 GEMMs stay exact.
# fp16: the same with float16 operands.
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


@dataclass
class CudaContext:
    stream: Any                    # cupy.cuda.Stream every launch goes to (never the default one)
    precision: str = "fp32"        # "fp32" exact float32 GEMMs; "tf32" opts in to TF32
    gemm: Any = None               # matmul/gemm.py GemmCache: planned cuBLASLt calls by shape
    paths: dict = field(default_factory=dict)   # autotune.py's kernel choices, by problem
    capturing: bool = False        # True while a CUDA graph is being captured: no syncs, no allocs
    # False: kernel choices may include cuDNN plans that accumulate with atomics (bits vary).
    deterministic: bool = True
    extras: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
