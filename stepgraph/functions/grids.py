"""torch.meshgrid: coordinate grids of 1-D tensors (Swin's relative position index, grid
sampling), traced and eager alike: each grid is a view of its tensor expanded."""
from __future__ import annotations

from ..errors import ShapeError

__all__ = ["meshgrid"]


def meshgrid(*tensors, indexing: str | None = None):
    """One grid per 1-D (or 0-d) tensor, all of shape (len(t0), len(t1), ...) for indexing
    "ij" (the default, as torch's when none is given), or with the first two axes swapped
    for "xy" (Cartesian: t0 varies along axis 1). The tensors may come as one list."""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    indexing = "ij" if indexing is None else indexing
    if indexing not in ("ij", "xy"):
        raise ValueError(f"meshgrid: indexing must be 'ij' or 'xy', got {indexing!r}")
    if not tensors:
        raise ShapeError("meshgrid: expects at least one tensor")
    if any(t.ndim > 1 for t in tensors):
        raise ShapeError(f"meshgrid: expects 0-d or 1-d tensors, got shapes "
                         f"{[tuple(t.shape) for t in tensors]}")
    lengths = [t.numel() for t in tensors]
    axes = list(range(len(tensors)))
    if indexing == "xy" and len(tensors) >= 2:
        axes[0], axes[1] = 1, 0
    shape = [0] * len(tensors)
    for i, axis in enumerate(axes):
        shape[axis] = lengths[i]
    grids = []
    for t, axis in zip(tensors, axes):
        view = [1] * len(tensors)
        view[axis] = -1
        grids.append(t.reshape(*view).expand(*shape))
    return tuple(grids)
