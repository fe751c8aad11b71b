"""The caches a study compares, and what it feeds them.

An arm (:class:`Arm`) is a method plus a recent window as a fraction of the budget; budgets
count every stored row and :func:`check_budget` checks each arm keeps exactly it. Calibrated
filters come from the registry or from training-split text (:func:`filters_for`), never the
evaluation split; :func:`streaming_nll` feeds an arm's real caches one token per step.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from bench.data import split_files
from bench.harness import progress
from qfserve.calibrations.capture import capture_queries
from qfserve.calibrations.compute import compute_filters, query_scales
from qfserve.calibrations.corpus import make_sequences, read_documents
from qfserve.engine.filters.artifact import resolve_filters
from qfserve.engine.kv import kvzip
from qfserve.engine.kv.cache import EvictionCache
from qfserve.engine.kv.config import DEFAULT_CALIB_TOKENS, DEFAULT_N_SINK, CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.query_aware import SnapKVScorer


@dataclass(frozen=True)
class Arm:
    """One cache arm: ``method`` (``full``, ``qfilters``, ``self``, ``traffic``, ``fallback``,
    ``knorm``, ``streaming``, ``snapkv``, ``tova``, ``kvzip``) and its knobs: the recent window as
    a fraction of the budget, the scoring axis's ``sign`` (the fallback's ablation), ``chunk``
    positions kept whole, ``adaptive`` head budgets, SnapKV's ``window``, the ``traffic``
    artifact's name and kvzip's rows ``shared`` across layers."""

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


ARM_FLAGS = {
    "--adaptive": "also run calibrated Q-Filters with head-adaptive budgets",
    "--self-calibrated": "also run Q-Filters from each prompt's own queries",
    "--query-aware": "also run SnapKV and TOVA, which read the model's queries",
    "--kvzip": "also run KVzip: per head, across a layer's heads, across layers",
}


def add_arm_arguments(p: Any) -> None:
    """The options that add arms (:func:`select_arms`), and ``--only`` to keep named ones."""
    p.add_argument("--chunks", type=int, nargs="+", default=[],
                   help="also run calibrated Q-Filters keeping whole chunks of these sizes")  # fmt: skip
    for flag, about in ARM_FLAGS.items():
        p.add_argument(flag, action="store_true", help=about)
    p.add_argument("--snapkv-windows", type=int, nargs="+", default=[],
                   help="with --query-aware, also run SnapKV with these observation windows")  # fmt: skip
    p.add_argument("--only", nargs="+", default=None, help="run only these arm names")


def add_traffic_argument(p: Any) -> None:
    """``--traffic-artifacts NAME=PATH ...``: filters learned from traffic, as arms or scorers."""
    p.add_argument("--traffic-artifacts", nargs="+", default=[], metavar="NAME=PATH",
                   help="also run Q-Filters from these artifacts learned from traffic")  # fmt: skip


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


# -- calibrated filters ------------------------------------------------------------------

CACHE_DIR = Path(
    os.environ.get("QFSERVE_BENCH_CACHE")
    or Path(tempfile.gettempdir()) / "qfserve-bench-calibration"
)
# (sequences, tokens per sequence, samples per head): the paper's / `qfserve calibrate`'s
# defaults in full mode, a few hundred tokens in quick mode.
FULL_SETTINGS = (20, 2048, 3000)
QUICK_SETTINGS = (3, 128, 300)


def text_files(text: str, seed: int = 0) -> list[Path]:
    """Training-split stdlib files of calibration text ``A`` or ``B`` (disjoint halves)."""
    if text not in ("A", "B"):
        raise ValueError(f"text must be 'A' or 'B', got {text!r}")
    files = list(split_files("train"))
    order = np.random.default_rng(seed).permutation(len(files))
    shuffled = [files[i] for i in order]
    return shuffled[0::2] if text == "A" else shuffled[1::2]


def describe_text(text: str, seed: int, used: int) -> str:
    return (
        f"text {text}: training-split stdlib *.py files (training.data.split_of == 'train'), "
        f"shuffled with seed {seed}, {'even' if text == 'A' else 'odd'} positions; "
        f"the beginnings of the first {used}"
    )


def capture(
    model: Any,
    tokenizer: Any,
    identity: dict[str, Any],
    *,
    text: str,
    settings: tuple[int, int, int],
    seed: int = 0,
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Sampled post-RoPE queries per layer ``(H, N, D)`` on calibration text, cached."""
    n_sequences, tokens, samples = settings
    context = identity.get("max_context") or tokens
    tokens = min(tokens, context)
    key = f"{identity['weights_sha1']}-{text}-{n_sequences}-{tokens}-{samples}-{seed}"
    path = CACHE_DIR / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.npz"
    if path.is_file():
        data = np.load(path, allow_pickle=False)
        queries = [data[f"layer{i}"] for i in range(identity["n_layers"])]
        return queries, {"description": str(data["description"]), "tokens": int(data["tokens"])}
    sequences, used = make_sequences(
        tokenizer,
        read_documents(text_files(text, seed)),
        n_sequences=n_sequences,
        tokens=tokens,
    )
    total = sum(len(s) for s in sequences)
    with progress(total=total, unit="tok", desc=f"calibrating on text {text}", leave=False) as bar:
        found = capture_queries(
            model, sequences, samples_per_head=samples, seed=seed, progress=bar.update
        )
    queries = [s.queries for s in found]
    description = describe_text(text, seed, used) + f"; {len(sequences)} x {tokens} tokens"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        description=description,
        tokens=total,
        **{f"layer{i}": q for i, q in enumerate(queries)},
    )
    tmp.replace(path)
    return queries, {"description": description, "tokens": total}


