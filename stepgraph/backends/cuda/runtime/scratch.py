"""Grow-only scratch memory of a context (ctx.extras["conv_scratch"]): the convolutions'
im2col columns and split partial sums (conv/conv.py) and cuDNN's workspaces (conv_cudnn.py,
attention_cudnn.py) share one pool.
"""
from __future__ import annotations

from ....errors import CaptureError


class ScratchPool:
    """Grow-only device buffers. A request takes the smallest buffer that fits, else allocates
    one (never during capture). Nothing is freed: graphs captured earlier keep their pointers."""

    def __init__(self):
        self.buffers: list = []

    def get(self, nbytes: int, ctx):
        for buf in self.buffers:
            if buf.nbytes >= nbytes:
                return buf
        if ctx.capturing or ctx.stream.is_capturing():
            raise CaptureError(f"conv2d needs {nbytes} bytes of scratch that were not allocated "
                               "before capture: run the plan eagerly once before capturing")
        import cupy as cp

        with ctx.stream:
            buf = cp.empty(-(-nbytes // (1 << 20)) << 20, dtype=cp.uint8)   # whole MiB
        self.buffers.append(buf)
        self.buffers.sort(key=lambda b: b.nbytes)
        return buf
