"""Tensor shape methods: views (reshape / view, flatten, unflatten, unsqueeze, squeeze,
view_as), axis orders (permute, transpose, .T, movedim), broadcasts and tiles (expand,
broadcast_to, repeat, tile, repeat_interleave), slicing along an axis (narrow, select, split,
tensor_split, chunk, unbind, diff), roll, flip / flipud / fliplr / rot90, diagonals (diagonal,
diag) and tril / triu. Attached to Tensor when this module is imported (ir/tensor.py
`attach_methods`).
"""
from __future__ import annotations

import math
import numbers
import operator

import numpy as np

from ..errors import ShapeError
from .promotion import result_type
from .tensor import Tensor, _dim, _dims, _is_scalar, _shape_args, attach_methods
from .trace import tensor_of


class _ShapeMethods:
    """Tensor's shape methods (module doc)."""

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

    def tensor_split(self, indices_or_sections, dim: int = 0) -> tuple[Tensor, ...]:
        """Pieces along `dim`, as torch.tensor_split: an int n gives n pieces, the first
        size % n one longer (NumPy's array_split); a list of indices (or a 1-d integer
        tensor of known values) cuts before each, indices past the end giving empty pieces."""
        d = _dim(dim, self.ndim, "tensor_split")
        size = self.shape[d]
        cuts = indices_or_sections
        if isinstance(cuts, Tensor):        # torch takes a 0-d tensor as sections too
            if cuts.dtype.is_floating_point or cuts.ndim > 1:
                raise ShapeError("tensor_split expected tensor_indices_or_sections to have "
                                 f"integral dtype and be 0-d or 1-d, got {cuts.dtype} of "
                                 f"{list(cuts.shape)}")
            if not cuts.is_eager:
                self._unsupported("tensor_split with a traced tensor of indices_or_sections "
                                  "(the pieces' sizes would depend on its values; pass a list "
                                  "of ints or an eager tensor)")
            cuts = int(cuts.item()) if cuts.ndim == 0 else [int(i) for i in cuts.tolist()]
        if isinstance(cuts, numbers.Integral):
            n = int(cuts)
            if n <= 0:
                raise ShapeError(f"tensor_split: number of sections must be greater than 0, "
                                 f"but got {n}")
            lengths = [size // n + (i < size % n) for i in range(n)]
            cuts = [sum(lengths[:i + 1]) for i in range(n - 1)]
        bounds = [0, *(int(c) for c in cuts), size]
        # torch clamps each cut into [0, size]; a piece ends no earlier than it starts
        bounds = [min(max(b if b >= 0 else b + size, 0), size) for b in bounds]
        return tuple(self.narrow(d, lo, max(hi - lo, 0))
                     for lo, hi in zip(bounds, bounds[1:]))

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

    def select(self, dim: int, index: int) -> Tensor:
        """The slice at `index` (negative counts from the end) along `dim`, without that
        axis, as torch.select (x[..., index, ...])."""
        d = _dim(dim, self.ndim, "select")
        if self.ndim == 0:
            raise IndexError("select() cannot be applied to a 0-dim tensor.")
        n, i = self.shape[d], operator.index(index)
        if not -n <= i < n:
            raise IndexError(f"select(): index {i} out of range for tensor of size "
                             f"{list(self.shape)} at dimension {d}")
        return self.narrow(d, i % n, 1).squeeze(d)

    def diff(self, n: int = 1, dim: int = -1, prepend=None, append=None) -> Tensor:
        """The n-th forward difference along `dim`, after prepend and append (tensors of
        x's rank, joined along dim) are added, as torch.diff: each pass x[1:] - x[:-1]
        (logical xor for bool tensors). n = 0 gives the input as it is (prepend and append
        not joined), as torch's."""
        if self.ndim == 0:
            raise ShapeError("diff expects input to be at least one-dimensional")
        if int(n) < 0:
            raise ShapeError(f"order must be non-negative but got {int(n)}")
        if int(n) == 0:
            return self
        d = _dim(dim, self.ndim, "diff")
        parts = []
        for extra in (prepend, self, append):
            if extra is None:
                continue
            if _is_scalar(extra):
                raise TypeError(f"diff(): argument 'prepend' / 'append' must be Tensor, not "
                                f"{type(extra).__name__}")
            extra = self._coerce(extra, "diff")
            if extra.ndim != self.ndim:
                raise ShapeError("diff expects prepend or append to be the same dimension as "
                                 "input")
            parts.append(extra)
        dtype = result_type(*parts)             # joined as torch.cat promotes
        parts = [p._cast(dtype) for p in parts]
        y = parts[0] if len(parts) == 1 else self.tracer.op("concat", parts, dim=d)
        for _ in range(int(n)):
            m = y.shape[d]
            if m == 0:
                break
            a, b = y.narrow(d, 1, m - 1), y.narrow(d, 0, m - 1)
            y = a.logical_xor(b) if y.dtype == "bool" else a - b
        return y

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

    def broadcast_to(self, *shape) -> Tensor:
        """This tensor broadcast to `shape` (-1 keeps an axis), as torch.broadcast_to: only
        axes of length 1 grow, and new ones go in front."""
        shape = tuple(int(s) for s in _shape_args(shape))
        lead = len(shape) - self.ndim
        if lead < 0:
            raise ShapeError(f"broadcast_to: the number of sizes provided ({len(shape)}) must "
                             f"be greater or equal to the number of dimensions in the tensor "
                             f"({self.ndim})")
        for i, n in enumerate(self.shape):
            if n != 1 and shape[lead + i] not in (n, -1):
                raise ShapeError(f"broadcast_to: the expanded size of the tensor "
                                 f"({shape[lead + i]}) must match the existing size ({n}) at "
                                 f"non-singleton dimension {lead + i}: target "
                                 f"{list(shape)}, tensor {list(self.shape)}")
        return self.expand(*shape)

    def tile(self, *dims) -> Tensor:
        """The tensor tiled `dims` times along its axes, as torch.tile: repeat, with 1s in
        front of dims when it names fewer axes than the tensor has."""
        dims = tuple(int(d) for d in _shape_args(dims))
        return self.repeat(*(1,) * (self.ndim - len(dims)), *dims)

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

    def flipud(self) -> Tensor:
        """The order along axis 0 reversed, as torch.flipud (at least 1-d)."""
        if self.ndim < 1:
            raise ShapeError("flipud: input must be >= 1-d.")
        return self.flip(0)

    def fliplr(self) -> Tensor:
        """The order along axis 1 reversed, as torch.fliplr (at least 2-d)."""
        if self.ndim < 2:
            raise ShapeError("fliplr: input must be >= 2-d.")
        return self.flip(1)

    def rot90(self, k: int = 1, dims=(0, 1)) -> Tensor:
        """Rotated by 90 degrees k times in the plane of `dims`, from the first axis towards
        the second, as torch.rot90: a flip and a transpose (k mod 4)."""
        dims = tuple(dims)
        if len(dims) != 2:
            raise ShapeError(f"expected total rotation dims == 2, but got dims = {len(dims)}")
        if self.ndim < 2:
            raise ShapeError(f"expected total dims >= 2, but got total dims = {self.ndim}")
        a, b = _dim(dims[0], self.ndim, "rot90"), _dim(dims[1], self.ndim, "rot90")
        if a == b:
            raise ShapeError(f"expected rotation dims to be different, but got dim0 = {a} "
                             f"and dim1 = {b}")
        k = int(k) % 4
        if k == 1:
            return self.flip(b).transpose(a, b)
        if k == 2:
            return self.flip(a, b)
        return self.flip(a).transpose(a, b) if k == 3 else self

    def diagonal(self, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Tensor:
        """The diagonal `offset` (above the main one if positive) of the planes of axes dim1
        and dim2, as a last axis, as torch.diagonal: those axes moved last and merged, then
        one strided slice (step = the row length + 1), a copy rather than torch's view."""
        a, b = _dim(dim1, self.ndim, "diagonal"), _dim(dim2, self.ndim, "diagonal")
        if a == b:
            raise ShapeError(f"diagonal dimensions cannot be identical {dim1}, {dim2}")
        rows, cols = self.shape[a], self.shape[b]
        offset = int(offset)
        length = max(min(rows, cols - offset) if offset >= 0 else min(rows + offset, cols), 0)
        rest = [i for i in range(self.ndim) if i not in (a, b)]
        flat = self.permute(*rest, a, b).reshape(*(self.shape[i] for i in rest), rows * cols)
        if length == 0:
            return flat.narrow(-1, 0, 0)
        start = offset if offset >= 0 else -offset * cols
        return self.tracer.op("slice", [flat], dim=flat.ndim - 1, start=start,
                              stop=start + (length - 1) * (cols + 1) + 1, step=cols + 1)

    def diag(self, diagonal: int = 0) -> Tensor:
        """torch.diag: of a matrix its diagonal `diagonal` (1-d); of a vector the square
        matrix with it on that diagonal, zeros elsewhere: the vector as a column beside a
        block of zeros, flattened, so that row i's element lands i * (size + 1) places on,
        with the zeros before and after it joined (no scatter)."""
        k = int(diagonal)
        if self.ndim == 2:
            return self.diagonal(k)
        if self.ndim != 1:
            raise ShapeError(f"diag(): Supports 1D or 2D tensors. Got {self.ndim}D")
        n = self.shape[0]
        size = n + abs(k)
        rows = self.tracer.op("concat", [self.reshape(n, 1), self.new_zeros((n, size))],
                              dim=1).reshape(n * (size + 1))
        lead = k if k >= 0 else -k * size
        parts = [self.new_zeros((lead,)), rows] if lead else [rows]
        if lead + n * (size + 1) < size * size:
            parts.append(self.new_zeros((size * size - lead - n * (size + 1),)))
        flat = parts[0] if len(parts) == 1 else self.tracer.op("concat", parts, dim=0)
        return flat.narrow(0, 0, size * size).reshape(size, size)

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


def attach(cls: type) -> None:
    """Give Tensor the shape methods of this module."""
    attach_methods(_ShapeMethods, cls)


attach(Tensor)
