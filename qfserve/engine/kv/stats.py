"""Cache statistics: per cache and summed over one request's layers. Counts only."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class CacheStats:
    """What a cache (or a request's caches) holds against what a full cache would.

    ``tokens_seen`` and ``tokens_kept`` are per layer and KV head (a request reports the
    largest layer's ``tokens_seen`` and the mean of ``tokens_kept`` over its full-attention
    layers, which differ where layers share the rows); byte counts are summed over layers,
    sliding-window layers included (``window_bytes`` of them: their last rows, which a full
    cache of the model holds too, so they count in both ``kept_bytes`` and ``full_seq_bytes``).
    ``evicting_layers`` and ``window_layers`` count the layers of each kind.
    """

    tokens_seen: int = 0
    tokens_kept: int = 0
    kept_bytes: int = 0
    full_seq_bytes: int = 0
    evictions: int = 0
    filter_source: str = "none"
    filter_bytes: int = 0
    evicting_layers: int = 0
    window_layers: int = 0
    window_bytes: int = 0

    @property
    def compression_ratio(self) -> float:
        """``full_seq_bytes / kept_bytes`` (1.0 when nothing is stored)."""
        return self.full_seq_bytes / self.kept_bytes if self.kept_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "compression_ratio": round(self.compression_ratio, 4)}


def _merge_source(a: str, b: str) -> str:
    # A request whose layers disagree (one fallback still warming up is still "fallback").
    for source in ("fallback", "self", "calibrated"):
        if source in (a, b):
            return source
    return "none"


def window_stats(cache: Any) -> CacheStats | None:
    """A sliding-window layer's figures (mlx-lm's ``RotatingKVCache``: the rows it holds, at
    most its window), or ``None`` for a cache of another kind."""
    if getattr(cache, "max_size", None) is None or not hasattr(cache, "keys"):
        return None
    keys, values = cache.keys, cache.values
    if keys is None or values is None:
        return CacheStats(window_layers=1)
    rows = min(int(cache.offset), int(cache.max_size))
    B, H = keys.shape[:2]
    row = B * H * (keys.shape[-1] * keys.dtype.size + values.shape[-1] * values.dtype.size)
    held = rows * row
    return CacheStats(kept_bytes=held, full_seq_bytes=held, window_layers=1, window_bytes=held)


def summarize(caches: Iterable[Any]) -> CacheStats:
    """Sum the statistics of a request's caches (sliding-window layers by
    :func:`window_stats`; other layers without ``stats()`` are skipped)."""
    total = CacheStats()
    kept = []
    for cache in caches:
        stats = getattr(cache, "stats", None)
        if stats is None:
            window = window_stats(cache)
            if window is not None:
                total = CacheStats(**{**asdict(total), **_added(total, window)})
            continue
        s = stats()
        kept.append(s.tokens_kept)
        total = CacheStats(
            tokens_seen=max(total.tokens_seen, s.tokens_seen),
            tokens_kept=round(sum(kept) / len(kept)),
            kept_bytes=total.kept_bytes + s.kept_bytes,
            full_seq_bytes=total.full_seq_bytes + s.full_seq_bytes,
            evictions=total.evictions + s.evictions,
            filter_source=_merge_source(total.filter_source, s.filter_source),
            filter_bytes=total.filter_bytes + s.filter_bytes,
            evicting_layers=total.evicting_layers + s.evicting_layers,
            window_layers=total.window_layers,
            window_bytes=total.window_bytes,
        )
    return total


def _added(total: CacheStats, window: CacheStats) -> dict[str, int]:
    names = ("kept_bytes", "full_seq_bytes", "window_layers", "window_bytes")
    return {n: getattr(total, n) + getattr(window, n) for n in names}
