"""The cache arms compared at a matched budget, and the check that each keeps exactly it.

An arm is a method plus a recent window given as a fraction of the budget, so one arm
definition spans every budget. Budgets count every stored row (sinks and recent rows
included), the same for every arm. The key-SVD fallback freezes its direction after
``min(budget, 128)`` keys, so it never holds more rows than the others while warming up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from qfserve.engine.kv import kvzip
from qfserve.engine.kv.cache import EvictionCache
from qfserve.engine.kv.config import DEFAULT_CALIB_TOKENS, DEFAULT_N_SINK, CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.query_aware import SnapKVScorer

LABELS = {
    "full": "full cache",
    "qfilters": "Q-Filters (calibrated)",
    "self": "Q-Filters (self-calibrated)",
    "traffic": "Q-Filters (learned from traffic)",
    "snapkv": "SnapKV (query-aware)",
    "tova": "TOVA (query-aware)",
    "fallback": "Q-Filters (key-SVD fallback)",
    "knorm": "K-norm",
    "kvzip": "KVzip (context reconstruction)",
    "streaming": "streaming (sinks + recent)",
}


@dataclass(frozen=True)
class Arm:
    """One cache arm.

    Args:
        method: ``full``, ``qfilters`` (calibrated), ``self`` (from the prompt's own
            queries, :mod:`qfserve.engine.kv.selfcal`), ``traffic`` (an artifact the server learned
            from traffic, :mod:`qfserve.engine.filters.traffic`), ``fallback`` (key-SVD), ``knorm``,
            ``streaming``, or the query-aware references ``snapkv`` and ``tova``.
        recent_frac: Recent window as a fraction of the budget (0 or 0.25 in the studies).
        sign: ``-1`` keeps the other end of the scoring axis (the fallback's ablation: its
            axis oriented *to* the keys' mean).
        chunk: Block evictions keep whole chunks of this many positions (1 = per row).
        adaptive: Head-adaptive budgets (calibrated Q-Filters with query scales only).
        window: SnapKV's observation window (``None``: its default,
            :data:`qfserve.engine.kv.query_aware.DEFAULT_WINDOW`).
        traffic: Which learned artifact a ``traffic`` arm uses (a name of the filters'
            ``learned``, :class:`bench.quality.calib.CalibratedFilters`).
        shared: kvzip's rows shared across every layer and head (``budget_mode="global"``).
    """

    method: str
    recent_frac: float = 0.0
    sign: int = 1
    chunk: int = 1
    adaptive: bool = False
    window: int | None = None
    traffic: str = ""
    shared: bool = False

    @property
    def name(self) -> str:
        if self.method == "full":
            return "full"
        flipped = "-" if self.sign < 0 else ""
        chunk = f"/c{self.chunk}" if self.chunk > 1 else ""
        ada = "/ada" if self.adaptive else ""
        window = "" if self.window is None else f"/w{self.window}"
        recent = int(round(self.recent_frac * 100))
        traffic = f"/{self.traffic}" if self.traffic else ""
        shared = "/global" if self.shared else ""
        return f"{self.method}{flipped}/r{recent}{chunk}{ada}{window}{traffic}{shared}"

    @property
    def label(self) -> str:
        flipped = ", sign flipped" if self.sign < 0 else ""
        recent = "" if self.recent_frac == 0 or self.method == "full" else ", recent b/4"
        chunk = f", chunks of {self.chunk}" if self.chunk > 1 else ""
        ada = ", adaptive budgets" if self.adaptive else ""
        window = "" if self.window is None else f", {self.window}-token window"
        method = LABELS[self.method]
        if self.traffic:
            method = method.replace("traffic)", f"{self.traffic} traffic)")
        shared = ", rows shared across layers" if self.shared else ""
        return f"{method}{flipped}{recent}{chunk}{ada}{window}{shared}"

    def recent(self, budget: int) -> int:
        return int(budget * self.recent_frac)

    def config(self, budget: int | None, *, n_sink: int = DEFAULT_N_SINK) -> CacheConfig:
        if self.method == "full" or budget is None:
            return CacheConfig(method="full")
        return CacheConfig(
            method="qfilters" if self.method in ("fallback", "self", "traffic") else self.method,
            budget=budget,
            n_sink=n_sink,
            recent=self.recent(budget),
            calib_tokens=min(DEFAULT_CALIB_TOKENS, budget),
            sign=self.sign,
            chunk=self.chunk,
            budget_mode="global" if self.shared else "adaptive" if self.adaptive else "per_head",
        )

    def caches(self, model: Any, budget: int | None, filters: np.ndarray | None) -> list[Any]:
        """Fresh caches for this arm (``filters`` used by the calibrated arm, and its
        ``learned`` ones by the traffic arms)."""
        config = self.config(budget)
        if self.method == "traffic":
            learned = getattr(filters, "learned", {}).get(self.traffic)
            if learned is None:
                raise ValueError(f"no filters learned from {self.traffic!r} traffic were given")
            return make_caches(model, config, filters=np.asarray(learned))
        if self.method in ("qfilters", "kvzip"):
            if filters is None:
                raise ValueError("the calibrated qfilters arm needs filters, got None")
            adaptive = self.adaptive and self.method == "qfilters"  # kvzip's need no scale
            scale = getattr(filters, "query_scale", None) if adaptive else None
            return make_caches(model, config, filters=np.asarray(filters), query_scale=scale)
        caches = make_caches(model, config, self_calibrate=self.method == "self")
        if self.window is not None:  # a study's knob, not a request's: set on the scorers
            for c in caches:
                if isinstance(getattr(c, "scorer", None), SnapKVScorer):
                    c.scorer.window = self.window
        return caches

    def source(self, caches: list[Any]) -> str:
        sources = {c.scorer.source for c in caches if isinstance(c, EvictionCache)}
        return ",".join(sorted(sources)) or "none"


READS_QUERIES = ("self", "snapkv", "tova", "kvzip")  # arms whose caches take the block's queries


def feed_block(caches: list[Any], block: list[tuple[Any, ...]]) -> None:
    """Hand one prompt block, computed once for every arm, to an arm's fresh caches:
    ``(keys, values)`` per layer, plus the block's rotated queries for self-calibrated
    and query-aware caches (what their layer's query tap would hold had the block run
    through them), and for kvzip caches the pass's scores, which they then evict by."""
    deferred = []
    for cache, (keys, values, *extra) in zip(caches, block, strict=True):
        tap = getattr(getattr(cache, "scorer", None), "tap", None)
        if tap is not None:
            if not extra:
                raise ValueError("an arm that reads queries needs the block's queries")
            tap.queries = extra[0]
        cache.update_and_fetch(keys, values)
        if isinstance(cache, EvictionCache) and cache.defers(keys.shape[2]):
            if len(extra) < 2:
                raise ValueError("a kvzip arm needs the block's reconstruction scores")
            deferred.append((cache, extra[1]))
    if deferred:  # as the pass ends: every layer at once (they may share the rows)
        kvzip.evict([c for c, _ in deferred], [s for _, s in deferred])


