"""Which positions a request's caches still hold: per position, how many (layer, KV head)
pairs keep its row. What ``kv_cache_detail`` reports, and what a user reads to see which
parts of a prompt a budget kept.

Each kind of cache says it its own way: an eviction cache from the true positions it keeps
when asked (:meth:`qfserve.engine.kv.cache.EvictionCache.kept_positions`), a full cache holds
every position, a sliding-window layer (mlx-lm's ``RotatingKVCache``) its first ``keep`` and
its last ``max_size - keep``. Caches that hold no row per token (recurrent state) are not
counted: they are neither in a count nor in the number of pairs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from qfserve.engine.kv.cache import EvictionCache


def _heads(cache: Any) -> int:
    keys = cache.keys
    return 0 if keys is None else int(keys.shape[1])


def layer_positions(cache: Any) -> np.ndarray | None:
    """The positions one layer holds, ``(H, S)`` int with ``-1`` where a slot holds none;
    ``None`` for a cache that holds no row per token."""
    if isinstance(cache, EvictionCache):
        held: np.ndarray = np.array(cache.kept_positions())
        if held.shape[0] != 1:
            raise ValueError(f"one sequence per cache, got {held.shape[0]}")
        return np.asarray(held[0])
    if isinstance(cache, RotatingKVCache):
        H, n = _heads(cache), int(cache.offset)
        if n <= cache.max_size:
            row = np.arange(n)
        else:
            row = np.concatenate(
                [np.arange(cache.keep), np.arange(n - (cache.max_size - cache.keep), n)]
            )
        return np.broadcast_to(row, (H, row.size))
    if isinstance(cache, KVCache):  # every row, FullKVCache included
        return np.broadcast_to(np.arange(int(cache.offset)), (_heads(cache), int(cache.offset)))
    return None


def held_counts(caches: list[Any], n: int) -> tuple[np.ndarray, int]:
    """For positions ``0 .. n - 1``: how many (layer, KV head) pairs hold the row, and how
    many pairs there are (layers that hold rows per token, times their KV heads)."""
    counts = np.zeros(n, dtype=np.int64)
    pairs = 0
    for cache in caches:
        held = layer_positions(cache)
        if held is None:
            continue
        pairs += held.shape[0]
        flat = held[(held >= 0) & (held < n)]
        counts += np.bincount(flat, minlength=n)[:n]
    return counts, pairs
