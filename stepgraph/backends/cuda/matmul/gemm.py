"""Every GEMM of the cuda backend: cuBLASLt through nvmath-python's low-level bindings.

CuPy's cuBLAS wrappers raise inside stream capture, and nvmath's high-level `Matmul` allocates its
result on every execute; the bindings let cuBLASLt write straight into preallocated arena views.

cuBLASLt is column-major. A row-major (r, c) array with row stride ld *is* the column-major
(c, r) matrix with leading dimension ld, i.e. its transpose. So the row-major product

    C (m, n) = op(A) @ op(B)

is asked of cuBLASLt as the column-major product

    C^T (n, m) = op(B)^T @ op(A)^T

with B's memory as cuBLASLt's A (transposed iff trans_b) and A's memory as cuBLASLt's B
(transposed iff trans_a). Nothing is copied or transposed in memory, and an epilogue's bias,
which cuBLASLt adds along the rows of D, runs along n = C's last (feature) axis.

A `GemmSpec` holds everything that decides the descriptors and the algorithm; `GemmCache` plans
each spec once (heuristic's best algorithm) and runs it on a stream given device pointers.
Planning queries no device memory and is done on first use; run an eager warm-up before capture
so that capture only replays planned calls.

bfloat16 (precision="bf16"; arrays hold the raw bits as uint16, the storage no other IR dtype
uses): A and B bf16, D bf16 or float32 (`GemmSpec.d_dtype`), CUBLAS_COMPUTE_32F with float32
alpha/beta: products accumulated in float32, the epilogue (bias, activation) applied in
float32, D rounded once. A bias is bf16 like D (CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, whose
default is D's type, set explicitly), and so is GELU_AUX's pre-activation (aux type = D's).
This is the numpy emulation's arithmetic but for the order of the float32 sums. float16
(precision="fp16", model.half(): CUDA_R_16F operands) is the same: COMPUTE_32F (float16
products are exact in float32), D float16 or float32, bias and aux of D's type.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ....errors import CaptureError, ShapeError, StepgraphError
from ....ir.graph import ir_dtype as graph_ir_dtype
from ..runtime import nvmath_bindings
from ..runtime.autotune import enclosing_cut, light_search
from . import split_k

WORKSPACE_BYTES = 32 << 20
HEURISTIC_RESULTS = 16
AUTOTUNE_REPEATS = 10     # timed calls per candidate algorithm
# The on-disk namespace of timed algorithm choices; "-2": choices made before 16-bit results
# kept their split-K parts in float32 (_heuristic) may name an algorithm that adds them in
# 16 bits.
CHOICES = "gemm-2"

# Epilogues by what they read or write besides A, B and D.
BIAS_EPILOGUES = frozenset({"BIAS", "RELU_BIAS", "RELU_AUX_BIAS", "GELU_BIAS", "GELU_AUX_BIAS",
                            "BGRADA", "BGRADB", "DRELU_BGRAD", "DGELU_BGRAD"})
AUX_EPILOGUES = frozenset({"RELU_AUX", "RELU_AUX_BIAS", "GELU_AUX", "GELU_AUX_BIAS",
                           "DRELU", "DRELU_BGRAD", "DGELU", "DGELU_BGRAD"})
EPILOGUES = frozenset({"DEFAULT", "RELU", "GELU"}) | BIAS_EPILOGUES | AUX_EPILOGUES
DTYPES = ("float32", "float64", "bfloat16", "float16")
# The 16-bit operand dtypes: float32 accumulation, D of their own dtype or float32.
HALF_GEMM_DTYPES = ("bfloat16", "float16")


class GemmUnsupportedError(StepgraphError):
    """cuBLASLt has no algorithm for this GEMM (typically an epilogue with these layouts)."""


@dataclass(frozen=True)
class Layout:
    """A column-major matrix as stored: rows x cols, leading dimension ld (elements);
    batch_stride elements between the matrices of a batch (0: one matrix for every item)."""

    rows: int
    cols: int
    ld: int
    batch_stride: int = 0


@dataclass(frozen=True)
class GemmSpec:
    """One cuBLASLt call, column-major: D (m, n) = op(A) (m, k) @ op(B) (k, n), plus D itself
    when `accumulate` (beta = 1, C is D), or plus C, an input of D's layout and type apart
    from D, when `add_c` (beta = 1: compile/matmul_add.py's sums; the DEFAULT epilogue only),
    then the epilogue. Layouts describe A, B and D as stored (before op). `align` is the byte
    alignment of the A, B and D pointers (and batch strides; with add_c, C's too: the
    smaller of the two): cuBLASLt assumes 256 unless told, and views into an arena may have
    less.
    `dtype` is A's and B's; `d_dtype` D's (and C's) when it differs (bf16 or float16 A/B with
    a float32 D: the 16-bit linear's unfused epilogue), else None."""

    a: Layout
    b: Layout
    d: Layout
    trans_a: bool = False
    trans_b: bool = False
    batch: int = 1
    dtype: str = "float32"
    precision: str = "fp32"
    epilogue: str = "DEFAULT"
    accumulate: bool = False
    add_c: bool = False
    aux_ld: int = 0
    align: tuple[int, int, int] = (256, 256, 256)
    d_dtype: str | None = None

    @property
    def out_dtype(self) -> str:
        return self.d_dtype or self.dtype

    @property
    def m(self) -> int:
        return self.d.rows

    @property
    def n(self) -> int:
        return self.d.cols

    @property
    def k(self) -> int:
        return self.a.rows if self.trans_a else self.a.cols

    def __post_init__(self):
        op_a = (self.a.cols, self.a.rows) if self.trans_a else (self.a.rows, self.a.cols)
        op_b = (self.b.cols, self.b.rows) if self.trans_b else (self.b.rows, self.b.cols)
        if op_a[0] != self.m or op_b[1] != self.n or op_a[1] != op_b[0]:
            raise ShapeError(f"gemm: op(A) {op_a} @ op(B) {op_b} does not give D "
                             f"({self.m}, {self.n})")
        for name, lay in (("A", self.a), ("B", self.b), ("D", self.d)):
            if min(lay.rows, lay.cols) < 1 or lay.ld < lay.rows:
                raise ShapeError(f"gemm: bad layout for {name}: {lay}")
        if self.dtype not in DTYPES:
            raise ShapeError(f"gemm: dtype {self.dtype!r} not supported (want one of {DTYPES})")
        if self.d_dtype is not None and (self.dtype not in HALF_GEMM_DTYPES or
                                         self.d_dtype != "float32"):
            raise ShapeError(f"gemm: {self.dtype} operands with a {self.d_dtype} result: only "
                             "bfloat16 or float16 -> float32 mixes")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"gemm: unknown epilogue {self.epilogue!r}")
        if self.epilogue in AUX_EPILOGUES and self.aux_ld < 1:
            raise ValueError(f"gemm: epilogue {self.epilogue} needs aux_ld")
        if self.add_c and (self.accumulate or self.epilogue != "DEFAULT"):
            raise ValueError(f"gemm: add_c with accumulate={self.accumulate} and epilogue "
                             f"{self.epilogue}: a separate C goes with the DEFAULT epilogue "
                             "alone, never with C = D")


