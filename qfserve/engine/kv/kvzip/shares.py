"""How KVzip's scores become kept rows: each cache evicts to its budget, and where every
layer shares the request's rows (``budget_mode="global"``, kvpress's default) the layers first
take their shares of one global top-k, so heads and layers whose reconstruction attention is
diffuse give rows to those that read the context.

A layer is stored padded to its longest head (:mod:`qfserve.engine.kv.adaptive`), and one
head may win most of the prompt: a copying head pays every row the same high attention
(at 8k tokens one SmolLM2 head kept 5,753 of 8,085 rows). Those heads answer questions (capped
at the layer's reserved rows, the needle through a small server fell from 1.00 to 0.20 at 1k
tokens), so they keep them, unless the layers' padded rows would outgrow what a prompt
compressed as it is read reserved: then the longest heads are cut to the largest cap that
fits (:func:`head_cap`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np


def evict(caches: list[Any], scores: list[mx.array]) -> None:
    """Evict each kvzip cache to its budget by the pass's ``scores`` (one ``(B, H, S)`` per
    cache), the layers first taking their shares of the rows where they share them."""
    if caches and caches[0].scorer.shared:
        budgets, cap = layer_budgets(caches, scores)
        for cache, budget in zip(caches, budgets, strict=True):
            cache.budget, cache.scorer.cap = budget, cap
    for cache, layer_scores in zip(caches, scores, strict=True):
        cache.compress(layer_scores)
    mx.eval([c.state for c in caches])


def layer_budgets(caches: list[Any], scores: list[mx.array]) -> tuple[list[int], int | None]:
    """Each layer's rows per head when every layer shares the request's rows: the global top
    ``budget * H * n_layers`` of the pass's scores, protected rows (sinks, recent window)
    first; a layer then keeps its share, spread over its heads by the same scores.

    Args:
        caches: The request's caches (one batch row), stored rows in temporal order.
        scores: ``(1, H, S)`` float32 per layer, the pass's.
    Returns:
        Rows per head per layer (at least the protected rows, ``H`` times it summing to at
        most ``budget * H * n_layers``), and the most rows a head may keep (``None``: any).
        Under a compress-as-read limit (:func:`qfserve.engine.kv.kvzip.set_limit`), the
        layers' longest heads sum to at most its ``keep_limit`` rows a layer.
    """
    guarded = []
    for cache, layer_scores in zip(caches, scores, strict=True):
        if cache.scorer.budget is None:  # the request's budget, kept for later turns
            cache.scorer.budget = cache.budget
        real = mx.ones(layer_scores.shape, dtype=mx.bool_) if cache.valid is None else cache.valid
        from_start = mx.cumsum(real.astype(mx.int32), axis=-1)
        from_end = mx.cumsum(real.astype(mx.int32), axis=-1, reverse=True)
        protected = real & ((from_start <= cache.n_sink) | (from_end <= cache.recent))
        ranked = mx.where(protected, mx.inf, mx.where(real, layer_scores, -mx.inf))
        guarded.append(ranked[0])
    ranks = [np.array(g) for g in guarded]
    H = ranks[0].shape[0]
    total = sum(c.scorer.budget * H for c in caches)
    counts = _head_counts(ranks, total)
    limits = [c.scorer.keep_limit for c in caches]
    cap = None if None in limits else head_cap([int(c.max()) for c in counts], sum(limits))
    if cap is not None:
        counts = [np.minimum(c, cap) for c in counts]
    budgets = [
        max(int(c.sum()) // H, cache.n_sink + cache.recent)
        for c, cache in zip(counts, caches, strict=True)
    ]
    # Ties at the threshold can give more than the total: trim the largest layers.
    excess = sum(budgets) - total // H
    while excess > 0:
        i = max(range(len(budgets)), key=budgets.__getitem__)
        budgets[i] -= 1
        excess -= 1
    return budgets, cap


def _head_counts(ranks: list[np.ndarray], total: int) -> list[np.ndarray]:
    """Rows per head (``(H,)`` per layer) among the global ``total`` best (``ranks``:
    ``(H, S)`` per layer, ``-inf`` where no row is; ties at the threshold all count)."""
    pool = np.concatenate([r.ravel() for r in ranks])
    pool = pool[pool > -np.inf]
    kth = -np.inf if pool.size <= total else np.partition(pool, pool.size - total)[-total]
    return [((r >= kth) & (r > -np.inf)).sum(axis=-1) for r in ranks]


def head_cap(longest: list[int], allowance: int) -> int | None:
    """The most rows a head may keep so that the layers' longest heads (``longest``, one a
    layer) sum to at most ``allowance`` (``None``: they do uncapped).

    The rows a cap takes from a head are not given to others: they would lengthen some
    other layer's padding, and whether the sum then fits would depend on where they land.
    The request keeps fewer rows than its budget only when its memory asks for it."""
    if sum(longest) <= allowance:
        return None
    fits, over = 0, max(longest)  # the sum of min(n, cap) grows with the cap
    while over - fits > 1:
        mid = (fits + over) // 2
        fits, over = (mid, over) if sum(min(n, mid) for n in longest) <= allowance else (fits, mid)
    return fits
