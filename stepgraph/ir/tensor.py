"""Tensor, the value modules see: symbolic while a forward is traced, eager outside one.

This module is its core: the Value and the tracer it holds, the shape / dtype / device
properties, reading values back (numpy, item, tolist, truth), backward (a training script's
hook), repr, and the refusal of every torch.Tensor method it lacks. The methods come in
families, each in a module of its own that attaches them to Tensor when imported
(`attach_methods`; stepgraph/__init__.py imports every family):
tensor_math (arithmetic, products), tensor_unary (elementwise math, activations, clamp),
tensor_compare (comparisons, logic, masks), tensor_shape (views, axes, slicing),
tensor_select (x[...], index_select, gather, scatter), tensor_reduce (sums, extremes,
topk / sort, statistics, norms), tensor_cast (dtypes, to), tensor_new (new_*, clone),
tensor_inplace (add_, +=, fill_, copy_), tensor_indexing (x[i] = v, eager reads, format) and
tensor_random (random draws). The tracers that record or run ops are ir/trace.py's.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from ..dtypes import as_dtype     # imports only errors and ir.graph: no cycle
from ..errors import ShapeError, UnsupportedOpError
from ..loop import hooks as loop_hooks    # imports nothing: a training script's backward()
from .graph import DTYPES, Value


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


class Size(tuple):
    """A tensor's shape (torch.Size): a tuple of ints with numel()."""

    def numel(self) -> int:
        return math.prod(self)

    def __repr__(self):
        return f"torch.Size({list(self)})"


# What every class body holds (__module__, __dict__, __doc__, ...): not methods.
_CLASS_BOOKKEEPING = frozenset(vars(type("Empty", (), {})))


def attach_methods(methods: type, cls: type) -> None:
    """Give `cls` (Tensor) what the body of class `methods` defines, as if written in its own
    body: functions and properties under the names they are bound to there (aliases such as
    `view = reshape` included), their qualified names `Tensor.<name>`. A method family is such
    a class, so its aliases and methods named like builtins (int, max) stay in a class body,
    where they shadow nothing."""
    prefix = methods.__qualname__ + "."
    for name, attr in vars(methods).items():
        if name in _CLASS_BOOKKEEPING:
            continue
        fn = attr.fget if isinstance(attr, property) else attr
        qualname = getattr(fn, "__qualname__", "")
        if qualname.startswith(prefix):
            fn.__qualname__ = f"{cls.__qualname__}.{qualname[len(prefix):]}"
        setattr(cls, name, attr)
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

    def __init__(self, value: Value, tracer, array=None):
        # tracer: ir/trace.py's Tracer recording ops, or EAGER (array holds the values)
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
        if getattr(self.tracer, "backward", None) is None or loop_hooks.SESSION is None:
            from ..errors import ALTERNATIVES
            self._unsupported("Tensor.backward outside a training loop with a torch-style "
                              "optimizer (make one with model.parameters(), or use "
                              f"{ALTERNATIVES['torch.Tensor.backward']})")
        if gradient is not None or create_graph or inputs is not None:
            self._unsupported("Tensor.backward(gradient=, create_graph=True or inputs=): a "
                              "captured loop differentiates a scalar loss")
        loop_hooks.SESSION.backward(self.tracer, self)

    def detach(self) -> Tensor:
        """The same values, cut from the backward (a stop_gradient view)."""
        return self.tracer.op("stop_gradient", [self])

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

    # ---- operands ----
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
        if isinstance(other, np.ndarray) and self.is_eager and str(other.dtype) in DTYPES \
                and other.dtype != np.uint16:     # uint16 would read as bfloat16 bits
            # torch takes a NumPy operand as a tensor of it (`sd[k] - before[k]`, a snapshot
            # taken with .numpy()); the reverse already works: NumPy reads the tensor
            return Tensor(Value(other.shape, str(other.dtype)), self.tracer, other)
        raise UnsupportedOpError(f"{op} with a {type(other).__name__} operand is not supported "
                                 f"(in {self.tracer.where()}); use a traced tensor or a "
                                 "Python number")

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
        """The slices along the first axis, as torch iterates (`unbind(0)`): an eager tensor's
        values (`[r.item() for r in torch.linspace(...)]` in a constructor) or a traced
        tensor's views, one per index of its static first axis."""
        if not self.shape:
            raise TypeError("iteration over a 0-d tensor")
        return iter(self.unbind(0))

    def __repr__(self):
        if self.is_eager or getattr(self.tracer, "phase", None) == "done":   # a stepped pass
            body = np.array2string(self.numpy(), separator=", ", prefix="tensor(",
                                   precision=4)
            dtype = "" if self.value.dtype in ("float32", "int64") else f", dtype={self.dtype!r}"
            return f"tensor({body}{dtype})"
        return f"Tensor({self.value!r})"