def _compute_and_scale_type(dtype: str, precision: str) -> tuple[int, int]:
    nv = nvmath_bindings.load()
    cublas, CudaDataType = nv.cublas, nv.CudaDataType

    if dtype == "float64":
        return cublas.ComputeType.COMPUTE_64F, CudaDataType.CUDA_R_64F
    if dtype in HALF_GEMM_DTYPES:   # float32 accumulation and epilogue, whatever the precision
        return cublas.ComputeType.COMPUTE_32F, CudaDataType.CUDA_R_32F
    # float32: exact FP32 unless the context opts in to TF32.
    compute = (cublas.ComputeType.COMPUTE_32F_FAST_TF32 if precision == "tf32"
               else cublas.ComputeType.COMPUTE_32F)
    return compute, CudaDataType.CUDA_R_32F


def _data_type(dtype: str) -> int:
    CudaDataType = nvmath_bindings.load().CudaDataType

    return {"float64": CudaDataType.CUDA_R_64F, "bfloat16": CudaDataType.CUDA_R_16BF,
            "float16": CudaDataType.CUDA_R_16F}.get(dtype, CudaDataType.CUDA_R_32F)


def algo_types(spec: GemmSpec) -> tuple[int, int, int, int]:
    """cuBLASLt's compute type, scale type, A/B data type and D data type for `spec` (what
    its algorithm ids and configurations are enumerated by)."""
    compute, scale = _compute_and_scale_type(spec.dtype, spec.precision)
    return compute, scale, _data_type(spec.dtype), _data_type(spec.out_dtype)


