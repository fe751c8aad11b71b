"""Self-calibration: Q-Filters from the queries a request's own prompt computes.

A model without a calibration artifact would otherwise get the key-SVD fallback, which
cannot know the filter's sign. Yet every prefill computes what the paper's calibration
needs: mlx-lm's attention rotates a block's queries (``self_attn.rope``) before that block's
keys reach ``cache.update_and_fetch``. A :class:`QueryTap` on each layer's rope (the query
wrapper of :mod:`qfserve.calibrations.capture`) holds the block's rotated queries at that moment,
and the layer's :class:`SelfCalibratingScorer` takes them from it.

The filter is the offline one (:mod:`qfserve.calibrations.compute`): the top right singular vector
of each query head's uncentred queries, sign anchored so the mean query projects
positively, averaged over the heads of each KV head's GQA group and renormalised (a group
whose heads cancel takes its pooled queries' vector). It is computed from sufficient
statistics rather than stored queries: ``v1`` of ``Q`` is the top eigenvector of
``Q^T Q`` (``D x D``), and ``sgn(1^T u1) = sgn(v1 . sum(q))``, so each head accumulates its
Gram matrix and query sum over the prompt's blocks. Every prompt query counts, the state is
``D x D`` per head whatever the prompt's length, and the filter is a lazy MLX expression, so
neither prefill nor decode waits on it (the offline code is numpy, which would need an
``mx.eval`` in the middle of the forward pass).

Timing: the filter is frozen at the first update that must evict (more than ``budget``
tokens seen), from every prompt block (more than one token) seen until then; scores of the
rows already stored are computed then, as the key-SVD fallback does. A prompt that gave no
block before its first eviction (a one-token prompt) takes the key-SVD estimate instead
(``source`` then says ``fallback``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from qfserve.calibrations.capture import QueryRoPE
from qfserve.calibrations.model_info import attention_modules, head_counts
from qfserve.engine.kv.scorers import ScoreForm, ScorerBase, estimate_direction, project

_MARK = "_qfserve_query_tap"
_CANCEL_TOL = 0.05  # as qfserve.calibrations.compute: a group mean this short is no direction


class QueryTap:
    """The last block of rotated queries one layer computed, for its caches' scorers.

    A decode step of a batch holds every member's query; a batch narrows the tap to one
    member's row before that member's cache updates (:meth:`narrow`). A block no scorer
    takes stays until the layer's next call (one prefill chunk at most). ``offer``, when
    set, also receives every prompt block (more than one token; :mod:`qfserve.engine.filters.traffic`).
    """

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale  # the layer's attention scale (for query-aware scorers)
        self.batch: mx.array | None = None  # (B, H_q, N, D): what the layer last rotated
        self.queries: mx.array | None = None  # (1, H_q, N, D): what a scorer may take
        self.offer: Callable[[mx.array, Any], None] | None = None

    def __call__(self, queries: mx.array, offset: Any) -> None:
        self.batch = queries
        self.queries = queries if queries.shape[0] == 1 else None
        if self.offer is not None and queries.shape[0] == 1 and queries.shape[2] > 1:
            self.offer(queries, offset)

    def __deepcopy__(self, memo: dict[int, Any]) -> QueryTap:
        # A tap belongs to its layer's rope, not to a cache: a copied cache (a reused one from
        # the prompt cache is a deep copy) must read the queries the model computes now, not
        # a detached copy of the tap that no rope calls any more.
        return self

    def narrow(self, row: int) -> None:
        """Offer only row ``row`` of the last batch (the member about to update)."""
        self.queries = None if self.batch is None else self.batch[row : row + 1]

    def take(self, n: int) -> mx.array | None:
        """The block's queries if the last block had ``n`` tokens, then forget them."""
        q, self.queries = self.queries, None
        return q if q is not None and q.shape[2] == n else None


def install_query_taps(model: nn.Module) -> list[QueryTap]:
    """One :class:`QueryTap` per layer, installed once on each layer's rope (idempotent).

    Raises:
        ValueError: the model has no standard attention blocks with a ``rope``.
    """
    taps = []
    for i, attn in enumerate(attention_modules(model)):
        rope = getattr(attn, "rope", None)
        tap = getattr(rope, _MARK, None)
        if tap is None:
            if not callable(rope):
                raise ValueError(f"layer {i}: {type(attn).__name__} has no `rope` to tap")
            n_heads, n_kv_heads, head_dim = head_counts(attn, model)
            tap = QueryTap(float(getattr(attn, "scale", head_dim**-0.5)))
            attn.rope = QueryRoPE(rope, tap, n_heads, n_kv_heads)
            setattr(attn.rope, _MARK, tap)
        taps.append(tap)
    return taps


