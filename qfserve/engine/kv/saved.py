"""What an :class:`qfserve.engine.kv.cache.EvictionCache` saves and restores: mlx-lm's
``state`` / ``meta_state`` protocol, so ``save_prompt_cache`` and ``load_prompt_cache`` (and
multi-turn reuse on disk) carry every layout: temporal or slots, chunks, ragged heads."""

from __future__ import annotations

import mlx.core as mx

from qfserve.engine.kv.slots import CacheFields


class SavedState(CacheFields):
    """The cache's arrays and settings as mlx-lm's prompt-cache files hold them."""

    @property
    def state(self) -> tuple[mx.array, ...]:
        # The arrays as stored (cheap to evaluate every step); kept() gives temporal order.
        # Chunks add the per-token scores and positions (``order`` in the slot layout).
        if self.keys is None or self.values is None:
            return ()
        if self.scores is None:
            return self.keys, self.values
        extra: tuple[mx.array, ...] = ()
        if self.token_scores is not None and self.positions is not None:
            extra = (self.token_scores, self.positions)
        ragged = () if self.valid is None else (self.valid,)
        if self.order is None or self.free is None:
            return self.keys, self.values, self.scores, *extra, *ragged
        return self.keys, self.values, self.scores, *extra, self.order, self.free, *ragged

    @state.setter
    def state(self, v: tuple[mx.array, ...]) -> None:
        # Read from the tuple alone (mlx-lm's from_state sets state before meta_state): ragged
        # heads end with ``valid`` (bool), the slot layout then with ``free`` (the only
        # uint32 array); chunks add two arrays.
        self.keys, self.values, *rest = v
        self.scores = rest.pop(0) if rest else None
        self.valid = rest.pop() if rest and rest[-1].dtype == mx.bool_ else None
        self._ragged_rows = None
        slots = bool(rest) and rest[-1].dtype == mx.uint32
        self.order, self.free = (rest[-2], rest[-1]) if slots else (None, None)
        chunked = rest[:-2] if slots else rest
        self.token_scores, self.positions = (chunked[0], chunked[1]) if chunked else (None, None)

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(
            str(x)
            for x in (
                self.offset,
                self.budget,
                self.n_sink,
                self.recent,
                self.evictions,
                self.chunk,
                -1 if self.floor is None else self.floor,
            )
        )

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        self.offset, self.budget, self.n_sink, self.recent, self.evictions, *more = map(int, v)
        self.chunk = more[0] if more else 1
        self.floor = more[1] if len(more) > 1 and more[1] >= 0 else None
