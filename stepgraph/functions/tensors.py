"""torch.* functions on tensors: joining (cat / concat / stack, vstack / hstack / dstack /
column_stack, block_diag, cartesian_prod), the shape helpers (atleast_*d, broadcast_tensors,
tile, rot90, tensor_split, diagonal, ...), tril / triu, max / min / amax / amin / aminmax /
argmax / argmin, var / std / var_mean / std_mean / logsumexp, count_nonzero, cumsum, diff,
gather, take_along_dim, index_select, topk / sort, prod / median / norm / dist / renorm,
scatter / scatter_add, the arithmetic and product names (add, matmul, outer, kron, ...), and
einsum. Most are the Tensor method of the same name (ir/tensor_*.py), so they work wherever
those methods do; the joining ones and einsum are composed here."""
from __future__ import annotations

import builtins
import math

import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from .math import _method

__all__ = ["cat", "concat", "concatenate", "stack", "unbind", "unsqueeze", "squeeze",
           "flatten", "unflatten", "movedim", "moveaxis", "swapaxes", "swapdims", "tril", "triu",
           "max", "min", "amax", "amin", "argmax", "argmin", "var", "std",
           "logsumexp", "cumsum", "gather", "index_select", "topk", "sort",
           "sum", "mean", "prod", "median", "norm", "softmax", "log_softmax", "split", "chunk",
           "narrow", "reshape", "permute", "transpose", "t", "scatter", "scatter_add", "add",
           "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide", "matmul",
           "mm", "bmm", "mv", "dot", "inner", "outer", "ger", "addmm", "baddbmm", "einsum",
           "floor_divide", "remainder", "flip", "roll", "repeat_interleave",
           "var_mean", "std_mean", "count_nonzero", "aminmax", "dist", "diff", "renorm", "tile",
           "broadcast_to", "broadcast_tensors", "broadcast_shapes", "flipud", "fliplr", "rot90",
           "vstack", "row_stack", "hstack", "dstack", "column_stack", "atleast_1d",
           "atleast_2d", "atleast_3d", "select", "take_along_dim", "tensor_split", "diagonal",
           "diag", "cartesian_prod", "block_diag", "kron"]


def _joined(what: str, tensors) -> list:
    """The tensors of a cat / stack, each traced in the trace of the first traced one."""
    tensors = list(tensors)
    if not tensors:
        raise ShapeError(f"{what}: expected a non-empty list of tensors")
    # a traced tensor's trace takes the others in; concrete (eager) tensors join as constants
    tensor = [t for t in tensors if hasattr(t, "tracer")]
    first = next((t for t in tensor if not _eager(t)), tensor[0] if tensor else None)
    if first is None:
        raise TypeError(f"{what}: expected traced tensors, got "
                        f"{[type(t).__name__ for t in tensors]}")
    return [first._coerce(t, what) for t in tensors]


def _eager(t) -> bool:
    # Tensor.__getattr__ refuses unknown names loudly, so ask the class first
    return hasattr(type(t), "is_eager") and bool(t.is_eager)


def cat(tensors, dim: int = 0):
    """The tensors joined along `dim` (one concat node; its gradient is one slice each)."""
    from ..ir.tensor import _dim
    tensors = _joined("cat", tensors)
    first = tensors[0]
    d = _dim(dim, first.ndim, "cat")
    for i, t in enumerate(tensors):
        if t.ndim != first.ndim or t.shape[:d] + t.shape[d + 1:] != \
                first.shape[:d] + first.shape[d + 1:] or t.dtype != first.dtype:
            raise ShapeError(f"cat: tensor {i} {t.dtype}{list(t.shape)} does not match tensor "
                             f"0 {first.dtype}{list(first.shape)} off dim {d}")
    if len(tensors) == 1:
        return first
    return first.tracer.op("concat", tensors, dim=d)


concat = concatenate = cat


def stack(tensors, dim: int = 0):
    """The tensors (all of one shape) joined along a new axis `dim`."""
    from ..ir.tensor import _dim
    tensors = _joined("stack", tensors)
    shapes = {t.shape for t in tensors}
    if len(shapes) != 1:
        raise ShapeError(f"stack: tensors must have one shape, got {sorted(shapes)}")
    d = _dim(dim, tensors[0].ndim + 1, "stack")
    return cat([t.unsqueeze(d) for t in tensors], d)


def unbind(input, dim: int = 0):
    return input.unbind(dim)


def unsqueeze(input, dim: int):
    return input.unsqueeze(dim)


def squeeze(input, dim=None):
    return input.squeeze(dim)


def flatten(input, start_dim: int = 0, end_dim: int = -1):
    return input.flatten(start_dim, end_dim)


def unflatten(input, dim: int, sizes):
    return input.unflatten(dim, sizes)


def movedim(input, source, destination):
    return input.movedim(source, destination)


