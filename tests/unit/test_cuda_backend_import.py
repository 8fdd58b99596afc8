"""The cuda backend's modules import without a GPU, CudaBackend says clearly when there is none,
and (on the CPU) the row-major -> column-major cuBLASLt layouts of gemm.matmul_spec compute
exactly the products the ops need: a numpy emulation of cuBLASLt's column-major semantics runs
each spec on flat buffers and is compared with the row-major reference."""
from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from stepgraph.errors import BackendUnavailableError, ShapeError


def cuda_modules() -> list[str]:
    """Every module of backends/cuda, dotted below it (runtime, families, backend)."""
    import stepgraph.backends

    root = Path(stepgraph.backends.__file__).parent / "cuda"
    return sorted(".".join(p.relative_to(root).with_suffix("").parts)
                  for p in root.rglob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("name", cuda_modules())
def test_cuda_modules_import_without_gpu(name):
    pytest.importorskip("cupy")
    module = importlib.import_module(f"stepgraph.backends.cuda.{name}")
    if name in ("matmul.linear", "conv.conv"):
        assert set(module.IMPLS) <= {"matmul", "linear", "conv2d", "conv2d_grad_input",
                                     "conv2d_grad_weight"}


def test_cuda_backend_without_gpu_raises_backend_unavailable():
    from stepgraph.backends import cuda_available
    from stepgraph.backends.cuda.backend import CudaBackend

    if cuda_available():
        pytest.skip("a GPU is visible: the backend is available")
    with pytest.raises(BackendUnavailableError, match="cuda"):
        CudaBackend()


# ---- layouts, emulated -----------------------------------------------------------------------

class FakeDeviceArray:
    """What matmul_spec reads from a CuPy array, over a numpy view of a flat host buffer."""

    class _Data:
        def __init__(self, ptr):
            self.ptr = ptr

    def __init__(self, view: np.ndarray, flat: np.ndarray):
        self.view, self.flat = view, flat
        self.shape, self.strides, self.ndim = view.shape, view.strides, view.ndim
        self.dtype, self.itemsize = view.dtype, view.itemsize
        self.data = self._Data(view.ctypes.data)
        self.offset = (view.ctypes.data - flat.ctypes.data) // view.itemsize


def fake(arr: np.ndarray) -> FakeDeviceArray:
    arr = np.ascontiguousarray(arr)
    return FakeDeviceArray(arr, arr.reshape(-1))


def emulate(spec, a: FakeDeviceArray, b: FakeDeviceArray, d: FakeDeviceArray, bias=None):
    """cuBLASLt's D = op(A) @ op(B) (+ D) (+ epilogue) on column-major layouts, where A, B, D are
    the flat buffers behind the fake arrays (cuBLASLt A is the row-major b, and so on)."""

    def matrix(arr, lay, i):
        start = arr.offset + i * lay.batch_stride
        last = start + (lay.rows - 1) + (lay.cols - 1) * lay.ld
        assert 0 <= start and last < arr.flat.size, f"layout {lay} item {i} leaves its buffer"
        item = arr.flat.itemsize
        return as_strided(arr.flat[start:], shape=(lay.rows, lay.cols),
                          strides=(item, lay.ld * item))

    for i in range(spec.batch):
        op_a = matrix(a, spec.a, i).T if spec.trans_a else matrix(a, spec.a, i)
        op_b = matrix(b, spec.b, i).T if spec.trans_b else matrix(b, spec.b, i)
        out = matrix(d, spec.d, i)
        result = op_a.astype(np.float64) @ op_b
        if spec.accumulate:
            result += out
        if spec.epilogue == "BIAS":
            result += bias[:, None]
        elif spec.epilogue == "BGRADB":
            bias[...] = op_b.sum(axis=0)
        out[...] = result


def run_spec(a, b, c, bias=None, **kw):
    """Row-major c = op(a) @ op(b) through matmul_spec + emulation; returns c."""
    from stepgraph.backends.cuda.matmul.gemm import matmul_spec

    fa, fb, fc = fake(a), fake(b), fake(c)
    spec = matmul_spec(fa, fb, fc, **kw)
    emulate(spec, fb, fa, fc, bias)      # cuBLASLt's A is the row-major b, B is a
    return fc.view


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 1, 5), (1, 9, 3), (6, 4, 11)])
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_matmul_layouts(m, k, n, trans_a, trans_b):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if trans_a else (m, k))
    b = rng.standard_normal((n, k) if trans_b else (k, n))
    c = run_spec(a, b, np.full((m, n), np.nan), trans_a=trans_a, trans_b=trans_b)
    want = (a.T if trans_a else a) @ (b.T if trans_b else b)
    np.testing.assert_allclose(c, want, rtol=1e-12, atol=1e-12)


