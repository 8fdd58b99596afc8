"""`stepgraph precompile`: compile every kernel module the cuda backend declares into CuPy's
on-disk kernel cache, once per install, so that even the first training process starts warm.

The modules are those a step's launches look up (runtime/compiler.py: each kernel file's plain
kernels and the chunks of its declared template instantiations, every element type's, and the
attention kernels of every head dim, tile, storage and arithmetic, one a module), built for
the current GPU, side by side. Kernels made per problem shape (tiled convolutions, fused
pointwise programs) are still compiled by the first step that needs them.
The cache is CuPy's (CUPY_CACHE_DIR, default ~/.cupy/kernel_cache).
"""
from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepgraph precompile",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    args = parser.parse_args(argv)
    from .backends import cuda_available, get_backend

    if not cuda_available():
        print("stepgraph precompile needs a CUDA GPU (CuPy found none)")
        return 2
    get_backend("cuda")                    # declares every family's kernels
    from .backends.cuda.runtime import compiler

    start = time.perf_counter()

    def done(filename: str, names: tuple[str, ...]) -> None:
        if not args.quiet:
            print(f"{filename:20s} {', '.join(names) if names else '(plain kernels)'}")

    count = compiler.precompile(done)
    print(f"{count} kernel modules in the kernel cache ({time.perf_counter() - start:.1f} s)")
    return 0
