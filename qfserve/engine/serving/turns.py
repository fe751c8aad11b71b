"""The worker's kept turns: where a request's caches may continue from, and where a finished
turn's caches go for the next one (:mod:`qfserve.engine.reuse.kept` holds and saves them).

Kept caches count against ``--max-kv-bytes`` beside the running requests and give way to
them: whatever the admitted requests reserve is taken from the kept turns' room first.
Over several ranks each rank keeps its own heads' rows, in a folder of its own, within its
share of the bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qfserve.engine.filters.model import ModelFilters
    from qfserve.engine.kv.config import CacheConfig
    from qfserve.engine.reuse.kept import KeptCaches
    from qfserve.engine.serving.config import EngineConfig
    from qfserve.engine.serving.jobs import KeptTurn
    from qfserve.engine.serving.lockstep import Lockstep
    from qfserve.engine.text.requests import GenerationRequest

logger = logging.getLogger(__name__)


class Turns:
    """Kept turns of one served model.

    Args:
        kept: The store.
        model: The served model's name (part of every key).
        filter_source: Where the Q-Filters come from, asked when a key is made (they may
            be learned from traffic while serving: caches scored by others do not match).
        room: KV bytes the running requests leave (this rank's share).
    """

    def __init__(
        self,
        kept: KeptCaches,
        model: str,
        filter_source: Callable[[], str],
        room: Callable[[], int],
    ) -> None:
        self.kept = kept
        self._model = model
        self._filter_source = filter_source
        self._room = room

    @classmethod
    def open(
        cls,
        config: EngineConfig,
        model: str,
        calibration: ModelFilters,
        room: Callable[[], int],
        lockstep: Lockstep | None,
        max_kv_bytes: int,
    ) -> Turns | None:
        """The kept turns of ``model`` under ``calibration``'s filters (``None``: reuse is
        off); saved turns are read back into fresh caches."""
        if not config.prompt_cache_size:
            return None
        from qfserve.engine.reuse.kept import KeptCaches

        folder = Path(config.prompt_cache_dir) if config.prompt_cache_dir else None
        ranks = 1 if lockstep is None else lockstep.size
        if folder is not None and lockstep is not None:  # its heads' rows, for this many ranks
            folder = folder / f"rank-{lockstep.rank}-of-{lockstep.size}"
        max_bytes = (config.prompt_cache_bytes or max_kv_bytes) // ranks
        kept = KeptCaches(
            config.prompt_cache_size,
            max_bytes,
            folder,
            calibration.fingerprint,
            calibration.caches_for,
        )
        loaded = repr(sorted((repr(key), tokens) for key, tokens in kept.cache.stored()))
        if lockstep is not None and not lockstep.same_everywhere(loaded):
            # A file one rank could not read (or save) would make it miss where others hit.
            logger.warning("the ranks loaded different saved prompt caches: none is used")
            kept.shrink(0)
        return cls(kept, model, lambda: calibration.source, room)

    @property
    def nbytes(self) -> int:
        return int(self.kept.cache.nbytes)

    @property
    def view(self) -> dict[str, Any]:
        return self.kept.view

    def key(self, request: GenerationRequest, cache: CacheConfig) -> tuple[Any, ...]:
        """What a kept cache must match for ``request`` running ``cache`` to continue it (its
        settings and conversation name; :func:`qfserve.engine.reuse.kept.cache_key`)."""
        from qfserve.engine.reuse.kept import cache_key

        return cache_key(self._model, cache, self._filter_source(), request.cache_name)

    def fetch(self, key: tuple[Any, ...], prompt: list[int]) -> tuple[list[Any] | None, int]:
        """A copy of the kept caches holding the longest prefix of ``prompt`` under ``key``,
        and how many of its tokens they hold (``None, 0``: none)."""
        return self.kept.fetch(key, prompt)

    def keep(self, request_id: str, turn: KeptTurn) -> None:
        """A request ended normally: its caches stay for the next turn to continue (a
        failure to keep or save them is logged; the request itself is already done)."""
        try:
            key = self.key(turn.request, turn.cache)
            self.kept.keep(key, turn.tokens, turn.caches, self._room())
        except Exception as exc:  # noqa: BLE001 - a cache not kept must not stop the worker
            logger.warning("request %s: its cache was not kept: %s", request_id, exc)

    def shrink(self) -> None:
        """Give way to the running requests' reservations."""
        self.kept.shrink(self._room())
