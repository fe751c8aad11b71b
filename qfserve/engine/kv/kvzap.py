"""KVzap's scorer on the eviction core: every row scored as it is written, from a surrogate.

A layer's :class:`KVzapScorer` reads the hidden state its layer's input norm just computed
(:class:`qfserve.calibrations.kvzap.hidden.HiddenTap`) for the rows being written and scores
each by its surrogate (:mod:`qfserve.calibrations.kvzap.surrogate`): the predicted log
KVzip+ score of that row, per KV head. So prompt chunks, later turns and decode steps are all
ranked by one learned estimate of what a reconstruction of the context would read, at the
cost of one small product per row and no extra pass: a prompt under memory pressure is
compressed as it is read, and decode keeps its O(budget) single-row eviction.

Where the request's layers share its rows (``budget_mode="global"``, as KVzap's paper and
kvpress's ``DMSPress`` apply it: one threshold over every layer and head), a prompt block is
stored whole as it is read, and once the read ends (:class:`KVzapPolicy`) the layers take
their shares of one top-k of the rows' predicted scores (:mod:`qfserve.engine.kv.kvzip.shares`,
KVzip's global allocation): layers and heads whose keys the reconstruction reads keep more.
Why: a fact stated once is read by few heads of few layers; a per-head budget keeps the same
share of every head, and on the needle in prose it kept what Q-Filters keep (``bench/RESULTS.md``).
The scores are fixed when a row is written, so no pass is needed: the rows are shared out
after every prefill chunk, and memory stays bounded while a prompt is read. A layer is stored
padded to its longest head, and the heads that take most rows are the ones that copy from the
context: capped to keep the padded rows within what per-head budgets hold, the needle in
prose fell from 6/6 to 1/6 at each of 2x, 4x and 8x (1k-2k tokens, in process). So they keep them, and the request
reserves what that can take: the layers' longest heads hold at most every row shared, so a
layer holds ``n_kv_heads * budget`` rows a head on average at most, and a chunk beside them
while it is read.

Rows it cannot score (a cache restored without its hidden states, which never happens in a
forward pass) rank by K-norm mapped below every surrogate score.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx

from qfserve.calibrations.kvzap.hidden import HiddenTap
from qfserve.calibrations.kvzap.surrogate import forward
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.memory import kv_need, need_param, shape
from qfserve.engine.kv.methods import Policy, Reservation, Work
from qfserve.engine.kv.scorers import AlwaysReady

_BELOW = -1e4  # under any log KVzip+ score a surrogate predicts (scores are attention shares)


class KVzapScorer(AlwaysReady):
    """A layer's scorer under ``method="kvzap"``.

    Args:
        tap: The layer's hidden-state tap.
        weights: The layer's surrogate weights (:func:`qfserve.calibrations.kvzap.surrogate.
            forward`'s).
        shared: The request's layers share its rows (``budget_mode="global"``): prompt
            blocks are stored whole until :func:`share` evicts every layer at once.
    """

    source = "kvzap"
    # Predicted log KVzip+ scores: one target for every head and layer, so they rank across
    # heads as they are (no per-head normalisation, as KVzip's attention weights).
    scores_are_weights = True

    def __init__(
        self, tap: HiddenTap, weights: tuple[mx.array, ...], *, shared: bool = False
    ) -> None:
        self.tap = tap
        self.weights = weights
        self.shared = shared
        # As KVzip's scorer (the shares read them): the request's budget before a layer
        # takes its share, and no cap on a head's rows (no compress-as-read limit).
        self.budget: int | None = None
        self.cap: int | None = None
        self.keep_limit: int | None = None

    def defers(self, n: int) -> bool:
        """A prompt block is stored whole until :func:`share` (rows shared across layers)."""
        return self.shared and n > 1

    @property
    def tracks_positions(self) -> bool:
        """Shared rows leave heads ragged, whose decode slots are ordered by true position
        (as KVzip's)."""
        return self.shared

    @property
    def nbytes(self) -> int:
        return 0  # the weights are the model's, shared by every request

    def score(self, keys: mx.array, start: int) -> mx.array:
        n = keys.shape[2]
        hidden = self.tap.take(n)
        if hidden is None:  # no hidden state for these rows: below every surrogate score
            norms = mx.sqrt(mx.square(keys.astype(mx.float32)).sum(axis=-1))
            return _BELOW - norms
        if hidden.dtype != mx.float32:
            hidden = hidden.astype(mx.float32)
        return forward(hidden, self.weights).transpose(0, 2, 1)  # (1, N, H) -> (1, H, N)


def kvzap_scorer(tap: Any, weights: tuple[mx.array, ...], *, shared: bool = False) -> KVzapScorer:
    """The scorer of one layer (``tap``: its :class:`HiddenTap`)."""
    if not isinstance(tap, HiddenTap):
        raise ValueError("method 'kvzap' needs the layer's hidden-state tap")
    return KVzapScorer(tap, weights, shared=shared)


def share(caches: list[Any]) -> None:
    """Evict the request's kvzap caches that share its rows down to their shares of one
    top-k over every layer's stored scores, where some holds more than the request's budget
    (a prompt block stored whole)."""
    from qfserve.engine.kv.kvzip.shares import evict

    shared = [
        c for c in caches if isinstance(getattr(c, "scorer", None), KVzapScorer) and c.scorer.shared
    ]
    if not any(c.size() > (c.scorer.budget or c.budget) for c in shared):
        return
    for cache in shared:
        cache.prepare_compress()
    # Shared rows track positions, so the raw per-row scores are ``token_scores`` (``scores``
    # holds the decode step's ranks, padding at +inf), as a block appended to them reads.
    evict(shared, [cache.token_scores for cache in shared])


class KVzapPolicy(Policy):
    """KVzap's policy: where the layers share the rows, each prompt chunk read is shared out
    (:func:`share`) before the next, and the prompt before decoding, and the request
    reserves the padded rows that can take (see the module doc); else the plain one."""

    @classmethod
    def reserved_rows(cls, budget: int, config: CacheConfig, heads: int, prefill_chunk: int) -> int:
        if config.budget_mode != "global":
            return budget
        return heads * budget + prefill_chunk + 1  # every row shared, and a chunk read

    def reserve(
        self,
        loaded: Any,
        prompt_tokens: int,
        max_tokens: int,
        *,
        max_kv_bytes: int,
        prefill_chunk: int,
        kept: bool,
    ) -> Reservation:
        heads = shape(loaded.model, loaded.config)[1]
        rows = self.reserved_rows(self.config.budget, self.config, heads, prefill_chunk)
        config = replace(self.config, budget=rows)
        return Reservation(kv_need(loaded, config, prompt_tokens, max_tokens), need_param(config))

    def after_read(self, tokens: Sequence[int]) -> Work | None:
        share(self.caches)
        return None

    def before_decode(self, tokens: Sequence[int]) -> Work | None:
        share(self.caches)
        return None
