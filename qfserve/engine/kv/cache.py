"""A KV cache that keeps at most ``budget`` rows per KV head, for any mlx-lm model.

It honours mlx-lm's cache protocol (``update_and_fetch``, ``offset``, ``make_mask``,
``state``, ``size``, ``nbytes``, ``empty``, ``is_trimmable``/``trim``), so mlx-lm's models and
generation loop run on it unchanged. Which rows survive is decided by a scorer
(:mod:`qfserve.engine.kv.scorers`) and the shared eviction core (:mod:`qfserve.engine.kv.evict`).

Timing: a block of N new rows is appended and returned whole, so its own queries attend to
all of it; eviction then trims what is *stored*, so the next block sees at most ``budget``
old rows plus itself. ``offset`` is the absolute position (RoPE must see true positions after
eviction); survivors keep the rotation they were stored with and are never renumbered.

Layout: after a block the rows are stored in temporal order; decode rows under the budget are
written in place into growth buffers, and once the cache is full, decode steps use the slot
layout of :mod:`qfserve.engine.kv.slots` (O(budget) per step, no copy).

Chunks (``chunk > 1``): a block eviction ranks rows by their chunk's mean score
(:func:`qfserve.engine.kv.evict.chunk_scores` over the per-token scores and absolute positions the cache
then also stores), so prefill and new turns keep whole chunks, on the plain-MLX path. The
decode step stays O(budget) and per row: at the first eviction every stored row is ranked by
the mean over its chunk's stored rows, a decoded row carries its own score (its chunk is
still being written), and the victim is the lowest of those, so decoding eats the weakest
chunk from its end instead of picking single tokens out of many chunks.

Thresholds (``threshold``, KVzap's way to bound, as kvpress's ``DMSPress``): a row outside
the sinks and the recent window whose score is below the threshold is evicted, the budget
still the cap. The cache's arrays hold one row count for all of a layer's KV heads, so the
layer holds the most rows any head keeps by that rule (:meth:`EvictionCache._threshold_rows`),
each head its best-scored ones: a block (a prompt chunk, a turn) is evicted down to it as it
is read, and a decode step every :data:`THRESHOLD_EVERY` rows (one O(rows) compaction, where a
check per step would cost a copy of the rows each step): between two, rows only join.

Adaptive budgets (``floor``): block evictions share ``budget * H`` rows across the layer's
heads (:mod:`qfserve.engine.kv.adaptive`); heads then hold different row counts, stored padded, with
``head_mask`` telling attention which rows are real (:mod:`qfserve.engine.kv.attention`). Rows
join every head while the layer holds fewer than ``budget * H`` (:mod:`qfserve.engine.kv.ragged`);
at it, a decode step evicts one row per head, so each head's count holds until the next block.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, create_attention_mask

from qfserve import kernels
from qfserve.engine.kv.evict import chunk_scores, gather_rows, select_keep
from qfserve.engine.kv.ragged import RaggedHeads
from qfserve.engine.kv.saved import SavedState
from qfserve.engine.kv.scorers import Scorer
from qfserve.engine.kv.stats import CacheStats

THRESHOLD_EVERY = 32  # decode rows between two threshold compactions


def _row_bytes(keys: mx.array, values: mx.array) -> int:
    """Bytes one sequence position occupies across batch and KV heads (keys + values)."""
    B, H, _, Dk = keys.shape
    return B * H * (Dk * keys.itemsize + values.shape[-1] * values.itemsize)


class EvictionCache(RaggedHeads, SavedState):
    """One layer's eviction cache.

    Args:
        scorer: Says how important each key is (see :class:`qfserve.engine.kv.scorers.Scorer`).
        budget: Rows kept per KV head after every update, sinks and recent rows included.
        n_sink: Leading positions never evicted.
        recent: Trailing positions never evicted.
        chunk: Positions per chunk for block evictions (1 = per-row selection).
        floor: Head-adaptive budgets (:mod:`qfserve.engine.kv.adaptive`): block evictions keep
            ``budget * H`` rows per layer, every head at least ``floor``, stored padded with
            a per-head mask that attention applies (``None``: ``budget`` rows per head).
        positions: Store every row's true position even where the method does not need it,
            for :meth:`kept_positions` (the rows kept are the same).
        use_kernel: Evict blocks with the fused GPU kernel (see
            :func:`qfserve.kernels.resolve_kernel_mode`); the decode step's single-row eviction is
            O(budget) in plain MLX either way, and chunked blocks use plain MLX.
        threshold: Also evict rows outside the sinks and the recent window scoring below it
            (``None``: the budget alone); per-head budgets only.
    """

    def __init__(
        self,
        scorer: Scorer,
        *,
        budget: int,
        n_sink: int = 4,
        recent: int = 0,
        chunk: int = 1,
        floor: int | None = None,
        positions: bool = False,
        use_kernel: bool = False,
        threshold: float | None = None,
    ):
        if n_sink + recent >= budget:
            raise ValueError(
                f"n_sink + recent must be < budget, got {n_sink} + {recent} >= {budget}"
            )
        if not 1 <= chunk < budget:
            raise ValueError(f"chunk must be in [1, budget={budget}), got {chunk}")
        if floor is not None and not n_sink + recent <= floor <= budget:
            raise ValueError(
                f"floor must be in [n_sink + recent = {n_sink + recent}, budget = {budget}], "
                f"got {floor}"
            )
        if threshold is not None and (floor is not None or not math.isfinite(threshold)):
            raise ValueError(f"a threshold must be finite, on per-head budgets: {threshold}")
        self.scorer = scorer
        self.threshold = threshold
        self._since_threshold = 0  # decode rows since the last threshold compaction
        self.budget = budget
        self.n_sink = n_sink
        self.recent = recent
        self.chunk = chunk
        self.floor = floor
        self.keep_positions = positions
        self.use_kernel = use_kernel
        self.keys: mx.array | None = None  # (B, H, S, D)
        self.values: mx.array | None = None  # (B, H, S, Dv)
        self.scores: mx.array | None = None  # (B, H, S) float32, once the scorer is ready
        # Slot layout only (None in temporal order): each slot's rank in time (B, H, S) int32,
        # and the slot the next token goes to (B, H, 1) uint32.
        self.order: mx.array | None = None
        self.free: mx.array | None = None
        # Chunks only: per-token scores (``scores`` then holds the ranks the decode step
        # compares) and absolute positions (B, H, S) int32 (``order`` in the slot layout).
        self.token_scores: mx.array | None = None
        self.positions: mx.array | None = None
        # Adaptive budgets only, once heads are ragged: (B, H, S) bool, False on padding;
        # head_mask is the mask of the rows update_and_fetch last returned.
        self.valid: mx.array | None = None
        self.head_mask: mx.array | None = None
        self._ragged_rows: int | None = None  # real rows of the fullest batch row, when known
        self.offset = 0  # absolute position of the next token (= tokens seen)
        self.evictions = 0  # updates that dropped rows

    def defers(self, n: int) -> bool:
        """A block of ``n`` rows is stored whole until :meth:`compress` scores it (KVzip's
        prompt blocks)."""
        defers = getattr(self.scorer, "defers", None)
        return defers is not None and defers(n)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``keys``/``values`` ``(B, H, N, D)``; return every stored row plus them."""
        if self.threshold is not None and keys.shape[2] == 1 and self.scores is not None:
            self._since_threshold += 1
            if self._since_threshold >= THRESHOLD_EVERY:
                self._since_threshold = 0
                self._compact_below_threshold()
        if self.free is not None:
            if keys.shape[2] == 1:
                self.head_mask = self.valid
                return self._write_into_free_slot(keys, values)
            self._to_temporal_order()
        elif keys.shape[2] == 1 and not self.defers(1) and (grown := self._grow_row(keys, values)):
            return grown
        start = self.offset
        self.offset += keys.shape[2]
        if self.keys is None or self.values is None:  # set together; None before the first update
            all_keys, all_values = keys, values
        else:
            all_keys = mx.concatenate([self.keys, keys], axis=2)
            all_values = mx.concatenate([self.values, values], axis=2)

        scorer = self.scorer
        scores: mx.array | None
        if scorer.ready and scorer.dynamic:  # every row re-scored (TOVA)
            scores = scorer.rescore(all_keys, keys.shape[2])
        elif scorer.ready:
            new_scores = scorer.score(keys, start)
            old_scores = self.scores if not self.tracks else self.token_scores
            scores = (
                new_scores
                if old_scores is None
                else mx.concatenate([old_scores, new_scores], axis=2)
            )
        else:
            # Nothing has been evicted yet, so the stored rows are positions 0 .. offset-1.
            scorer.observe(all_keys, self.offset)
            scores = scorer.score(all_keys, 0) if scorer.ready else None
        positions = None
        if self.tracks and self.positions is None and self.keys is not None:
            # Restored from a state saved before the scorer was ready: nothing was evicted,
            # so the stored rows are positions 0 .. start - 1.
            self.positions = mx.broadcast_to(
                mx.arange(start - self.keys.shape[2], start, dtype=mx.int32), self.keys.shape[:3]
            )
        if self.tracks:
            new_positions = mx.broadcast_to(
                mx.arange(start, self.offset, dtype=mx.int32), keys.shape[:3]
            )
            positions = (
                new_positions
                if self.positions is None
                else mx.concatenate([self.positions, new_positions], axis=2)
            )

        valid = None
        if self.valid is not None:
            valid = mx.concatenate([self.valid, mx.ones(keys.shape[:3], dtype=mx.bool_)], axis=2)
        self.head_mask = valid

        L, N = all_keys.shape[2], keys.shape[2]
        defers = self.defers(N)
        if valid is not None and scores is not None and not defers and not self._ragged_fits(valid):
            self._evict_ragged(all_keys, all_values, scores, valid, positions, N)
        elif defers or valid is not None:
            # A block kept whole for KVzip's pass, or ragged heads under the layer's rows (a
            # budget raised after a block eviction, KVzip's layer share): they grow, as a
            # cache under its budget does.
            if valid is not None and self._ragged_rows is not None:
                self._ragged_rows += keys.shape[1] * N
            self.keys, self.values, self.positions, self.valid = (
                all_keys,
                all_values,
                positions,
                valid,
            )
            self._set_scores(scores)
        # A decode row is bounded by the budget here; the threshold's compaction takes it
        # every THRESHOLD_EVERY rows, whichever path appended it.
        elif scores is None or L <= (limit := self.budget if N == 1 else self._block_limit(scores)):
            self.keys, self.values, self.positions = all_keys, all_values, positions
            self._set_scores(scores)
        elif N == 1 and L == self.budget + 1 and limit == self.budget:
            self._enter_slots(all_keys, all_values, scores, positions)
        else:
            self._evict_block(all_keys, all_values, scores, positions, limit)
        return all_keys, all_values

    def _block_limit(self, scores: mx.array) -> int:
        """Rows a block in temporal order may keep: the budget, or fewer under a threshold."""
        if self.threshold is None:
            return self.budget
        L = scores.shape[2]
        at = mx.arange(L)
        guarded = (at < self.n_sink) | (at >= L - self.recent)
        return self._threshold_rows(scores, guarded)

    def _threshold_rows(self, scores: mx.array, guarded: mx.array, held: Any = None) -> int:
        """The layer's rows under the threshold: per head, the ``guarded`` rows and those
        scoring at or above it (among the ``held`` slots); the most any head keeps, at most
        the budget, and one row more than the protected ones at least (a block eviction
        keeps more than those)."""
        assert self.threshold is not None
        kept = guarded | (scores >= self.threshold)  # NaN: below
        if held is not None:
            kept = kept & held
        most = int(kept.sum(axis=-1).max().item())  # type: ignore[arg-type]
        return max(self.n_sink + self.recent + 1, min(self.budget, most))

    def _compact_below_threshold(self) -> None:
        """A decode step's threshold check: the rows evicted down to what the threshold keeps
        (in temporal order; the next rows grow into buffers again)."""
        assert self.keys is not None and self.scores is not None
        if self.valid is not None or self.defers(1):
            return
        if self.free is not None:  # slot layout: guarded as the victim's choice is
            assert self.order is not None
            slots = mx.arange(self.scores.shape[-1])
            guarded = (slots < self.n_sink) | (self.order >= self.offset - self.recent)
            limit = self._threshold_rows(self.scores, guarded, slots != self.free)
        else:
            limit = self._block_limit(self.scores)
        if limit >= self.size():
            return
        if self.free is not None:
            self._to_temporal_order()
        assert self.keys is not None and self.values is not None and self.scores is not None
        scores = self.token_scores if self.tracks else self.scores
        assert scores is not None
        self._evict_block(self.keys, self.values, scores, self.positions, limit)

    def _evict_block(
        self,
        keys: mx.array,
        values: mx.array,
        scores: mx.array,
        positions: mx.array | None,
        budget: int | None = None,
    ) -> None:
        """Keep ``budget`` rows (default: the cache's) of a temporal-order block (rows per
        head, or the layer's rows shared across heads with a floor)."""
        budget = self.budget if budget is None else budget
        if self.floor is not None:
            self._evict_ragged(keys, values, scores, None, positions, keys.shape[2])
        elif positions is not None:
            idx = select_keep(
                chunk_scores(scores, positions, self.chunk), budget, self.n_sink, self.recent
            )
            self.keys, self.values = gather_rows(keys, idx), gather_rows(values, idx)
            self.positions = gather_rows(positions, idx)
            self._set_scores(gather_rows(scores, idx), ranked=True)
            self.evictions += 1
        else:
            self.keys, self.values, self.scores = kernels.fused_evict(
                keys,
                values,
                scores,
                budget=budget,
                n_sink=self.n_sink,
                recent=self.recent,
                use_kernel=self.use_kernel,
            )
            self.evictions += 1

    def prepare_compress(self) -> None:
        """Stored rows in temporal order with their absolute positions (before
        :meth:`compress` is handed scores for them)."""
        if self.keys is None:
            raise ValueError("the cache is empty")
        if self.free is not None:
            self._to_temporal_order()
        if self.positions is None:  # nothing was evicted: rows are positions offset - S ..
            S = self.keys.shape[2]
            self.positions = mx.broadcast_to(
                mx.arange(self.offset - S, self.offset, dtype=mx.int32), self.keys.shape[:3]
            )

    def compress(self, scores: mx.array) -> None:
        """Replace the stored rows' scores and evict down to the budget as one block (the
        pass of a scorer that defers blocks, :mod:`qfserve.engine.kv.kvzip`).

        Args:
            scores: ``(B, H, S)`` float32 over the stored rows in temporal order (after
                :meth:`prepare_compress`), higher = keep.
        """
        self.prepare_compress()
        assert self.keys is not None and self.values is not None
        if scores.shape != self.keys.shape[:3]:
            raise ValueError(f"scores must have shape {self.keys.shape[:3]}, got {scores.shape}")
        if self.valid is not None:
            self._evict_ragged(
                self.keys, self.values, scores, self.valid, self.positions, self.keys.shape[2]
            )
        elif self.keys.shape[2] <= self.budget:
            self._set_scores(scores)
        else:
            self._evict_block(self.keys, self.values, scores, self.positions)

    def kept_positions(self) -> mx.array:
        """The true position of each stored row, ``(B, H, S)`` int32 in the stored layout,
        ``-1`` where a slot holds no row (the free slot, a ragged head's padding).

        Raises:
            ValueError: rows were evicted and their positions not kept (a cache made
                without ``positions``, chunks or a scorer that tracks them).
        """
        if self.keys is None:
            return mx.zeros((1, 0, 0), dtype=mx.int32)
        if self.free is not None:  # slot layout: ``order`` holds true positions when tracked
            if not self.tracks:
                raise ValueError("this cache does not keep its rows' positions")
            assert self.order is not None
            slots = mx.arange(self.order.shape[-1], dtype=mx.uint32)
            held = slots != self.free
            positions = self.order
        elif self.positions is not None:
            positions = self.positions
            held = mx.ones(positions.shape, dtype=mx.bool_)
        elif self.evictions:
            raise ValueError("this cache does not keep its rows' positions")
        else:  # nothing dropped: the rows are positions offset - S .. offset - 1
            S = self.keys.shape[2]
            positions = mx.broadcast_to(
                mx.arange(self.offset - S, self.offset, dtype=mx.int32), self.keys.shape[:3]
            )
            held = mx.ones(positions.shape, dtype=mx.bool_)
        if self.valid is not None:
            held = held & self.valid
        return mx.where(held, positions, -1)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        # The mask describes stored rows: every one of them is visible to the new block.
        return create_attention_mask(
            N, offset=self.size(), return_array=return_array, window_size=window_size
        )

    def size(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.shape[2] - (self.free is not None)  # the free slot holds no token

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        held = [self.keys, self.values, self.scores, self.token_scores, self.positions, self.valid]
        room = self._room  # under the budget, the growth buffers (SlotLayout._grow_row)
        if room is not None:
            held = [*room[: len(room) // 2], self.valid]
        return sum(a.nbytes for a in held if a is not None)

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
            if self.token_scores is not None:
                self.token_scores = self.token_scores[..., :keep]
            if self.positions is not None:
                self.positions = self.positions[..., :keep]
        return n

    def stats(self) -> CacheStats:
        if self.keys is None or self.values is None:
            return CacheStats(filter_source=self.scorer.source, evicting_layers=1)
        row = _row_bytes(self.keys, self.values)
        kept = self.size()
        held = kept  # rows per head the arrays hold
        if self.valid is not None:  # ragged heads: the mean real rows per head (the budget),
            B, H = self.keys.shape[:2]  # while the arrays hold the longest head's, padded
            rows = self.valid.sum().item() - (B * H if self.free is not None else 0)
            kept = int(rows) // (B * H)  # type: ignore[arg-type]
        return CacheStats(
            tokens_seen=self.offset,
            tokens_kept=kept,
            kept_bytes=row * held,
            full_seq_bytes=row * self.offset,
            evictions=self.evictions,
            filter_source=self.scorer.source,
            filter_bytes=self.scorer.nbytes,
            evicting_layers=1,
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
