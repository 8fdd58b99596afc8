"""The CUDA backend (backend.py), laid out as shared machinery apart from the op families.

runtime/      what every family uses: NVRTC compilation (compiler.py), the launch helpers and
              per-node device memory (launch.py), the context, graph capture and replay,
              kernel autotuning, side streams and the update stream, scratch memory and
              nvmath's cuBLASLt bindings
include/      the .cuh headers the kernel files share (NVRTC's include directory)
<family>.py   an op family: a launcher per kernel of <family>.cu beside it, and its IMPLS
<family>/     the families of several modules, each with its .cu files: conv/ (own kernels,
              cuDNN, tiled), attention/ (own flash-style kernels, cuDNN), matmul/ (cuBLASLt
              GEMMs, linear, the small-matmul kernels, bmm)

The backend's op table is the union of the families' IMPLS (backend.py IMPL_MODULES).
Importing this package loads no CUDA library: as torch.backends.cuda it holds the `matmul`
flags (backends/flags.py).
"""
from ..flags import matmul  # noqa: F401