def test_linear_layout_puts_bias_on_features():
    rng = np.random.default_rng(1)
    x, w, bias = rng.standard_normal((5, 3)), rng.standard_normal((4, 3)), rng.standard_normal(4)
    y = run_spec(x, w, np.full((5, 4), np.nan), bias=bias, trans_b=True, epilogue="BIAS")
    np.testing.assert_allclose(y, x @ w.T + bias, rtol=1e-12)


def test_bgradb_layout_gives_bias_gradient():
    """dw = dz^T @ x: BGRADB's reduction over K is dz.sum(0), the linear bias gradient."""
    rng = np.random.default_rng(2)
    dz, x, db = rng.standard_normal((6, 4)), rng.standard_normal((6, 3)), np.full(4, np.nan)
    dw = run_spec(dz, x, np.full((4, 3), np.nan), bias=db, trans_a=True, epilogue="BGRADB")
    np.testing.assert_allclose(dw, dz.T @ x, rtol=1e-12)
    np.testing.assert_allclose(db, dz.sum(0), rtol=1e-12)


def test_padded_rows_use_the_row_stride():
    from stepgraph.backends.cuda.matmul.gemm import matmul_spec

    rng = np.random.default_rng(3)
    base = rng.standard_normal((5, 8))
    a = FakeDeviceArray(base[:, :3], base.reshape(-1))     # (5, 3) with row stride 8
    b, c = fake(rng.standard_normal((3, 2))), fake(np.full((5, 2), np.nan))
    spec = matmul_spec(a, b, c)
    assert spec.b.ld == 8
    emulate(spec, b, a, c)
    np.testing.assert_allclose(c.view, base[:, :3] @ b.view, rtol=1e-12)


def test_conv_gemm_layouts():
    """The three conv GEMMs of conv.py, batched with the weight broadcast over the batch."""
    rng = np.random.default_rng(4)
    nb, o, ck, p = 3, 4, 5, 7
    w2 = rng.standard_normal((o, ck))
    cols = rng.standard_normal((nb, ck, p))
    y = run_spec(w2, cols, np.full((nb, o, p), np.nan))                         # forward
    np.testing.assert_allclose(y, np.einsum("ok,nkp->nop", w2, cols), rtol=1e-12)
    y0 = rng.standard_normal((nb, o, p))
    y = run_spec(w2, cols, y0.copy(), accumulate=True)                          # + bias fill
    np.testing.assert_allclose(y, y0 + np.einsum("ok,nkp->nop", w2, cols), rtol=1e-12)
    dy = rng.standard_normal((nb, o, p))
    dcols = run_spec(w2, dy, np.full((nb, ck, p), np.nan), trans_a=True)       # grad_input
    np.testing.assert_allclose(dcols, np.einsum("ok,nop->nkp", w2, dy), rtol=1e-12)
    dy_t, cols_t = rng.standard_normal((o, nb * p)), rng.standard_normal((ck, nb * p))
    dw = run_spec(dy_t, cols_t, np.full((o, ck), np.nan), trans_b=True)        # grad_weight
    np.testing.assert_allclose(dw, dy_t @ cols_t.T, rtol=1e-12)


def test_mismatched_shapes_raise_shape_error():
    from stepgraph.backends.cuda.matmul.gemm import matmul_spec

    with pytest.raises(ShapeError):
        matmul_spec(fake(np.zeros((3, 4))), fake(np.zeros((5, 6))), fake(np.zeros((3, 6))))
    with pytest.raises(ShapeError):    # last axis not contiguous
        base = np.zeros((4, 6))
        matmul_spec(FakeDeviceArray(base[:, ::2], base.reshape(-1)), fake(np.zeros((3, 2))),
                    fake(np.zeros((4, 2))))