def _scale_dtype(dtype: str) -> str:
    """The host dtype of alpha and beta (the scale type of _compute_and_scale_type)."""
    return "float64" if dtype == "float64" else "float32"


@dataclass
class PlannedGemm:
    """Descriptors and the chosen algorithm of one GemmSpec (owned by a GemmCache)."""

    spec: GemmSpec
    desc: int
    layouts: tuple[int, int, int]          # A, B, D (C shares D's layout)
    heuristic: np.ndarray                  # keeps the algo struct alive; algo_ptr points in it
    algo_ptr: int
    workspace_size: int
    pointer_buf: np.ndarray = field(default_factory=lambda: np.zeros((), np.int64))
    launched: bool = False                 # True once a call went through
    tuned: bool = False                    # True once the candidates have been timed
    # True where every candidate was past an enclosing timing's cut (autotune.enclosing_cut):
    # the eager-fastest runs, and the first call outside such a timing tunes in full.
    cut_short: bool = False
    # True where the search kept to the heuristic's candidates (autotune.light_search): the
    # next call outside a light timing searches in full.
    light: bool = False
    extended: bool = False                 # True once split_k's configurations joined

    def algo_address(self, index: int) -> int:
        """Address of the algo struct of heuristic result `index`."""
        return (self.heuristic.ctypes.data + index * self.heuristic.itemsize
                + self.heuristic.dtype.fields["algo"][1])


