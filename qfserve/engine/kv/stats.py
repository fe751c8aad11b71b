"""Cache statistics: per cache and summed over one request's layers. Counts only."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class CacheStats:
    """What a cache (or a request's caches) holds against what a full cache would.

    ``tokens_seen`` and ``tokens_kept`` are per layer and KV head (a request reports the
    largest layer's ``tokens_seen`` and the mean of ``tokens_kept`` over its layers, which
    differ where layers share the rows); byte counts are summed over layers.
    """

    tokens_seen: int = 0
    tokens_kept: int = 0
    kept_bytes: int = 0
    full_seq_bytes: int = 0
    evictions: int = 0
    filter_source: str = "none"
    filter_bytes: int = 0

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


def summarize(caches: Iterable[Any]) -> CacheStats:
    """Sum the statistics of a request's caches; layers without ``stats()`` are skipped."""
    total = CacheStats()
    kept = []
    for cache in caches:
        stats = getattr(cache, "stats", None)
        if stats is None:
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
        )
    return total
