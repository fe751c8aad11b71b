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
stored whole as it is read, and after every prefill chunk (:class:`KVzapPolicy`) the layers
take their shares of ``budget x layers`` rows a head by the rows' predicted scores
(:func:`layer_rows`): layers whose keys a reconstruction would read keep more. Why: a fact
stated once is read by few heads of few layers; a per-head budget keeps the same share of
every layer, and on the needle in prose it kept what Q-Filters keep (``bench/RESULTS.md``).
The scores are fixed when a row is written, so no pass is needed, and memory stays bounded
while a prompt is read: a request reserves ``budget`` rows a head on average over the layers
and a chunk beside them. Every head of a layer keeps the same count, its neediest head's:
a layer is stored at its longest head's length, so shares counted per head (KVzip's) hold up
to ``n_kv_heads`` times the budget's bytes, and the heads that take most rows, the ones that
copy from the context, are the ones a cap would cut. Decode shares too
(:func:`share_in_decode`): after a share each layer stores :func:`decode_room` decode rows
whole beside its share, then evicts one a step, and the layers share again every
:data:`DECODE_SHARE_PERIOD` rooms; a head holds ``budget`` rows on average over the layers
after each share, and that room more (a chunk of the reservation) between two.

Rows it cannot score (a cache restored without its hidden states, which never happens in a
forward pass) rank by K-norm mapped below every surrogate score.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from qfserve.calibrations.kvzap.hidden import HiddenTap
from qfserve.calibrations.kvzap.surrogate import forward
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.methods import Policy, Work
from qfserve.engine.kv.scorers import AlwaysReady, ScoreForm

_BELOW = -1e4  # under any log KVzip+ score a surrogate predicts (scores are attention shares)
# Decode rows a layer stores whole after a share across layers (at most an eighth of a
# budget), and the shares' period in those rooms. Why share in decode: a layer's share is
# fixed after the prompt otherwise, and each layer then evicts at its own rate; shared again,
# the layers whose new rows score highest keep more (bench/RESULTS.md: a long generation).
DECODE_ROOM = 32
DECODE_SHARE_PERIOD = 8


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
        self.budget: int | None = None  # the request's, before a layer takes its share
        self._map: tuple[mx.array, mx.array] | None = None  # :meth:`form`'s weight and bias

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

    def form(self) -> ScoreForm | None:
        """A decode row's score as the eviction step computes it from the row's hidden state
        before the norm (a linear surrogate, and a fused block's row); else ``None``, and
        :meth:`score` scores it. Why: apart, the norm, a one-row BLAS product and a transpose
        cost ~50 us a layer on the CPU, a tenth of a SmolLM2 decode step."""
        raw = self.tap.peek_raw() if len(self.weights) == 2 else None
        if raw is None:
            return None
        if self._map is None:  # (H, D) and (H, 1): the native step's layout, made once
            w, b = self.weights
            self._map = (mx.contiguous(w.T).astype(mx.float32), b.reshape(-1, 1))
            mx.eval(self._map)
        return ScoreForm("hidden", self._map[0], self._map[1], raw)

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