class GemmCache:
    """Planned cuBLASLt GEMMs by GemmSpec, with one handle and one workspace for all of them
    (calls on one stream run one after another, so they can share the workspace)."""

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES, autotune: bool = True):
        import cupy as cp

        cublasLt = nvmath_bindings.load().cublasLt
        self._lt = cublasLt
        self.handle = cublasLt.create()
        self.workspace = cp.empty(workspace_bytes, dtype=cp.uint8)
        self.workspace_bytes = workspace_bytes
        self.autotune = autotune
        self._plans: dict[GemmSpec, PlannedGemm] = {}
        self._unsupported: dict[GemmSpec, str] = {}
        # Host scalars (pointer mode HOST: read when the call is enqueued, so capture-safe).
        self._one = {d: np.ones(1, d) for d in DTYPES}
        self._zero = {d: np.zeros(1, d) for d in DTYPES}

    def __len__(self) -> int:
        return len(self._plans)

    def plan(self, spec: GemmSpec, bias_ptr: int = 0, aux_ptr: int = 0) -> PlannedGemm:
        """The planned call for `spec` (planned now if new). Raises GemmUnsupportedError."""
        planned = self._plans.get(spec)
        if planned is None:
            if spec in self._unsupported:
                raise GemmUnsupportedError(self._unsupported[spec])
            try:
                planned = self._make_plan(spec, bias_ptr, aux_ptr)
            except GemmUnsupportedError as err:
                self._unsupported[spec] = str(err)
                raise
            self._plans[spec] = planned
        return planned

    def supports(self, spec: GemmSpec) -> bool:
        try:
            self.plan(spec)
        except GemmUnsupportedError:
            return False
        return True

    def run(self, spec: GemmSpec, stream_ptr: int, a_ptr: int, b_ptr: int, d_ptr: int,
            bias_ptr: int = 0, aux_ptr: int = 0, ctx=None, c_ptr: int = 0) -> None:
        """Enqueue D = op(A) @ op(B) [+ D | + C] + epilogue on the stream; pointers are device
        addresses laid out as `spec` says (c_ptr: C's, with spec.add_c). No allocation, no
        host sync, except that the first call of a spec given the context `ctx` autotunes (it
        syncs, outside capture)."""
        if spec.add_c != bool(c_ptr):
            raise ValueError(f"gemm: add_c={spec.add_c} with a C pointer {c_ptr:#x}: C is "
                             "given exactly when the spec adds it")
        if spec.epilogue in BIAS_EPILOGUES and not bias_ptr:
            raise ValueError(f"gemm: epilogue {spec.epilogue} needs a bias pointer")
        if spec.epilogue in AUX_EPILOGUES and not aux_ptr:
            raise ValueError(f"gemm: epilogue {spec.epilogue} needs an aux pointer")
        p = self.plan(spec, bias_ptr, aux_ptr)
        lt, attr = self._lt, self._lt.MatmulDescAttribute
        # One descriptor serves every call of this spec; the per-call pointers are set just
        # before the call (cuBLASLt reads them when the call is enqueued).
        if spec.epilogue in BIAS_EPILOGUES:
            p.pointer_buf[()] = bias_ptr
            lt.matmul_desc_set_attribute(p.desc, attr.BIAS_POINTER, p.pointer_buf.ctypes.data, 8)
        if spec.epilogue in AUX_EPILOGUES:
            p.pointer_buf[()] = aux_ptr
            lt.matmul_desc_set_attribute(p.desc, attr.EPILOGUE_AUX_POINTER,
                                         p.pointer_buf.ctypes.data, 8)
        scale = _scale_dtype(spec.dtype)
        alpha = self._one[scale]
        # Accumulate: C is D itself (same layout, in place); add_c: C is its own input, of
        # D's layout. Otherwise beta = 0 and C is null, so D's old contents (NaN poison,
        # garbage) are never read.
        beta = self._one[scale] if spec.accumulate or spec.add_c else self._zero[scale]
        c_ptr = d_ptr if spec.accumulate else c_ptr
        a_lay, b_lay, d_lay = p.layouts

        def call(algo_ptr: int) -> None:
            lt.matmul(self.handle, p.desc, alpha.ctypes.data, a_ptr, a_lay, b_ptr, b_lay,
                      beta.ctypes.data, c_ptr, d_lay, d_ptr, d_lay, algo_ptr,
                      self.workspace.data.ptr, self.workspace_bytes, stream_ptr)

        if ctx is not None and self.autotune and not spec.accumulate \
                and (not p.tuned or p.light and not light_search()
                     or p.cut_short and enclosing_cut() is None) \
                and (len(p.heuristic) > 1 or split_k.wanted(spec)):
            self._autotune(p, call, ctx)
        try:
            call(p.algo_ptr)
        except lt.cuBLASLtError as err:
            if p.launched:
                raise
            # A plan's first call (the eager warm-up) refused: drop the spec as unsupported,
            # so that callers with an unfused path take it (nothing was launched).
            self._drop(spec, f"cuBLASLt refused {spec}: {err}")
            raise GemmUnsupportedError(self._unsupported[spec]) from err
        p.launched = True

    def _autotune(self, p: PlannedGemm, call, ctx) -> None:
        """Time every candidate the heuristic offered on the real operands and keep the
        fastest. The heuristic's first choice is often a split-K algorithm that launches
        several kernels, slower than a one-kernel tile for the small GEMMs of a step; for a
        deep GEMM with a small result its few candidates miss the fastest split, so every
        configuration cuBLASLt accepts joins them (split_k.py). After the first, a candidate
        is timed in full only while it may still win (autotune.give_up_above). Runs at the
        first (eager) call, never during capture: it syncs the stream. Each candidate is
        timed as a captured replay, so host launch costs do not decide. Specs that
        accumulate into D are not tuned (repeated calls would change D); those adding a
        separate C are (C is only read: every timed call writes the same D). The choice persists
        on disk (autotune.choices): a later process with the same GPU, driver and cuBLASLt
        takes it without timing (_restore). Inside a timing of paths (a conv's GEMM path
        against its direct kernel and cuDNN), a candidate past that timing's cut is dropped
        too, the first included: it could not make the path win. Where all were, nothing is
        stored (cut_short). A light search (autotune.light_search: the path's first timing)
        times the heuristic's candidates alone, and is not stored either."""
        from ..runtime.autotune import choices, give_up_above, tighter
        from ..runtime.graph import EagerMs, time_on_device

        if ctx.capturing or ctx.stream.is_capturing():
            return
        disk, problem = choices(ctx, CHOICES), repr(p.spec)
        found: dict[str, int | None] = {}

        def valid(value) -> bool:
            found["index"] = self._restore(p, value)
            return found["index"] is not None

        if disk is not None and disk.get(problem, valid) is not None:    # a full search's
            p.algo_ptr, p.tuned = p.algo_address(found["index"]), True
            p.light = p.cut_short = False
            return
        wanted = split_k.wanted(p.spec)
        p.light = wanted and light_search()
        if wanted and not p.light and not p.extended:
            more = split_k.candidates(self._lt, self.handle, p, algo_types(p.spec))
            p.heuristic, p.extended = np.concatenate([p.heuristic, more]), True
            p.algo_ptr = p.algo_address(0)       # the old buffer is gone
        outer = enclosing_cut()
        best, best_time, timed_in_full = 0, float("inf"), False
        for i in range(len(p.heuristic)):
            algo = p.algo_address(i)
            if not _usable(p, i, self.workspace_bytes):
                continue
            try:
                elapsed = time_on_device(ctx, lambda: call(algo), AUTOTUNE_REPEATS,
                                         give_up_above=tighter(give_up_above(best_time), outer))
            except (self._lt.cuBLASLtError, CaptureError):
                continue                         # an algorithm may refuse the call
            timed_in_full |= not isinstance(elapsed, EagerMs)
            if elapsed < best_time:
                best, best_time = i, elapsed
        p.algo_ptr, p.tuned = p.algo_address(best), True
        p.cut_short = outer is not None and not timed_in_full
        if disk is not None and timed_in_full and not p.light:
            disk.put(problem, {"index": best, "algo": p.heuristic[best]["algo"].tobytes().hex()})

    def _restore(self, p: PlannedGemm, value) -> int | None:
        """The index in p.heuristic of a stored choice {"index", "algo"}: where the heuristic
        offers that algorithm now, else the stored algorithm appended once cuBLASLt's own
        check accepts it for this problem (cuBLASLt's algo struct may be serialised and
        reused with the same library version, which the cache key pins; the heuristic's list
        is not always the same from one process to the next). None: stale or damaged."""
        index = _offered(p, value, self.workspace_bytes)
        if index is not None:
            return index
        offset = p.heuristic.dtype.fields["algo"][1]
        size = p.heuristic.dtype.fields["algo"][0].itemsize
        try:
            algo = bytes.fromhex(value["algo"])
        except (TypeError, ValueError, KeyError):
            return None
        if len(algo) != size:
            return None
        row = np.zeros(1, dtype=p.heuristic.dtype)
        row.view(np.uint8)[offset:offset + size] = np.frombuffer(algo, np.uint8)
        check = np.zeros(1, dtype=p.heuristic.dtype)
        a_lay, b_lay, d_lay = p.layouts
        try:
            self._lt.matmul_algo_check(self.handle, p.desc, a_lay, b_lay, d_lay, d_lay,
                                       row.ctypes.data + offset, check.ctypes.data)
        except self._lt.cuBLASLtError:
            return None
        row["workspace_size"], row["state"] = check["workspace_size"], check["state"]
        p.heuristic = np.concatenate([p.heuristic, row])
        index = len(p.heuristic) - 1
        return index if _usable(p, index, self.workspace_bytes) else None

    def _drop(self, spec: GemmSpec, reason: str) -> None:
        p = self._plans.pop(spec)
        self._unsupported[spec] = reason
        for lay in p.layouts:
            self._lt.matrix_layout_destroy(lay)
        self._lt.matmul_desc_destroy(p.desc)

    def _make_plan(self, spec: GemmSpec, bias_ptr: int, aux_ptr: int) -> PlannedGemm:
        lt = self._lt
        compute, scale = _compute_and_scale_type(spec.dtype, spec.precision)
        desc = lt.matmul_desc_create(compute, scale)
        layouts: list[int] = []
        try:
            self._describe(desc, spec, bias_ptr, aux_ptr)
            types = (_data_type(spec.dtype),) * 2 + (_data_type(spec.out_dtype),)
            for dt, lay in zip(types, (spec.a, spec.b, spec.d)):
                layouts.append(lt.matrix_layout_create(dt, lay.rows, lay.cols, lay.ld))
                if spec.batch > 1:
                    _set(lt.matrix_layout_set_attribute, lt.get_matrix_layout_attribute_dtype,
                         layouts[-1], lt.MatrixLayoutAttribute.BATCH_COUNT, spec.batch)
                    _set(lt.matrix_layout_set_attribute, lt.get_matrix_layout_attribute_dtype,
                         layouts[-1], lt.MatrixLayoutAttribute.STRIDED_BATCH_OFFSET,
                         lay.batch_stride)
            heuristic = self._heuristic(desc, layouts, spec)
        except Exception:
            for lay in layouts:
                lt.matrix_layout_destroy(lay)
            lt.matmul_desc_destroy(desc)
            raise
        # Result 0 is the heuristic's best; pass its algo struct by address on every call.
        return PlannedGemm(spec, desc, tuple(layouts), heuristic,
                           heuristic.ctypes.data + heuristic.dtype.fields["algo"][1],
                           int(heuristic["workspace_size"][0]))

    def _describe(self, desc: int, spec: GemmSpec, bias_ptr: int, aux_ptr: int) -> None:
        cublas = nvmath_bindings.load().cublas
        lt = self._lt
        attr = lt.MatmulDescAttribute

        def set_(name, value):
            _set(lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype, desc,
                 attr[name], value)

        set_("TRANSA", cublas.Operation.T if spec.trans_a else cublas.Operation.N)
        set_("TRANSB", cublas.Operation.T if spec.trans_b else cublas.Operation.N)
        if spec.epilogue == "DEFAULT":
            return
        set_("EPILOGUE", lt.Epilogue[spec.epilogue])
        # cuBLASLt checks these pointers for null when it picks an algorithm; the real ones are
        # set on every run. The workspace is a valid, 256-byte aligned stand-in.
        stand_in = self.workspace.data.ptr
        if spec.epilogue in BIAS_EPILOGUES:
            set_("BIAS_POINTER", bias_ptr or stand_in)
            set_("BIAS_BATCH_STRIDE", 0)      # one bias vector for every batch item
            if spec.out_dtype in HALF_GEMM_DTYPES and "BIAS_DATA_TYPE" in attr.__members__:
                # The default (-1) already means D's type; said explicitly, as the graph's
                # bias is 16-bit (a float32 bias would need the float32 type here).
                set_("BIAS_DATA_TYPE", _data_type(spec.out_dtype))
        if spec.epilogue in AUX_EPILOGUES:
            set_("EPILOGUE_AUX_POINTER", aux_ptr or stand_in)
            set_("EPILOGUE_AUX_LD", spec.aux_ld)
            set_("EPILOGUE_AUX_BATCH_STRIDE", spec.aux_ld * spec.d.cols)

    def _heuristic(self, desc: int, layouts: list[int], spec: GemmSpec):
        lt = self._lt
        pref = lt.matmul_preference_create()
        try:
            pattr = lt.MatmulPreferenceAttribute

            def set_(name, value):
                _set(lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype,
                     pref, pattr[name], value)

            # Slack below the real size: nvmath pads epilogue workspaces by 16 bytes (a
            # cuBLASLt issue), so never offer an algorithm the last bytes.
            set_("MAX_WORKSPACE_BYTES", self.workspace_bytes - 256)
            align_a, align_b, align_d = spec.align
            set_("MIN_ALIGNMENT_A_BYTES", align_a)
            set_("MIN_ALIGNMENT_B_BYTES", align_b)
            set_("MIN_ALIGNMENT_C_BYTES", align_d)
            set_("MIN_ALIGNMENT_D_BYTES", align_d)
            if spec.out_dtype in HALF_GEMM_DTYPES:
                # Split-K parts added in float32 only: the in-place and output-type schemes
                # add them in D's 16 bits, tens of ulps from one float32 sum (TESTING.md).
                set_("REDUCTION_SCHEME_MASK", int(lt.ReductionScheme.COMPUTE_TYPE))
            results = np.zeros(HEURISTIC_RESULTS, dtype=lt.matmul_heuristic_result_dtype)
            count = np.zeros(1, dtype=np.int32)
            a_lay, b_lay, d_lay = layouts
            try:
                lt.matmul_algo_get_heuristic(self.handle, desc, a_lay, b_lay, d_lay, d_lay, pref,
                                             HEURISTIC_RESULTS, results.ctypes.data,
                                             count.ctypes.data)
            except lt.cuBLASLtError as err:
                raise GemmUnsupportedError(f"cuBLASLt cannot run {spec}: {err}") from err
        finally:
            lt.matmul_preference_destroy(pref)
        if count[0] < 1 or results[0]["state"] != 0:
            raise GemmUnsupportedError(f"cuBLASLt found no algorithm for {spec}")
        return results[:count[0]].copy()

    def close(self) -> None:
        """Destroy every descriptor and the handle (the cache is unusable afterwards)."""
        lt = getattr(self, "_lt", None)
        if lt is None or not getattr(self, "handle", 0):
            return
        for p in self._plans.values():
            for lay in p.layouts:
                lt.matrix_layout_destroy(lay)
            lt.matmul_desc_destroy(p.desc)
        self._plans.clear()
        lt.destroy(self.handle)
        self.handle = 0

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass


