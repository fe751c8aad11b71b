"""The ragged-heads half of :class:`qfserve.engine.kv.cache.EvictionCache` (adaptive budgets).

A block eviction shares the layer's ``budget * H`` rows across its heads
(:mod:`qfserve.engine.kv.adaptive`), so heads hold different row counts, stored padded with
``valid`` marking the real rows. Under that total, rows are appended as to any cache under
its budget; at it, a decode step evicts one row per head in the slot layout.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx

from qfserve.engine.kv import adaptive
from qfserve.engine.kv.evict import chunk_scores, gather_rows
from qfserve.engine.kv.slots import SlotLayout

_INF = float("inf")


class RaggedHeads(SlotLayout):
    """Ragged-head evictions, over the slot layout (their state lives on the cache)."""

    def _ragged_fits(self, valid: mx.array) -> bool:
        """Every batch row's heads hold at most ``budget * H`` real rows in ``valid``.

        The count is kept in Python (:attr:`_ragged_rows`) so a decode step never waits on
        the device; it is read from ``valid`` only after a restore."""
        if self._ragged_rows is None:
            assert self.valid is not None
            self._ragged_rows = int(cast(int, self.valid.sum(axis=(1, 2)).max().item()))
        stored = 0 if self.valid is None else self.valid.shape[2]
        added = valid.shape[1] * (valid.shape[2] - stored)
        return self._ragged_rows + added <= self.budget * valid.shape[1]

    def _evict_ragged(
        self,
        keys: mx.array,
        values: mx.array,
        scores: mx.array,
        valid: mx.array | None,
        positions: mx.array | None,
        N: int,
    ) -> None:
        """A block shares the layer budget across heads (``valid``: None before heads are
        ragged), ranked by chunk means with chunks; a decode row joining ragged heads takes
        the slot layout, every head then evicting one row per step as always."""
        if N > 1 or valid is None:
            ranked = scores
            if positions is not None:
                ranked = chunk_scores(scores, positions, self.chunk, valid)
            # The most rows a head may keep (kvzip's shares under a compress-as-read limit):
            # storage is padded to the longest head.
            cap = getattr(self.scorer, "cap", None)
            keep, counts = adaptive.select_adaptive(
                ranked,
                budget=self.budget,
                n_sink=self.n_sink,
                recent=self.recent,
                floor=self.budget if self.floor is None else self.floor,
                eligible=valid,
                logits=not getattr(self.scorer, "scores_are_weights", False),
                cap=cap,
            )
            idx, self.valid = adaptive.ragged_gather(keep, counts)
            # Every batch row now holds ``budget * H`` rows when all were eligible and none
            # capped; else the count is read once from ``valid`` when next needed.
            full = valid is None and cap is None
            self._ragged_rows = self.budget * keys.shape[1] if full else None
            self.keys, self.values = gather_rows(keys, idx), gather_rows(values, idx)
            self.scores = gather_rows(scores, idx)
            if positions is not None:
                self.token_scores, self.positions = self.scores, gather_rows(positions, idx)
        else:
            self.keys, self.values, self.valid = keys, values, valid
            ranks = scores
            if positions is not None:
                # As without ragged heads: the stored rows rank by their chunk's mean, the
                # decoded row by its own score; the slots' order is their true position.
                means = chunk_scores(
                    scores[..., :-1], positions[..., :-1], self.chunk, valid[..., :-1]
                )
                ranks = mx.concatenate([means, scores[..., -1:]], axis=2)
                self.token_scores = scores
                self.positions = self.order = mx.where(valid, positions, -1)
            else:
                self.order = adaptive.slot_order(valid, self.offset)
            finite = mx.nan_to_num(ranks, nan=-_INF, posinf=_INF, neginf=-_INF)
            self.scores = mx.where(valid, finite, _INF)  # padding is never the victim
            self.free = self._victim()
        self.evictions += 1