def test_alignment():
    from stepgraph.backends.cuda.matmul.gemm import alignment

    assert alignment(0x10000) == 256
    assert alignment(0x10004) == 4
    assert alignment(0x10000, 12) == 4
    assert alignment(0x10010, 0, 64) == 16


def test_conv_chunks_bound_the_scratch(monkeypatch):
    from stepgraph.backends.cuda.conv import conv, geometry

    g = conv.Geometry(n=10, c=3, h=8, w=8, o=4, kh=3, kw=3, sh=1, sw=1, ph=1, pw=1)
    assert (g.ho, g.wo, g.ck, g.p) == (8, 8, 27, 64)
    monkeypatch.setattr(geometry, "SCRATCH_CHUNK_BYTES", 3 * 27 * 64 * 4)
    assert g.chunk(27 * 64 * 4) == 3
    monkeypatch.setattr(geometry, "SCRATCH_CHUNK_BYTES", 1)
    assert g.chunk(27 * 64 * 4) == 1
    assert conv.Geometry(2, 5, 4, 3, 7, 1, 1, 1, 1, 0, 0).pointwise


def test_conv_kernels_compile_with_nvrtc():
    """Every template instantiation conv.py launches compiles (NVRTC needs no GPU)."""
    pytest.importorskip("cupy")
    from cupy.cuda import nvrtc

    from stepgraph.backends.cuda.conv import conv
    from stepgraph.backends.cuda.runtime import compiler

    names = [f"{k}<{t}>" for k in ("conv2d_im2col_kernel", "conv2d_grad_weight_gather_kernel",
                                   "conv2d_col2im_kernel") for t in conv._CTYPES.values()]
    names += [f"{conv.EPILOGUE_KERNEL}<{t}>" for t in conv.EPILOGUE_CTYPES.values()]
    headers = compiler.headers()     # conv.cu includes bf16.cuh
    try:
        prog = nvrtc.createProgram(compiler.source_path("conv.cu").read_text(), "conv.cu",
                                   [h.read_text().encode() for h in headers],
                                   [h.name.encode() for h in headers])
    except Exception as err:   # libnvrtc missing: nothing to check here
        pytest.skip(f"NVRTC not usable: {err}")
    for name in names:
        nvrtc.addNameExpression(prog, name)
    try:
        nvrtc.compileProgram(prog, ["-arch=sm_90", "-std=c++17", "-ftz=true"])
    except nvrtc.NVRTCError as err:
        pytest.fail(f"conv.cu: {err}\n{nvrtc.getProgramLog(prog)}")
    assert all(nvrtc.getLoweredName(prog, name) for name in names)


def test_fed_device_arrays_are_held_until_their_copies_have_run():
    """keep_until_read keeps the device arrays of a feed referenced until the event recorded
    after their copies has completed (host arrays are copied at once and not held); nothing
    is recorded while capturing. CuPy's events are faked: no GPU needed."""
    import types

    from stepgraph.backends.cuda.backend import CudaBackend

    class Event:
        def __init__(self, disable_timing=False):
            self.done, self.stream = False, None

        def record(self, stream):
            self.done, self.stream = False, stream

    stream = types.SimpleNamespace(capturing=False)
    stream.is_capturing = lambda: stream.capturing
    backend = types.SimpleNamespace(
        _being_read=[], stream=stream,
        _cp=types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event)))
    device_x, device_y, host = object(), object(), np.zeros(3)

    CudaBackend.keep_until_read(backend, (device_x, host))
    ((event, held),) = backend._being_read
    assert held == [device_x] and event.stream is stream
    CudaBackend.keep_until_read(backend, (device_y,))
    assert [a for _, arrays in backend._being_read for a in arrays] == [device_x, device_y]
    event.done = True                                   # the first feed's copies have run
    stream.capturing = True
    CudaBackend.keep_until_read(backend, (object(),))  # a capture records nothing
    assert [a for _, arrays in backend._being_read for a in arrays] == [device_y]
    stream.capturing = False
    ((second, _),) = backend._being_read
    second.done = True
    CudaBackend.keep_until_read(backend, (device_x,))
    assert backend._being_read == [(second, [device_x])]     # a read event serves again