def _usable(p: PlannedGemm, index: int, workspace_bytes: int) -> bool:
    """Whether heuristic result `index` of `p` can run with this workspace."""
    result = p.heuristic[index]
    return result["state"] == 0 and result["workspace_size"] <= workspace_bytes - 256


def _offered(p: PlannedGemm, value, workspace_bytes: int) -> int | None:
    """The index at which the heuristic offers now, byte for byte, the algorithm of a stored
    choice {"index", "algo"} (the stored index first: the list's order may differ between
    processes); None when it offers it nowhere usable (the entry is stale or damaged)."""
    stored = value["index"]
    order = ([stored] if isinstance(stored, int) else []) + list(range(len(p.heuristic)))
    for i in order:
        if 0 <= i < len(p.heuristic) and _usable(p, i, workspace_bytes) \
                and p.heuristic[i]["algo"].tobytes().hex() == value["algo"]:
            return i
    return None


def _set(setter, dtype_of, obj: int, attr, value) -> None:
    buf = np.array(int(value), dtype=dtype_of(attr))
    setter(obj, attr, buf.ctypes.data, buf.itemsize)


# ---- row-major arrays ----------------------------------------------------------------------

def alignment(ptr: int, *strides_bytes: int) -> int:
    """Largest power of two (<= 256) dividing the pointer and every stride given."""
    value = 256
    for v in (ptr, *strides_bytes):
        if v:
            value = min(value, v & -v)
    return value