def remove_query_taps(model: nn.Module) -> None:
    """Put every layer's own rope back (caches that still read a tap then find none)."""
    for attn in attention_modules(model):
        if getattr(getattr(attn, "rope", None), _MARK, None) is not None:
            attn.rope = attn.rope.inner


def top_vector(gram: mx.array, total: mx.array) -> mx.array:
    """Sign-anchored top eigenvector of each uncentred second moment.

    Args:
        gram: ``(..., D, D)`` sums of ``q q^T``.
        total: ``(..., D)`` sums of ``q``.
    Returns:
        ``(..., D)`` unit vectors with ``v . total >= 0``.
    """
    _, vecs = mx.linalg.eigh(gram, stream=mx.cpu)  # ascending: the last is the top
    top = vecs[..., -1]
    return top * mx.where((top * total).sum(axis=-1, keepdims=True) >= 0, 1.0, -1.0)


def filters_from_moments(gram: mx.array, total: mx.array, n_kv_heads: int) -> mx.array:
    """A layer's KV-head filters from its query heads' moments (calibration's recipe).

    Args:
        gram: ``(H_q, D, D)`` per query head; total ``(H_q, D)``.
        n_kv_heads: KV heads; query head ``h`` belongs to ``h // (H_q // n_kv_heads)``.
    Returns:
        ``(n_kv_heads, D)`` float32 unit filters.
    """
    Hq, D, _ = gram.shape
    group = Hq // n_kv_heads
    mean = top_vector(gram, total).reshape(n_kv_heads, group, D).mean(axis=1)  # (KV, D)
    norm = mx.linalg.norm(mean, axis=-1, keepdims=True)
    pooled = top_vector(
        gram.reshape(n_kv_heads, group, D, D).sum(axis=1),
        total.reshape(n_kv_heads, group, D).sum(1),
    )
    chosen = mx.where(norm < _CANCEL_TOL, pooled, mean / mx.maximum(norm, 1e-12))
    return chosen / mx.linalg.norm(chosen, axis=-1, keepdims=True)


class SelfCalibratingScorer(ScorerBase):
    """Q-Filters of one layer from the request's own prompt queries (see the module doc).

    Args:
        tap: The layer's :class:`QueryTap`.
        budget: The cache's budget: the filter is frozen when more tokens must be kept.
        sign: ``-1`` keeps the other end of the axis (the ablation).
    """

    def __init__(self, tap: QueryTap, *, budget: int, sign: int = 1):
        self.tap = tap
        self.budget = budget
        self.sign = sign
        self.source = "self"
        self.filters: mx.array | None = None  # (H, D) once frozen
        self.queries_seen = 0
        self._seen = 0  # tokens observed so far
        self._gram: mx.array | None = None  # (H_q, D, D)
        self._total: mx.array | None = None  # (H_q, D)

    @property
    def ready(self) -> bool:
        return self.filters is not None

    @property
    def nbytes(self) -> int:
        return 0 if self.filters is None else self.filters.nbytes

    def observe(self, keys: mx.array, tokens_seen: int) -> None:
        n = tokens_seen - self._seen
        queries = self.tap.take(n) if n > 1 else None  # prompt blocks only
        self._seen = tokens_seen
        if queries is not None:
            q = queries[0].astype(mx.float32)  # (H_q, N, D)
            gram, total = q.swapaxes(-1, -2) @ q, q.sum(axis=1)
            if self._gram is not None and self._total is not None:
                gram, total = self._gram + gram, self._total + total
            self._gram, self._total = gram, total
            self.queries_seen += q.shape[1]
            mx.async_eval(gram, total)  # folds the block in; nothing waits for it
        if tokens_seen <= self.budget:
            return
        if self._gram is None or self._total is None:  # no prompt block: the keys' estimate
            self.filters, self.source = estimate_direction(keys)[0], "fallback"
            return
        self.filters = filters_from_moments(self._gram, self._total, keys.shape[1])
        self._gram = self._total = None

    def score(self, keys: mx.array, start: int) -> mx.array:
        if self.filters is None:
            raise RuntimeError("SelfCalibratingScorer.score called before the filter was frozen")
        return project(keys, self.filters, self.sign)

    def form(self) -> ScoreForm | None:
        if self.filters is None:
            return None
        return ScoreForm("project", self.filters if self.sign == 1 else -self.filters)
