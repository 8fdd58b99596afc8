"""conv2d forward and its two gradients: im2col / col2im kernels (kernels/conv.cu) + cuBLASLt.

All row-major; gemm.py derives each cuBLASLt call from row-major shapes, written out per op
below. W (O, C, kh, kw) is the row-major (O, CK) matrix as it is (CK = C*kh*kw, P = Ho*Wo).

  forward      y[n] (O, P) = W (O, CK) @ cols[n] (CK, P)       strided batch over n
  grad_input   dcols[n] (CK, P) = W^T @ dy[n] (O, P)           strided batch, then col2im
  grad_weight  dW (O, CK) = dy_t (O, nP) @ cols_t (CK, nP)^T   one GEMM sums over the batch

The column buffers live in a grow-only scratch pool per context (never freed, so a captured
graph's pointers stay valid; shared by every conv node, which run one after another on the
context's stream). A node takes its scratch on its first, eager call: run an eager warm-up
before capture. A batch needing more than SCRATCH_CHUNK_BYTES runs in chunks of samples
(two launches per chunk).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import CaptureError, ShapeError
from ...ir.ops import conv_out
from . import compiler, gemm

SCRATCH_CHUNK_BYTES = 256 << 20
BLOCK = 256
MAX_BLOCKS = 1 << 15     # grid-stride loops cover the rest
_CTYPES = {"float32": "float", "float64": "double"}


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

    @property
    def ho(self) -> int:
        return conv_out(self.h, self.kh, self.sh, self.ph)

    @property
    def wo(self) -> int:
        return conv_out(self.w, self.kw, self.sw, self.pw)

    @property
    def ck(self) -> int:
        return self.c * self.kh * self.kw

    @property
    def p(self) -> int:
        return self.ho * self.wo

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


def _geometry(x_shape, w_shape, attrs: dict) -> Geometry:
    (sh, sw), (ph, pw) = attrs["stride"], attrs["padding"]
    n, c, h, w = x_shape
    o, c2, kh, kw = w_shape
    if c != c2:
        raise ShapeError(f"conv2d: input has {c} channels, weight expects {c2}")
    return Geometry(n, c, h, w, o, kh, kw, sh, sw, ph, pw)


def _contiguous(arr, name: str, shape=None):
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise ShapeError(f"conv2d: {name} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    if not arr.flags.c_contiguous:
        raise ShapeError(f"conv2d: {name} {arr.shape} must be contiguous (no copies are made)")
    return arr


# ---- scratch -------------------------------------------------------------------------------

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


def _chunk_plan(op: str, g: Geometry, itemsize: int) -> tuple[int, list[tuple[int, ...]]]:
    """(samples per chunk, scratch array shapes) of one conv op."""
    if op == "conv2d_grad_weight":
        nb = g.chunk((g.ck + g.o) * g.p * itemsize)
        return nb, [(g.ck, nb * g.p), (g.o, nb * g.p)]
    nb = g.chunk(g.ck * g.p * itemsize)
    return nb, ([] if g.pointwise else [(nb, g.ck, g.p)])


def _scratch(ctx, shapes: list[tuple[int, ...]], dtype) -> list:
    """Contiguous arrays of the given shapes, carved one after another from the scratch pool
    (each starting 256-byte aligned)."""
    import cupy as cp

    item = np.dtype(dtype).itemsize
    sizes = [int(np.prod(s)) * item for s in shapes]
    offsets = np.cumsum([0] + [-(-b // 256) * 256 for b in sizes])
    pool = ctx.extras.setdefault("conv_scratch", ScratchPool())
    buf = pool.get(int(offsets[-1]), ctx)
    return [cp.ndarray(s, dtype=dtype, memptr=buf.data + int(off))
            for s, off in zip(shapes, offsets[:-1])]


# ---- launchers -----------------------------------------------------------------------------

def _launch(ctx, name: str, dtype, total: int, args: tuple) -> None:
    if str(dtype) not in _CTYPES:
        raise ShapeError(f"{name}: dtype {dtype} not supported (want one of {list(_CTYPES)})")
    if total <= 0:
        return
    kern = compiler.kernel("conv.cu", f"{name}<{_CTYPES[str(dtype)]}>")
    blocks = min(-(-total // BLOCK), MAX_BLOCKS)
    with ctx.stream:
        kern((blocks,), (BLOCK,), args)


def conv2d_im2col(ctx, g: Geometry, x, cols, bias, y) -> None:
    """cols (nb, CK, P) = patches of x (nb, C, H, W); y (nb, O, P) = bias broadcast if given.
    cols may be None (pointwise convolutions need no patches, only the bias fill)."""
    nb = x.shape[0]
    n_cols = 0 if cols is None else nb * g.ck * g.p
    n_bias = 0 if bias is None else nb * g.o * g.p
    args = (x, cols if cols is not None else y, bias if bias is not None else y, y,
            np.int64(n_cols), np.int64(n_bias), np.int32(g.o)) + g.kernel_args()
    _launch(ctx, "conv2d_im2col_kernel", x.dtype, n_cols + n_bias, args)


def conv2d_grad_weight_gather(ctx, g: Geometry, x, dy, cols_t, dy_t) -> None:
    """cols_t (CK, nb*P) = patches of x (nb, ...); dy_t (O, nb*P) = dy (nb, O, P) regrouped."""
    nb = x.shape[0]
    total = (g.ck + g.o) * nb * g.p
    args = (x, dy, cols_t, dy_t, np.int32(nb), np.int32(g.o)) + g.kernel_args()
    _launch(ctx, "conv2d_grad_weight_gather_kernel", x.dtype, total, args)


def conv2d_col2im(ctx, g: Geometry, dcols, dx) -> None:
    """dx (nb, C, H, W) = sum of the patch entries of dcols (nb, CK, P) that read each pixel."""
    nb = dx.shape[0]
    args = (dcols, dx, np.int32(nb)) + g.kernel_args()
    _launch(ctx, "conv2d_col2im_kernel", dx.dtype, nb * g.c * g.h * g.w, args)


# ---- op impls ------------------------------------------------------------------------------

def conv2d_forward(node, ins, outs, ctx) -> None:
    """y = conv2d(x, w) + b (ops.py, "conv2d").

    Per chunk of nb samples, row-major y[n] (O, P) = W (O, CK) @ cols[n] (CK, P) as a strided
    batch (gemm.matmul_spec):
      cuBLASLt A = cols[n]: stored (P, CK) ld P, op N, batch stride CK*P
      cuBLASLt B = W:       stored (CK, O) ld CK, op N, batch stride 0 (same W for every n)
      cuBLASLt D = y[n]:    stored (P, O) ld P, batch stride O*P
    The bias runs along O, D's columns, where cuBLASLt's bias epilogue cannot go; instead the
    im2col kernel fills y with the bias and the GEMM accumulates onto it (beta = 1), exact FP32.
    """
    x, w = _contiguous(ins[0], "x"), _contiguous(ins[1], "weight")
    g = _geometry(x.shape, w.shape, node.attrs)
    bias = _contiguous(ins[2], "bias", (g.o,)) if len(ins) == 3 else None
    y = _contiguous(outs[0], "y", (g.n, g.o, g.ho, g.wo))
    w2 = w.reshape(g.o, g.ck)
    nb, shapes = _chunk_plan(node.op, g, x.itemsize)
    cols = _scratch(ctx, shapes, x.dtype)[0] if shapes else None
    for n0 in range(0, g.n, nb):
        m = min(nb, g.n - n0)
        xc, yc = x[n0:n0 + m], y[n0:n0 + m].reshape(m, g.o, g.p)
        cc = xc.reshape(m, g.c, g.h * g.w) if g.pointwise else cols[:m]
        if not g.pointwise or bias is not None:
            conv2d_im2col(ctx, g, xc, None if g.pointwise else cc, bias, yc)
        gemm.matmul(ctx, w2, cc, yc, accumulate=bias is not None)


def conv2d_grad_input(node, ins, outs, ctx) -> None:
    """dx of conv2d given dy and w (ops.py, "conv2d_grad_input").

    Per chunk, row-major dcols[n] (CK, P) = W^T (CK, O) @ dy[n] (O, P), strided batch:
      cuBLASLt A = dy[n]:    stored (P, O) ld P, op N, batch stride O*P
      cuBLASLt B = W:        stored (CK, O) ld CK, op T -> (O, CK), batch stride 0
      cuBLASLt D = dcols[n]: stored (P, CK) ld P, batch stride CK*P
    then col2im gathers dcols into dx. Pointwise convolutions write dx[n] (C, HW) directly.
    """
    w = _contiguous(ins[1], "weight")
    g = _geometry(tuple(node.attrs["input_shape"]), w.shape, node.attrs)
    dy = _contiguous(ins[0], "dy", (g.n, g.o, g.ho, g.wo))
    dx = _contiguous(outs[0], "dx", (g.n, g.c, g.h, g.w))
    w2 = w.reshape(g.o, g.ck)
    nb, shapes = _chunk_plan(node.op, g, dy.itemsize)
    dcols = _scratch(ctx, shapes, dy.dtype)[0] if shapes else None
    for n0 in range(0, g.n, nb):
        m = min(nb, g.n - n0)
        dyc = dy[n0:n0 + m].reshape(m, g.o, g.p)
        if g.pointwise:
            gemm.matmul(ctx, w2, dyc, dx[n0:n0 + m].reshape(m, g.c, g.p), trans_a=True)
            continue
        gemm.matmul(ctx, w2, dyc, dcols[:m], trans_a=True)
        conv2d_col2im(ctx, g, dcols[:m], dx[n0:n0 + m])


def conv2d_grad_weight(node, ins, outs, ctx) -> None:
    """dw of conv2d given dy and x (ops.py, "conv2d_grad_weight").

    The batch sum goes into the GEMM's K dimension, deterministic: per chunk a gather kernel
    writes cols_t (CK, nb*P) and dy_t (O, nb*P), then row-major dW (O, CK) = dy_t @ cols_t^T,
    accumulating over chunks (beta = 1 after the first):
      cuBLASLt A = cols_t: stored (nbP, CK) ld nbP, op T -> (CK, nbP)
      cuBLASLt B = dy_t:   stored (nbP, O) ld nbP, op N
      cuBLASLt D = dW:     stored (CK, O) ld CK
    """
    x = _contiguous(ins[1], "x")
    g = _geometry(x.shape, tuple(node.attrs["weight_shape"]), node.attrs)
    dy = _contiguous(ins[0], "dy", (g.n, g.o, g.ho, g.wo))
    dw = _contiguous(outs[0], "dw", (g.o, g.c, g.kh, g.kw))
    dw2 = dw.reshape(g.o, g.ck)
    nb, shapes = _chunk_plan(node.op, g, x.itemsize)
    cols_t, dy_t = _scratch(ctx, shapes, x.dtype)
    for n0 in range(0, g.n, nb):
        m = min(nb, g.n - n0)
        # A short last chunk uses the leading m*P columns, as contiguous (CK, m*P) matrices.
        ct, dt = cols_t.ravel()[:g.ck * m * g.p], dy_t.ravel()[:g.o * m * g.p]
        ct, dt = ct.reshape(g.ck, m * g.p), dt.reshape(g.o, m * g.p)
        conv2d_grad_weight_gather(ctx, g, x[n0:n0 + m], dy[n0:n0 + m], ct, dt)
        gemm.matmul(ctx, dt, ct, dw2, trans_b=True, accumulate=n0 > 0)


def prepare_scratch(node, ins, outs, ctx) -> None:
    """Take the node's scratch now, launching nothing: for a caller that captures without an
    eager warm-up (launchers.PREPARE's contract). GEMMs plan on first use, capture included."""
    if node.op == "conv2d_grad_input":
        g = _geometry(tuple(node.attrs["input_shape"]), ins[1].shape, node.attrs)
    elif node.op == "conv2d_grad_weight":
        g = _geometry(ins[1].shape, tuple(node.attrs["weight_shape"]), node.attrs)
    else:
        g = _geometry(ins[0].shape, ins[1].shape, node.attrs)
    _, shapes = _chunk_plan(node.op, g, ins[0].itemsize)
    if shapes:
        _scratch(ctx, shapes, ins[0].dtype)


IMPLS = {
    "conv2d": conv2d_forward,
    "conv2d_grad_input": conv2d_grad_input,
    "conv2d_grad_weight": conv2d_grad_weight,
}

PREPARE = dict.fromkeys(IMPLS, prepare_scratch)