def _rowmajor_layout(arr, name: str) -> tuple[Layout, int]:
    """The column-major view of a row-major 2-D array (or 3-D batch of them): a (r, c) array
    with row stride ld is the stored column-major (c, r) matrix with leading dimension ld.
    Returns the layout and the pointer's alignment."""
    if arr.ndim not in (2, 3):
        raise ShapeError(f"gemm: {name} must be 2-D or a 3-D batch, got shape {arr.shape}")
    item = arr.itemsize
    r, c = arr.shape[-2:]
    s_row, s_col = arr.strides[-2:]
    if c > 1 and s_col != item:
        raise ShapeError(f"gemm: {name} {arr.shape} strides {arr.strides}: last axis must be "
                         "contiguous (no copies are made)")
    if s_row % item or (r > 1 and s_row < c * item):
        raise ShapeError(f"gemm: {name} {arr.shape} strides {arr.strides}: bad row stride")
    ld = s_row // item if r > 1 else c     # a single row: any ld >= c describes it
    batch_stride = 0
    if arr.ndim == 3 and arr.shape[0] > 1:
        if arr.strides[0] % item:
            raise ShapeError(f"gemm: {name} {arr.shape} strides {arr.strides}: bad batch stride")
        batch_stride = arr.strides[0] // item
    align = alignment(arr.data.ptr, ld * item if r > 1 else 0, batch_stride * item)
    return Layout(rows=c, cols=r, ld=max(ld, c, 1), batch_stride=batch_stride), align


