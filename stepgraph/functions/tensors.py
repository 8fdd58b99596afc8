"""torch.* functions on tensors: joining (cat / concat / stack), the shape helpers, tril /
triu, max / min / amax / amin / argmax / argmin, var / std / logsumexp, cumsum, gather,
index_select, topk / sort. Each is the Tensor method of the same name (ir/trace.py), so
it works wherever those methods do."""
from __future__ import annotations

from ..errors import ShapeError

__all__ = ["cat", "concat", "concatenate", "stack", "unsqueeze", "squeeze", "flatten",
           "unflatten", "movedim", "moveaxis", "swapaxes", "swapdims", "tril", "triu", "max",
           "min", "amax", "amin", "argmax", "argmin", "var", "std",
           "logsumexp", "cumsum", "gather", "index_select", "topk", "sort"]


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
    from ..ir.trace import _dim
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
    from ..ir.trace import _dim
    tensors = _joined("stack", tensors)
    shapes = {t.shape for t in tensors}
    if len(shapes) != 1:
        raise ShapeError(f"stack: tensors must have one shape, got {sorted(shapes)}")
    d = _dim(dim, tensors[0].ndim + 1, "stack")
    return cat([t.unsqueeze(d) for t in tensors], d)


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
