"""Context-reconstruction scoring (KVzip, Kim et al., arXiv 2505.23416) on the eviction core.

Query-agnostic scorers (Q-Filters, K-norm) guess from a key alone what later queries will
read; a fact stated once in prose is easy to lose that way. KVzip asks the model instead:
after the context is read, the model is teacher-forced on ``"Repeat the previous context
exactly."`` followed by the context itself, and a stored key's score is the most attention
it receives from any reconstruction query of its KV group. A key the model needs to say the
context again is a key a later question can need, whatever that question is, so a cache kept
this way answers questions it was compressed without.

The pass (:class:`Reconstruction`), as kvpress's ``KVzipPress`` runs it: the context's tokens
are cut into chunks of :data:`DEFAULT_CHUNK`; chunk ``i`` is reconstructed on its own after
:data:`REPEAT_FIRST` (later chunks: :data:`REPEAT_NEXT` and the previous chunk's last
:data:`PREV_TAIL` tokens), then the chat template's assistant opening. Each reconstruction
query's softmax runs over the sinks, the stored rows of its chunk and the reconstruction's own
keys (causal); scores are the max over queries and the group's query heads. The pass's own
keys and values live in a per-layer view (:class:`_ReconstructionView`) and are dropped, so
peak memory is the stored rows plus one chunk; RoPE positions continue after the context,
and the kept rows keep the rotation they were stored with.

Where it sits: a :class:`KVzipScorer` makes its :class:`qfserve.engine.kv.cache.EvictionCache` store
prompt blocks whole (:meth:`KVzipScorer.defers`); :func:`compress` (or the scheduler, chunk by chunk)
runs the pass and hands each cache its scores (:meth:`EvictionCache.compress`), which the
shared core turns into ``budget`` rows per head or a layer budget shared across heads.
Generated rows are ranked by the request's Q-Filters (calibrated filters, else K-norm)
mapped below every context row (:func:`generated_tier`), so the decode step keeps its
O(budget) single-row eviction: the rows KVzip chose stay, generated rows beyond the recent
window go first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from qfserve.engine.kv.scorers import AlwaysReady, Scorer
from qfserve.engine.kv.selfcal import QueryTap

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
DEFAULT_CHUNK = 2048  # context tokens reconstructed at once (kvpress's and the paper's)
PREV_TAIL = 8  # tokens of the previous chunk that open the next chunk's prompt
REPEAT_ROWS = 64  # at most the repeat prompt, the previous tail and the template's suffix
DEFAULT_BLOCK = 512  # reconstruction tokens per forward pass (bounds the score matrices)


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
        # Rows the prompt may hold before what is read so far is compressed (memory).
        self.limit: int | None = None
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


@dataclass(frozen=True)
class RepeatPrompt:
    """The token ids that open each reconstruction chunk, for one tokenizer.

    Args:
        first: ``REPEAT_FIRST``'s ids.
        next: ``REPEAT_NEXT``'s ids (the previous chunk's tail follows them).
        suffix: What the chat template puts between a user turn and the reply (``"\\n"``
            without a template), as kvpress derives it.
    """

    first: tuple[int, ...]
    next: tuple[int, ...]
    suffix: tuple[int, ...]

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> RepeatPrompt:
        """Derive the ids from ``tokenizer`` (mlx-lm's wrapper or a ``transformers`` one)."""
        suffix_text = "\n"
        if getattr(tokenizer, "chat_template", None):
            dummy = "dummy context"
            separator = "\n" + "#" * len(dummy)
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": dummy + separator}],
                add_generation_prompt=True,
                tokenize=False,
            )
            suffix_text = text.split(separator)[-1]

        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(ids(REPEAT_FIRST), ids(REPEAT_NEXT), ids(suffix_text))

    def chunks(
        self, tokens: Sequence[int], chunk: int, first: int = 0
    ) -> list[tuple[int, int, list[int]]]:
        """``(start, end, ids)`` per chunk of ``tokens[first:]``: the context span it
        reconstructs and the ids fed for it (prompt, suffix, the span's tokens)."""
        out = []
        for start in range(first, len(tokens), chunk):
            end = min(start + chunk, len(tokens))
            lead = (
                self.first
                if start == 0
                else (*self.next, *tokens[max(0, start - PREV_TAIL) : start])
            )
            out.append((start, end, [*lead, *self.suffix, *tokens[start:end]]))
        return out