def matmul_spec(a, b, c, *, trans_a: bool = False, trans_b: bool = False,
                precision: str = "fp32", epilogue: str = "DEFAULT", accumulate: bool = False,
                aux_ld: int = 0, addend=None) -> GemmSpec:
    """The cuBLASLt call computing the row-major c = op(a) @ op(b) (+ c when accumulate,
    + addend when given: cuBLASLt's C, laid out and typed as c).

    a, b, c are CuPy arrays, 2-D, or 3-D batches (c 3-D; a 2-D operand is used for every
    item). Derivation, row-major c (m, n), op(a) (m, k), op(b) (k, n):
      cuBLASLt A = b's memory, stored (cols_b, rows_b), transposed iff trans_b: op -> (n, k)
      cuBLASLt B = a's memory, stored (cols_a, rows_a), transposed iff trans_a: op -> (k, m)
      cuBLASLt D = c's memory, stored (n, m) = op(A) @ op(B); bias (if any) has length n.
    """
    if c.ndim == 3:
        batch = c.shape[0]
        for name, arr in (("a", a), ("b", b)):
            if arr.ndim == 3 and arr.shape[0] != batch:
                raise ShapeError(f"gemm: {name} batch {arr.shape[0]} != output batch {batch}")
    elif a.ndim != 2 or b.ndim != 2:
        raise ShapeError(f"gemm: batched operands {a.shape}, {b.shape} need a 3-D output")
    else:
        batch = 1
    dtypes = {ir_dtype(a), ir_dtype(b)}
    out = ir_dtype(c)
    if len(dtypes) != 1 or (out not in dtypes and not (
            dtypes <= set(HALF_GEMM_DTYPES) and out == "float32")):
        raise ShapeError(f"gemm: mixed dtypes a {ir_dtype(a)}, b {ir_dtype(b)}, c {out} (only "
                         "bfloat16 or float16 operands may give a float32 result)")
    dtype = dtypes.pop()
    lay_b, align_b = _rowmajor_layout(b, "b")
    lay_a, align_a = _rowmajor_layout(a, "a")
    lay_c, align_c = _rowmajor_layout(c, "c")
    if addend is not None:
        align_c = min(align_c, _addend_alignment(addend, c, lay_c))
    return GemmSpec(a=lay_b, b=lay_a, d=lay_c, trans_a=bool(trans_b), trans_b=bool(trans_a),
                    batch=batch, dtype=dtype, precision=precision, epilogue=epilogue,
                    accumulate=accumulate, add_c=addend is not None, aux_ld=aux_ld,
                    align=(align_b, align_a, align_c), d_dtype=None if out == dtype else out)


