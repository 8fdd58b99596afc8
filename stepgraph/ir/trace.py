"""Tracing: modules are called once on symbolic tensors and every op records a node.

`Tracer` builds a Graph; `Tensor` is the symbolic value modules see. Nothing here runs per step.
Outside a traced forward, tensors are eager: `EAGER` runs each op at once (its shape rule and its
NumPy reference), so every Tensor method works on concrete values as well. An eager tensor that
meets a traced one becomes a `constant` of the trace.
"""
from __future__ import annotations

import math
import numbers
import operator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from ..errors import FLOAT16_HINT, ShapeError, UnsupportedOpError
from ..grad_mode import is_grad_enabled
from .graph import (BF16, DTYPES, INPUT, PARAM, STATE, Graph, Node, Value, ir_dtype,
                    storage_dtype)
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
    if ndim == 0:               # a 0-d tensor's dim 0 / -1 names no axis to reduce
        return ()
    if len(axes) != len(dims):
        raise ShapeError(f"{what}: dim {dim} names an axis twice")
    return tuple(axes)


def _shape_args(shape) -> tuple:
    return tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape


def _vector_norm(x: Tensor, p, dim, keepdim: bool, eps: float) -> Tensor:
    """(sum |x|^p)^(1/p) over `dim` (max |x| for p inf, min for -inf, the count of nonzeros
    for 0). eps > 0 (F.normalize's divisor, p > 0 only) clamps the norm below at eps, on
    the sum at eps^p: the same value without the root's infinite derivative at zero. eps 0:
    the root of a zero sum is 0 with gradient zero."""
    if not _is_scalar(p) or math.isnan(p) or eps and not p > 0:
        x._unsupported(f"norm with p={p!r} (p must be a number{', > 0' if eps else ''})")
    dims = () if dim is None else dim
    if abs(p) == math.inf:
        a = x.abs()
        y = a.amax(dims, keepdim) if p > 0 else a.amin(dims, keepdim)
        return y.clamp_min(eps) if eps else y
    if p == 0:                                  # piecewise constant: no gradient
        return (x != 0).to(x.dtype).sum(dim, keepdim)
    s = (x * x if p == 2 else x.abs() if p == 1 else x.abs() ** p).sum(dim, keepdim)
    if p == 1:
        return s.clamp_min(eps) if eps else s
    root = (lambda t: t.sqrt()) if p == 2 else (lambda t: t ** (1.0 / p))
    if eps:
        return root(s.clamp_min(eps ** p))
    zero = s == 0
    return root(s.masked_fill(zero, 1.0)).masked_fill(zero, 0.0)


class Size(tuple):
    """A tensor's shape (torch.Size): a tuple of ints with numel()."""

    def numel(self) -> int:
        return math.prod(self)

    def __repr__(self):
        return f"torch.Size({list(self)})"


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
        hint = f" ({FLOAT16_HINT})" if name == "float16" else ""
        raise UnsupportedOpError(f"dtype {dtype!r} is not supported by stepgraph: "
                                 f"one of {DTYPES}{hint}")
    return name


def _is_device(x) -> bool:
    """A device argument of Tensor.to: "cuda", "cpu:0", or a device object."""
    if isinstance(x, str):
        return x.split(":")[0] in ("cpu", "cuda")
    return hasattr(x, "type") and hasattr(x, "index")


def _inplace(name: str):
    """Tensor.<name>_: the out-of-place method's result, held from then on by the same
    tensor object (`Tensor._assign`)."""
    def method(self, *args, **kwargs):
        return self._assign(getattr(self, name)(*args, **kwargs), f"Tensor.{name}_")
    method.__name__ = method.__qualname__ = f"{name}_"
    method.__doc__ = f"In-place {name}: this tensor now holds x.{name}(...) (see _assign)."
    return method


