"""Tracing: modules are called once on symbolic tensors and every op records a node.

`Tracer` builds a Graph; `Tensor` is the symbolic value modules see. Nothing here runs per step.
"""
from __future__ import annotations

import math
import numbers
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from .graph import BF16, DTYPES, INPUT, PARAM, STATE, Graph, Node, Value
from .ops import OPS, infer_outputs

if TYPE_CHECKING:
    from ..nn.module import Buffer, Parameter


def _is_scalar(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, Tensor)


def _dim(d: int, ndim: int, what: str) -> int:
    """A dimension index in [0, ndim), PyTorch's negative indices allowed."""
    if not -max(ndim, 1) <= d < max(ndim, 1):
        raise ShapeError(f"{what}: dim {d} out of range for a tensor of rank {ndim}")
    return d % max(ndim, 1)


def _dims(dim, ndim: int, what: str) -> tuple[int, ...]:
    """dim=None|int|tuple as sorted non-negative axes (None or (): every axis)."""
    if dim is None or dim == ():
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    axes = sorted({_dim(d, ndim, what) for d in dims})
    if len(axes) != len(dims):
        raise ShapeError(f"{what}: dim {dim} names an axis twice")
    return tuple(axes)


def _shape_args(shape) -> tuple:
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape


# PyTorch's dtype names that differ from the IR's.
_DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64",
                  "int": "int32"}


def dtype_name(dtype) -> str:
    """The IR dtype of what a model passes as a dtype: a name ("float32", "long"), a dtype
    object whose str ends in its name ("torch.float32"), a NumPy dtype or a Python type (float
    is float64, as NumPy and torch.Tensor.to have it)."""
    if isinstance(dtype, (type, np.dtype)):
        name = np.dtype(dtype).name
    else:
        name = str(dtype).rsplit(".", 1)[-1]
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        hint = " (use precision=\"bf16\" for 16-bit compute)" if name == "float16" else ""
        raise UnsupportedOpError(f"dtype {dtype!r} is not supported by stepgraph: "
                                 f"one of {DTYPES}{hint}")
    return name


def _is_device(x) -> bool:
    """A device argument of Tensor.to: "cuda", "cpu:0", or a device object."""
    if isinstance(x, str):
        return x.split(":")[0] in ("cpu", "cuda")
    return hasattr(x, "type") and hasattr(x, "index")


