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

from qfserve.engine.kv.evict import (
    chunk_scores,
    gather_rows,
    int32,
    select_victim,
    write_and_select,
)
from qfserve.engine.kv.scorers import ScoreForm, Scorer

_INF = float("inf")
_STEP = 256  # rows the growth buffers add at a time, as mlx-lm's KVCache


class CacheFields:
    """The eviction cache's state, declared once for the halves that read it (the slot
    layout, ragged heads, saved state); :class:`qfserve.engine.kv.cache.EvictionCache` sets
    them."""

    scorer: Scorer
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
    keep_positions: bool = False
    # A score below which rows go (kvzap_threshold; None: the budget alone) and the decode
    # rows since its last compaction. Not saved: a restored cache takes its request's.
    threshold: float | None = None
    _since_threshold: int = 0
    evictions: int
    _ragged_rows: int | None
    _keys: mx.array | None = None
    # Under the budget: buffers growing to budget + 1 rows (keys, values, scores, positions
    # where tracked) and the views of them the cache's arrays are (SlotLayout._grow_row).
    _room: tuple[mx.array, ...] | None = None

    @property
    def keys(self) -> mx.array | None:
        return self._keys

    @keys.setter
    def keys(self, value: mx.array | None) -> None:
        # Whatever replaces the rows (a block, a trim, a restore, a packed batch lending
        # them) lets go of the growth buffers: they are neither held nor counted after it.
        self._keys = value
        self._room = None


class SlotLayout(CacheFields):
    """The slot-layout half of the eviction cache (its state lives on the cache)."""

    def _victim(self) -> mx.array:
        assert self.scores is not None and self.order is not None
        return select_victim(self.scores, self.order, self.n_sink, self.offset - self.recent)

    @property
    def tracks(self) -> bool:
        """Absolute positions are stored: with chunks, for scorers that map rows to
        positions (KVzip), and where asked (``keep_positions``: :meth:`kept_positions`)."""
        return (
            self.chunk > 1 or self.keep_positions or getattr(self.scorer, "tracks_positions", False)
        )

    def _set_scores(self, scores: mx.array | None, *, ranked: bool = False) -> None:
        """Store per-token ``scores`` (temporal order); once ``ranked`` (evicting), NaN maps
        to -inf and, with chunks, the decode step's ranks are the chunk means."""
        if not self.tracks or scores is None:
            self.scores = scores
            if ranked and scores is not None:
                self.scores = mx.nan_to_num(scores, nan=-_INF, posinf=_INF, neginf=-_INF)
            return
        self.token_scores = scores
        if ranked:
            assert self.positions is not None
            means = chunk_scores(scores, self.positions, self.chunk)
            self.scores = mx.nan_to_num(means, nan=-_INF, posinf=_INF, neginf=-_INF)
        else:
            self.scores = scores

    def _enter_slots(
        self, keys: mx.array, values: mx.array, scores: mx.array, positions: mx.array | None
    ) -> None:
        """Full with one new row (``budget + 1`` rows in temporal order): switch to the slot
        layout; nothing is copied."""
        self.keys, self.values = keys, values
        if positions is not None:
            # The stored rows are ranked by chunk; the decoded row carries its own score.
            self.positions = positions[..., :-1]
            self._set_scores(scores[..., :-1], ranked=True)
            assert self.scores is not None
            own = mx.nan_to_num(scores[..., -1:], nan=-_INF, posinf=_INF, neginf=-_INF)
            self.scores = mx.concatenate([self.scores, own], axis=2)
            self.token_scores = scores
            self.positions = self.order = positions
        else:
            self._set_scores(scores, ranked=True)
            # Rank in time: the last rows get their true positions (the recent window is
            # exact); older rows get smaller ranks in the same order.
            L = keys.shape[2]
            self.order = mx.broadcast_to(
                mx.arange(self.offset - L, self.offset, dtype=mx.int32), scores.shape
            )
        self.free = self._victim()
        self.evictions += 1

    def _grow_row(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array] | None:
        """One decode row under the budget, written in place (``None``: not this cache's case).

        Why: appending by concatenation copies every stored row each step, which at a short
        context made a Q-Filters step cost several times ``KVCache``'s. So, as mlx-lm's
        ``KVCache`` does, the rows go into buffers grown by steps of 256 rows up to
        ``budget + 1`` (keys, values, scores, and positions where tracked), the prompt's rows
        copied in at the first decode row: filled, they are the slot layout's arrays, with
        no copy. ``keys``, ``values``, ``scores`` (and ``token_scores``, ``positions``) are
        views of the filled rows, so every other path reads the cache as before; one that
        replaces the keys drops the buffers (``CacheFields.keys``).
        """
        tracks, scorer = self.tracks, self.scorer
        arrays = (self.keys, self.values, self.scores) + ((self.positions,) if tracks else ())
        held = [a for a in arrays if a is not None]
        if (
            len(held) < len(arrays)
            or self.free is not None
            or self.valid is not None
            or self.token_scores is not (self.scores if tracks else None)
            or not scorer.ready
            or scorer.dynamic
            or held[0].shape[2] > self.budget
            or held[0].dtype != keys.dtype
            or held[0].shape[:2] != keys.shape[:2]
        ):
            return None
        L = held[0].shape[2]
        room = self._room
        fresh = (
            room is None
            or len(room) != 2 * len(held)
            or any(v is not a for v, a in zip(room[len(held) :], held, strict=True))
        )
        if fresh or room is None or room[0].shape[2] == L:  # new buffers, or more room
            rows = min(self.budget + 1, -(-(L + 1) // _STEP) * _STEP)
            room = tuple(  # the rows held (the old buffers' views, if any), then room
                mx.concatenate([a, mx.zeros((*a.shape[:2], rows - L, *a.shape[3:]), a.dtype)], 2)
                for a in held
            )
        position = self.offset
        self.offset += 1
        new = [keys, values, scorer.score(keys, position).astype(room[2].dtype)]
        if tracks:
            new.append(mx.array(position, dtype=mx.int32))
        for buffer, row in zip(room, new, strict=False):
            buffer[:, :, L : L + 1] = row
        buffers = room[: len(held)]
        if L + 1 <= self.budget:
            views = tuple(b[:, :, : L + 1] for b in buffers)
            self.keys = views[0]  # first: setting the keys drops the room
            self.values, self.scores = views[1:3]
            if tracks:
                self.token_scores, self.positions = views[2], views[3]
            self._room = (*buffers, *views)
            return self.keys, self.values
        # Every slot filled: the buffers are the slot layout's arrays, as a block's would be.
        self._room = None
        self._enter_slots(buffers[0], buffers[1], buffers[2], buffers[3] if tracks else None)
        return buffers[0], buffers[1]

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
            if self.tracks:  # order holds the true positions: the tracked arrays follow it
                self.positions, self.token_scores = self.order, ranked
            self.free = self._victim()
        else:
            form = self.scorer.form()
            score: mx.array | ScoreForm
            if form is not None and (
                form.kind == "hidden" or form.kind == "project" and self.token_scores is None
            ):
                score = form  # scored within the step (write_and_select)
            else:
                score = self.scorer.score(keys, position)  # (B, H, 1)
            self.keys, self.values, self.scores, self.order, self.free, *tokens = write_and_select(
                self.keys,
                self.values,
                self.scores,
                self.order,
                self.free,
                (keys, values, score),
                int32(position),
                int32(self.offset - self.recent),
                int32(self.n_sink),  # an input: a constant is kept per trace
                token_scores=self.token_scores,  # chunks: the raw score there too
            )
            if tokens:
                self.token_scores = tokens[0]
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
