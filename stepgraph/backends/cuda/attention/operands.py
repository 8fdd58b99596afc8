"""What attention.cu's kernels take, shared by the fused launchers (attention.py) and the
composed ones (attention_composed.py): the file, the block size, an operand's (batch, head,
row) strides and the problem's sizes."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SOURCE = "attention.cu"
THREADS = 128                 # attention.cu SDPA_THREADS


@dataclass(frozen=True)
class Heads:
    """An operand (..., rows, dim): row r of head h of batch entry b starts at element
    b * batch + h * head + r * row (elements; columns contiguous)."""

    batch: int
    head: int
    row: int

    def args(self) -> tuple:
        return np.int64(self.batch), np.int64(self.head), np.int64(self.row)


@dataclass(frozen=True)
class Problem:
    """bh = prod(q's leading dims) (batch x heads) attention problems of L queries and S keys,
    head dims E (q, k) and Ev (v); `heads` is q's last leading dim (1 without two), `group`
    the query heads per kv head (k and v have heads / group)."""

    bh: int
    heads: int
    L: int
    S: int
    E: int
    Ev: int
    group: int = 1

    def args(self) -> tuple:
        return tuple(np.int32(x) for x in (self.heads, self.bh, self.L, self.S, self.E,
                                           self.Ev))