class Tensor:
    """A symbolic tensor: a Value plus the tracer recording ops on it.

    Supports PyTorch's arithmetic operators (+ - * / ** with tensors, broadcasting, or Python
    scalars on either side), @ ((..., K) @ (K, N), and (..., M, K) @ (..., K, N) with the same
    batch dims through bmm), reshape/view/flatten, transpose/permute/.T, split/chunk/narrow,
    sum/mean, and the methods relu/sigmoid/tanh/softmax/log_softmax. Any other torch.Tensor
    method or indexing raises UnsupportedOpError naming the op and the module that called
    it."""

    def __init__(self, value: Value, tracer: Tracer):
        self.value = value
        self.tracer = tracer

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    @property
    def dtype(self) -> str:
        return self.value.dtype

    @property
    def ndim(self) -> int:
        return len(self.value.shape)

    def size(self, dim: int | None = None):
        """The shape, or the length of axis `dim`."""
        return self.shape if dim is None else self.shape[_dim(dim, self.ndim, "size")]

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    # ---- shape ----
    def reshape(self, *shape) -> Tensor:
        """A view with `shape` (one entry may be -1); no copy."""
        shape = tuple(int(d) for d in _shape_args(shape))
        if shape.count(-1) > 1:
            raise ShapeError(f"reshape: only one dimension can be -1, got {shape}")
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            if known == 0 or self.value.size % known:
                raise ShapeError(f"reshape: cannot view {self.shape} as {shape}")
            shape = tuple(self.value.size // known if d == -1 else d for d in shape)
        if shape == self.shape:
            return self
        return self.tracer.op("reshape", [self], shape=shape)

    view = reshape

    def contiguous(self) -> Tensor:
        return self                 # every traced value is contiguous

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor:
        """Merge axes start_dim..end_dim (inclusive) into one, as torch.flatten."""
        if self.ndim == 0:
            return self.reshape(1)
        s, e = _dim(start_dim, self.ndim, "flatten"), _dim(end_dim, self.ndim, "flatten")
        if s > e:
            raise ShapeError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
        n = math.prod(self.shape[s:e + 1])
        return self.reshape(*self.shape[:s], n, *self.shape[e + 1:])

    def permute(self, *dims) -> Tensor:
        """Axes reordered by `dims` (materialised)."""
        dims = tuple(_dim(d, self.ndim, "permute") for d in _shape_args(dims))
        if sorted(dims) != list(range(self.ndim)):
            raise ShapeError(f"permute: {dims} is not a permutation of {self.ndim} axes")
        if dims == tuple(range(self.ndim)):
            return self
        return self.tracer.op("permute", [self], dims=dims)

    def transpose(self, dim0: int, dim1: int) -> Tensor:
        """Axes dim0 and dim1 swapped."""
        dims = list(range(self.ndim))
        a, b = _dim(dim0, self.ndim, "transpose"), _dim(dim1, self.ndim, "transpose")
        dims[a], dims[b] = dims[b], dims[a]
        return self.permute(*dims)

    @property
    def T(self) -> Tensor:
        return self.permute(*reversed(range(self.ndim)))

    # ---- reductions ----
    def sum(self, dim=None, keepdim: bool = False) -> Tensor:
        """Sum over `dim` (None: every axis; an int or a tuple of ints)."""
        axes = _dims(dim, self.ndim, "sum")
        y = self.tracer.op("reduce_sum", [self], axes=axes) if axes else self
        if keepdim:
            y = y.reshape(*(1 if i in axes else d for i, d in enumerate(self.shape)))
        return y

    def mean(self, dim=None, keepdim: bool = False) -> Tensor:
        """Mean over `dim`: the sum divided by the number of summed elements."""
        count = math.prod(self.shape[a] for a in _dims(dim, self.ndim, "mean"))
        return self.sum(dim, keepdim) / float(count)

    # ---- arithmetic ----
    def _binary(self, other, kind: str, reverse: bool = False) -> Tensor:
        if _is_scalar(other):
            if reverse and kind in ("sub", "div"):
                kind = "r" + kind
            return self.tracer.op("scalar", [self], kind=kind, value=float(other))
        other = self._coerce(other, kind)
        a, b = (other, self) if reverse else (self, other)
        return self.tracer.op("binary", [a, b], kind=kind)

    def _coerce(self, other, op: str) -> Tensor:
        """`other` as a tensor of this trace: Parameters and Buffers are traced on use."""
        if isinstance(other, Tensor):
            if other.tracer is not self.tracer:
                raise UnsupportedOpError(f"{op}: the tensors belong to different traces "
                                         f"(in {self.tracer.where()})")
            return other
        # A model's Parameter or Buffer says how it is traced (nn/module.py), so that the IR
        # needs no import of nn, which imports it.
        traced = getattr(other, "traced", None)
        if traced is not None:
            return traced(self.tracer)
        raise UnsupportedOpError(f"{op} with a {type(other).__name__} operand is not supported "
                                 f"(in {self.tracer.where()}); use a traced tensor or a "
                                 "Python number")

    def __add__(self, other):
        return self._binary(other, "add")

    def __radd__(self, other):
        return self._binary(other, "add", reverse=True)

    def __sub__(self, other):
        return self._binary(other, "sub")

    def __rsub__(self, other):
        return self._binary(other, "sub", reverse=True)

    def __mul__(self, other):
        return self._binary(other, "mul")

    def __rmul__(self, other):
        return self._binary(other, "mul", reverse=True)

    def __truediv__(self, other):
        return self._binary(other, "div")

    def __rtruediv__(self, other):
        return self._binary(other, "div", reverse=True)

    def __neg__(self):
        return self.tracer.op("scalar", [self], kind="mul", value=-1.0)

    def __pos__(self):
        return self

    def __pow__(self, exponent):
        if not _is_scalar(exponent):
            return self._binary(exponent, "pow")
        return self.tracer.op("scalar", [self], kind="pow", value=float(exponent))

    pow = __pow__

    def __matmul__(self, other):
        other = self._coerce(other, "matmul")
        if other.ndim == 1:                                   # (..., K) @ (K,) -> (...)
            y = self @ other.reshape(other.shape[0], 1)
            return y.reshape(*y.shape[:-1])
        if other.ndim >= 3:
            return self._batched_matmul(other)
        if other.ndim != 2 or self.ndim == 0:
            self._unsupported(f"matmul of {self.shape} @ {other.shape} (only (..., K) @ (K, N) "
                              "and (..., M, K) @ (..., K, N))")
        if self.ndim == 1:                                    # (K,) @ (K, N) -> (N,)
            return (self.reshape(1, -1) @ other).reshape(other.shape[1])
        if self.ndim == 2:
            return self.tracer.op("matmul", [self, other])
        lead = self.shape[:-1]                                # (..., K): rows of one matmul
        y = self.tracer.op("matmul", [self.reshape(-1, self.shape[-1]), other])
        return y.reshape(*lead, other.shape[1])

    matmul = __matmul__

    def _batched_matmul(self, other: Tensor) -> Tensor:
        """(..., M, K) @ (..., K, N) with the same batch dims: one bmm over their product.
        Batch dims that would broadcast are not supported."""
        if self.ndim != other.ndim or self.shape[:-2] != other.shape[:-2]:
            self._unsupported(f"matmul of {self.shape} @ {other.shape} (batched operands need "
                              "the same batch dims; broadcasting them is not supported)")
        lead = self.shape[:-2]
        a = self.reshape(-1, *self.shape[-2:])
        b = other.reshape(-1, *other.shape[-2:])
        y = self.tracer.op("bmm", [a, b])
        return y.reshape(*lead, *y.shape[-2:])

    # ---- slicing ----
    def narrow(self, dim: int, start: int, length: int) -> Tensor:
        """Elements start..start+length-1 along `dim` (a contiguous copy; none when the
        slice is the whole axis)."""
        d = _dim(dim, self.ndim, "narrow")
        if start < 0:
            start += self.shape[d]
        if not 0 <= start <= start + length <= self.shape[d]:
            raise ShapeError(f"narrow: [{start}:{start + length}] out of range for axis {d} of "
                             f"{self.shape}")
        if (start, length) == (0, self.shape[d]):
            return self
        return self.tracer.op("slice", [self], dim=d, start=int(start),
                              stop=int(start + length))

    def split(self, split_size_or_sections, dim: int = 0) -> tuple[Tensor, ...]:
        """Pieces along `dim`: of split_size each (the last may be smaller), or of the given
        section sizes (which must add up to the axis), as torch.split."""
        d = _dim(dim, self.ndim, "split")
        n = self.shape[d]
        if isinstance(split_size_or_sections, numbers.Integral):
            size = int(split_size_or_sections)
            if size <= 0 and n:
                raise ShapeError(f"split: split_size must be positive, got {size}")
            sizes = [min(size, n - i) for i in range(0, n, size)] if n else [0]
        else:
            sizes = [int(s) for s in split_size_or_sections]
            if sum(sizes) != n or min(sizes, default=0) < 0:
                raise ShapeError(f"split: sections {sizes} do not add up to {n} (axis {d} of "
                                 f"{self.shape})")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(self.narrow(d, s, k) for s, k in zip(starts, sizes))

    def chunk(self, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
        """`chunks` pieces along `dim` of ceil(size / chunks) each (fewer when that covers
        the axis sooner), as torch.chunk."""
        if chunks <= 0:
            raise ShapeError(f"chunk: chunks must be positive, got {chunks}")
        n = self.shape[_dim(dim, self.ndim, "chunk")]
        return self.split(max(-(-n // chunks), 1), dim)

    # ---- activations ----
    def _act(self, kind: str) -> Tensor:
        return self.tracer.op("act", [self], kind=kind, slope=0.01)

    def relu(self) -> Tensor:
        return self._act("relu")

    def sigmoid(self) -> Tensor:
        return self._act("sigmoid")

    def tanh(self) -> Tensor:
        return self._act("tanh")

    def _last_axis(self, op: str, dim: int) -> Tensor:
        # The ops work over the last axis: move `dim` there and back.
        d = _dim(dim, self.ndim, op)
        if d == self.ndim - 1:
            return self.tracer.op(op, [self])
        return self.transpose(d, -1)._last_axis(op, -1).transpose(d, -1)

    def softmax(self, dim: int) -> Tensor:
        """softmax over `dim`."""
        return self._last_axis("softmax", dim)

    def log_softmax(self, dim: int) -> Tensor:
        """log(softmax) over `dim`."""
        return self._last_axis("log_softmax", dim)

    # ---- elementwise math, comparisons, masks and casts (ops/unary.py, ops/compare.py) ----
    def _unary(self, kind: str) -> Tensor:
        return self.tracer.op("unary", [self], kind=kind)

    def exp(self) -> Tensor:
        return self._unary("exp")

    def log(self) -> Tensor:
        return self._unary("log")

    def log1p(self) -> Tensor:
        """log(1 + x), accurate for small x."""
        return self._unary("log1p")

    def expm1(self) -> Tensor:
        """exp(x) - 1, accurate for small x."""
        return self._unary("expm1")

    def sqrt(self) -> Tensor:
        return self._unary("sqrt")

    def rsqrt(self) -> Tensor:
        """1 / sqrt(x)."""
        return self._unary("rsqrt")

    def abs(self) -> Tensor:
        return self._unary("abs")

    __abs__ = abs

    def sign(self) -> Tensor:
        """-1, 0 or 1 (NaN stays NaN); its gradient is zero."""
        return self._unary("sign")

    def sin(self) -> Tensor:
        return self._unary("sin")

    def cos(self) -> Tensor:
        return self._unary("cos")

    def erf(self) -> Tensor:
        return self._unary("erf")

    def floor(self) -> Tensor:
        return self._unary("floor")

    def ceil(self) -> Tensor:
        return self._unary("ceil")

    def round(self) -> Tensor:
        """Nearest integer, halves to even (torch.round without decimals)."""
        return self._unary("round")

    def trunc(self) -> Tensor:
        return self._unary("trunc")

    def neg(self) -> Tensor:
        return -self

    negative = neg

    def reciprocal(self) -> Tensor:
        """1 / x."""
        return 1.0 / self

    def square(self) -> Tensor:
        return self * self

    def __rpow__(self, base):
        """base ** self for a Python number base."""
        if not _is_scalar(base):
            return NotImplemented
        return self.tracer.op("scalar", [self], kind="rpow", value=float(base))

    def maximum(self, other) -> Tensor:
        """Elementwise max with a tensor (broadcasting; NaN propagates)."""
        return self._binary(self._coerce(other, "maximum"), "maximum")

    def minimum(self, other) -> Tensor:
        """Elementwise min with a tensor (broadcasting; NaN propagates)."""
        return self._binary(self._coerce(other, "minimum"), "minimum")

    def clamp(self, min=None, max=None) -> Tensor:
        """min(max(x, min), max); min and max Python numbers or tensors (broadcasting), either
        may be None. Gradient flows where x was kept (ties with a tensor bound: half, as
        torch.maximum's)."""
        if min is None and max is None:
            raise ShapeError("clamp: at least one of min and max must be given")
        y = self
        for bound, kind in ((min, "maximum"), (max, "minimum")):
            if bound is None:
                continue
            if _is_scalar(bound):
                y = y.tracer.op("scalar", [y], kind=kind, value=float(bound))
            else:
                y = y._binary(y._coerce(bound, "clamp"), kind)
        return y

    clip = clamp

    def clamp_min(self, min) -> Tensor:
        return self.clamp(min=min)

    def clamp_max(self, max) -> Tensor:
        return self.clamp(max=max)

    def _compare(self, other, kind: str):
        if _is_scalar(other):
            return self.tracer.op("compare_scalar", [self], kind=kind, value=float(other))
        if not isinstance(other, Tensor) and getattr(other, "traced", None) is None:
            return NotImplemented       # == with any other object: Python's identity test
        return self.tracer.op("compare", [self, self._coerce(other, kind)], kind=kind)

    def __lt__(self, other):
        return self._compare(other, "lt")

    def __le__(self, other):
        return self._compare(other, "le")

    def __gt__(self, other):
        return self._compare(other, "gt")

    def __ge__(self, other):
        return self._compare(other, "ge")

    def __eq__(self, other):
        return self._compare(other, "eq")

    def __ne__(self, other):
        return self._compare(other, "ne")

    # Comparisons give tensors, so hashing stays by identity (tensors as dict keys).
    __hash__ = object.__hash__
    lt, le, gt, ge, eq, ne = __lt__, __le__, __gt__, __ge__, __eq__, __ne__
    less, less_equal, greater, greater_equal, not_equal = lt, le, gt, ge, ne

    def _logical(self, other, kind: str) -> Tensor:
        if self.dtype != "bool" or getattr(other, "dtype", None) != "bool":
            self._unsupported(f"logical {kind} of {self.dtype} and "
                              f"{getattr(other, 'dtype', type(other).__name__)} (bool masks "
                              "only)")
        return self.tracer.op("logical", [self, self._coerce(other, kind)], kind=kind)

    def logical_and(self, other) -> Tensor:
        return self._logical(other, "and")

    def logical_or(self, other) -> Tensor:
        return self._logical(other, "or")

    def logical_xor(self, other) -> Tensor:
        return self._logical(other, "xor")

    def logical_not(self) -> Tensor:
        """not x; a non-bool x is compared with zero first, as torch.logical_not."""
        x = self if self.dtype == "bool" else self != 0
        return self.tracer.op("logical_not", [x])

    __and__ = __rand__ = logical_and
    __or__ = __ror__ = logical_or
    __xor__ = __rxor__ = logical_xor

    def __invert__(self) -> Tensor:
        if self.dtype != "bool":
            self._unsupported(f"bitwise not (~) of a {self.dtype} tensor (bool masks only)")
        return self.logical_not()

    def masked_fill(self, mask, value) -> Tensor:
        """value where mask (bool, broadcast with x) is True, else x; value a Python number
        (float("-inf") included) or a 0-d tensor. No gradient reaches the filled places."""
        mask = self._coerce(mask, "masked_fill")
        if _is_scalar(value):
            return self.tracer.op("masked_fill", [self, mask], value=float(value))
        return self.tracer.op("where", [mask, self._coerce(value, "masked_fill"), self])

    def where(self, condition, other) -> Tensor:
        """x where condition (bool) else other, a tensor or a Python number; the three
        broadcast together (torch.Tensor.where)."""
        cond = self._coerce(condition, "where")
        if _is_scalar(other):
            return self.masked_fill(cond.logical_not(), other)
        return self.tracer.op("where", [cond, self, self._coerce(other, "where")])

    # ---- dtype and device ----
    def _cast(self, dtype) -> Tensor:
        dtype = dtype_name(dtype)
        if dtype == self.dtype:
            return self
        return self.tracer.op("cast", [self], dtype=dtype)

    def to(self, *args, dtype=None, device=None, non_blocking=False, copy=False) -> Tensor:
        """A cast to `dtype` or to another tensor's dtype; a device argument ("cuda", "cpu",
        a device object) changes nothing: a traced tensor lives where the step runs."""
        for a in args:
            if isinstance(a, Tensor):
                dtype = a.dtype
            elif not _is_device(a):
                dtype = a
        return self if dtype is None else self._cast(dtype)

    def type_as(self, other) -> Tensor:
        return self._cast(other.dtype)

    def float(self) -> Tensor:
        return self._cast("float32")

    def double(self) -> Tensor:
        return self._cast("float64")

    def bfloat16(self) -> Tensor:
        return self._cast(BF16)

    def half(self) -> Tensor:
        self._unsupported('Tensor.half (float16; compile with precision="bf16" for 16-bit '
                          "compute)")

    def long(self) -> Tensor:
        return self._cast("int64")

    def int(self) -> Tensor:
        return self._cast("int32")

    def bool(self) -> Tensor:
        return self._cast("bool")

    # ---- what cannot be traced ----
    def __getattr__(self, name: str):
        # Only reached for attributes Tensor lacks: the torch.Tensor methods stepgraph has no op
        # for. Private and dunder names stay AttributeErrors (copy, pickle, hasattr probes).
        if name.startswith("_") or name in ("value", "tracer"):
            raise AttributeError(name)
        self._unsupported(f"Tensor.{name}")

    def _unsupported(self, op: str):
        raise UnsupportedOpError(f"{op} is not supported by stepgraph (called in "
                                 f"{self.tracer.where()})")

    def __getitem__(self, index):
        self._unsupported("indexing (Tensor.__getitem__)")

    def __setitem__(self, index, value):
        self._unsupported("item assignment (Tensor.__setitem__)")

    def __iter__(self):
        self._unsupported("iteration over a tensor")

    def __bool__(self):
        self._unsupported("a tensor's truth value (data-dependent control flow)")

    def __floordiv__(self, other):
        self._unsupported("floor division //")

    def __mod__(self, other):
        self._unsupported("remainder %")

    def __repr__(self):
        return f"Tensor({self.value!r})"


# Tracers whose module forward is running, innermost last (Tracer.module_scope pushes).
_ACTIVE: list[Tracer] = []


def current_tracer() -> Tracer | None:
    """The tracer of the module forward being traced right now, else None. Tensor factories
    with no tensor argument (`arange`) record into it."""
    return _ACTIVE[-1] if _ACTIVE else None


def arange(end: int, *, dtype=None, device=None):
    """0, 1, ..., end - 1 as torch.arange(end) (dtype default int64). Inside a module's
    forward being traced (see `current_tracer`), a Tensor made by the `arange` op on the
    device; anywhere else a NumPy array. `device` is accepted for PyTorch compatibility: a
    traced arange lives where the step runs."""
    if not isinstance(end, numbers.Integral):
        raise TypeError(f"arange: end must be an int, got {type(end).__name__}")
    dtype = str(np.dtype(dtype or "int64"))
    tracer = current_tracer()
    if tracer is None:
        return np.arange(int(end), dtype=dtype)
    return tracer.op("arange", [], n=int(end), dtype=dtype)


class Tracer:
    """Records nodes into `graph`. Parameters and state become external values once each."""

    def __init__(self, seed: int = 0, training: bool = True, frozen: frozenset = frozenset()):
        self.graph = Graph()
        self.frozen = frozen                       # ids of Parameters traced as constants
        self.seed = seed
        self.training = training
        self.param_values: dict[int, Value] = {}   # id(Parameter) -> Value
        self.parameters: list[Parameter] = []
        self.buffer_values: dict[int, Value] = {}  # id(Buffer) -> its state Value
        self._rng_step: Value | None = None
        self._dropout_sites = 0
        self.label = ""                            # module label for recorded nodes
        self.module_path: list[str] = []           # paths of the modules being called
        self.module_paths: dict[int, str] = {}     # id(module) -> path, set by the root call

    # ---- where ops come from ----
    def where(self) -> str:
        """The path of the module whose forward is running, e.g. "model.layer1.0.conv1"."""
        return self.module_path[-1] if self.module_path else "no module (top level)"

    @contextmanager
    def module_scope(self, path: str, label: str):
        """Nodes recorded inside carry `label`; errors name `path`. Both restored on exit.
        While inside, this is the current tracer (`current_tracer`)."""
        saved = self.label
        self.module_path.append(path)
        self.label = label
        _ACTIVE.append(self)
        try:
            yield
        finally:
            _ACTIVE.pop()
            self.module_path.pop()
            self.label = saved

    # ---- externals ----
    def input(self, shape, dtype: str, name: str) -> Tensor:
        v = Value(tuple(shape), dtype, INPUT, name)
        self.graph.inputs.append(v)
        return Tensor(v, self)

    def param(self, p: Parameter) -> Tensor:
        """A Parameter as a `param` value, once per Parameter; a frozen one (in `frozen`) as
        a `state` value instead, like a buffer: the backward and the update never see it."""
        if id(p) in self.frozen:
            return self.buffer(p)
        v = self.param_values.get(id(p))
        if v is None:
            v = Value(p.shape, p.dtype, PARAM, p.name)
            self.param_values[id(p)] = v
            self.parameters.append(p)
            self.graph.params.append(v)
        return Tensor(v, self)

    def buffer(self, b: Buffer) -> Tensor:
        """A module buffer as a `state` value named by its state_dict key, once per buffer:
        compiled steps bind it to the buffer's storage, and ops may update it in place."""
        v = self.buffer_values.get(id(b))
        if v is None:
            if not b.name:
                raise ValueError(f"{b!r} has no state_dict key: register it on a module of "
                                 "the model being traced")
            v = self.state(b.shape, b.dtype, b.name)
            self.buffer_values[id(b)] = v
        return Tensor(v, self)

    def state(self, shape, dtype: str, name: str) -> Value:
        v = Value(tuple(shape), dtype, STATE, name)
        self.graph.state.append(v)
        return v

    def rng_step(self) -> Value:
        """The device step counter dropout reads; shared with the optimizer (`optimizer.step`)."""
        if self._rng_step is None:
            self._rng_step = self.state((), "int64", "optimizer.step")
        return self._rng_step

    def next_dropout_site(self) -> int:
        self._dropout_sites += 1
        return self._dropout_sites - 1

    # ---- ops ----
    def emit(self, op: str, inputs: list[Value], label: str | None = None, **attrs) -> list[Value]:
        specs = infer_outputs(op, inputs, attrs)
        outs = [Value(shape, dtype) for shape, dtype in specs]
        mutates = OPS[op].mutates(attrs)
        self.graph.nodes.append(Node(op, list(inputs), outs, attrs, mutates,
                                     self.label if label is None else label))
        return outs

    def op(self, op: str, inputs: list, **attrs) -> Tensor:
        """Record `op` on tensors (or values); return its first output as a Tensor."""
        values = [t.value if isinstance(t, Tensor) else t for t in inputs]
        return Tensor(self.emit(op, values, **attrs)[0], self)

    def op_all(self, op: str, inputs: list, **attrs) -> list[Tensor]:
        values = [t.value if isinstance(t, Tensor) else t for t in inputs]
        return [Tensor(v, self) for v in self.emit(op, values, **attrs)]
