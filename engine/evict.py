"""The eviction core: which stored rows survive, written once for every scorer.

Scores are ``(B, H, L)`` float32, higher = keep. The first ``n_sink`` rows and the last
``recent`` rows are protected (forced to +inf). Survivors are returned as row indices in
temporal order. Ties are broken deterministically: among equal scores the lower position is
kept, which is also what the fused kernels in ``metal/`` reproduce.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

_INF = mx.array(float("inf"), dtype=mx.float32)
_NEG_INF = mx.array(float("-inf"), dtype=mx.float32)


@lru_cache(maxsize=64)
def _guard(L: int, n_sink: int, recent: int) -> mx.array:
    # True on protected rows. Built once per shape, not per step.
    rows = mx.arange(L)
    return (rows < n_sink) | (rows >= L - recent)


@lru_cache(maxsize=64)
def _rows(L: int) -> mx.array:
    return mx.arange(L, dtype=mx.uint32)


def protect(scores: mx.array, n_sink: int, recent: int) -> mx.array:
    """Force the first ``n_sink`` and the last ``recent`` rows of ``scores`` to +inf.

    Args:
        scores: ``(B, H, L)`` float32.
    Returns:
        ``(B, H, L)`` float32 with protected rows at +inf.
    """
    return mx.where(_guard(scores.shape[-1], n_sink, recent), _INF, scores)


def select_keep(scores: mx.array, budget: int, n_sink: int, recent: int) -> mx.array:
    """Indices of the ``budget`` rows to keep, in temporal order (general path).

    Top-``budget`` by score with protected rows forced in. The threshold is the
    ``budget``-th largest score; rows strictly above it are always admitted and rows equal
    to it only while quota remains, lowest position first, so exactly ``budget`` rows
    survive even when scores tie (every protected row ties at +inf).

    Args:
        scores: ``(B, H, L)`` float32 with ``L > budget``.
        budget: Rows to keep, ``n_sink + recent < budget < L``.
    Returns:
        ``(B, H, budget)`` uint32 row indices, ascending.
    """
    L = scores.shape[-1]
    # NaN compares false against any threshold and would break the count: rank it lowest.
    scores = mx.where(scores != scores, _NEG_INF, scores)
    masked = protect(scores, n_sink, recent)
    kth = L - budget
    thresh = mx.partition(masked, kth=kth, axis=-1)[..., kth : kth + 1]  # (B, H, 1)
    above = masked > thresh
    tied = masked == thresh
    quota = budget - above.sum(axis=-1, keepdims=True)
    keep = above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= quota))
    rows = _rows(L)
    # Kept rows sort first (their own index), dropped rows after (index + L): unique keys.
    order = mx.sort(mx.where(keep, rows, rows + L), axis=-1)
    return order[..., :budget]


def select_drop_one(scores: mx.array, n_sink: int, recent: int) -> mx.array:
    """Indices of the rows to keep when exactly one row must go (the decode path), O(L).

    Drops the lowest-scoring unprotected row; among ties the latest one, which matches
    :func:`select_keep`'s lower-position-first tie-break. A NaN score counts as the lowest
    (``argmin`` picks NaN first), as in :func:`select_keep`.

    Args:
        scores: ``(B, H, L)`` float32.
    Returns:
        ``(B, H, L - 1)`` uint32 row indices, ascending.
    """
    L = scores.shape[-1]
    masked = protect(scores, n_sink, recent)
    # argmin returns the first minimum; on the reversed rows that is the latest one.
    victim = (L - 1) - mx.argmin(masked[..., ::-1], axis=-1, keepdims=True)  # (B, H, 1)
    rows = _rows(L - 1)
    return rows + (rows >= victim)


def gather_rows(x: mx.array, idx: mx.array) -> mx.array:
    """Rows ``idx`` of ``x`` along the sequence axis.

    Args:
        x: ``(B, H, L, D)`` or ``(B, H, L)``.
        idx: ``(B, H, K)`` row indices.
    Returns:
        ``(B, H, K, D)`` or ``(B, H, K)``.
    """
    if x.ndim == 4:
        return mx.take_along_axis(x, idx[..., None], axis=2)
    return mx.take_along_axis(x, idx, axis=2)