def standard_arms(
    recent_fracs: tuple[float, ...] = (0.0, 0.25), *, fallback_signs: tuple[int, ...] = (1, -1)
) -> list[Arm]:
    """Full, then calibrated, fallback (each sign), K-norm and streaming at each recent
    fraction.

    Streaming keeps the latest rows by construction, so a recent window changes nothing for
    it: it runs once, with ``recent = 0``.
    """
    arms = [Arm("full")]
    for frac in recent_fracs:
        arms.append(Arm("qfilters", frac))
        arms += [Arm("fallback", frac, sign) for sign in fallback_signs]
        arms.append(Arm("knorm", frac))
    arms.append(Arm("streaming", 0.0))
    return arms


def add_arm_arguments(p: Any) -> None:
    """``--chunks`` (chunked Q-Filters arms) and ``--only`` (keep the named arms)."""
    p.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[],
        help="also run calibrated Q-Filters keeping whole chunks of these sizes",
    )
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="also run calibrated Q-Filters with head-adaptive budgets",
    )
    p.add_argument(
        "--self-calibrated",
        action="store_true",
        help="also run Q-Filters computed from each prompt's own queries (qfserve.engine.kv.selfcal)",
    )
    p.add_argument(
        "--query-aware",
        action="store_true",
        help="also run SnapKV and TOVA, which read the model's queries (qfserve.engine.kv.query_aware)",
    )
    p.add_argument(
        "--snapkv-windows",
        type=int,
        nargs="+",
        default=[],
        help="with --query-aware, also run SnapKV with these observation windows",
    )
    p.add_argument(
        "--kvzip",
        action="store_true",
        help="also run KVzip (qfserve.engine.kv.kvzip): per head, across a layer's heads, across layers",
    )
    p.add_argument("--only", nargs="+", default=None, help="run only these arm names")


