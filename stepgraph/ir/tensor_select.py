"""Tensor elements picked by position: x[...] of a traced tensor (ints, slices, None, `...`
and one integer tensor), index_select, gather, take_along_dim, and the out-of-place scatter /
scatter_add.
Attached to Tensor when this module is imported (ir/tensor.py `attach_methods`);
ir/tensor_indexing.py adds index assignment and an eager tensor's NumPy reads on top.
"""
from __future__ import annotations

import numbers

from ..errors import ShapeError
from .tensor import Tensor, _dim, _is_scalar, attach_methods


class _SelectMethods:
    """Tensor's selection by position (module doc)."""

    # ---- indexing ----
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

    # ---- gather and scatter along a dim ----
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

    def take_along_dim(self, indices, dim=None) -> Tensor:
        """Elements at `indices` along `dim`, as torch.take_along_dim: gather after x and
        indices are broadcast to each other off `dim` (dim None: of the flattened tensor);
        a negative index counts from the end, as torch's (gather's would not)."""
        indices = self._coerce(indices, "take_along_dim")
        if indices.dtype not in ("int64", "int32"):
            raise ShapeError(f"take_along_dim(): dtype of indices should be Long but got "
                             f"{indices.dtype}")
        if dim is None:
            return self.reshape(-1).take_along_dim(indices.reshape(-1), 0)
        d = _dim(dim, self.ndim, "take_along_dim")
        if indices.ndim != self.ndim:
            raise ShapeError(f"torch.take_along_dim(): input and indices should have the same "
                             f"number of dimensions, but got {self.ndim} dimensions for input, "
                             f"and {indices.ndim} dimensions for indices")
        shape = []
        for axis, (n, m) in enumerate(zip(self.shape, indices.shape)):
            if axis != d and n != m and 1 not in (n, m):
                raise ShapeError(f"take_along_dim: input {list(self.shape)} and indices "
                                 f"{list(indices.shape)} do not broadcast at dim {axis}")
            shape.append(max(n, m) if n and m else 0)
        x = self.expand(*(n if a == d else s for a, (n, s) in enumerate(zip(self.shape,
                                                                             shape))))
        # the wrap and the broadcast in float32 (the cuda kernels have no int64 arithmetic or
        # expand): exact for any index below 2**24 in magnitude
        wrapped = indices._cast("float32")
        wrapped = wrapped + (wrapped < 0)._cast("float32") * self.shape[d]
        index = wrapped.expand(*(m if a == d else s for a, (m, s) in
                                 enumerate(zip(indices.shape, shape))))
        return x.gather(d, index._cast(indices.dtype))

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


def attach(cls: type) -> None:
    """Give Tensor the selection by position of this module."""
    attach_methods(_SelectMethods, cls)


attach(Tensor)
