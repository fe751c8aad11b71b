"""KVzip's scorer, prompts and the eviction its scores drive (see :mod:`qfserve.engine.kv.kvzip`)."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import mlx.core as mx

from qfserve.engine.kv.scorers import AlwaysReady, Scorer
from qfserve.engine.kv.selfcal import QueryTap

DEFAULT_CHUNK = 2048  # context tokens reconstructed at once (kvpress's and the paper's)
REPEAT_ROWS = 64  # at most the repeat prompt, the previous tail and the template's suffix
DEFAULT_BLOCK = 512  # reconstruction tokens per forward pass (bounds the score matrices)


@partial(mx.compile, shapeless=True)  # one op a decode step and layer, not three
def generated_tier(scores: mx.array) -> mx.array:
    """Map any float scores monotonically into ``(-1, 0)``: below every reconstruction score
    (attention weights, ``>= 0``) while keeping their order (``atan`` keeps float32
    resolution where plain offsets would round it away)."""
    return mx.arctan(scores) / math.pi - 0.5


class KVzipScorer(AlwaysReady):
    """A layer's scorer under ``method="kvzip"``.

    Prompt blocks are stored whole until the reconstruction pass scores them
    (:meth:`defers`); until then, and for every generated row, scores come from
    ``inner`` mapped by :func:`generated_tier`.

    Args:
        tap: The layer's query tap (the pass reads the reconstruction queries from it).
        inner: Ranks generated rows: calibrated Q-Filters where the model has them.
        shared: The pass shares the rows of every layer (``budget_mode="global"``): each
            layer then keeps what the global top-k gives it (:func:`layer_budgets`).
    """

    tracks_positions = True  # the pass maps stored rows to context chunks by position
    scores_are_weights = True  # attention weights: comparable across heads as they are

    def __init__(self, tap: QueryTap, inner: Scorer, *, shared: bool = False) -> None:
        self.tap = tap
        self.inner = inner
        self.shared = shared
        self.budget: int | None = None  # the request's budget, before a layer takes its share
        # Set while a turn runs on its full cache, compressed only when it is kept for reuse.
        self.holding = False
        # Rows the prompt may hold a layer before what is read so far is compressed, and
        # rows the layers may keep after a pass (memory; set_limit).
        self.limit: int | None = None
        self.keep_limit: int | None = None
        # The most rows a head keeps, where the layers' padded rows would outgrow the limit.
        self.cap: int | None = None
        self.source = inner.source

    def defers(self, n: int) -> bool:
        """A block of ``n`` rows is stored whole until :meth:`EvictionCache.compress`: every
        prompt block, and every row while holding."""
        return n > 1 or self.holding

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def score(self, keys: mx.array, start: int) -> mx.array:
        return generated_tier(self.inner.score(keys, start))


def needs_pass(caches: list[Any]) -> bool:
    """Some layer under :class:`KVzipScorer` holds more rows than the request's budget, some
    of them not yet scored by a pass, and is not holding them for the turn boundary.

    Scored rows alone need none: a layer may keep more than the budget when layers share
    the rows (``budget_mode="global"``), and a pass with nothing to score would still rank
    the rows again and evict, which is not idempotent (protected rows count beyond the
    shares), so the rows a pass kept would be cut again before the answer."""
    return any(
        isinstance(getattr(c, "scorer", None), KVzipScorer)
        and not c.scorer.holding
        and c.size() > (c.scorer.budget or c.budget)
        and _has_unscored(c)
        for c in caches
    )


def _has_unscored(cache: Any) -> bool:
    """Some stored row has a provisional score (below zero, :func:`generated_tier`), or
    none has a score yet."""
    if cache.token_scores is None:
        return True
    pending = cache.token_scores < 0
    if cache.valid is not None:
        pending = pending & cache.valid
    if cache.free is not None:  # the free slot still holds the last victim's row: gone
        slots = mx.arange(pending.shape[-1], dtype=mx.uint32)
        pending = pending & (slots != cache.free)
    return bool(pending.any().item())


def over_limit(caches: list[Any]) -> bool:
    """The layers hold more rows together than the memory the request may hold lets a prompt
    keep before the rows read so far are compressed (:func:`set_limit`): the memory is the
    request's, so a layer whose heads keep more is balanced by the others."""
    limited = _limited(caches)
    return bool(sum(c.size() for c in limited) > sum(c.scorer.limit for c in limited))


def _limited(caches: list[Any]) -> list[Any]:
    """The caches under :class:`KVzipScorer` with a compress-as-read limit (:func:`set_limit`)."""
    return [
        c
        for c in caches
        if isinstance(getattr(c, "scorer", None), KVzipScorer) and c.scorer.limit is not None
    ]


def set_limit(caches: list[Any], rows: int, prefill_chunk: int) -> None:
    """Compress the prompt read so far whenever the layers hold more than ``rows`` rows a
    layer, read ``prefill_chunk`` tokens at a time (one more where that would leave one:
    what the request reserved, :func:`qfserve.engine.kv.kvzip.policy.compress_as_read`).

    After a pass the layers may keep more than ``rows`` (their ``keep_limit``, which their
    padded rows are held to: :mod:`qfserve.engine.kv.kvzip.shares`). The reservation holds
    a pass over up to ``rows`` and a read of unscored rows; once what is kept leaves less
    than a read below ``rows``, a pass runs after every read, over that read and the rows
    no pass scored yet (a kept turn's last generated ones, in its recent window), so the
    rest of that room is the kept rows'."""
    read = prefill_chunk + 1
    for cache in caches:
        if isinstance(getattr(cache, "scorer", None), KVzipScorer):
            unscored = read + cache.recent + 1
            keep = rows + min(DEFAULT_CHUNK, rows + read) - min(DEFAULT_CHUNK, unscored)
            cache.scorer.limit, cache.scorer.keep_limit = rows, keep


def beyond_keep(caches: list[Any]) -> int:
    """Rows the layers hold together beyond their ``keep_limit`` (:func:`set_limit`): a
    kept turn compressed without a limit may hold more than a pass would leave."""
    limited = _limited(caches)
    held = sum(int(c.size()) for c in limited)
    return max(0, held - sum(int(c.scorer.keep_limit) for c in limited))


def hold(caches: list[Any], on: bool = True) -> None:
    """Keep every row of a kvzip request's caches (``on``) until the turn is kept for reuse
    and compressed, or let them evict again."""
    for cache in caches:
        if isinstance(getattr(cache, "scorer", None), KVzipScorer):
            cache.scorer.holding = on


def holding(caches: list[Any]) -> bool:
    """Some layer holds its rows for the turn boundary (:func:`hold`)."""
    return any(getattr(getattr(c, "scorer", None), "holding", False) for c in caches)