moveaxis = movedim


def swapaxes(input, axis0: int, axis1: int):
    return input.transpose(axis0, axis1)


swapdims = swapaxes


def tril(input, diagonal: int = 0):
    return input.tril(diagonal)


def triu(input, diagonal: int = 0):
    return input.triu(diagonal)


def max(input, dim=None, keepdim: bool = False):  # noqa: A001 (torch's name)
    """torch.max: of all elements, (values, indices) along an int `dim`, or torch.maximum
    with a tensor second argument."""
    return input.max(dim, keepdim)


def min(input, dim=None, keepdim: bool = False):  # noqa: A001
    """torch.min, as torch.max."""
    return input.min(dim, keepdim)


def amax(input, dim=(), keepdim: bool = False):
    return input.amax(dim, keepdim)


def amin(input, dim=(), keepdim: bool = False):
    return input.amin(dim, keepdim)


def argmax(input, dim=None, keepdim: bool = False):
    return input.argmax(dim, keepdim)


def argmin(input, dim=None, keepdim: bool = False):
    return input.argmin(dim, keepdim)


def var(input, dim=None, unbiased=None, keepdim: bool = False, *, correction=None):
    return input.var(dim, unbiased, keepdim, correction=correction)


def std(input, dim=None, unbiased=None, keepdim: bool = False, *, correction=None):
    return input.std(dim, unbiased, keepdim, correction=correction)


def logsumexp(input, dim, keepdim: bool = False):
    return input.logsumexp(dim, keepdim)


def cumsum(input, dim: int, dtype=None):
    return input.cumsum(dim, dtype=dtype)


def gather(input, dim: int, index):
    return input.gather(dim, index)


def index_select(input, dim: int, index):
    return input.index_select(dim, index)


def topk(input, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: A002
    return input.topk(k, dim, largest, sorted)


def sort(input, dim: int = -1, descending: bool = False, stable: bool = False):
    return input.sort(dim, descending, stable)


sum, mean, prod, median, norm = (_method(n) for n in ("sum", "mean", "prod", "median", "norm"))
split, chunk, narrow, reshape = (_method(n) for n in ("split", "chunk", "narrow", "reshape"))
permute, transpose, t = (_method(n) for n in ("permute", "transpose", "t"))
scatter, scatter_add = _method("scatter"), _method("scatter_add")
add, sub, subtract, mul, multiply = (_method(n) for n in ("add", "sub", "subtract", "mul",
                                                          "multiply"))
div, divide, true_divide = (_method(n) for n in ("div", "divide", "true_divide"))
floor_divide, remainder = _method("floor_divide"), _method("remainder")
roll, repeat_interleave = _method("roll"), _method("repeat_interleave")


def flip(input, dims):
    """torch.flip(input, dims): the order along `dims` reversed."""
    return input.flip(dims)


count_nonzero, dist, diff, renorm = (_method(n) for n in ("count_nonzero", "dist", "diff",
                                                          "renorm"))
tile, broadcast_to, flipud, fliplr = (_method(n) for n in ("tile", "broadcast_to", "flipud",
                                                           "fliplr"))
rot90, select, take_along_dim = _method("rot90"), _method("select"), _method("take_along_dim")
tensor_split, diagonal, diag = (_method(n) for n in ("tensor_split", "diagonal", "diag"))
aminmax, kron = _method("aminmax"), _method("kron")


def var_mean(input, dim=None, unbiased=None, keepdim: bool = False, *, correction=None):
    """(var, mean) over `dim`, as torch.var_mean (a tuple; var's arguments)."""
    if isinstance(dim, bool):               # var_mean(x, False): the old unbiased argument
        dim, unbiased = None, dim
    return (input.var(dim, unbiased, keepdim, correction=correction),
            input.mean(dim, keepdim))


def std_mean(input, dim=None, unbiased=None, keepdim: bool = False, *, correction=None):
    """(std, mean) over `dim`, as torch.std_mean (a tuple; std's arguments)."""
    if isinstance(dim, bool):
        dim, unbiased = None, dim
    return (input.std(dim, unbiased, keepdim, correction=correction),
            input.mean(dim, keepdim))


def broadcast_shapes(*shapes):
    """The shape the given shapes broadcast to, as torch.broadcast_shapes (ShapeError where
    two sizes of an axis differ and neither is 1)."""
    from ..ir.tensor import Size
    try:
        return Size(np.broadcast_shapes(*((s,) if isinstance(s, int) else tuple(s)
                                          for s in shapes)))
    except ValueError:
        raise ShapeError(f"broadcast_shapes: shape mismatch: objects cannot be broadcast to "
                         f"a single shape: {list(shapes)}") from None


def broadcast_tensors(*tensors):
    """The tensors expanded to their common broadcast shape, as torch.broadcast_tensors."""
    tensors = _joined("broadcast_tensors", _unpacked(tensors))
    shape = broadcast_shapes(*(t.shape for t in tensors))
    return tuple(t.expand(*shape) for t in tensors)


def _unpacked(tensors) -> list:
    """f(a, b) and f([a, b]) alike (torch's *tensors functions take either)."""
    return list(tensors[0]) if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)) \
        else list(tensors)