def _addend_alignment(addend, c, lay_c: Layout) -> int:
    """The alignment of cuBLASLt's C pointer for `addend`, which must be laid out and typed
    as the result c (one layout describes both)."""
    lay, align = _rowmajor_layout(addend, "addend")
    if lay != lay_c or addend.shape != c.shape or ir_dtype(addend) != ir_dtype(c):
        raise ShapeError(f"gemm: the addend {ir_dtype(addend)}{list(addend.shape)} strides "
                         f"{addend.strides} is not laid out as the result "
                         f"{ir_dtype(c)}{list(c.shape)} strides {c.strides}")
    return align


def matmul(ctx, a, b, c, *, trans_a: bool = False, trans_b: bool = False,
           epilogue: str = "DEFAULT", bias=None, aux=None, aux_ld: int = 0,
           accumulate: bool = False, addend=None) -> None:
    """c = epilogue(op(a) @ op(b) [+ c | + addend] [+ bias]) for row-major CuPy arrays, on
    ctx.stream. `addend` (cuBLASLt's C, beta = 1, DEFAULT epilogue only) has c's shape,
    strides and dtype and is only read.

    `bias` is read by BIAS-type epilogues (length c.shape[-1], the features) and written by
    BGRAD ones (BGRADA: c.shape[-1] = sums of op(b) over k; BGRADB: c.shape[-2] = sums of
    op(a) over k, e.g. db = dz.sum(0) beside dw = dz^T @ x). `aux` is the epilogue's auxiliary
    buffer, shaped like c (row-major, row stride aux_ld), e.g. GELU_AUX's pre-activation."""
    spec = matmul_spec(a, b, c, trans_a=trans_a, trans_b=trans_b, precision=ctx.precision,
                       epilogue=epilogue, accumulate=accumulate, aux_ld=aux_ld, addend=addend)
    if bias is not None:
        # BIAS, BGRADA: one entry per row of cuBLASLt's D (c's last axis); BGRADB: per column.
        length = spec.d.cols if epilogue == "BGRADB" else spec.d.rows
        if bias.shape != (length,) or not _contiguous(bias) or ir_dtype(bias) != spec.out_dtype:
            raise ShapeError(f"gemm: epilogue {epilogue} needs a contiguous {spec.out_dtype} "
                             f"vector of {length}, got {ir_dtype(bias)}{list(bias.shape)}")
    if aux is not None and ir_dtype(aux) != spec.out_dtype:
        raise ShapeError(f"gemm: epilogue {epilogue} aux must be {spec.out_dtype} like the "
                         f"result, got {ir_dtype(aux)}")
    ctx.gemm.run(spec, ctx.stream.ptr, b.data.ptr, a.data.ptr, c.data.ptr,
                 bias.data.ptr if bias is not None else 0, aux.data.ptr if aux is not None else 0,
                 ctx=ctx, c_ptr=addend.data.ptr if addend is not None else 0)


def ir_dtype(arr: Any) -> str:
    """The IR dtype of a GEMM operand: uint16 storage is bfloat16, float16 its own
    (ir/graph.py)."""
    return graph_ir_dtype(arr.dtype)


def _contiguous(arr: Any) -> bool:
    return bool(arr.flags.c_contiguous)