class CalibratedFilters(np.ndarray):
    """``(n_layers, n_kv_heads, head_dim)`` filters that also carry the calibration's query
    scales ``(n_layers, n_kv_heads)`` (``query_scale``; ``None`` for a version-1 artifact)
    and any filters learned from traffic by name (``learned``, :func:`with_learned`), so
    studies pass one object to every arm and the adaptive and traffic arms find theirs."""

    query_scale: np.ndarray | None
    learned: dict[str, np.ndarray]

    def __new__(cls, filters: np.ndarray, query_scale: np.ndarray | None) -> CalibratedFilters:
        obj = np.asarray(filters, dtype=np.float32).view(cls)
        obj.query_scale = None if query_scale is None else np.asarray(query_scale, np.float32)
        obj.learned = {}
        return obj

    def __array_finalize__(self, obj: Any) -> None:
        self.query_scale = getattr(obj, "query_scale", None)
        self.learned = getattr(obj, "learned", {})


def with_learned(
    filters: np.ndarray, specs: list[str], identity: dict[str, Any]
) -> tuple[CalibratedFilters, dict[str, Any]]:
    """``filters`` carrying the artifacts named by ``specs`` (``NAME=PATH``, from
    :mod:`bench.studies.traffic`), each checked against the model; and a record of them.

    Raises:
        ValueError: a spec is not ``NAME=PATH``, or names one twice.
        CalibrationError: an artifact is for another model, shape or weights.
    """
    from qfserve.calibrations.artifact import load_calibration

    out = CalibratedFilters(np.asarray(filters), getattr(filters, "query_scale", None))
    out.learned = {}
    record = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        # A name is the arm name's last part: none that reads as a setting (r25, c8, w8, ada).
        if (not sep or not path or name in out.learned or not re.fullmatch(r"[a-z][a-z_-]*", name)
                or name == "ada"):  # fmt: skip
            raise ValueError(
                f"--traffic-artifacts takes distinct NAME=PATH with NAME in lower-case letters, "
                f"'_' and '-' (not 'ada'), got {spec!r}"
            )
        cal = load_calibration(
            path,
            model_id=identity["model_id"],
            n_layers=identity["n_layers"],
            n_kv_heads=identity["n_kv_heads"],
            head_dim=identity["head_dim"],
            weights=identity["fingerprint"],
        )
        out.learned[name] = cal.filters
        digest = hashlib.sha1(np.ascontiguousarray(cal.filters, np.float32).tobytes())
        record[name] = {"path": path, "text": cal.metadata.get("text"),
                        "sha1": digest.hexdigest()[:12]}  # fmt: skip
    return out, record


