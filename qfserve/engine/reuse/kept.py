"""Multi-turn reuse: finished requests' caches, found again by the tokens they hold.

A chat client resends the whole conversation every turn. When a new prompt starts with the
exact tokens a finished request's caches hold (its prompt and what it generated), the new
request continues from those caches and prefills only the rest. mlx-lm's ``LRUPromptCache``
does the bookkeeping (a trie over token ids per key, nearest-prefix lookup, LRU by count and
bytes, trimming of caches that can be trimmed); this module adds what it does not know:

- The key: the model, every eviction setting and the filters' identity, so a request only
  ever continues a cache built exactly as its own would be (a full cache: its method only);
  and the conversation's name (``prompt_cache_key``), so a named conversation only
  continues its own caches.
- Evicting caches: one that has dropped rows cannot be trimmed, so it is reused only when
  its whole token list is a prefix of the new prompt, with at least one token left to feed.
  A reused cache has already evicted: the new turn attends to the compressed history, not
  to the full one a fresh prefill would rebuild and compress again.
- Tokenisation: the key is token ids, so an assistant turn the template renders differently
  from what was generated simply does not match (a counted miss), never a wrong reuse.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path
from typing import Any

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from qfserve.engine.kv.config import CacheConfig

logger = logging.getLogger(__name__)


def cache_key(
    model: str, config: CacheConfig, filter_source: str, name: str | None = None
) -> tuple[Any, ...]:
    """What must be equal for a cache to be continued: model, settings, filters and the
    conversation's name (``None``: unnamed). A full cache holds every row whatever its budget
    says (an ``auto`` budget sizes it to each turn's prompt), so only its method counts."""
    if config.method == "full":
        config = CacheConfig(method="full")
    source = filter_source if config.method == "qfilters" else "none"
    return (model, *astuple(config), source, name)


class PromptCache:
    """Caches of finished requests, by key and token ids (owned by the model thread).

    Args:
        max_size: Entries kept at most.
        max_bytes: Bytes they hold at most.
    """

    def __init__(self, max_size: int, max_bytes: int = 1 << 62):
        self.max_size = max_size
        self._lru = LRUPromptCache(max_size=max_size, max_bytes=max_bytes)
        self.hits = 0
        self.misses = 0
        self._entries: dict[tuple[Any, tuple[int, ...]], dict[str, Any]] = {}

    @property
    def nbytes(self) -> int:
        return int(self._lru.nbytes)

    def __len__(self) -> int:
        return len(self._lru)

    def fetch(self, key: tuple[Any, ...], tokens: list[int]) -> tuple[list[Any] | None, int]:
        """Caches to continue ``tokens`` from (a copy) and how many tokens they already hold;
        ``(None, 0)`` on a miss. At least one token is always left to feed."""
        caches, rest = self._lru.fetch_nearest_cache(key, tokens)
        if caches is not None and not rest:  # the whole prompt is cached: feed its last token
            if can_trim_prompt_cache(caches):
                trim_prompt_cache(caches, 1)
                rest = tokens[-1:]
            else:
                caches = None
        if caches is None:
            self.misses += 1
            return None, 0
        self.hits += 1
        held = len(tokens) - len(rest)
        # The entry that served it: a prefix of the prompt, or the whole prompt trimmed by one.
        entry = self._entries.get((key, tuple(tokens[:held]))) or self._entries.get(
            (key, tuple(tokens))
        )
        if entry is not None:
            entry["hits"] += 1
        return caches, held

    def insert(self, key: tuple[Any, ...], tokens: list[int], caches: list[Any]) -> None:
        """Keep ``caches``, which hold exactly ``tokens`` (the objects, not a copy).

        An entry's ``hits`` count the turns its conversation was continued from it; when a
        later turn's caches replace an earlier turn's (mlx-lm drops the prefixes of a
        trimmable cache), the count carries over to the entry that replaced them."""
        entry = (key, tuple(tokens))
        earlier = {
            k: e["hits"]
            for k, e in self._entries.items()
            if k[0] == key and k != entry and entry[1][: len(k[1])] == k[1]
        }
        self._lru.insert_cache(key, list(tokens), caches)
        self._entries[entry] = {
            "tokens": len(tokens),
            "bytes": sum(c.nbytes for c in caches),
            "settings": {"model": key[0], **_settings(key)},
            "hits": 0,
        }
        self._forget_evicted()
        if entry in self._entries:
            self._entries[entry]["hits"] = sum(
                hits for k, hits in earlier.items() if k not in self._entries
            )

    def shrink(self, max_bytes: int) -> None:
        """Drop least recently used entries until they hold ``max_bytes`` at most."""
        self._lru.trim_to(n_bytes=max_bytes)
        self._forget_evicted()

    def stored(self) -> list[tuple[tuple[Any, ...], tuple[int, ...]]]:
        """(key, tokens) of every entry."""
        return list(self._entries)

    def __contains__(self, entry: object) -> bool:
        return entry in self._entries

    def entries(self) -> list[dict[str, Any]]:
        """What the admin endpoint lists: tokens, bytes, settings and hits, never tokens' ids."""
        return [dict(e) for e in self._entries.values()]

    def _forget_evicted(self) -> None:
        # LRUPromptCache does not list its entries; its LRU order (mlx-lm 0.32) is read here.
        live = {(m, tuple(t)) for lru in self._lru._lru._lrus.values() for m, t in lru}
        for k in [k for k in self._entries if k not in live]:
            del self._entries[k]


class KeptCaches:
    """The worker's prompt cache: a :class:`PromptCache`, mirrored on disk when ``folder`` is
    set (:mod:`qfserve.engine.reuse.disk`: the saved entries are loaded here, each kept entry is saved
    and each dropped one deleted), and the summary the admin endpoint reads off the thread.

    Args:
        size: Entries kept at most.
        max_bytes: Bytes they hold at most.
        folder: ``--prompt-cache-dir``, or ``None``.
        fingerprint: The model weights' fingerprint; saved entries of other weights are
            left alone.
        fresh: Builds a request's caches for given settings (the server's own filters),
            into which saved entries are restored.
    """

    def __init__(
        self,
        size: int,
        max_bytes: int,
        folder: Path | None,
        fingerprint: str,
        fresh: Callable[[CacheConfig], list[Any]],
    ) -> None:
        from qfserve.engine.reuse import disk as persist

        self.cache = PromptCache(size, max_bytes)
        self._folder = folder
        self._fingerprint = fingerprint
        self._saved: set[str] = set()  # entry files this server wrote or loaded
        if folder is not None:
            for key, tokens, caches in persist.load_folder(folder, fingerprint, fresh, size):
                self.cache.insert(key, tokens, caches)
                self._saved.add(persist.entry_name(key, tokens))
            logger.info("prompt cache: %d saved entries from %s", len(self.cache), folder)
        self.view: dict[str, Any] = {}
        self._publish()

    def __len__(self) -> int:
        return len(self.cache)

    def fetch(self, key: tuple[Any, ...], prompt: list[int]) -> tuple[list[Any] | None, int]:
        """:meth:`PromptCache.fetch`."""
        try:
            return self.cache.fetch(key, prompt)
        finally:
            self._publish()

    def keep(self, key: tuple[Any, ...], tokens: list[int], caches: list[Any], room: int) -> None:
        """Keep a finished request's ``caches`` (holding ``tokens``) within ``room`` bytes,
        and on disk."""
        from qfserve.engine.reuse import disk as persist

        try:
            self.cache.insert(key, tokens, caches)
            self.cache.shrink(room)
            if self._folder is not None:
                if (key, tuple(tokens)) in self.cache:
                    persist.save(self._folder, key, tokens, caches, self._fingerprint)
                    self._saved.add(persist.entry_name(key, tokens))
                live = {persist.entry_name(k, list(t)) for k, t in self.cache.stored()}
                persist.prune(self._folder, self._saved, live)
                self._saved &= live
        finally:
            self._publish()

    def shrink(self, room: int) -> None:
        """Give way to running requests: hold ``room`` bytes at most."""
        self.cache.shrink(room)
        self._publish()

    def _publish(self) -> None:
        cache = self.cache
        self.view = {
            "enabled": True,
            "entries": cache.entries(),
            "bytes": cache.nbytes,
            "hits": cache.hits,
            "misses": cache.misses,
        }


def _settings(key: tuple[Any, ...]) -> dict[str, Any]:
    # The conversation's name (key[-1]) is the client's; the admin view shows settings only.
    names = [f for f in CacheConfig.__dataclass_fields__]
    return {**dict(zip(names, key[1:-2], strict=True)), "filter_source": key[-2]}
