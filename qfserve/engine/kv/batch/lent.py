"""What a packed batch leaves in a member cache while it holds the member's rows: arrays of
the right shape and size with no data, so the member's statistics stay current, its rows
are not held twice, and computing with it fails loudly (:mod:`.packed`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class Lent:
    """Stands in for a packed member's array: its shape and size, no data."""

    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def itemsize(self) -> int:
        return self.dtype.size

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)
