"""A KV cache that keeps at most ``budget`` rows per KV head, for any mlx-lm model.

It honours mlx-lm's cache protocol (``update_and_fetch``, ``offset``, ``make_mask``,
``state``, ``size``, ``nbytes``, ``empty``, ``is_trimmable``/``trim``), so mlx-lm's models and
generation loop run on it unchanged. Which rows survive is decided by a scorer
(:mod:`engine.scorers`) and the shared eviction core (:mod:`engine.evict`).

Timing: a block of N new rows is appended and returned whole, so its own queries attend to
all of it; eviction then trims what is *stored*, so the next block sees at most ``budget``
old rows plus itself. ``offset`` is the absolute position (RoPE must see true positions after
eviction); survivors keep the rotation they were stored with and are never renumbered.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, create_attention_mask

import metal
from engine.evict import gather_rows, select_drop_one
from engine.scorers import Scorer
from engine.stats import CacheStats


def _row_bytes(keys: mx.array, values: mx.array) -> int:
    """Bytes one sequence position occupies across batch and KV heads (keys + values)."""
    B, H, _, Dk = keys.shape
    return B * H * (Dk * keys.itemsize + values.shape[-1] * values.itemsize)


class EvictionCache:
    """One layer's eviction cache.

    Args:
        scorer: Says how important each key is (see :class:`engine.scorers.Scorer`).
        budget: Rows kept per KV head after every update, sinks and recent rows included.
        n_sink: Leading positions never evicted.
        recent: Trailing positions never evicted.
        use_kernel: Evict blocks with the fused GPU kernel (see
            :func:`metal.resolve_kernel_mode`); the decode step's single-row eviction is
            O(budget) in plain MLX either way.
    """

    def __init__(
        self,
        scorer: Scorer,
        *,
        budget: int,
        n_sink: int = 4,
        recent: int = 0,
        use_kernel: bool = False,
    ):
        if n_sink + recent >= budget:
            raise ValueError(
                f"n_sink + recent must be < budget, got {n_sink} + {recent} >= {budget}"
            )
        self.scorer = scorer
        self.budget = budget
        self.n_sink = n_sink
        self.recent = recent
        self.use_kernel = use_kernel
        self.keys: mx.array | None = None  # (B, H, S, D), temporal order
        self.values: mx.array | None = None  # (B, H, S, Dv)
        self.scores: mx.array | None = None  # (B, H, S) float32, once the scorer is ready
        self.offset = 0  # absolute position of the next token (= tokens seen)
        self.evictions = 0  # updates that dropped rows

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` ``(B, H, N, D)``; return every stored row plus them."""
        start = self.offset
        self.offset += keys.shape[2]
        if self.keys is None or self.values is None:  # set together; None before the first update
            all_keys, all_values = keys, values
        else:
            all_keys = mx.concatenate([self.keys, keys], axis=2)
            all_values = mx.concatenate([self.values, values], axis=2)

        scorer = self.scorer
        scores: mx.array | None
        if scorer.ready:
            new_scores = scorer.score(keys, start)
            scores = (
                new_scores
                if self.scores is None
                else mx.concatenate([self.scores, new_scores], axis=2)
            )
        else:
            # Nothing has been evicted yet, so the stored rows are positions 0 .. offset-1.
            scorer.observe(all_keys, self.offset)
            scores = scorer.score(all_keys, 0) if scorer.ready else None

        L = all_keys.shape[2]
        if scores is None or L <= self.budget:
            self.keys, self.values, self.scores = all_keys, all_values, scores
        else:
            if keys.shape[2] == 1 and L == self.budget + 1:
                keep = select_drop_one(scores, self.n_sink, self.recent)
                self.keys = gather_rows(all_keys, keep)
                self.values = gather_rows(all_values, keep)
                self.scores = gather_rows(scores, keep)
            else:
                self.keys, self.values, self.scores = metal.fused_evict(
                    all_keys,
                    all_values,
                    scores,
                    budget=self.budget,
                    n_sink=self.n_sink,
                    recent=self.recent,
                    use_kernel=self.use_kernel,
                )
            self.evictions += 1
        return all_keys, all_values

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        # The mask describes stored rows: every one of them is visible to the new block.
        return create_attention_mask(
            N, offset=self.size(), return_array=return_array, window_size=window_size
        )

    def size(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self) -> tuple[mx.array, ...]:
        if self.keys is None or self.values is None:
            return ()
        if self.scores is None:
            return self.keys, self.values
        return self.keys, self.values, self.scores

    @state.setter
    def state(self, v: tuple[mx.array, ...]) -> None:
        self.keys, self.values, *rest = v
        self.scores = rest[0] if rest else None

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(
            str(x) for x in (self.offset, self.budget, self.n_sink, self.recent, self.evictions)
        )

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        self.offset, self.budget, self.n_sink, self.recent, self.evictions = map(int, v)

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        scores = 0 if self.scores is None else self.scores.nbytes
        return self.keys.nbytes + self.values.nbytes + scores

    def is_trimmable(self) -> bool:
        # Once rows were dropped, "remove the last n tokens" no longer maps onto stored rows.
        return self.evictions == 0

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = min(self.offset, n)
        keep = self.size() - n
        self.offset -= n
        if self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
            if self.scores is not None:
                self.scores = self.scores[..., :keep]
        return n

    def stats(self) -> CacheStats:
        if self.keys is None or self.values is None:
            return CacheStats(filter_source=self.scorer.source)
        row = _row_bytes(self.keys, self.values)
        return CacheStats(
            tokens_seen=self.offset,
            tokens_kept=self.size(),
            kept_bytes=row * self.size(),
            full_seq_bytes=row * self.offset,
            evictions=self.evictions,
            filter_source=self.scorer.source,
            filter_bytes=self.scorer.nbytes,
        )


class FullKVCache(KVCache):
    """mlx-lm's own ``KVCache`` (the no-eviction control arm) with the same statistics."""

    def stats(self) -> CacheStats:
        if self.keys is None or self.values is None:
            return CacheStats()
        row = _row_bytes(self.keys, self.values)
        return CacheStats(
            tokens_seen=self.offset,
            tokens_kept=self.offset,
            kept_bytes=row * self.offset,
            full_seq_bytes=row * self.offset,
        )
