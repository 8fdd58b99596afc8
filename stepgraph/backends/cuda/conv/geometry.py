"""A conv2d problem's geometry: the one description of a convolution (batch, channels,
image, kernel, stride, padding, dilation, groups) that every conv path reads.

A module of its own because conv.py dispatches to conv_tiled.py and conv_cudnn.py, and those
take a Geometry: kept in conv.py it made import circles (conv -> conv_cudnn -> conv, and
through conv_tiled), here each of them imports this leaf.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ....errors import ShapeError
from ....ops.conv import conv_out

SCRATCH_CHUNK_BYTES = 256 << 20     # the im2col scratch of one chunk of samples (conv.py)


@dataclass(frozen=True)
class Geometry:
    n: int
    c: int
    h: int
    w: int
    o: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    dil_h: int = 1
    dil_w: int = 1
    groups: int = 1

    @property
    def ho(self) -> int:
        return conv_out(self.h, self.dil_h * (self.kh - 1) + 1, self.sh, self.ph)

    @property
    def wo(self) -> int:
        return conv_out(self.w, self.dil_w * (self.kw - 1) + 1, self.sw, self.pw)

    @property
    def plain(self) -> bool:
        """groups 1 and dilation 1: what the own kernels (gemm, direct, tiled) run."""
        return (self.groups, self.dil_h, self.dil_w) == (1, 1, 1)

    @property
    def w_shape(self) -> tuple[int, int, int, int]:
        return (self.o, self.c // self.groups, self.kh, self.kw)

    @property
    def dilation(self) -> tuple[int, int]:
        return (self.dil_h, self.dil_w)

    def cudnn_dims(self) -> dict[str, list[int]]:
        """Logical (NCHW-ordered) dims of the cuDNN graph's tensors x, w, y and the bias b."""
        return {"x": [self.n, self.c, self.h, self.w], "w": list(self.w_shape),
                "y": [self.n, self.o, self.ho, self.wo], "b": [1, self.o, 1, 1]}

    def cudnn_conv(self) -> dict[str, list[int]]:
        """The cuDNN convolution's padding, stride and dilation, per spatial axis."""
        return {"padding": [self.ph, self.pw], "stride": [self.sh, self.sw],
                "dilation": [self.dil_h, self.dil_w]}

    @property
    def ck(self) -> int:
        return self.c * self.kh * self.kw

    @property
    def p(self) -> int:
        return self.ho * self.wo

    @property
    def macs(self) -> int:
        """Multiply-adds of the forward (and of each gradient): each output sums over its
        group's C / groups input channels."""
        return self.n * self.o * self.p * self.ck // self.groups

    @property
    def pointwise(self) -> bool:
        """1x1, stride 1, no padding: cols[n] is x[n] itself, no im2col needed."""
        return (self.kh, self.kw, self.sh, self.sw, self.ph, self.pw) == (1, 1, 1, 1, 0, 0)

    def kernel_args(self) -> tuple:
        """The GEOMETRY_PARAMS of conv.cu, in order."""
        return tuple(np.int32(v) for v in (self.c, self.h, self.w, self.kh, self.kw, self.sh,
                                           self.sw, self.ph, self.pw, self.ho, self.wo))

    def chunk(self, bytes_per_sample: int) -> int:
        """Samples per chunk so that the scratch stays under SCRATCH_CHUNK_BYTES."""
        return max(1, min(self.n, SCRATCH_CHUNK_BYTES // max(1, bytes_per_sample)))


def geometry(x_shape, w_shape, attrs: dict) -> Geometry:
    (sh, sw), (ph, pw) = attrs["stride"], attrs["padding"]
    dil_h, dil_w = attrs.get("dilation", (1, 1))
    groups = int(attrs.get("groups", 1))
    n, c, h, w = x_shape
    o, c2, kh, kw = w_shape
    if c != c2 * groups or o % groups:
        raise ShapeError(f"conv2d: input has {c} channels and weight {tuple(w_shape)}, which "
                         f"do not make {groups} group(s) (want C = {c2} * groups, O % groups 0)")
    return Geometry(n, c, h, w, o, kh, kw, sh, sw, ph, pw, dil_h, dil_w, groups)