def decode_room(budget: int) -> int:
    """Decode rows a layer of a request whose layers share its rows stores whole between two
    shares: :data:`DECODE_ROOM`, at most an eighth of the ``budget``."""
    return max(1, min(DECODE_ROOM, budget // 8))


def share(caches: list[Any], *, decode: bool = False) -> None:
    """Evict the request's kvzap caches that share its rows to their layers' shares
    (:func:`layer_rows`), where some holds more than its share (a prompt block stored
    whole); with ``decode``, always, each layer then storing :func:`decode_room` decode rows
    whole until the next share, beside its share (as a prompt chunk is read beside the
    shares, within what the request reserves)."""
    shared = _shared(caches)
    if not shared or not decode and not any(c.size() > c.budget for c in shared):
        return
    for cache in shared:
        cache.prepare_compress()
        if cache.scorer.budget is None:  # the request's budget, kept for later turns
            cache.scorer.budget = cache.budget
    room = decode_room(shared[0].scorer.budget) if decode else 0
    # Shared rows track positions, so the raw per-row scores are ``token_scores`` (``scores``
    # holds the decode step's ranks), as a block appended to them reads.
    scores = [cache.token_scores for cache in shared]
    rows = layer_rows(shared, scores)
    for cache, n, layer_scores in zip(shared, rows, scores, strict=True):
        cache.budget = n
        cache.compress(layer_scores)
        cache.budget = n + room
    mx.eval([c.state for c in shared])


def _shared(caches: list[Any]) -> list[Any]:
    """The request's kvzap caches whose layers share its rows."""
    return [
        c for c in caches if isinstance(getattr(c, "scorer", None), KVzapScorer) and c.scorer.shared
    ]


def share_in_decode(caches: list[Any], steps: int) -> None:
    """After a request's ``steps``-th decode step: :func:`share` ``decode`` every
    :data:`DECODE_SHARE_PERIOD` times the room. Between two shares a layer stores the room's
    rows whole, then evicts one a step at its share and the room, by the native decode step:
    storing rows whole (mlx ops a row) costs more a step than evicting (one native op)."""
    shared = _shared(caches)
    budget = shared[0].scorer.budget if shared else None
    if budget is not None and steps % (DECODE_SHARE_PERIOD * decode_room(budget)) == 0:
        share(caches, decode=True)


def layer_rows(caches: list[Any], scores: list[mx.array]) -> list[int]:
    """Rows per head of each layer when the layers share the request's rows: every head of
    a layer keeps the same count, the counts summing to the request's ``budget`` times the
    layers.

    A layer is stored at its longest head's length, so rows a head keeps below the longest
    cost nothing more: the count a layer needs is its neediest head's. A layer's k-th row is
    worth its heads' best k-th score, and the layers take the best of those over every layer
    (protected rows, sinks and the recent window, first), ties trimmed from the longest.

    Args:
        caches: The request's kvzap caches (one batch row), rows in temporal order.
        scores: ``(1, H, S)`` float32 per layer, the rows' predicted scores.
    """
    worth = []
    for cache, layer_scores in zip(caches, scores, strict=True):
        ranked = np.array(layer_scores[0], dtype=np.float32)
        S = ranked.shape[-1]
        protected = np.zeros(S, dtype=bool)
        protected[: cache.n_sink] = True
        protected[max(0, S - cache.recent) :] = True
        ranked[:, protected] = np.inf
        best_first = -np.sort(-ranked, axis=-1)  # each head's rows
        worth.append(best_first.max(axis=0))  # the heads' best k-th: non-increasing in k
    total = sum(c.scorer.budget for c in caches)
    pool = np.concatenate(worth)
    kth = -np.inf if pool.size <= total else np.partition(pool, pool.size - total)[-total]
    rows = [int((w >= kth).sum()) for w in worth]
    while sum(rows) > total:  # ties at the threshold
        rows[rows.index(max(rows))] -= 1
    return rows


class KVzapPolicy(Policy):
    """KVzap's policy: where the layers share the rows, each prompt chunk read is shared out
    (:func:`share`) before the next, the prompt before decoding, and the rows held in decode
    every few rooms (:func:`share_in_decode`); the request reserves the rows they hold on
    average and a chunk beside them (see the module doc). Else the plain one."""

    @classmethod
    def reserved_rows(cls, budget: int, config: CacheConfig, prefill_chunk: int) -> int:
        if config.budget_mode != "global":
            return budget
        # The layers' mean, and a chunk read beside it (a prompt's, or decode's room).
        return budget + max(prefill_chunk, decode_room(budget)) + 1

    def after_read(self, tokens: Sequence[int]) -> Work | None:
        share(self.caches)
        return None

    def before_decode(self, tokens: Sequence[int]) -> Work | None:
        share(self.caches, decode=True)
        return None

    def after_step(self, steps: int) -> None:
        if self.config.budget_mode == "global":  # per-head rows: nothing to look at a step
            share_in_decode(self.caches, steps)