def add_traffic_argument(p: Any) -> None:
    """``--traffic-artifacts NAME=PATH ...``: Q-Filters from artifacts learned from traffic
    (:mod:`bench.quality.traffic`), as ``traffic`` arms or scorers. Only the studies whose
    resumed records know which artifact made them (retrieval) or that do not resume
    (attention) take it."""
    p.add_argument(
        "--traffic-artifacts",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="also run Q-Filters from these artifacts learned from traffic (bench.quality.traffic)",
    )


def select_arms(arms: list[Arm], args: Any) -> list[Arm]:
    """``arms`` plus a chunked Q-Filters arm per ``--chunks`` size and recent fraction of
    the plain one, with ``--adaptive`` an adaptive arm and one per chunk size with both,
    filtered by ``--only`` (the full cache always runs)."""
    plain = [a for a in arms if a.method == "qfilters" and a.chunk == 1 and not a.adaptive]
    extra = [Arm("qfilters", a.recent_frac, chunk=c) for c in args.chunks for a in plain]
    if args.adaptive:
        extra += [Arm("qfilters", a.recent_frac, adaptive=True) for a in plain]
        extra += [Arm("qfilters", a.recent_frac, chunk=c, adaptive=True)
                  for c in args.chunks for a in plain]  # fmt: skip  # both refinements
    if getattr(args, "self_calibrated", False):
        extra += [Arm("self", a.recent_frac) for a in plain]
    for spec in getattr(args, "traffic_artifacts", []):
        extra += [Arm("traffic", a.recent_frac, traffic=spec.split("=")[0]) for a in plain]
    if getattr(args, "query_aware", False):
        extra += [Arm(m, a.recent_frac) for m in ("snapkv", "tova") for a in plain]
        windows = getattr(args, "snapkv_windows", [])
        extra += [Arm("snapkv", a.recent_frac, window=w) for w in windows for a in plain]
    if getattr(args, "kvzip", False):
        extra += [Arm("kvzip", a.recent_frac) for a in plain]
        extra += [Arm("kvzip", a.recent_frac, adaptive=True) for a in plain]
        extra += [Arm("kvzip", a.recent_frac, shared=True) for a in plain]
    out = [*arms, *extra]
    if args.only:
        unknown = set(args.only) - {a.name for a in out}
        if unknown:
            raise ValueError(
                f"--only names unknown arms {sorted(unknown)}; have {[a.name for a in out]}"
            )
        out = [a for a in out if a.method == "full" or a.name in args.only]
    return out


def kept_rows(caches: list[Any]) -> list[int]:
    """Rows each evicting layer keeps per KV head (under adaptive budgets, the mean over its
    heads: their total is what the budget bounds)."""
    return [
        c.stats().tokens_kept if c.valid is not None else c.size()
        for c in caches
        if isinstance(c, EvictionCache)
    ]


def check_budget(caches: list[Any], budget: int | None, tokens_seen: int) -> int:
    """Raise unless every evicting layer holds exactly ``min(budget, tokens_seen)`` rows.

    Returns:
        The rows held (``tokens_seen`` for the full arm).
    """
    if budget is None:
        return tokens_seen
    expected = min(budget, tokens_seen)
    if any(getattr(getattr(c, "scorer", None), "shared", False) for c in caches):
        # Layers share the rows: each keeps whole rows per head, so the mean may fall short
        # of the budget by less than a row.
        mean = float(np.mean(kept_rows(caches)))
        if not expected - 1 < mean <= expected:
            raise RuntimeError(f"budget violated: layers hold {mean:.2f} rows on average")
        return expected
    rows = set(kept_rows(caches))
    if rows != {expected}:
        raise RuntimeError(f"budget violated: layers hold {sorted(rows)} rows, expected {expected}")
    return expected
