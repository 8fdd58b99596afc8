"""The CUDA backend (CuPy + NVRTC kernels, cuBLASLt, cuDNN, CUDA Graphs): import its modules
directly (`backends.cuda.backend`); importing this package loads no CUDA library. As
torch.backends.cuda it also holds the `matmul` flags (backends/flags.py)."""
from ..flags import matmul  # noqa: F401
