"""The eviction core: which stored rows survive, written once for every scorer.

Scores are ``(B, H, L)`` float32, higher = keep. The first ``n_sink`` rows and the last
``recent`` rows are protected (forced to +inf); NaN ranks lowest. Survivors are row indices in
temporal order. Ties are broken deterministically: among equal scores the lower position is
kept.

Two paths: a block eviction (:func:`select_keep`, the plain-MLX path of the fused kernel in
:mod:`metal.qfilters_apply`, so kernel and CPU share one definition) and the decode step,
where exactly one row goes (:func:`select_drop_one`, O(L), no sort).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from metal.qfilters_apply import protected_rows, select_keep_reference

_INF = mx.array(float("inf"), dtype=mx.float32)


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
    return mx.where(protected_rows(scores.shape[-1], n_sink, recent), _INF, scores)


def select_keep(scores: mx.array, budget: int, n_sink: int, recent: int) -> mx.array:
    """Indices of the ``budget`` rows to keep, in temporal order (block path).

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
    return select_keep_reference(scores, budget=budget, n_sink=n_sink, recent=recent)


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