class _ReconstructionView:
    """Stands in for one layer's cache during the pass: attention sees the stored rows plus
    the chunk's reconstruction rows so far; those rows stay here and are dropped.

    It accumulates ``scores`` ``(B, H, S)`` over the stored rows: the max over every
    reconstruction query of the group of its softmax weight, over the sinks, the stored rows
    of the chunk and the reconstruction keys (causal).
    """

    def __init__(self, cache: Any, first: int) -> None:
        self.cache = cache
        # Rows before ``first`` keep the scores an earlier pass gave them.
        self.scores = mx.where(cache.positions < first, mx.maximum(cache.token_scores, 0.0), 0.0)
        self.keys: mx.array | None = None  # the chunk's reconstruction rows
        self.values: mx.array | None = None
        # Sinks, the chunk's first and last stored row (over heads), its positions.
        self._span = (0, 0, 0, 0, 0)

    def begin(self, start: int, end: int) -> None:
        """Reconstruct context positions ``[start, end)`` next."""
        positions = self.cache.positions
        if self.cache.valid is not None:  # padding rows (at each head's end) join no chunk
            positions = mx.where(self.cache.valid, positions, mx.iinfo(mx.int32).max)
        lo = int((positions < start).sum(axis=-1).min().item())
        hi = int((positions < end).sum(axis=-1).max().item())
        sinks = min(self.cache.n_sink, start, lo)
        self._span = (sinks, lo, hi, start, end)
        self.keys = self.values = None

    @property
    def offset(self) -> int:
        return int(self.cache.offset) + (0 if self.keys is None else self.keys.shape[2])

    @property
    def head_mask(self) -> mx.array | None:
        valid = self.cache.valid
        if valid is None or self.keys is None:
            return None
        return mx.concatenate([valid, mx.ones(self.keys.shape[:3], dtype=mx.bool_)], axis=2)

    def size(self) -> int:
        return int(self.cache.keys.shape[2]) + (0 if self.keys is None else self.keys.shape[2])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return create_attention_mask(
            N, offset=self.size(), return_array=return_array, window_size=window_size
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None or self.values is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self._score(keys.shape[2])
        stored = self.cache
        return (
            mx.concatenate([stored.keys, self.keys], axis=2),
            mx.concatenate([stored.values, self.values], axis=2),
        )

    def _score(self, N: int) -> None:
        assert self.keys is not None
        tap: QueryTap = self.cache.scorer.tap
        queries = tap.take(N)
        if queries is None:
            raise RuntimeError("kvzip: the layer's query tap holds no reconstruction queries")
        sinks, lo, hi, start, end = self._span
        stored, positions = self.cache.keys, self.cache.positions
        B, Hq, _, D = queries.shape
        H = stored.shape[1]
        R = self.keys.shape[2]  # reconstruction rows, the N new ones last
        keys = mx.concatenate([stored[:, :, :sinks], stored[:, :, lo:hi], self.keys], axis=2)
        q = queries.astype(mx.float32).reshape(B, H, Hq // H, N, D)
        logits = (q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)) * tap.scale
        # (B, H, G, N, sinks + hi - lo + R). A stored row of [lo, hi) outside the chunk's
        # positions (heads keep different rows) is masked, as are later reconstruction rows.
        span = positions[:, :, lo:hi]
        ours = (span >= start) & (span < end)  # (B, H, hi - lo)
        if self.cache.valid is not None:
            ours = ours & self.cache.valid[:, :, lo:hi]
        causal = mx.arange(R)[None, :] <= mx.arange(R - N, R)[:, None]  # (N, R)
        visible = mx.concatenate(
            [
                mx.broadcast_to(mx.ones((1, 1, 1, 1, sinks), dtype=mx.bool_), (B, H, 1, N, sinks)),
                mx.broadcast_to(ours[:, :, None, None, :], (B, H, 1, N, hi - lo)),
                mx.broadcast_to(causal[None, None, None], (B, H, 1, N, R)),
            ],
            axis=-1,
        )
        weights = mx.softmax(mx.where(visible, logits, -mx.inf), axis=-1)
        best = weights[..., sinks : sinks + hi - lo].max(axis=(2, 3))  # (B, H, hi - lo)
        best = mx.where(ours, best, 0.0)
        head = self.scores[:, :, lo:hi]
        self.scores[:, :, lo:hi] = mx.maximum(head, best)


class Reconstruction:
    """The reconstruction pass over one request's caches, run in steps of ``limit`` tokens
    (the scheduler interleaves it with decoding, as it does prefill chunks).

    A pass reconstructs from the first position no earlier pass scored (a later turn: its
    own tokens and the answer before them), since each chunk is scored on its own: the rows
    kept from earlier turns keep their scores, and a conversation costs one pass over its
    tokens in all, not one per turn over its whole history.

    Args:
        model: The mlx-lm model the caches belong to.
        caches: The request's caches; layers under :class:`KVzipScorer` are scored.
        tokens: The tokens the caches hold, in order (``offset`` of them).
        repeat: The tokenizer's :class:`RepeatPrompt`.
        chunk: Context tokens reconstructed at once.
    """

    def __init__(
        self,
        model: Any,
        caches: list[Any],
        tokens: Sequence[int],
        repeat: RepeatPrompt,
        *,
        chunk: int = DEFAULT_CHUNK,
    ) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        scored = [c for c in caches if isinstance(getattr(c, "scorer", None), KVzipScorer)]
        if scored and len(scored) != len(caches):
            raise ValueError("kvzip needs every layer's cache to be an eviction cache")
        for cache in scored:
            if cache.offset != len(tokens):
                raise ValueError(f"the caches hold {cache.offset} tokens, got {len(tokens)}")
            cache.prepare_compress()
        self.model = model
        self.caches = scored
        self.first = _first_unscored(scored, len(tokens))
        self._plan = repeat.chunks(tokens, chunk, self.first) if scored else []
        self._views = [_ReconstructionView(c, self.first) for c in scored]
        self._fed = 0  # ids of the current chunk fed so far

    @property
    def done(self) -> bool:
        return not self._plan

    def step(self, limit: int) -> int:
        """Feed up to ``limit`` reconstruction tokens; returns how many it fed. Once every
        chunk is fed, each cache is compressed to its budget."""
        fed = 0
        while self._plan and fed < limit:
            start, end, ids = self._plan[0]
            if self._fed == 0:
                for view in self._views:
                    view.begin(start, end)
            n = min(limit - fed, len(ids) - self._fed)
            block = mx.array(ids[self._fed : self._fed + n])[None]
            taps = [view.cache.scorer.tap for view in self._views]
            offers = [tap.offer for tap in taps]
            try:  # the pass's queries are not traffic to learn filters from
                for tap in taps:
                    tap.offer = None
                self.model(block, cache=self._views)
            finally:
                for tap, offer in zip(taps, offers, strict=True):
                    tap.offer = offer
            mx.eval([view.scores for view in self._views])
            self._fed += n
            fed += n
            if self._fed == len(ids):
                self._plan.pop(0)
                self._fed = 0
        if not self._plan and self._views:
            evict(self.caches, [view.scores for view in self._views])
            self._views = []
        return fed


def _first_unscored(caches: list[Any], n: int) -> int:
    """The first position whose row no pass has scored yet (a prompt block's or a generated
    row's provisional score is below zero, :func:`generated_tier`); ``n`` if none."""
    firsts = []
    for cache in caches:
        pending = cache.token_scores < 0
        if cache.valid is not None:
            pending = pending & cache.valid
        firsts.append(mx.where(pending, cache.positions, n).min())
    return min(int(cast(int, f.item())) for f in firsts) if firsts else n


def evict(caches: list[Any], scores: list[mx.array]) -> None:
    """Evict each kvzip cache to its budget by the pass's ``scores`` (one ``(B, H, S)`` per
    cache), the layers first taking their shares of the rows where they share them."""
    if caches and caches[0].scorer.shared:
        for cache, budget in zip(caches, layer_budgets(caches, scores), strict=True):
            cache.budget = budget
    for cache, layer_scores in zip(caches, scores, strict=True):
        cache.compress(layer_scores)
    mx.eval([c.state for c in caches])


def layer_budgets(caches: list[Any], scores: list[mx.array]) -> list[int]:
    """Each layer's rows per head when every layer shares the request's rows (kvpress's
    KVzip default): the global top ``budget * H * n_layers`` of the pass's scores, protected
    rows (sinks, recent window) first; a layer then keeps its share, spread over its heads by
    the same scores (:mod:`qfserve.engine.kv.adaptive`), so heads and layers whose reconstruction
    attention is diffuse give rows to those that read the context.

    Args:
        caches: The request's caches (one batch row), stored rows in temporal order.
        scores: ``(1, H, S)`` float32 per layer, the pass's.
    Returns:
        Rows per head per layer: at least the protected rows, ``H`` times it summing to at
        most ``budget * H * n_layers``.
    """
    ranked = []
    for cache, layer_scores in zip(caches, scores, strict=True):
        if cache.scorer.budget is None:  # the request's budget, kept for later turns
            cache.scorer.budget = cache.budget
        real = mx.ones(layer_scores.shape, dtype=mx.bool_) if cache.valid is None else cache.valid
        from_start = mx.cumsum(real.astype(mx.int32), axis=-1)
        from_end = mx.cumsum(real.astype(mx.int32), axis=-1, reverse=True)
        protected = real & ((from_start <= cache.n_sink) | (from_end <= cache.recent))
        guarded = mx.where(protected, mx.inf, mx.where(real, layer_scores, -mx.inf))
        ranked.append(guarded.reshape(-1))
    flat = mx.concatenate(ranked)
    H = caches[0].keys.shape[1]
    total = sum(c.scorer.budget * H for c in caches)
    kth = mx.sort(flat)[-min(total, flat.size)]
    budgets = []
    for cache, layer in zip(caches, ranked, strict=True):
        rows = int(cast(int, (layer >= kth).sum().item())) // H
        budgets.append(max(rows, cache.n_sink + cache.recent))
    # Ties at the threshold can give more than the total: trim the largest layers.
    excess = sum(budgets) - total // H
    while excess > 0:
        i = max(range(len(budgets)), key=budgets.__getitem__)
        budgets[i] -= 1
        excess -= 1
    return budgets


def needs_pass(caches: list[Any]) -> bool:
    """Some layer under :class:`KVzipScorer` holds more rows than the request's budget and
    is not holding them for the turn boundary."""
    return any(
        isinstance(getattr(c, "scorer", None), KVzipScorer)
        and not c.scorer.holding
        and c.size() > (c.scorer.budget or c.budget)
        for c in caches
    )


def over_limit(caches: list[Any]) -> bool:
    """Some layer holds more rows than the memory its request may hold lets a prompt keep
    before the rows read so far are compressed (:func:`set_limit`)."""
    return any(
        isinstance(getattr(c, "scorer", None), KVzipScorer)
        and c.scorer.limit is not None
        and c.size() > c.scorer.limit
        for c in caches
    )


def set_limit(caches: list[Any], rows: int) -> None:
    """Compress the prompt read so far whenever a layer holds more than ``rows`` rows."""
    for cache in caches:
        if isinstance(getattr(cache, "scorer", None), KVzipScorer):
            cache.scorer.limit = rows


def hold(caches: list[Any], on: bool = True) -> None:
    """Keep every row of a kvzip request's caches (``on``) until the turn is kept for reuse
    and compressed, or let them evict again."""
    for cache in caches:
        if isinstance(getattr(cache, "scorer", None), KVzipScorer):
            cache.scorer.holding = on


def holding(caches: list[Any]) -> bool:
    """Some layer holds its rows for the turn boundary (:func:`hold`)."""
    return any(getattr(getattr(c, "scorer", None), "holding", False) for c in caches)


def compress(
    model: Any,
    caches: list[Any],
    tokens: Sequence[int],
    repeat: RepeatPrompt,
    *,
    chunk: int = DEFAULT_CHUNK,
    block: int = DEFAULT_BLOCK,
) -> None:
    """Run the whole reconstruction pass on ``caches`` and evict each to its budget.

    Args:
        model: The caches' model.
        caches: One request's caches, holding ``tokens``.
        tokens: Every token the caches have seen, in order.
        repeat: The tokenizer's :class:`RepeatPrompt`.
        chunk: Context tokens reconstructed at once.
        block: Reconstruction tokens per forward pass.
    """
    run = Reconstruction(model, caches, tokens, repeat, chunk=chunk)
    while not run.done:
        run.step(block)
