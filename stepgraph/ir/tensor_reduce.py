"""Tensor reductions: sum / mean / prod, max / min / amax / amin / aminmax / argmax /
argmin, topk / sort / median, var / std / logsumexp, count_nonzero, cumsum and the vector
norms (`norm`, dist, renorm, and `_vector_norm` for F.normalize). Attached to Tensor when
this module is imported (ir/tensor.py `attach_methods`).
"""
from __future__ import annotations

import math
import numbers

from ..errors import ShapeError
from .tensor import Tensor, _dim, _dims, _is_scalar, attach_methods
from .tensor_cast import dtype_name


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


class _ReduceMethods:
    """Tensor's reductions (module doc)."""

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

    # ---- extremes, order and statistics along dims ----
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

    def any(self, dim=None, keepdim: bool = False) -> Tensor:
        """True where some element along `dim` (None: all) is nonzero, NaN included, as
        torch.any (a bool tensor)."""
        return self._truth()._cast("float32").amax(() if dim is None else dim, keepdim) > 0

    def all(self, dim=None, keepdim: bool = False) -> Tensor:
        """True where every element along `dim` (None: all) is nonzero, as torch.all."""
        return self._truth()._cast("float32").amin(() if dim is None else dim, keepdim) > 0

    def aminmax(self, *, dim=None, keepdim: bool = False):
        """(min, max) over `dim` (an int; None: every element), as torch.aminmax: a
        torch.return_types.aminmax with `.min` and `.max`; keepdim with dim None keeps every
        axis with length 1, as torch's."""
        if dim is not None and not isinstance(dim, numbers.Integral):
            raise TypeError(f"aminmax: dim must be an int or None, got {dim!r}")
        from .. import return_types
        return return_types.aminmax(self.amin(() if dim is None else dim, keepdim),
                                    self.amax(() if dim is None else dim, keepdim))

    def count_nonzero(self, dim=None) -> Tensor:
        """The int64 count of nonzero elements (NaN counts) over `dim` (None: all; an int or a
        tuple), as torch.count_nonzero. Summed in float32 (the cuda kernels have no int64
        sums): exact for counts below 2**24."""
        return self._truth()._cast("float32").sum(dim)._cast("int64")

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

    def dist(self, other, p=2) -> Tensor:
        """The p-norm of self - other (broadcast) over every element, as torch.dist."""
        return _vector_norm(self - self._coerce(other, "dist"), p, None, False, eps=0.0)

    def renorm(self, p, dim: int, maxnorm) -> Tensor:
        """Each slice along `dim` whose p-norm (over the other axes) exceeds maxnorm scaled
        to norm maxnorm, as torch.renorm: by maxnorm / (norm + 1e-7), torch's factor; the
        others as they are. The factor is differentiated, as torch's backward does."""
        d = _dim(dim, self.ndim, "renorm")
        if not _is_scalar(p) or p <= 0:
            raise ShapeError(f"renorm: non-positive-norm not supported (p={p!r})")
        if self.ndim <= 1:
            raise ShapeError(f"renorm: input needs at least 2 dimensions, got {self.ndim} "
                             "dimensions")
        rest = tuple(i for i in range(self.ndim) if i != d)
        norm = _vector_norm(self, p, rest, True, eps=0.0)
        scale = (maxnorm / (norm + 1e-7)).masked_fill(norm <= maxnorm, 1.0)
        return self * scale


def attach(cls: type) -> None:
    """Give Tensor the reductions of this module."""
    attach_methods(_ReduceMethods, cls)


attach(Tensor)
