"""The decode step's slot layout of :class:`qfserve.engine.kv.cache.EvictionCache`.

Once the cache is full, each decode step writes the new row into the slot freed by the
previous step's victim (``budget + 1`` slots, one of them free between steps), so a step
costs O(budget) comparisons and O(1) row writes instead of copying every row. ``order`` ranks
the slots in time; attention over a single new token does not depend on row order;
:meth:`SlotLayout.kept` gives the rows in temporal order, and a block compacts them back
(:meth:`SlotLayout._to_temporal_order`) before it is appended. With ragged heads (adaptive
budgets) padding slots are never victims and are dropped again by the compaction.
"""

from __future__ import annotations

import mlx.core as mx

from qfserve.engine.kv.evict import gather_rows, select_victim, write_and_select
from qfserve.engine.kv.scorers import ScoreForm, Scorer

_INF = float("inf")


class CacheFields:
    """The eviction cache's state, declared once for the halves that read it (the slot
    layout, ragged heads, saved state); :class:`qfserve.engine.kv.cache.EvictionCache` sets
    them."""

    scorer: Scorer
    keys: mx.array | None
    values: mx.array | None
    scores: mx.array | None
    order: mx.array | None
    free: mx.array | None
    token_scores: mx.array | None
    positions: mx.array | None
    valid: mx.array | None
    offset: int
    budget: int
    n_sink: int
    recent: int
    chunk: int
    floor: int | None
    evictions: int
    _ragged_rows: int | None


class SlotLayout(CacheFields):
    """The slot-layout half of the eviction cache (its state lives on the cache)."""

    def _victim(self) -> mx.array:
        assert self.scores is not None and self.order is not None
        return select_victim(self.scores, self.order, self.n_sink, self.offset - self.recent)

    def _write_into_free_slot(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """One decode step at budget: the new row takes the free slot, then a victim is chosen."""
        assert self.keys is not None and self.values is not None
        assert self.scores is not None and self.order is not None and self.free is not None
        position = self.offset
        self.offset += 1
        if self.scorer.dynamic:  # every row re-scored (TOVA)
            slot = self.free[..., None]  # (B, H, 1, 1)
            self.keys = mx.put_along_axis(self.keys, slot, keys, axis=2)
            self.values = mx.put_along_axis(self.values, slot, values, axis=2)
            ranked = self.scorer.rescore(self.keys, 1)
            self.scores = mx.nan_to_num(ranked, nan=-_INF, posinf=_INF, neginf=-_INF)
            self.order = mx.put_along_axis(
                self.order, self.free, mx.array(position, dtype=mx.int32), axis=2
            )
            self.free = self._victim()
        else:
            form = self.scorer.form()
            score: mx.array | ScoreForm
            if self.token_scores is None and form is not None and form.kind == "project":
                score = form  # scored within the step (write_and_select)
            else:
                score = raw = self.scorer.score(keys, position)  # (B, H, 1)
                if self.token_scores is not None:
                    self.token_scores = mx.put_along_axis(self.token_scores, self.free, raw, axis=2)
            self.keys, self.values, self.scores, self.order, self.free = write_and_select(
                self.keys,
                self.values,
                self.scores,
                self.order,
                self.free,
                (keys, values, score),
                mx.array(position, dtype=mx.int32),
                mx.array(self.offset - self.recent, dtype=mx.int32),
                mx.array(self.n_sink, dtype=mx.int32),  # an input: a constant is kept per trace
            )
            if self.token_scores is not None:
                self.positions = self.order
        self.evictions += 1
        return self.keys, self.values

    def _kept_slots(self) -> mx.array:
        """Slots of the kept rows in temporal order ``(B, H, S)`` (slot layout only); with
        ragged heads, each head's rows first, then padding."""
        assert self.order is not None and self.free is not None
        slots = mx.arange(self.order.shape[-1], dtype=mx.uint32)
        gone = slots == self.free
        if self.valid is not None:
            gone = gone | ~self.valid
        rank = mx.where(gone, mx.iinfo(mx.int32).max, self.order)
        return mx.argsort(rank, axis=-1)[..., : self._kept_count()].astype(mx.uint32)

    def _kept_count(self) -> int:
        """Stored slots once compacted: all but the free one, or the most any head keeps."""
        assert self.keys is not None
        if self.valid is None:
            return self.keys.shape[2] - 1
        return int((self.valid.sum(axis=-1) - 1).max().item())  # type: ignore[arg-type]

    def _to_temporal_order(self) -> None:
        assert self.keys is not None and self.values is not None and self.scores is not None
        idx = self._kept_slots()
        self.keys = gather_rows(self.keys, idx)
        self.values = gather_rows(self.values, idx)
        self.scores = gather_rows(self.scores, idx)
        if self.token_scores is not None and self.positions is not None:
            self.token_scores = gather_rows(self.token_scores, idx)
            self.positions = gather_rows(self.positions, idx)
        if self.valid is not None:
            counts = self.valid.sum(axis=-1, keepdims=True) - 1  # the free slot's row is gone
            self.valid = mx.arange(idx.shape[-1])[None, None, :] < counts
        self.order = self.free = None

    def kept(self) -> tuple[mx.array, mx.array, mx.array | None]:
        """The kept keys, values and scores in temporal order (a view; the cache is unchanged)."""
        if self.keys is None or self.values is None:
            raise ValueError("the cache is empty")
        if self.free is None:
            return self.keys, self.values, self.scores
        idx = self._kept_slots()
        assert self.scores is not None
        return (
            gather_rows(self.keys, idx),
            gather_rows(self.values, idx),
            gather_rows(self.scores, idx),
        )