def _at_least(rank: int, tensors):
    """One tensor viewed with at least `rank` axes, or a tuple of them for several (or a
    list), as torch.atleast_1d / 2d / 3d: 0-d as (1,) * rank; 1-d (n,) as (1, n) or (1, n,
    1); 2-d (m, n) as (m, n, 1)."""
    def viewed(t):
        if t.ndim >= rank:
            return t
        if t.ndim == 0:
            return t.reshape(*(1,) * rank)
        if t.ndim == 1:
            return t.reshape(1, -1) if rank == 2 else t.reshape(1, -1, 1)
        return t.unsqueeze(-1)
    single = len(tensors) == 1 and not isinstance(tensors[0], (list, tuple))
    out = tuple(viewed(t) for t in _unpacked(tensors))
    return out[0] if single else out


def atleast_1d(*tensors):
    return _at_least(1, tensors)


def atleast_2d(*tensors):
    return _at_least(2, tensors)


def atleast_3d(*tensors):
    return _at_least(3, tensors)


def vstack(tensors):
    """The tensors (as atleast_2d) joined along axis 0, as torch.vstack / row_stack."""
    return cat(atleast_2d(_joined("vstack", tensors)), 0)


row_stack = vstack


def hstack(tensors):
    """The tensors (as atleast_1d) joined along axis 1, or axis 0 if all are 1-d, as
    torch.hstack."""
    tensors = atleast_1d(_joined("hstack", tensors))
    return cat(tensors, 0 if builtins.all(t.ndim == 1 for t in tensors) else 1)


def dstack(tensors):
    """The tensors (as atleast_3d) joined along axis 2, as torch.dstack."""
    return cat(atleast_3d(_joined("dstack", tensors)), 2)


def column_stack(tensors):
    """The tensors joined along axis 1, 0-d and 1-d ones as (n, 1) columns, as
    torch.column_stack."""
    tensors = _joined("column_stack", tensors)
    return cat([t.reshape(t.numel(), 1) if t.ndim <= 1 else t for t in tensors], 1)


def cartesian_prod(*tensors):
    """Every combination of the elements of the 1-d tensors, one per row, the last varying
    fastest (as itertools.product), as torch.cartesian_prod: each tensor broadcast over the
    grid of all and flattened, the columns stacked. One tensor comes back as it is."""
    tensors = _joined("cartesian_prod", _unpacked(tensors))
    for t in tensors:
        if t.ndim != 1:
            raise ShapeError(f"Expect a 1D vector, but got shape {list(t.shape)}")
    if len(tensors) == 1:
        return tensors[0]
    grid = tuple(t.shape[0] for t in tensors)
    columns = [t.reshape(*(n if j == i else 1 for j, n in enumerate(grid))).expand(*grid)
               .reshape(-1) for i, t in enumerate(tensors)]
    return stack(columns, 1)


def block_diag(*tensors):
    """The tensors (0-d as (1, 1), 1-d as one row) on the diagonal of a matrix of zeros, as
    torch.block_diag: each one's rows padded with zeros left and right, the rows joined; the
    result has the tensors' promoted dtype."""
    from ..ir.promotion import result_type
    tensors = _joined("block_diag", _unpacked(tensors))
    blocks = []
    for i, t in enumerate(tensors):
        if t.ndim > 2:
            raise ShapeError(f"torch.block_diag: Input tensors must have 2 or fewer "
                             f"dimensions. Input {i} has {t.ndim} dimensions")
        blocks.append(t.reshape(1, 1) if t.ndim == 0 else t.reshape(1, -1) if t.ndim == 1
                      else t)
    dtype = result_type(*blocks)
    width = builtins.sum(b.shape[1] for b in blocks)
    rows, left = [], 0
    for b in blocks:
        r, c = b.shape
        parts = [p for p in (b.new_zeros((r, left), dtype=dtype), b._cast(dtype),
                             b.new_zeros((r, width - left - c), dtype=dtype)) if p.shape[1]]
        rows.append(cat(parts, 1) if parts else b.new_zeros((r, width), dtype=dtype))
        left += c
    return cat(rows, 0)
matmul, mm, bmm, mv = (_method(n) for n in ("matmul", "mm", "bmm", "mv"))
dot, inner, outer, ger = (_method(n) for n in ("dot", "inner", "outer", "ger"))
addmm, baddbmm = _method("addmm"), _method("baddbmm")