class Tensor:
    """A symbolic tensor: a Value plus the tracer recording ops on it.

    Supports PyTorch's arithmetic operators (+ - * / ** // % with tensors, broadcasting, or
    Python scalars on either side) and their names (add, sub, mul, div, ...), @ ((..., K) @
    (K, N), and (..., M, K) @ (..., K, N) with the same batch dims through bmm), mm/bmm/mv/
    dot/outer/addmm/baddbmm, reshape/view/flatten, transpose/permute/.T, split/chunk/narrow,
    sum/mean/prod/median/norm, and the methods relu/sigmoid/tanh/softmax/log_softmax;
    indexing x[...], unsqueeze/squeeze/unflatten/expand/repeat/repeat_interleave/movedim/
    flip/roll, tril/triu, max/min/amax/amin/argmax/argmin, var/std/logsumexp, cumsum, gather,
    scatter/scatter_add, topk/sort, new_zeros/new_ones/new_full/new_tensor, and in-place
    forms (x += y, add_, relu_, masked_fill_, ...) that rebind this object (`_assign`). Any
    other torch.Tensor method, and what has a data-dependent shape (boolean masks), raises
    UnsupportedOpError naming the op and the module that called it.

    An eager tensor (tracer `EAGER`, made outside a traced forward by the factories of
    stepgraph.functions) also holds its values, `array` in storage dtype (bfloat16 as uint16
    bits): its methods compute at once, and it reads back with numpy()/item()/tolist()."""

    def __init__(self, value: Value, tracer: Tracer | EagerTracer, array=None):
        self.value = value
        self.tracer = tracer
        self.array = array

    @property
    def is_eager(self) -> bool:
        return self.array is not None

    @property
    def shape(self) -> Size:
        return Size(self.value.shape)

    @property
    def dtype(self):
        from ..dtypes import as_dtype
        return as_dtype(self.value.dtype)

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

    # ---- properties and reading values back (eager tensors) ----
    @property
    def device(self):
        """The CPU: eager tensors live in host memory, and a traced tensor's place is the
        compiled step's (`compile_train_step(device=...)`), which tracing does not know;
        factories accept any device, so `device=x.device` in model code works as written."""
        from ..devices import device
        return device("cpu")

    @property
    def requires_grad(self) -> bool:
        """False: gradients are derived from the loss at compile time, never tracked on
        tensors (Parameters are what the optimizer updates)."""
        return False

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def data(self) -> Tensor:
        """This tensor's values outside the backward: an eager tensor itself (it shares the
        values, as torch's), a traced one its detach()."""
        return self if self.is_eager else self.detach()

    def backward(self, gradient=None, retain_graph=None, create_graph: bool = False,
                 inputs=None) -> None:
        """In a training script (an optimizer made with parameters, loop/): ends the pass
        that computed this loss; optimizer.step() then runs forward, backward and update as
        one compiled step. gradient, create_graph and inputs other than the defaults are
        refused; retain_graph is accepted (a pass is compiled whole either way)."""
        from ..loop import hooks       # no cycle: hooks imports nothing

        if getattr(self.tracer, "backward", None) is None or hooks.SESSION is None:
            from ..errors import ALTERNATIVES
            self._unsupported("Tensor.backward outside a training loop with a torch-style "
                              "optimizer (make one with model.parameters(), or use "
                              f"{ALTERNATIVES['torch.Tensor.backward']})")
        if gradient is not None or create_graph or inputs is not None:
            self._unsupported("Tensor.backward(gradient=, create_graph=True or inputs=): a "
                              "captured loop differentiates a scalar loss")
        hooks.SESSION.backward(self.tracer, self)

    def detach(self) -> Tensor:
        """The same values, cut from the backward (a stop_gradient view)."""
        return self.tracer.op("stop_gradient", [self])

    def clone(self, *, memory_format=None) -> Tensor:
        """A copy (eager); a traced value is never overwritten, so its clone is a new object
        holding the same value: an in-place method on one leaves the other as it was."""
        self._memory_format(memory_format, "Tensor.clone")
        return tensor_of(self.array.copy()) if self.is_eager else Tensor(self.value, self.tracer)

    def cpu(self) -> Tensor:
        """This tensor: eager ones live on the host, traced ones where the step runs."""
        return self

    def cuda(self, device=None, non_blocking: bool = False) -> Tensor:
        """This tensor: where a step runs is compile_train_step(device=...), not tensors."""
        return self

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        """Accepted: gradients are derived from the loss at compile time."""
        return self

    def is_contiguous(self, memory_format=None) -> bool:
        return True

    def fill_(self, value) -> Tensor:
        """Every element set to `value` (a number), in place: an eager tensor's array is
        written, a traced one holds a `fill` node from then on (`_assign`)."""
        if not _is_scalar(value):
            self._unsupported(f"Tensor.fill_ with a {type(value).__name__} value (a number)")
        if not self.is_eager:
            return self._assign(self.new_full(self.shape, value), "Tensor.fill_")
        self.array[...] = EAGER.op("fill", [], value=value, shape=(),
                                   dtype=self.value.dtype).array
        return self

    def zero_(self) -> Tensor:
        return self.fill_(0)

    def copy_(self, src, non_blocking: bool = False) -> Tensor:
        """`src`'s values (broadcast to this shape, cast to this dtype) written in place; a
        traced tensor, or one given traced values, holds them from then on (`_assign`)."""
        if not self.is_eager or isinstance(src, Tensor) and not src.is_eager:
            if not isinstance(src, Tensor):     # a Parameter or Buffer, or array-like values
                src = self._coerce(src, "copy_") if hasattr(src, "traced") else \
                    tensor_of(np.asarray(src))
            return self._assign(src._cast(self.dtype).expand(*self.shape), "Tensor.copy_")
        values = src.numpy() if isinstance(src, Tensor) else np.asarray(src)
        if self.value.dtype == "bfloat16":
            from ..backends.numpy import bf16
            values = bf16.to_bits(np.asarray(values, np.float32))
        self.array[...] = np.broadcast_to(values, self.shape)
        return self

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return self.ndim

    def element_size(self) -> int:
        return self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def numpy(self) -> np.ndarray:
        """The values as a NumPy array (bfloat16 as float32); eager tensors only."""
        array = self.array
        if not self.is_eager:
            reader = getattr(self.tracer, "read_value", None)   # a training script's pass
            if reader is None:
                self._unsupported("reading the values of a traced tensor (numpy/item/tolist: "
                                  "a traced forward has no values yet)")
            array = reader(self.value)
        if self.value.dtype == "bfloat16":
            from ..backends.numpy import bf16
            return bf16.from_bits(array)
        return array

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def item(self):
        """The one value of a one-element tensor as a Python number."""
        values = self.numpy()
        if values.size != 1:
            raise ShapeError(f"item: a tensor of {values.size} elements has no single value")
        return values.reshape(()).item()

    def tolist(self):
        return self.numpy().tolist()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __index__(self):
        if self.dtype.is_floating_point:
            raise TypeError("only integer tensors of a single element can be an index")
        return int(self.item())

    def __bool__(self):
        if not self.is_eager and getattr(self.tracer, "read_value", None) is None:
            self._unsupported("a tensor's truth value (data-dependent control flow)")
        return bool(self.item())

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

    def contiguous(self, memory_format=None) -> Tensor:
        """This tensor: every value is contiguous (memory_format as _memory_format's)."""
        self._memory_format(memory_format, "Tensor.contiguous")
        return self

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
        if self.ndim == 0:      # torch accepts dims 0 / -1 of a 0-d tensor: nothing to swap
            return self
        dims[a], dims[b] = dims[b], dims[a]
        return self.permute(*dims)

    @property
    def T(self) -> Tensor:
        return self.permute(*reversed(range(self.ndim)))

    # ---- reductions ----
    def sum(self, dim=None, keepdim: bool = False) -> Tensor:
        """Sum over `dim` (None: every axis; an int or a tuple of ints). Booleans and
        integers sum as int64, as torch's (a count of True values)."""
        axes = _dims(dim, self.ndim, "sum")
        x = self if self.dtype.is_floating_point or self.value.dtype == "int64" else \
            self.long()
        y = self.tracer.op("reduce_sum", [x], axes=axes) if axes else x
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
            x = self._to_float(kind == "div" or kind == "rdiv" or
                               isinstance(other, (float, np.floating)))
            return self.tracer.op("scalar", [x], kind=kind, value=float(other))
        other = self._coerce(other, kind)
        a, b = (other, self) if reverse else (self, other)
        floats = kind == "div" or a.dtype.is_floating_point or b.dtype.is_floating_point
        # an integer operand takes the float operand's dtype (int32 with float64 is float64)
        like = next((t.value.dtype for t in (a, b) if t.dtype.is_floating_point), "float32")
        a, b = a._to_float(floats, like), b._to_float(floats, like)
        return self.tracer.op("binary", [a, b], kind=kind)

    def _to_float(self, needed: bool, dtype: str = "float32") -> Tensor:
        """An integer tensor cast to `dtype` (float32 unless the other operand's float) where
        torch's type promotion gives a float (division, a float operand); else this tensor.
        The int + int forms keep the int."""
        if not needed or self.dtype.is_floating_point:
            return self
        return self.tracer.op("cast", [self], dtype=dtype)

    def _coerce(self, other, op: str) -> Tensor:
        """`other` as a tensor of this trace: Parameters and Buffers are traced on use."""
        if isinstance(other, Tensor):
            # an eager operand of a traced op becomes a constant when the op is recorded
            if other.tracer is not self.tracer and not (self.is_eager or other.is_eager):
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
        x = self._to_float(isinstance(exponent, (float, np.floating)))
        return x.tracer.op("scalar", [x], kind="pow", value=float(exponent))

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

    # ---- arithmetic and products by name (torch.Tensor.add, mm, outer, ...) ----
    def add(self, other, *, alpha=1) -> Tensor:
        """self + alpha * other."""
        return self + (other if alpha == 1 else self._coerce_any(other, "add") * alpha)

    def sub(self, other, *, alpha=1) -> Tensor:
        """self - alpha * other."""
        return self - (other if alpha == 1 else self._coerce_any(other, "sub") * alpha)

    def mul(self, other) -> Tensor:
        return self * other

    def div(self, other, *, rounding_mode=None) -> Tensor:
        """self / other; rounding_mode "trunc" or "floor" rounds the quotient."""
        if rounding_mode not in (None, "trunc", "floor"):
            raise ValueError(f"div: rounding_mode must be None, 'trunc' or 'floor', got "
                             f"{rounding_mode!r}")
        return self / other if rounding_mode is None else self._rounded(other, rounding_mode)

    subtract, multiply, divide, true_divide = sub, mul, div, div

    def _rounded(self, other, kind: str, reverse: bool = False) -> Tensor:
        """floor(a / b) (kind "floor"), trunc(a / b) ("trunc") or a - b * floor(a / b)
        ("mod", the remainder with the divisor's sign, as Python's %), a = self and b = other
        (swapped when reverse). With integer operands only, the result is an integer tensor
        computed in float64: exact for magnitudes below 2^53."""
        ints = not self.dtype.is_floating_point and (
            isinstance(other, numbers.Integral) or
            isinstance(other, Tensor) and not other.dtype.is_floating_point)
        x = self._cast("float64") if ints else self
        o = other if _is_scalar(other) else self._coerce(other, kind)
        o = o._cast("float64") if ints and isinstance(o, Tensor) else o
        a, b = (o, x) if reverse else (x, o)
        q = a / b
        y = q.trunc() if kind == "trunc" else q.floor()
        if kind == "mod":
            y = a - b * y
        return y._cast(self.dtype) if ints else y

    def __floordiv__(self, other):
        """floor(self / other), as torch.floor_divide (`_rounded`)."""
        return self._rounded(other, "floor")

    def __rfloordiv__(self, other):
        return self._rounded(other, "floor", reverse=True)

    def __mod__(self, other):
        """self - other * floor(self / other), as torch.remainder (`_rounded`)."""
        return self._rounded(other, "mod")

    def __rmod__(self, other):
        return self._rounded(other, "mod", reverse=True)

    floor_divide, remainder = __floordiv__, __mod__

    def _coerce_any(self, other, op: str):
        """A Python number as it is, anything else as a tensor of this trace."""
        return other if _is_scalar(other) else self._coerce(other, op)

    def mm(self, mat2) -> Tensor:
        """(n, k) @ (k, m)."""
        mat2 = self._coerce(mat2, "mm")
        if self.ndim != 2 or mat2.ndim != 2:
            raise ShapeError(f"mm: needs two matrices, got {self.shape} and {mat2.shape}")
        return self @ mat2

    def bmm(self, mat2) -> Tensor:
        """(b, n, k) @ (b, k, m)."""
        mat2 = self._coerce(mat2, "bmm")
        if self.ndim != 3 or mat2.ndim != 3:
            raise ShapeError(f"bmm: needs two 3-d tensors, got {self.shape} and {mat2.shape}")
        return self @ mat2

    def mv(self, vec) -> Tensor:
        """(n, k) @ (k,)."""
        vec = self._coerce(vec, "mv")
        if self.ndim != 2 or vec.ndim != 1:
            raise ShapeError(f"mv: needs a matrix and a vector, got {self.shape} and "
                             f"{vec.shape}")
        return self @ vec

    def dot(self, other) -> Tensor:
        """The sum of the products of two 1-d tensors of one length."""
        other = self._coerce(other, "dot")
        if self.ndim != 1 or other.shape != self.shape:
            raise ShapeError(f"dot: needs two 1-d tensors of one length, got {self.shape} and "
                             f"{other.shape}")
        return (self * other).sum()

    inner = dot

    def outer(self, vec2) -> Tensor:
        """The (n, m) products of two 1-d tensors: one broadcast multiply, as exact as
        torch's."""
        vec2 = self._coerce(vec2, "outer")
        if self.ndim != 1 or vec2.ndim != 1:
            raise ShapeError(f"outer: needs two 1-d tensors, got {self.shape} and {vec2.shape}")
        return self.reshape(-1, 1) * vec2.reshape(1, -1)

    ger = outer

    def addmm(self, mat1, mat2, *, beta=1, alpha=1) -> Tensor:
        """beta * self + alpha * (mat1 @ mat2)."""
        return self._scaled_sum(self._coerce(mat1, "addmm").mm(mat2), beta, alpha)

    def baddbmm(self, batch1, batch2, *, beta=1, alpha=1) -> Tensor:
        """beta * self + alpha * (batch1 @ batch2), batched."""
        return self._scaled_sum(self._coerce(batch1, "baddbmm").bmm(batch2), beta, alpha)

    def _scaled_sum(self, product: Tensor, beta, alpha) -> Tensor:
        product = product if alpha == 1 else product * alpha
        # torch ignores self when beta is 0 (NaN in it does not propagate)
        return product if beta == 0 else (self if beta == 1 else self * beta) + product

    def t(self) -> Tensor:
        """The transpose of a matrix; a 0-d or 1-d tensor as it is."""
        if self.ndim > 2:
            raise ShapeError(f"t: expects a tensor of at most 2 axes, got {self.shape}")
        return self.T

    # ---- in-place forms: x.add_(y), x += y, x.relu_(), x.masked_fill_(m, v) ----
    def _assign(self, result: Tensor, what: str) -> Tensor:
        """Make this tensor hold `result` (an in-place method's work). An eager tensor's
        array is written. A traced value is never overwritten: the object is rebound to the
        new node, so every name bound to it sees the change, as model code expects of
        `x += residual`; views taken before the call keep the old values (torch's views
        share storage and would see it)."""
        if result.shape != self.shape or result.dtype != self.dtype:
            raise ShapeError(f"{what}: the result {result.dtype}{list(result.shape)} cannot "
                             f"be written in place into a {self.dtype}{list(self.shape)} "
                             "tensor")
        if self.is_eager and result.is_eager:
            self.array[...] = result.array
        elif result.is_eager:                   # eager values for a traced tensor: a constant
            self.value = self.tracer.constant(result)
        else:
            self.value, self.tracer, self.array = result.value, result.tracer, None
        return self

    add_, sub_, mul_, div_, pow_ = (_inplace(n) for n in ("add", "sub", "mul", "div", "pow"))
    __iadd__, __isub__, __imul__, __itruediv__, __ipow__ = add_, sub_, mul_, div_, pow_
    floor_divide_, remainder_ = _inplace("floor_divide"), _inplace("remainder")
    __ifloordiv__, __imod__ = floor_divide_, remainder_
    subtract_, multiply_, divide_, true_divide_ = sub_, mul_, div_, div_
    neg_, negative_, reciprocal_, square_ = (_inplace(n) for n in ("neg", "negative",
                                                                   "reciprocal", "square"))
    clamp_, clamp_min_, clamp_max_, clip_ = (_inplace(n) for n in ("clamp", "clamp_min",
                                                                   "clamp_max", "clip"))
    relu_, sigmoid_, tanh_ = (_inplace(n) for n in ("relu", "sigmoid", "tanh"))
    exp_, log_, log1p_, expm1_ = (_inplace(n) for n in ("exp", "log", "log1p", "expm1"))
    sqrt_, rsqrt_, abs_, sign_ = (_inplace(n) for n in ("sqrt", "rsqrt", "abs", "sign"))
    floor_, ceil_, round_, trunc_ = (_inplace(n) for n in ("floor", "ceil", "round", "trunc"))
    sin_, cos_, erf_ = (_inplace(n) for n in ("sin", "cos", "erf"))
    masked_fill_, addmm_, baddbmm_ = (_inplace(n) for n in ("masked_fill", "addmm",
                                                            "baddbmm"))
    scatter_, scatter_add_ = _inplace("scatter"), _inplace("scatter_add")

    # ---- new tensors of this dtype (torch.Tensor.new_*) ----
    def new_full(self, size, fill_value, *, dtype=None, device=None,
                 requires_grad: bool = False) -> Tensor:
        """`fill_value` everywhere, of shape `size` and (unless `dtype`) this dtype: a `fill`
        node of this tensor's trace (computed at once for an eager tensor). `device` is
        checked and ignored, as the factories do."""
        from ..devices import as_device
        from ..dtypes import tensor_dtype
        as_device(device)
        shape = tuple(int(d) for d in _shape_args((size,)))
        return self.tracer.op("fill", [], value=fill_value, shape=shape,
                              dtype=str(tensor_dtype(dtype or self.dtype, "new_full")))

    def new_zeros(self, *size, dtype=None, device=None, requires_grad: bool = False):
        return self.new_full(_shape_args(size), 0, dtype=dtype, device=device)

    def new_ones(self, *size, dtype=None, device=None, requires_grad: bool = False):
        return self.new_full(_shape_args(size), 1, dtype=dtype, device=device)

    def new_empty(self, *size, dtype=None, device=None, requires_grad: bool = False):
        """As new_zeros (nothing may depend on stale memory)."""
        return self.new_zeros(*size, dtype=dtype, device=device)

    def new_tensor(self, data, *, dtype=None, device=None, requires_grad: bool = False):
        """An eager tensor holding a copy of `data` in this dtype (unless `dtype`); where it
        meets a traced tensor it is a constant of its values."""
        from ..devices import as_device
        from ..dtypes import tensor_dtype
        as_device(device)
        dtype = str(tensor_dtype(dtype or self.dtype, "new_tensor"))
        values = data.numpy() if isinstance(data, Tensor) else np.asarray(data)
        if dtype == BF16:
            from ..backends.numpy import bf16
            return tensor_of(bf16.to_bits(np.asarray(values, np.float32)))
        return tensor_of(np.array(values, dtype=storage_dtype(dtype), order="C"))

    # ---- slicing ----
    def narrow(self, dim: int, start: int, length: int) -> Tensor:
        """Elements start..start+length-1 along `dim` (a contiguous copy; none when the
        slice is the whole axis). start and length are ints or constant 0-d integer arrays
        (a torch / NumPy scalar tensor); a traced tensor is refused."""
        d = _dim(dim, self.ndim, "narrow")
        if isinstance(start, Tensor) and not start.is_eager:
            self._unsupported("narrow with a traced tensor start (the slice must be known "
                              "when tracing; pass an int or a constant 0-d int tensor)")
        start, length = operator.index(start), operator.index(length)
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

    def unbind(self, dim: int = 0) -> tuple[Tensor, ...]:
        """The slices along `dim`, each without that axis, as torch.unbind."""
        d = _dim(dim, self.ndim, "unbind")
        return tuple(self.narrow(d, i, 1).squeeze(d) for i in range(self.shape[d]))

    # ---- indexing, joining, reductions along a dim ----
    def __getitem__(self, index) -> Tensor:
        """x[...] with ints (negative too), slices (positive steps), None, `...` and at most
        one integer tensor (rows taken along its axis, e.g. `emb[idx]`; float x, indices in
        range; ints beside it only next to it). Boolean masks give a data-dependent shape and
        are refused."""
        items = [self._index_item(i) for i in (index if isinstance(index, tuple) else (index,))]
        real = sum(item is not None and item is not Ellipsis for item in items)
        if real > self.ndim:
            raise IndexError(f"too many indices ({real}) for a tensor of shape {self.shape}")
        if items.count(Ellipsis) > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        fill = [slice(None)] * (self.ndim - real)
        at = items.index(Ellipsis) if Ellipsis in items else len(items)
        items[at:at + 1] = fill
        self._check_advanced(items)
        y, axis = self, 0
        for item in items:
            y, axis = y._index_axis(item, axis)
        return y

    def _check_advanced(self, items: list):
        """Refuse what PyTorch reads as advanced indexing beyond one tensor whose axes land
        where it stands: several tensors (paired elementwise), or a tensor and an int apart
        (their axes would move to the front)."""
        tensors = [i for i, item in enumerate(items) if isinstance(item, Tensor)]
        if len(tensors) > 1:
            self._unsupported("indexing with several integer tensors (use gather, or index "
                              "one axis at a time)")
        if tensors:
            advanced = [i for i, item in enumerate(items)
                        if isinstance(item, (Tensor, numbers.Integral))]
            if advanced[-1] - advanced[0] + 1 != len(advanced):
                self._unsupported("indexing with an integer tensor and an int apart (index "
                                  "in two steps, e.g. x[0][:, idx])")

    def _index_item(self, item):
        """One item of an index, an integer tensor index traced (Parameters, Buffers)."""
        if item is None or item is Ellipsis or isinstance(item, (numbers.Integral, slice)):
            return item
        item = self._coerce(item, "indexing")
        dtype = item.value.dtype
        if dtype in ("bool", "uint8"):             # uint8 indexes as a mask in PyTorch too
            self._unsupported("boolean-mask indexing x[mask] (its shape depends on the data; "
                              "use x.masked_fill(~mask, 0) or torch.where(mask, x, 0))")
        if dtype not in ("int32", "int64"):
            self._unsupported(f"indexing with a {dtype} tensor (indices are int64)")
        return item

    def _index_axis(self, item, axis: int) -> tuple[Tensor, int]:
        """Apply one index item at `axis`; the result and the axis the next item applies to."""
        if item is None:
            return self.unsqueeze(axis), axis + 1
        if isinstance(item, Tensor):
            return self._take(item, axis), axis + item.ndim
        n = self.shape[axis]
        if isinstance(item, numbers.Integral):
            if not -n <= item < n:
                raise IndexError(f"index {item} is out of bounds for axis {axis} with size {n}")
            y = self.narrow(axis, int(item) % n, 1)
            return y.reshape(*y.shape[:axis], *y.shape[axis + 1:]), axis
        start, stop, step = item.indices(n)
        if step <= 0:
            raise ValueError(f"slice step must be positive, got {step} (as in PyTorch)")
        stop = max(stop, start)
        if (start, stop, step) == (0, n, 1):
            return self, axis + 1
        return self.tracer.op("slice", [self], dim=axis, start=start, stop=stop,
                              step=step), axis + 1

    def _take(self, index: Tensor, axis: int) -> Tensor:
        """Rows of this tensor along `axis` picked by the integer tensor `index`: the index's
        axes replace `axis` (an embedding lookup of the axis' slices)."""
        front = self.movedim(axis, 0)
        table = front.reshape(front.shape[0], -1)
        rows = self.tracer.op("embedding", [table, index])
        y = rows.reshape(*index.shape, *front.shape[1:])
        k = index.ndim
        dims = list(range(k, k + axis)) + list(range(k)) + list(range(k + axis, y.ndim))
        return y.permute(*dims)

    def index_select(self, dim: int, index) -> Tensor:
        """The slices of axis `dim` picked by the 1-D integer tensor `index`, as
        torch.index_select (x[..., index, ...])."""
        index = self._index_item(index)
        if not isinstance(index, Tensor) or index.ndim != 1:
            raise ShapeError(f"index_select: index must be a 1-D integer tensor, got {index!r}")
        d = _dim(dim, self.ndim, "index_select")
        if self.ndim == 0:          # torch reads a 0-d tensor as one element along dim 0
            return self.reshape(1)._take(index, 0).reshape()
        return self._take(index, d)

    def unsqueeze(self, dim: int) -> Tensor:
        """A view with a new axis of size 1 at `dim` (in [-ndim - 1, ndim])."""
        d = _dim(dim, self.ndim + 1, "unsqueeze")
        return self.reshape(*self.shape[:d], 1, *self.shape[d:])

    def squeeze(self, dim=None) -> Tensor:
        """A view without the axes of size 1 among `dim` (None: every axis); other named axes
        stay, as in torch.squeeze."""
        if isinstance(dim, (tuple, list)) and not dim:    # torch: dim=() squeezes no axis
            return self
        axes = _dims(dim, self.ndim, "squeeze")
        return self.reshape(*(d for i, d in enumerate(self.shape)
                              if not (i in axes and d == 1)))

    def unflatten(self, dim: int, sizes) -> Tensor:
        """Axis `dim` split into `sizes` (one entry may be -1)."""
        d = _dim(dim, self.ndim, "unflatten")
        sizes = [int(s) for s in sizes]
        if -1 in sizes:
            known = math.prod(s for s in sizes if s != -1)
            sizes[sizes.index(-1)] = self.shape[d] // known if known else 0
        if math.prod(sizes) != self.shape[d]:
            raise ShapeError(f"unflatten: sizes {sizes} do not multiply to {self.shape[d]} "
                             f"(axis {d} of {self.shape})")
        return self.reshape(*self.shape[:d], *sizes, *self.shape[d + 1:])

    def view_as(self, other) -> Tensor:
        return self.reshape(*other.shape)

    reshape_as = view_as

    def expand(self, *sizes) -> Tensor:
        """A broadcast copy of shape `sizes` (-1 keeps an axis; new axes go in front)."""
        sizes = tuple(int(s) for s in _shape_args(sizes))
        lead = len(sizes) - self.ndim
        if lead < 0:
            raise ShapeError(f"expand: {len(sizes)} sizes for a tensor of rank {self.ndim}")
        shape = tuple(self.shape[i - lead] if s == -1 and i >= lead else s
                      for i, s in enumerate(sizes))
        if shape == self.shape:
            return self
        return self.tracer.op("expand", [self], shape=shape)

    def expand_as(self, other) -> Tensor:
        return self.expand(*other.shape)

    def repeat(self, *sizes) -> Tensor:
        """The tensor tiled `sizes` times along each axis, as torch.Tensor.repeat: viewed as
        (1, s0, 1, s1, ...), expanded to (r0, s0, r1, s1, ...) and merged pairwise."""
        sizes = tuple(int(s) for s in _shape_args(sizes))
        if len(sizes) < self.ndim:
            raise ShapeError(f"repeat: {len(sizes)} repeats for a tensor of rank {self.ndim}")
        shape = (1,) * (len(sizes) - self.ndim) + self.shape
        pairs = self.reshape(*(d for s in shape for d in (1, s)))
        tiled = pairs.expand(*(d for r, s in zip(sizes, shape) for d in (r, s)))
        return tiled.reshape(*(r * s for r, s in zip(sizes, shape)))

    def repeat_interleave(self, repeats, dim=None, *, output_size=None) -> Tensor:
        """Each element repeated `repeats` (an int) times along `dim` (None: of the
        flattened tensor), as torch.repeat_interleave: a new axis after `dim` expanded and
        merged into it. A tensor of per-element repeats gives a data-dependent shape."""
        if not isinstance(repeats, numbers.Integral):
            self._unsupported("Tensor.repeat_interleave with a tensor of repeats (the shape "
                              "depends on the data; use an int, or repeat)")
        if dim is None:
            return self.reshape(-1).repeat_interleave(repeats, 0)
        d = _dim(dim, self.ndim, "repeat_interleave")
        spread = self.unsqueeze(d + 1)
        spread = spread.expand(*spread.shape[:d + 1], int(repeats), *spread.shape[d + 2:])
        return spread.flatten(d, d + 1)

    def roll(self, shifts, dims=None) -> Tensor:
        """Elements shifted `shifts` places along `dims` (int or tuples of one length; None:
        the flattened tensor, shape kept), wrapping around: two slices joined per axis."""
        if dims is None:
            return self.reshape(-1).roll(shifts, 0).reshape(*self.shape)
        shifts = (shifts,) if isinstance(shifts, numbers.Integral) else tuple(shifts)
        dims = (dims,) if isinstance(dims, numbers.Integral) else tuple(dims)
        if len(shifts) != len(dims):
            raise ShapeError(f"roll: {len(shifts)} shifts for {len(dims)} dims")
        y = self
        for shift, dim in zip(shifts, dims):
            d = _dim(dim, self.ndim, "roll")
            n = self.shape[d]
            k = int(shift) % n if n else 0
            if k:
                y = y.tracer.op("concat", [y.narrow(d, n - k, k), y.narrow(d, 0, n - k)], dim=d)
        return y

    def flip(self, *dims) -> Tensor:
        """The order along `dims` reversed (float tensors): the slices read at reversed
        constant positions (index_select)."""
        y = self
        for dim in _shape_args(dims):
            d = _dim(dim, self.ndim, "flip")
            if self.shape[d] > 1:
                y = y.index_select(d, tensor_of(np.arange(self.shape[d] - 1, -1, -1)))
        return y

    def movedim(self, source, destination) -> Tensor:
        """Axes `source` (int or tuple) moved to positions `destination`, the others kept in
        order."""
        src = (source,) if isinstance(source, int) else tuple(source)
        dst = (destination,) if isinstance(destination, int) else tuple(destination)
        src = tuple(_dim(d, self.ndim, "movedim") for d in src)
        dst = tuple(_dim(d, self.ndim, "movedim") for d in dst)
        if len(src) != len(dst) or len(set(src)) != len(src) or len(set(dst)) != len(dst):
            raise ShapeError(f"movedim: source {source} and destination {destination} must "
                             "name as many distinct axes")
        rest = iter(d for d in range(self.ndim) if d not in src)
        placed = dict(zip(dst, src))
        return self.permute(*(placed[i] if i in placed else next(rest)
                              for i in range(self.ndim)))

    moveaxis = movedim
    swapaxes = swapdims = transpose

    def tril(self, diagonal: int = 0) -> Tensor:
        """Zeros above diagonal `diagonal` of the last two axes."""
        return self._triangle(diagonal, upper=False)

    def triu(self, diagonal: int = 0) -> Tensor:
        """Zeros below diagonal `diagonal` of the last two axes."""
        return self._triangle(diagonal, upper=True)

    def _triangle(self, diagonal: int, upper: bool) -> Tensor:
        if self.ndim < 2:
            raise ShapeError(f"{'triu' if upper else 'tril'}: needs at least 2 axes, got "
                             f"{self.shape}")
        return self.tracer.op("triangle", [self], diagonal=int(diagonal), upper=upper)

    def _extreme(self, kind: str, dim, keepdim: bool, what: str) -> Tensor:
        """max / min over the axes `dim` (None: all) as one reduce_max: several axes are moved
        to the end and merged first."""
        axes = _dims(dim, self.ndim, what)
        if self.ndim == 0:
            return self
        if len(axes) == 1:
            y = self.tracer.op("reduce_max", [self], dim=axes[0], kind=kind)
        else:
            rest = [i for i in range(self.ndim) if i not in axes]
            moved = self.permute(*rest, *axes)
            merged = moved.reshape(*(self.shape[i] for i in rest), -1)
            y = self.tracer.op("reduce_max", [merged], dim=len(rest), kind=kind)
        if keepdim:
            y = y.reshape(*(1 if i in axes else d for i, d in enumerate(self.shape)))
        return y

    def amax(self, dim=(), keepdim: bool = False) -> Tensor:
        """Maximum over `dim` (int, tuple; () or None: all axes); the gradient is split
        evenly between tied maxima."""
        return self._extreme("max", dim, keepdim, "amax")

    def amin(self, dim=(), keepdim: bool = False) -> Tensor:
        """Minimum over `dim`, as amax."""
        return self._extreme("min", dim, keepdim, "amin")

    def max(self, dim=None, keepdim: bool = False):
        """The maximum of all elements; with an int `dim` (values, indices) along it, as
        torch.return_types.max; with a tensor, torch.maximum."""
        return self._max_or_min(dim, keepdim, largest=True)

    def min(self, dim=None, keepdim: bool = False):
        """The minimum of all elements; with `dim` (values, indices); with a tensor,
        torch.minimum."""
        return self._max_or_min(dim, keepdim, largest=False)

    def _max_or_min(self, dim, keepdim: bool, largest: bool):
        from .. import return_types
        if dim is None:
            return self._extreme("max" if largest else "min", None, False, "max")
        if not isinstance(dim, numbers.Integral):
            return self.maximum(dim) if largest else self.minimum(dim)
        d = _dim(dim, self.ndim, "max" if largest else "min")
        values, indices = self.topk(1, d, largest)
        if not keepdim:
            values, indices = values.squeeze(d), indices.squeeze(d)
        return (return_types.max if largest else return_types.min)(values, indices)

    def argmax(self, dim=None, keepdim: bool = False) -> Tensor:
        """The int64 index of the maximum along `dim` (None: of the flattened tensor); the
        first one of ties. No gradient."""
        return self._arg(dim, keepdim, largest=True)

    def argmin(self, dim=None, keepdim: bool = False) -> Tensor:
        """The int64 index of the minimum along `dim`, as argmax."""
        return self._arg(dim, keepdim, largest=False)

    def _arg(self, dim, keepdim: bool, largest: bool) -> Tensor:
        if dim is None:
            i = self.reshape(-1).topk(1, 0, largest).indices
            return i.reshape(*(1,) * self.ndim) if keepdim else i.reshape()
        d = _dim(dim, self.ndim, "argmax" if largest else "argmin")
        i = self.topk(1, d, largest).indices
        return i if keepdim else i.squeeze(d)

    def topk(self, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
        """(values, indices) of the k largest (or smallest) elements along `dim`, as
        torch.return_types.topk; always in order (`sorted` False allows any order), ties by
        the lower index first."""
        from .. import return_types
        d = _dim(dim, self.ndim, "topk")
        if self.ndim == 0:          # torch reads a 0-d tensor as one element along dim 0
            values, indices = self.reshape(1).topk(k, 0, largest)
            return return_types.topk(values.reshape(), indices.reshape())
        values, indices = self.tracer.op_all("topk", [self], dim=d, k=int(k),
                                             largest=bool(largest))
        return return_types.topk(values, indices)

    def sort(self, dim: int = -1, descending: bool = False, stable: bool = False):
        """(values, indices) sorted along `dim`, as torch.return_types.sort; ties keep index
        order (stable)."""
        from .. import return_types
        d = _dim(dim, self.ndim, "sort")
        # a 0-d tensor is one element along dim 0 (as topk reads it)
        values, indices = self.topk(self.shape[d] if self.ndim else 1, d, largest=descending)
        return return_types.sort(values, indices)

    def var(self, dim=None, unbiased=None, keepdim: bool = False, *, correction=None):
        """Variance over `dim`: the sum of squared deviations from the mean divided by
        N - correction (correction 1 unless unbiased=False or given)."""
        if isinstance(dim, bool):               # x.var(False): the old unbiased argument
            dim, unbiased = None, dim
        if correction is None:
            correction = 0 if unbiased is False else 1
        axes = _dims(dim, self.ndim, "var")
        count = math.prod(self.shape[a] for a in axes)
        dev = self - self.mean(axes, keepdim=True)
        return (dev * dev).sum(axes, keepdim) / float(max(count - correction, 0))

    def std(self, dim=None, unbiased=None, keepdim: bool = False, *, correction=None):
        """Square root of var (same arguments)."""
        return self.var(dim, unbiased, keepdim, correction=correction) ** 0.5

    def logsumexp(self, dim, keepdim: bool = False) -> Tensor:
        """log(sum(exp(x))) over `dim`, stably: x - log_softmax(x) is that value at every
        position of the reduced axes, so the first one is read."""
        axes = _dims(dim, self.ndim, "logsumexp")
        rest = [i for i in range(self.ndim) if i not in axes]
        rows = self.permute(*rest, *axes).reshape(*(self.shape[i] for i in rest), -1)
        first = rows.narrow(-1, 0, 1)
        y = (first - rows.log_softmax(-1).narrow(-1, 0, 1)).reshape(*first.shape[:-1])
        if keepdim:
            y = y.reshape(*(1 if i in axes else d for i, d in enumerate(self.shape)))
        return y

    def cumsum(self, dim: int, dtype=None) -> Tensor:
        """Running sums along `dim`."""
        if dtype is not None and dtype != self.dtype:
            self._unsupported(f"cumsum with dtype={dtype} (cast first)")
        d = _dim(dim, self.ndim, "cumsum")
        if self.ndim == 0:          # one element: its own running sum
            return self
        return self.tracer.op("cumsum", [self], dim=d, reverse=False)

    def gather(self, dim: int, index) -> Tensor:
        """y[p] = x[p with axis `dim` replaced by index[p]], as torch.gather."""
        index = self._coerce(index, "gather")
        if self.ndim == 0:          # torch reads a 0-d tensor as one element along dim 0
            _dim(dim, 1, "gather")
            y = self.reshape(1).gather(0, index.reshape(1) if index.ndim == 0 else index)
            return y.reshape(()) if index.ndim == 0 else y
        d, x = _dim(dim, self.ndim, "gather"), self
        if index.ndim != self.ndim:
            raise ShapeError(f"gather: index {index.shape} must have the rank of {self.shape}")
        for axis, n in enumerate(index.shape):      # the op takes x's extent off dim
            if axis != d and n != x.shape[axis]:
                x = x.narrow(axis, 0, n)
        return self.tracer.op("gather", [x, index], dim=d)

    def scatter_add(self, dim: int, index, src) -> Tensor:
        """x with src[p] added at x[p with axis `dim` replaced by index[p]] for every p of
        index (out-of-place torch.scatter_add; repeated indices add up). index has x's shape
        off `dim`; src is read over index's shape. Gradient: dy to x, dy gathered to src."""
        if self.ndim == 0:
            return self._one_element("scatter_add", dim, index, src)
        d = _dim(dim, self.ndim, "scatter_add")
        return self + self._scattered(d, self._coerce(index, "scatter_add"), src,
                                      "scatter_add")

    def scatter(self, dim: int, index, src=None, *, value=None, reduce=None) -> Tensor:
        """x with the places index names along `dim` replaced by src[p] (a tensor) or by
        `value` (a number, also accepted as src), out-of-place torch.scatter. torch leaves
        which value lands where an index repeats unspecified; here src's values there add
        up, so give distinct indices with a tensor src."""
        if reduce is not None:
            self._unsupported(f"Tensor.scatter with reduce={reduce!r} (use scatter_add, or "
                              "scatter_reduce's out-of-place forms)")
        src = value if src is None else src
        if src is None:
            raise TypeError("scatter: give src (a tensor or a number) or value")
        if self.ndim == 0:
            return self._one_element("scatter", dim, index, src)
        d = _dim(dim, self.ndim, "scatter")
        index = self._coerce(index, "scatter")
        ones = self.tracer.op("fill", [], value=1.0, shape=index.shape, dtype=self.value.dtype)
        hit = self._scattered(d, index, ones, "scatter") > 0
        if _is_scalar(src):
            return self.masked_fill(hit, src)
        return self._scattered(d, index, src, "scatter").where(hit, self)

    def _one_element(self, what: str, dim: int, index, src) -> Tensor:
        """scatter / scatter_add of a 0-d tensor: torch reads it, a 0-d index and a 0-d src
        as one element along dim 0."""
        _dim(dim, 1, what)
        index = self._coerce(index, what)
        as_1d = lambda t: t.reshape(1) if isinstance(t, Tensor) and t.ndim == 0 else t  # noqa
        if not _is_scalar(src):
            src = as_1d(self._coerce(src, what))
        return getattr(self.reshape(1), what)(0, as_1d(index), src).reshape(())

    def _scattered(self, d: int, index: Tensor, src, what: str) -> Tensor:
        """src's values over index's shape summed into zeros of x's shape at the places
        index names along axis d (the `gather_grad` op)."""
        src = self._coerce(src, what)
        if index.ndim != self.ndim or any(n > self.shape[a] for a, n in
                                          enumerate(index.shape) if a != d):
            raise ShapeError(f"{what}: index {index.shape} must have the rank of {self.shape} "
                             f"and fit in it off dim {d}")
        if src.ndim != index.ndim or any(s < n for s, n in zip(src.shape, index.shape)):
            raise ShapeError(f"{what}: src {src.shape} must cover index {index.shape}")
        for axis, n in enumerate(index.shape):
            if src.shape[axis] != n:
                src = src.narrow(axis, 0, n)
        # an index shorter than x off d reaches the leading part of those axes only: scatter
        # into that part, then join zeros for the rest
        part = tuple(self.shape[a] if a == d else n for a, n in enumerate(index.shape))
        y = self.tracer.op("gather_grad", [src, index], input_shape=part, dim=d)
        for axis, (n, full) in enumerate(zip(part, self.shape)):
            if n < full:
                rest = y.new_zeros(tuple(full - n if a == axis else m
                                         for a, m in enumerate(y.shape)))
                y = self.tracer.op("concat", [y, rest], dim=axis)
        return y

    def prod(self, dim=None, keepdim: bool = False, *, dtype=None) -> Tensor:
        """The product over `dim` (None: of all elements), as a tree of elementwise products
        of the axis' halves: log2(n) multiply nodes, and a gradient exact where elements are
        zero (the product of the others)."""
        if dtype is not None and dtype_name(dtype) != self.value.dtype:
            self._unsupported(f"Tensor.prod with dtype={dtype} (cast first)")
        if dim is None:
            return self.reshape(-1)._prod_axis(0).reshape()
        d = _dim(dim, self.ndim, "prod")
        if self.ndim == 0:
            return self
        y = self._prod_axis(d)
        return y if keepdim else y.squeeze(d)

    def _prod_axis(self, d: int) -> Tensor:
        """The product along axis d, kept with length 1."""
        if self.shape[d] == 0:
            shape = tuple(1 if i == d else n for i, n in enumerate(self.shape))
            return self.tracer.op("fill", [], value=1, shape=shape, dtype=self.value.dtype)
        y = self
        while y.shape[d] > 1:
            n, half = y.shape[d], y.shape[d] // 2
            pairs = y.narrow(d, 0, half) * y.narrow(d, n - half, half)
            # an odd length leaves its middle element to the next round
            y = pairs if n % 2 == 0 else \
                self.tracer.op("concat", [pairs, y.narrow(d, half, 1)], dim=d)
        return y

    def median(self, dim=None, keepdim: bool = False):
        """The lower median (of an even count the smaller middle value), as torch.median:
        of all elements, or (values, indices) along an int `dim` as
        torch.return_types.median. The gradient goes to the element picked."""
        from .. import return_types
        if dim is None:
            return self.reshape(-1).median(0).values
        d = _dim(dim, self.ndim, "median")
        if self.ndim == 0:
            return return_types.median(self, self.new_zeros((), dtype="int64"))
        k = (self.shape[d] + 1) // 2            # the k smallest end at the lower median
        values, indices = self.topk(k, d, largest=False)
        values, indices = values.narrow(d, k - 1, 1), indices.narrow(d, k - 1, 1)
        if not keepdim:
            values, indices = values.squeeze(d), indices.squeeze(d)
        return return_types.median(values, indices)

    def norm(self, p="fro", dim=None, keepdim: bool = False, dtype=None) -> Tensor:
        """The vector p-norm over `dim` (None: all elements), p a number, +-inf or "fro" (the
        2-norm of the elements, over any dims), as torch.norm's vector norms; an all-zero
        slice has gradient zero, as in torch. Matrix norms ("nuc") need an SVD: refused."""
        if p == "fro":
            p = 2
        elif isinstance(p, str):
            self._unsupported(f"norm with p={p!r} (a matrix norm: it needs an SVD)")
        if dtype is not None:
            return self.to(dtype).norm(p, dim, keepdim)
        return _vector_norm(self, p, dim, keepdim, eps=0.0)

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
        # The ops work over the last axis: move `dim` there and back. A 0-d tensor is one row
        # of one element; an empty one has no rows to normalise (the result is itself).
        d = _dim(dim, self.ndim, op)
        if self.ndim == 0:
            return self.reshape(1)._last_axis(op, 0).reshape()
        if self.value.size == 0:
            return self
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

    def _truth(self) -> Tensor:
        """This tensor as a bool mask: a non-bool one compared with zero (NaN is true)."""
        return self if self.dtype == "bool" else self != 0

    def logical_and(self, other) -> Tensor:
        """x and y elementwise; non-bool operands are compared with zero first, as
        torch.logical_and (the `&` operator takes bool masks only)."""
        return self._truth()._logical(self._coerce(other, "logical_and")._truth(), "and")

    def logical_or(self, other) -> Tensor:
        return self._truth()._logical(self._coerce(other, "logical_or")._truth(), "or")

    def logical_xor(self, other) -> Tensor:
        return self._truth()._logical(self._coerce(other, "logical_xor")._truth(), "xor")

    def logical_not(self) -> Tensor:
        """not x; a non-bool x is compared with zero first, as torch.logical_not."""
        x = self if self.dtype == "bool" else self != 0
        return self.tracer.op("logical_not", [x])

    def __and__(self, other) -> Tensor:
        return self._logical(other, "and")

    def __or__(self, other) -> Tensor:
        return self._logical(other, "or")

    def __xor__(self, other) -> Tensor:
        return self._logical(other, "xor")

    __rand__, __ror__, __rxor__ = __and__, __or__, __xor__

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
        try:
            dtype = dtype_name(dtype)
        except UnsupportedOpError as err:       # the message gains the module path
            raise UnsupportedOpError(f"{err} (called in {self.tracer.where()})") from None
        if dtype == self.dtype:
            return self
        return self.tracer.op("cast", [self], dtype=dtype)

    def _memory_format(self, memory_format, what: str) -> None:
        """Accept torch's preserve_format and contiguous_format, by name: a traced tensor's
        layout is the planner's (compile_*(memory_format=...)), so both change nothing.
        Others (channels_last) would ask for a layout per tensor, which stepgraph lacks."""
        if memory_format is not None and str(memory_format).removeprefix("torch.") not in (
                "preserve_format", "contiguous_format"):
            self._unsupported(f"{what} with memory_format={memory_format} (the layout is "
                              "compile_train_step(memory_format=...)'s)")

    def to(self, *args, dtype=None, device=None, non_blocking=False, copy=False,
           memory_format=None) -> Tensor:
        """A cast to `dtype` or to another tensor's dtype; a device argument ("cuda", "cpu",
        a device object) changes nothing: a traced tensor lives where the step runs."""
        self._memory_format(memory_format, "Tensor.to")
        for a in args:
            if isinstance(a, bool):             # positional non_blocking, copy
                continue
            if isinstance(a, Tensor):
                dtype = a.dtype
            elif not _is_device(a):
                dtype = a
        return self if dtype is None else self._cast(dtype)

    def type(self, dtype=None, non_blocking: bool = False):
        """With a dtype, a cast to it (as `to`); without, torch's type string of this
        tensor ("torch.FloatTensor")."""
        if dtype is not None:
            return self._cast(dtype)
        names = {"float32": "Float", "float64": "Double", "int64": "Long", "int32": "Int",
                 "uint8": "Byte", "bool": "Bool", BF16: "BFloat16"}
        return f"torch.{names[self.value.dtype]}Tensor"

    def type_as(self, other) -> Tensor:
        return self._cast(other.dtype)

    def float(self, memory_format=None) -> Tensor:
        self._memory_format(memory_format, "Tensor.float")
        return self._cast("float32")

    def double(self, memory_format=None) -> Tensor:
        self._memory_format(memory_format, "Tensor.double")
        return self._cast("float64")

    def bfloat16(self) -> Tensor:
        return self._cast(BF16)

    def half(self) -> Tensor:
        self._unsupported(f"Tensor.half (float16 is not an IR dtype; {FLOAT16_HINT})")

    def long(self, memory_format=None) -> Tensor:
        self._memory_format(memory_format, "Tensor.long")
        return self._cast("int64")

    def int(self, memory_format=None) -> Tensor:
        self._memory_format(memory_format, "Tensor.int")
        return self._cast("int32")

    def bool(self, memory_format=None) -> Tensor:
        self._memory_format(memory_format, "Tensor.bool")
        return self._cast("bool")

    # ---- what cannot be traced ----
    def __getattr__(self, name: str):
        # Only reached for attributes Tensor lacks: the torch.Tensor methods stepgraph has no op
        # for. Private and dunder names stay AttributeErrors (copy, pickle, hasattr probes).
        if name.startswith("_") or name in ("value", "tracer", "array"):
            raise AttributeError(name)
        from ..errors import ALTERNATIVES
        alternative = ALTERNATIVES.get(f"torch.Tensor.{name}")
        self._unsupported(f"Tensor.{name}" + (f" (use {alternative})" if alternative else ""))

    def _unsupported(self, op: str):
        raise UnsupportedOpError(f"{op} is not supported by stepgraph (called in "
                                 f"{self.tracer.where()})")

    def __iter__(self):
        self._unsupported("iteration over a tensor")

    def __repr__(self):
        if self.is_eager or getattr(self.tracer, "phase", None) == "done":   # a stepped pass
            body = np.array2string(self.numpy(), separator=", ", prefix="tensor(",
                                   precision=4)
            dtype = "" if self.value.dtype in ("float32", "int64") else f", dtype={self.dtype!r}"
            return f"tensor({body}{dtype})"
        return f"Tensor({self.value!r})"


# Tracers whose module forward is running, innermost last (Tracer.module_scope pushes).
_ACTIVE: list[Tracer] = []


def current_tracer() -> Tracer | None:
    """The tracer of the module forward being traced right now, else None. Tensor factories
    with no tensor argument (stepgraph.functions.factories) record into it."""
    return _ACTIVE[-1] if _ACTIVE else None


class Tracer:
    """Records nodes into `graph`. Parameters and state become external values once each."""

    def __init__(self, seed: int = 0, training: bool = True, frozen: frozenset = frozenset(),
                 rng_key: str = "optimizer.step"):
        self.graph = Graph()
        self.frozen = frozen                       # ids of Parameters traced as constants
        self.seed = seed
        self.training = training
        self.rng_key = rng_key                     # the state value random draws read
        self.param_values: dict[int, Value] = {}   # id(Parameter) -> Value
        self.parameters: list[Parameter] = []
        self.buffer_values: dict[int, Value] = {}  # id(Buffer) -> its state Value
        self._rng_step: Value | None = None
        self._dropout_sites = 0
        self.label = ""                            # module label for recorded nodes
        self.module_path: list[str] = []           # paths of the modules being called
        self.module_paths: dict[int, str] = {}     # id(module) -> path, set by the root call
        self._constants: dict[int, tuple] = {}     # id(eager Tensor) -> (it, constant Value)
        # Values computed inside torch.utils.checkpoint regions: the backward recomputes them
        # instead of keeping them (compile/recompute.py).
        self.recomputed: set[Value] = set()

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
        """The device step counter dropout and random draws read: a train trace's is shared
        with the optimizer (`optimizer.step`), a predict trace's is the predictor's own
        (`rng_key`, compile/build.py)."""
        if self._rng_step is None:
            self._rng_step = self.state((), "int64", self.rng_key)
        return self._rng_step

    @property
    def rng_counter(self) -> Value | None:
        """The counter `rng_step` made, or None when nothing traced so far draws."""
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
        return self.op_all(op, inputs, **attrs)[0]

    def op_all(self, op: str, inputs: list, **attrs) -> list[Tensor]:
        """As `op`, every output. Under no_grad (grad_mode) each output of a training trace
        passes through a stop_gradient view, so the backward stops there (an eval trace, as
        compile_predict's, has no backward: no views that would split fusable patterns)."""
        values = self.emit(op, [self._value(t) for t in inputs], **attrs)
        if self.training and not is_grad_enabled():
            values = [self.emit("stop_gradient", [v])[0] for v in values]
        return [Tensor(v, self) for v in values]

    def _value(self, t) -> Value:
        """The Value of an op input: a tensor's, an eager tensor's constant, or `t` itself."""
        if not isinstance(t, Tensor):
            return t
        return self.constant(t) if t.is_eager else t.value

    def constant(self, t: Tensor) -> Value:
        """Eager tensor `t` as a `constant` node's output, once per tensor: its values at
        trace time become part of the graph."""
        held = self._constants.get(id(t))
        if held is None:
            data = Constant(np.array(t.array, order="C"))   # its values now, 0-d kept
            held = self._constants[id(t)] = (t, self.emit("constant", [], data=data,
                                                          dtype=t.value.dtype)[0])
        return held[1]


class Constant:
    """The array of a `constant` node (attrs data). Equal only to itself, so passes that
    compare attrs never compare arrays; its repr is short, for dumps and profiles."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __repr__(self):
        return f"Constant({self.array.dtype}{list(self.array.shape)})"


class EagerTracer:
    """Runs ops at once instead of recording them: what tensors made outside a traced
    forward use. `op` checks the op's shape rule, then runs its NumPy reference on the
    inputs' arrays. An op that also reads a traced tensor is recorded into that tensor's
    trace instead (the eager inputs becoming constants)."""

    training = False
    seed = 0

    def __init__(self):
        self._dropout_sites = 0

    def where(self) -> str:
        return "eager code (outside a traced forward)"

    def rng_step(self) -> Tensor:
        """Eager dropout's step counter: always 0; each call draws at a new site instead,
        so every eager dropout gets a fresh mask."""
        return tensor_of(np.zeros((), np.int64))

    def next_dropout_site(self) -> int:
        self._dropout_sites += 1
        return self._dropout_sites - 1

    def op(self, op: str, inputs: list, **attrs) -> Tensor:
        return self.op_all(op, inputs, **attrs)[0]

    def op_all(self, op: str, inputs: list, **attrs) -> list[Tensor]:
        traced = next((t.tracer for t in inputs if isinstance(t, Tensor) and not t.is_eager),
                      None)
        if traced is not None:
            return traced.op_all(op, inputs, **attrs)
        from ..backends import get_backend
        from ..compile.plan import VIEW_OPS

        values = [t.value for t in inputs]
        outs = [Value(shape, dtype) for shape, dtype in infer_outputs(op, values, attrs)]
        if op in VIEW_OPS:          # as a plan runs them: the input's array, reshaped
            return [Tensor(outs[0], self, inputs[0].array.reshape(outs[0].shape))]
        node = Node(op, values, outs, attrs, OPS[op].mutates(attrs), "eager")
        arrays = [np.empty(v.shape, storage_dtype(v.dtype)) for v in outs]
        get_backend("cpu").run_node(node, [t.array for t in inputs], arrays)
        return [Tensor(v, self, a) for v, a in zip(outs, arrays)]

    def param(self, p) -> Tensor:
        """A Parameter's current values as an eager tensor (a copy)."""
        return tensor_of(p.numpy())

    buffer = param


EAGER = EagerTracer()


def tensor_of(array: np.ndarray) -> Tensor:
    """An eager tensor holding `array` (storage dtype; uint16 is bfloat16 bits), not copied."""
    array = np.asarray(array)
    return Tensor(Value(array.shape, ir_dtype(array.dtype)), EAGER, array)
