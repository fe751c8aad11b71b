"""The reconstruction pass (see :mod:`qfserve.engine.kv.kvzip`): run chunk by chunk over the
rows no earlier pass scored, each layer's view scoring its stored rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import RotatingKVCache, create_attention_mask

from qfserve.calibrations.repeat import RepeatPrompt
from qfserve.engine.kv import blocked
from qfserve.engine.kv.attention import native_kernel
from qfserve.engine.kv.kvzip.scorer import (
    DEFAULT_BLOCK,
    DEFAULT_CHUNK,
    REPEAT_ROWS,
    KVzipScorer,
    hold,
    holding,
    needs_pass,
)
from qfserve.engine.kv.kvzip.shares import evict


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
        stored = self.cache
        return (
            mx.concatenate([stored.keys, self.keys], axis=2),
            mx.concatenate([stored.values, self.values], axis=2),
        )

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any
    ) -> mx.array:
        """The layer's attention for a reconstruction block (through the model's attention
        hook, :mod:`qfserve.engine.kv.attention`): the block's output, and from the same
        exponentials each stored row's score.

        The forward pass attends to every stored row; a score's softmax runs over the sinks,
        the stored rows of the chunk and the reconstruction rows only (kvpress's), so its
        denominator sums those columns of the tile's exponentials. The native kernel
        (:func:`qfserve.engine.kv.attention.native_kernel`) computes both in one op;
        without it, numpy's tiles (:func:`blocked.block_attention`) with an observer.
        """
        sinks, lo, hi, start, end = self._span
        S0 = self.cache.keys.shape[2]
        span = self.cache.positions[:, :, lo:hi]
        ours = (span >= start) & (span < end)  # (B, H, hi - lo): heads keep different rows
        if self.cache.valid is not None:
            ours = ours & self.cache.valid[:, :, lo:hi]
        kernel = native_kernel()
        if kernel is not None and queries.dtype == keys.dtype == mx.float32:
            B, H = ours.shape[:2]
            counted = mx.concatenate(  # (B, H, S): the columns of the scores' softmax
                [
                    mx.broadcast_to(mx.arange(lo) < sinks, (B, H, lo)),
                    ours,
                    mx.zeros((B, H, S0 - hi), dtype=mx.bool_),
                    mx.ones((B, H, keys.shape[2] - S0), dtype=mx.bool_),
                ],
                axis=2,
            )
            out, scores = kernel.reconstruction_attention(  # the chunk's stored rows scored
                queries,
                keys,
                values,
                scale,
                counted,
                key_mask=self.head_mask,
                score_from=lo,
                score_to=hi,
            )
            self.scores[:, :, lo:hi] = mx.maximum(self.scores[:, :, lo:hi], scores[:, :, lo:hi])
            mx.eval(out, self.scores)
            return cast(mx.array, out)
        weight = np.asarray(ours.astype(mx.float32))  # (B, H, hi - lo)
        best = np.zeros(weight.shape, dtype=np.float32)

        def observe(b: int, h: int, first: int, e: np.ndarray, total: np.ndarray) -> None:
            w = weight[b, h]
            chunk = e[:, :, lo:hi]  # (G, rows, hi - lo)
            kept = e[:, :, :sinks].sum(-1) + chunk @ w + e[:, :, S0:].sum(-1)
            # A row's weight is a column factor: the max over queries runs before it.
            chunk *= np.reciprocal(kept)[..., None]  # in place: the tile is done with them
            score = chunk.max(axis=(0, 1)) * w
            np.maximum(best[b, h], score, out=best[b, h])

        out = blocked.block_attention(
            queries, keys, values, scale, key_mask=self.head_mask, observe=observe
        )
        self.scores[:, :, lo:hi] = mx.maximum(self.scores[:, :, lo:hi], mx.array(best))
        mx.eval(out, self.scores)
        return out


def _window_copy(cache: RotatingKVCache) -> RotatingKVCache:
    """A sliding-window layer's stand-in for one chunk of the pass: a copy of its rotating
    cache (arrays shared, never written: MLX arrays are values), so the pass's rows are read
    with the layer's own window and dropped with the copy. Nothing in it is scored."""
    copy = RotatingKVCache(max_size=cache.max_size, keep=cache.keep)
    if cache.keys is not None:
        copy.state = cache.state  # keys, values, offset, keep, max_size and write index
    return copy


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
        group: The ``mx.distributed`` group the model is split over, if any: every rank
            must start the pass at the same position to feed the same tokens, though each
            holds (and has evicted) only its own heads' rows.
    """

    def __init__(
        self,
        model: Any,
        caches: list[Any],
        tokens: Sequence[int],
        repeat: RepeatPrompt,
        *,
        chunk: int = DEFAULT_CHUNK,
        group: Any = None,
    ) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        scored = [c for c in caches if isinstance(getattr(c, "scorer", None), KVzipScorer)]
        windows = [c for c in caches if isinstance(c, RotatingKVCache)]
        if scored and len(scored) + len(windows) != len(caches):
            raise ValueError(
                "kvzip needs every full-attention layer's cache to be an eviction cache"
            )
        for cache in scored:
            if cache.offset != len(tokens):
                raise ValueError(f"the caches hold {cache.offset} tokens, got {len(tokens)}")
            cache.prepare_compress()
        self.model = model
        self.caches = scored
        self._layers = caches  # the model's caches in order: scored, or sliding windows
        self.first = first_unscored(scored, len(tokens), group)
        self._plan = repeat.chunks(tokens, chunk, self.first) if scored else []
        self._views = [_ReconstructionView(c, self.first) for c in scored]
        self._fed = 0  # ids of the current chunk fed so far
        self._stand_ins: list[Any] = []  # per layer for the current chunk

    @property
    def done(self) -> bool:
        return not self._plan

    def step(self, limit: int) -> int:
        """Feed about ``limit`` reconstruction tokens; returns how many it fed. A chunk's
        rest within ``REPEAT_ROWS`` of the limit is fed whole: a chunk of ``limit`` context
        tokens is one forward pass, not one and a sliver of its prompt's length (every
        forward packs all the stored rows). Once every chunk is fed, each cache is compressed
        to its budget."""
        fed = 0
        while self._plan and fed < limit:
            start, end, ids = self._plan[0]
            if self._fed == 0:
                for view in self._views:
                    view.begin(start, end)
                views = iter(self._views)
                self._stand_ins = [
                    _window_copy(c) if isinstance(c, RotatingKVCache) else next(views)
                    for c in self._layers
                ]
            rest = len(ids) - self._fed
            n = rest if rest <= limit - fed + REPEAT_ROWS else limit - fed
            block = mx.array(ids[self._fed : self._fed + n])[None]
            taps = [view.cache.scorer.tap for view in self._views]
            offers = [tap.offer for tap in taps]
            try:  # the pass's queries are not traffic to learn filters from
                for tap in taps:
                    tap.offer = None
                self.model(block, cache=self._stand_ins)
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


def first_unscored(caches: list[Any], n: int, group: Any = None) -> int:
    """The first position whose row no pass has scored yet (a prompt block's or a generated
    row's provisional score is below zero, :func:`generated_tier`); ``n`` if none. Over a
    ``group`` of ranks, the first over all of them."""
    first = mx.array(n)
    for cache in caches:
        pending = cache.token_scores < 0
        if cache.valid is not None:
            pending = pending & cache.valid
        first = mx.minimum(first, mx.where(pending, cache.positions, n).min())
    if group is not None and group.size() > 1:
        first = mx.distributed.all_min(first, group=group)
    return int(cast(int, first.item()))


def compress(
    model: Any,
    caches: list[Any],
    tokens: Sequence[int],
    repeat: RepeatPrompt,
    *,
    chunk: int = DEFAULT_CHUNK,
    block: int = DEFAULT_BLOCK,
    group: Any = None,
) -> None:
    """Run the whole reconstruction pass on ``caches`` and evict each to its budget.

    Args:
        model: The caches' model.
        caches: One request's caches, holding ``tokens``.
        tokens: Every token the caches have seen, in order.
        repeat: The tokenizer's :class:`RepeatPrompt`.
        chunk: Context tokens reconstructed at once.
        block: Reconstruction tokens per forward pass.
        group: The ranks the model is split over, if any (:class:`Reconstruction`).
    """
    run = Reconstruction(model, caches, tokens, repeat, chunk=chunk, group=group)
    while not run.done:
        run.step(block)


def settle(
    model: Any, caches: list[Any], tokens: Sequence[int], repeat: RepeatPrompt, *, group: Any = None
) -> None:
    """A kvzip turn that answered on its full cache is compressed before it is kept, so the
    next turn continues a bounded cache scored without knowing its question (the whole pass
    in one go; a no-op for other caches). ``tokens``: the prompt and the answer."""
    if not holding(caches):
        return
    hold(caches, False)
    if needs_pass(caches):
        seen = max(int(c.offset) for c in caches)
        compress(model, caches, tokens[:seen], repeat, group=group)