def filters_for(
    model: Any,
    tokenizer: Any,
    identity: dict[str, Any],
    *,
    mode: str = "auto",
    quick: bool = False,
    seed: int = 0,
) -> tuple[np.ndarray, dict[str, Any]]:
    """The calibrated filters the studies use, and a record of where they came from.

    Args:
        mode: ``auto`` (the registry's artifact when one exists, else fresh), ``registry``
            (raise without one) or ``fresh``.
    Returns:
        ``(n_layers, n_kv_heads, head_dim)`` float32 filters and a JSON-able record.
    """
    if mode not in ("auto", "registry", "fresh"):
        raise ValueError(f"mode must be 'auto', 'registry' or 'fresh', got {mode!r}")
    if mode != "fresh":
        filters, source = resolve_filters(
            model, identity["model_id"], fingerprint=identity["fingerprint"]
        )
        if filters is not None:
            from qfserve.calibrations.registry import find, load_for_model

            path = find(identity["model_id"])
            n_layers, n_kv, head_dim = filters.shape
            cal = load_for_model(
                identity["model_id"], n_layers=n_layers, n_kv_heads=n_kv, head_dim=head_dim
            )
            meta = cal.metadata if cal is not None else {}
            scale = cal.query_scale if cal is not None else None
            return CalibratedFilters(np.array(filters), scale), {
                "source": "registry",
                "path": str(path),
                "text": meta.get("text"),
                "samples_per_head": meta.get("samples_per_head"),
                "disjoint_from_eval": "unknown: check the artifact's text",
            }
        if mode == "registry":
            raise ValueError(
                f"no calibration artifact for {identity['model_id']!r} (mode=registry)"
            )
    settings = QUICK_SETTINGS if quick else FULL_SETTINGS
    queries, info = capture(model, tokenizer, identity, text="A", settings=settings, seed=seed)
    filters, summaries = compute_filters(queries, identity["n_kv_heads"])
    return CalibratedFilters(filters, query_scales(queries, filters)), {
        "source": "fresh",
        "text": info["description"],
        "tokens": info["tokens"],
        "samples_per_head": int(queries[0].shape[1]),
        "disjoint_from_eval": not (set(text_files("A", seed)) & set(split_files("eval"))),
        "anisotropy": summaries,
    }


# -- teacher-forced likelihood -----------------------------------------------------------