def softmax(input, dim: int, dtype=None):
    """softmax over `dim`, of input cast to `dtype` first when given (as torch)."""
    return (input if dtype is None else input.to(dtype)).softmax(dim)


def log_softmax(input, dim: int, dtype=None):
    """log(softmax) over `dim`, of input cast to `dtype` first when given."""
    return (input if dtype is None else input.to(dtype)).log_softmax(dim)


def einsum(equation: str, *operands):
    """torch.einsum of one or two operands, as sums, permutes and one matmul or bmm: the
    indices both operands and the output share are the batch, those of both operands only
    are contracted, indices of one operand only and not in the output are summed first.
    `...` stands for the same leading axes in every operand (not broadcast). A repeated
    index within one operand (a diagonal) and three or more operands are refused."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    operands = _joined("einsum", operands)
    terms, out = _einsum_terms(equation, operands)
    sizes = {}
    for term, x in zip(terms, operands):
        for letter, n in zip(term, x.shape):
            if sizes.setdefault(letter, n) != n:
                raise ShapeError(f"einsum {equation!r}: index {letter!r} is {sizes[letter]} "
                                 f"in one operand and {n} in another (no broadcasting)")
    if len(operands) == 1:
        return _einsum_reorder(operands[0], terms[0], out)
    (a, b), (ta, tb) = operands, terms
    batch = [c for c in out if c in ta and c in tb]
    left = [c for c in out if c in ta and c not in tb]
    right = [c for c in out if c in tb and c not in ta]
    inner_ = [c for c in ta if c in tb and c not in out]
    n = lambda letters: math.prod(sizes[c] for c in letters)  # noqa: E731
    # each operand as (batch, rows, contracted) and (batch, contracted, columns); its indices
    # in none of those (not in the other operand nor the output) are summed on the way
    a = _einsum_reorder(a, ta, "".join(batch + left + inner_))
    b = _einsum_reorder(b, tb, "".join(batch + inner_ + right))
    if batch:
        y = a.reshape(n(batch), n(left), n(inner_)) @ b.reshape(n(batch), n(inner_), n(right))
    else:
        y = a.reshape(n(left), n(inner_)) @ b.reshape(n(inner_), n(right))
    y = y.reshape(*(sizes[c] for c in batch + left + right))
    return _einsum_reorder(y, "".join(batch + left + right), out)


def _einsum_terms(equation: str, operands) -> tuple[list[str], str]:
    """The operands' index strings and the output's, `...` replaced by one new letter per
    axis it covers (right-aligned across operands); an implicit output is `...` followed
    by the indices seen once, in alphabetical order, as torch."""
    lhs, arrow, out = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    where = operands[0].tracer.where()
    if len(terms) != len(operands):
        raise ShapeError(f"einsum {equation!r}: {len(terms)} index groups for "
                         f"{len(operands)} operands")
    if len(operands) > 2:
        raise UnsupportedOpError(f"torch.einsum of {len(operands)} operands is not supported "
                                 f"by stepgraph (called in {where}): nest two-operand "
                                 "einsums")
    # the module defines max, min and sum as torch functions: builtins spelled out
    spare = [chr(c) for c in range(0x3b1, 0x3c9)]      # Greek letters stand for `...`
    width = builtins.max(x.ndim - len(t.replace("...", "")) for t, x in zip(terms, operands))
    dots = "".join(spare[:builtins.max(width, 0)])
    terms = [t.replace("...", dots[len(dots) - (x.ndim - len(t) + 3):]) if "..." in t else t
             for t, x in zip(terms, operands)]
    if not arrow:
        seen = "".join(terms)
        out = (dots if any("..." in t for t in lhs.split(",")) else "") + "".join(
            sorted(c for c in set(seen) if seen.count(c) == 1 and c not in dots))
    out = out.replace("...", dots)
    for term, x in zip(terms, operands):
        if len(term) != x.ndim or not term.isalpha():
            raise ShapeError(f"einsum {equation!r}: {term!r} does not index a tensor of shape "
                             f"{tuple(x.shape)}")
        if len(set(term)) != len(term):
            raise UnsupportedOpError(f"torch.einsum {equation!r} repeats an index within one "
                                     f"operand (a diagonal), which stepgraph does not support "
                                     f"(called in {where}): multiply by torch.eye and sum")
    if len(set(out)) != len(out) or any(c not in "".join(terms) for c in out):
        raise ShapeError(f"einsum {equation!r}: the output indices {out!r} must be distinct "
                         "and appear in an operand")
    return terms, out


def _einsum_reorder(x, term: str, out: str):
    """x indexed by `term` as indexed by `out`: the indices missing from out summed, the
    rest permuted into out's order."""
    gone = tuple(i for i, c in enumerate(term) if c not in out)
    if gone:
        x, term = x.sum(gone), "".join(c for c in term if c in out)
    return x.permute(*(term.index(c) for c in out)) if term else x
