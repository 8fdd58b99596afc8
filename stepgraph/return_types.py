"""The named (values, indices) pairs that max / min / median / topk / sort with a dim
return, as torch.return_types: unpack them as tuples or read `.values` and `.indices`; and
aminmax's (min, max)."""
from __future__ import annotations

from collections import namedtuple

max = namedtuple("max", ["values", "indices"])          # noqa: A001 (torch's names)
min = namedtuple("min", ["values", "indices"])          # noqa: A001
topk = namedtuple("topk", ["values", "indices"])
sort = namedtuple("sort", ["values", "indices"])
median = namedtuple("median", ["values", "indices"])
aminmax = namedtuple("aminmax", ["min", "max"])

__all__ = ["max", "min", "median", "topk", "sort", "aminmax"]