def token_nll(logits: mx.array, targets: mx.array) -> mx.array:
    """``(B, N)`` negative log-likelihood of ``targets`` ``(B, N)`` under ``logits`` ``(B, N, V)``."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -mx.take_along_axis(logprobs, targets[..., None], axis=-1).squeeze(-1)


def full_nll(model: Any, tokens: np.ndarray) -> np.ndarray:
    """``(B, L-1)`` next-token NLL with a full cache (one forward pass over ``(B, L)``)."""
    x = mx.array(tokens.astype(np.int32))
    nll = token_nll(model(x[:, :-1]), x[:, 1:])
    return np.array(nll)


def prefill_length(budget: int | None, calib_tokens: int | None) -> int:
    """Tokens that can go in as one block without changing what the cache stores."""
    if budget is None:
        return 1 << 30
    if calib_tokens is None:
        return budget
    return min(budget, calib_tokens - 1)


def streaming_nll(
    model: Any,
    tokens: np.ndarray,
    caches: list[Any],
    *,
    budget: int | None,
    prefill: int,
    block: int | None = None,
    on_step: Callable[[int], None] | None = None,
    after_prefill: Callable[[], None] | None = None,
) -> tuple[np.ndarray, int]:
    """Next-token NLL ``(B, L-1)`` with ``caches`` fed one token per step after ``prefill``.

    Args:
        tokens: ``(B, L)`` token ids.
        budget: The arm's budget (``None`` for the full arm): checked after every step.
        prefill: Leading tokens fed before the single steps (see :func:`prefill_length`).
        block: Feed those in blocks of this many tokens, as a server reads a prompt (each
            block may evict: block evictions are where chunked selection and adaptive
            budgets act); ``None``: one block.
        on_step: Called with the number of tokens fed after each step.
        after_prefill: Called once the prefill tokens are in (KVzip's pass runs there).
    Returns:
        The NLL and the most rows any layer held at any step (with ``after_prefill``, at
        any step from the end of the prefill on).
    Raises:
        RuntimeError: a layer ever held more than ``budget`` rows, or fewer at the end.
    """
    L = tokens.shape[1]
    x = mx.array(tokens.astype(np.int32))
    prefill = max(1, min(prefill, L - 1))
    step = block or prefill
    spans = [(s, min(prefill, s + step)) for s in range(0, prefill, step)]
    spans += [(i, i + 1) for i in range(prefill, L - 1)]
    out, max_rows = [], 0
    for s, e in spans:
        out.append(token_nll(model(x[:, s:e], cache=caches), x[:, s + 1 : e + 1]))
        mx.eval(out[-1])
        if e == prefill and after_prefill is not None:
            after_prefill()
        if budget is None:
            max_rows = e
        elif after_prefill is not None and e < prefill:
            pass  # kvzip keeps the whole prompt until its pass: the bound holds from there on
        else:  # layers that share the rows (kvzip, global) are bounded on average
            held = kept_rows(caches)
            shared = any(getattr(getattr(c, "scorer", None), "shared", False) for c in caches)
            max_rows = max(max_rows, math.ceil(np.mean(held)) if shared else max(held))
        if budget is not None and max_rows > budget:
            raise RuntimeError(f"budget violated: a layer held {max_rows} rows > {budget}")
        if on_step is not None:
            on_step(e - s)
    check_budget(caches, budget, L - 1)
    return np.array(mx.concatenate(out, axis=1)), max_rows


# -- the speed studies' arms -------------------------------------------------------------


def cache_config(arm: str | int) -> CacheConfig:
    """``"full"`` or a budget: Q-Filters with the server's defaults (n_sink 4, recent 0)."""
    if arm == "full":
        return CacheConfig(method="full")
    return CacheConfig(method="qfilters", budget=int(arm))


def caches_for(run: Any, arm: str | int) -> list[Any]:
    """Fresh caches of a speed arm (``"full"`` or a budget) with the server's filters."""
    config = cache_config(arm)
    return make_caches(run.model, config, filters=run.filters if config.evicts else None)


def prefill(model, caches: list[Any], tokens: Sequence[int], chunk: int = 512) -> None:
    """Run ``tokens`` through the model in chunks (no sampling), filling ``caches``."""
    ids = mx.array(list(tokens))
    for s in range(0, len(tokens), chunk):
        model(ids[None, s : s + chunk], cache=caches)
        mx.eval([c.state for c in caches])


def kv_stats(caches: list[Any]) -> dict[str, int]:
    """Kept rows and bytes (statistics) and the bytes the cache arrays really hold."""
    from qfserve.engine.kv.stats import summarize

    s = summarize(caches)
    return {
        "tokens_seen": s.tokens_seen,
        "tokens_kept": s.tokens_kept,
        "kept_bytes": s.kept_bytes,
        "full_seq_bytes": s.full_seq_bytes,
        "cache_nbytes": sum(c.nbytes for c in caches),
    }


def decode_timer(model, caches: list[Any], steps: int, *, hold: bool):
    """A callable timing ``steps`` single-token decode steps; returns ms/step.

    ``hold`` trims every trimmable cache back by one row after each step, so a full cache
    (and an eviction cache that has not evicted yet) stays at its context length.
    """
    token = mx.array([[17]])

    def run() -> float:
        tic = time.perf_counter()
        for _ in range(steps):
            logits = model(token, cache=caches)
            mx.eval(logits, [c.state for c in caches])
            if hold:
                for c in caches:
                    if c.is_trimmable():
                        c.trim(1)
        return (time.perf_counter() - tic) / steps * 1e3

    return run
