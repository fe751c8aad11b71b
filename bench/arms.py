"""The caches a study compares, and what it feeds them.

An :class:`Arm` is a method plus a recent window as a fraction of the budget; budgets count every
stored row. Calibrated filters come from the registry or training-split text, never the
evaluation split.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from bench.data import split_files
from bench.resume import progress
from qfserve.calibrations.capture import capture_queries
from qfserve.calibrations.compute import compute_filters
from qfserve.calibrations.corpus import make_sequences, read_documents
from qfserve.calibrations.kvzap.hidden import HiddenTap
from qfserve.calibrations.kvzap.surrogate import Surrogate
from qfserve.engine.filters.artifact import resolve_filters
from qfserve.engine.kv import kvzip
from qfserve.engine.kv.cache import EvictionCache
from qfserve.engine.kv.config import DEFAULT_CALIB_TOKENS, DEFAULT_N_SINK, CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.kvzap import KVzapScorer, decode_room, share, share_in_decode


@dataclass(frozen=True)
class Arm:
    """One cache arm: ``method`` and its knobs: the fallback's axis ``sign``, and kvzip's rows
    ranked across a layer's heads (``adaptive``) or kvzip's or kvzap's ``shared`` across layers."""

    method: str
    recent_frac: float = 0.0
    sign: int = 1
    adaptive: bool = False
    shared: bool = False

    @property
    def name(self) -> str:
        if self.method == "full":
            return "full"
        tags = ("ada" * self.adaptive, "global" * self.shared)
        method = f"{self.method}{'-' * (self.sign < 0)}"
        return "/".join([method, f"r{int(round(self.recent_frac * 100))}", *filter(None, tags)])

    def recent(self, budget: int) -> int:
        return int(budget * self.recent_frac)

    def block(self, budget: int) -> int:
        """:func:`prefill_length` at ``budget``: what the fallback's calibration leaves."""
        calib = self.config(budget).calib_tokens if self.method == "fallback" else None
        return prefill_length(budget, calib)

    def config(self, budget: int | None, *, n_sink: int = DEFAULT_N_SINK) -> CacheConfig:
        if self.method == "full" or budget is None:
            return CacheConfig(method="full")
        return CacheConfig(
            method="qfilters" if self.method == "fallback" else self.method,
            budget=budget,
            n_sink=n_sink,
            recent=self.recent(budget),
            calib_tokens=min(DEFAULT_CALIB_TOKENS, budget),
            sign=self.sign,
            budget_mode="global" if self.shared else "adaptive" if self.adaptive else "per_head",
        )

    def caches(
        self,
        model: Any,
        budget: int | None,
        filters: np.ndarray | None,
        *,
        surrogate: Surrogate | None = None,
    ) -> list[Any]:
        """Fresh caches (``filters`` for the calibrated arms; the model's KVzap ``surrogate``
        for kvzap)."""
        config = self.config(budget)
        if self.method == "kvzap":
            if surrogate is None:
                raise ValueError("the kvzap arm needs the model's KVzap surrogates, got None")
            return make_caches(model, config, surrogate=surrogate)
        if self.method in ("qfilters", "kvzip"):
            if filters is None:
                raise ValueError("the calibrated qfilters arm needs filters, got None")
            return make_caches(model, config, filters=np.asarray(filters))
        return make_caches(model, config)

    def source(self, caches: list[Any]) -> str:
        sources = {c.scorer.source for c in caches if isinstance(c, EvictionCache)}
        return ",".join(sorted(sources)) or "none"


READS_QUERIES = ("snapkv", "tova", "kvzip")  # arms whose caches take the block's queries


@dataclass(frozen=True)
class LayerBlock:
    """One layer's share of a prompt block computed once for every arm: ``keys`` and
    ``values`` ``(1, H, N, D)``, and what some arms read besides: the rotated ``queries``
    ``(1, H_q, N, D)`` (query taps), kvzip's reconstruction-pass ``scores`` per row, and the
    input norm's ``hidden`` states ``(1, N, hidden)`` (kvzap's surrogate input)."""

    keys: mx.array
    values: mx.array
    queries: mx.array | None = None
    scores: mx.array | None = None
    hidden: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        """The arrays it holds (to evaluate them together)."""
        return [
            a
            for a in (self.keys, self.values, self.queries, self.scores, self.hidden)
            if a is not None
        ]


def feed_block(caches: list[Any], block: list[LayerBlock]) -> None:
    """Hand one prompt block, computed once for every arm, to an arm's fresh caches: each
    layer's keys and values, with its queries or hidden states set on the scorer's tap first
    (a kvzap scorer reads them as the rows are written), then kvzip's pass scores."""
    deferred, shared = [], False
    for cache, layer in zip(caches, block, strict=True):
        tap = getattr(getattr(cache, "scorer", None), "tap", None)
        if isinstance(tap, HiddenTap):
            if layer.hidden is None:
                raise ValueError("a kvzap arm needs the block's hidden states")
            tap.hidden = layer.hidden
        elif tap is not None:
            if layer.queries is None:
                raise ValueError("an arm that reads queries needs the block's queries")
            tap.queries = layer.queries
        cache.update_and_fetch(layer.keys, layer.values)
        if isinstance(cache, EvictionCache) and isinstance(cache.scorer, KVzapScorer):
            shared = shared or cache.scorer.shared
        elif isinstance(cache, EvictionCache) and cache.defers(layer.keys.shape[2]):
            if layer.scores is None:
                raise ValueError("a kvzip arm needs the block's reconstruction scores")
            deferred.append((cache, layer.scores))
    if deferred:  # as the pass ends: every layer at once (they may share the rows)
        kvzip.evict([c for c, _ in deferred], [s for _, s in deferred])
    if shared:  # kvzap's layers sharing the rows: by the scores the rows were written with,
        share(caches, decode=True)  # as before decoding (the block is the prompt but its last)


def standard_arms(
    recent_fracs: tuple[float, ...] = (0.0, 0.25), *, fallback_signs: tuple[int, ...] = (1, -1)
) -> list[Arm]:
    """Full, then calibrated, fallback (each sign) and K-norm per recent fraction, then streaming
    (it keeps the latest rows anyway: once, with ``recent = 0``)."""
    arms = [Arm("full")]
    for frac in recent_fracs:
        arms += [Arm("qfilters", frac), *(Arm("fallback", frac, s) for s in fallback_signs)]
        arms.append(Arm("knorm", frac))
    return [*arms, Arm("streaming", 0.0)]


ARM_FLAGS = {
    "--query-aware": "also run SnapKV and TOVA, which read the model's queries",
    "--kvzip": "also run KVzip: per head, across a layer's heads, across layers",
    "--kvzap": "also run KVzap: each row scored as it is written by the model's learned "
    "surrogates (the registry's, or trained afresh per --calibration), per head and across "
    "layers",
}


def add_arm_arguments(p: Any) -> None:
    """The options that add arms (:func:`select_arms`), and ``--only`` to keep named ones."""
    for flag, about in ARM_FLAGS.items():
        p.add_argument(flag, action="store_true", help=about)
    p.add_argument("--only", nargs="+", default=None, help="run only these arm names")


def select_arms(arms: list[Arm], args: Any) -> list[Arm]:
    """``arms`` plus, at each recent fraction of the plain Q-Filters arm, those the options of
    :func:`add_arm_arguments` add, filtered by ``--only`` (the full cache always runs)."""
    plain = [a for a in arms if a.method == "qfilters"]
    extra: list[tuple[str, dict[str, bool]]] = []
    if getattr(args, "query_aware", False):
        extra += [("snapkv", {}), ("tova", {})]
    if getattr(args, "kvzip", False):
        extra += [("kvzip", {}), ("kvzip", {"adaptive": True}), ("kvzip", {"shared": True})]
    if getattr(args, "kvzap", False):
        extra += [("kvzap", {}), ("kvzap", {"shared": True})]
    out = [*arms, *(Arm(m, a.recent_frac, **knobs) for m, knobs in extra for a in plain)]
    if args.only:
        if unknown := set(args.only) - {a.name for a in out}:
            raise ValueError(
                f"--only names unknown arms {sorted(unknown)}; have {[a.name for a in out]}"
            )
        out = [a for a in out if a.method == "full" or a.name in args.only]
    return out


def kept_rows(caches: list[Any]) -> list[int]:
    """Rows each evicting layer keeps per KV head (kvzip across heads: the mean over them)."""
    return [
        c.stats().tokens_kept if c.valid is not None else c.size()
        for c in caches
        if isinstance(c, EvictionCache)
    ]


def _shares_rows(caches: list[Any]) -> bool:
    # Layers that share the rows (kvzip, kvzap across layers) each keep whole rows per head,
    # so only their mean is bounded, and may fall short of the budget by less than a row.
    return any(getattr(getattr(c, "scorer", None), "shared", False) for c in caches)


def _decode_room(caches: list[Any], budget: int) -> int:
    # KVzap's shared rows store a room of decode rows beside their shares, then share again:
    # they may hold up to that room more (qfserve.engine.kv.kvzap.decode_room).
    kvzap = any(isinstance(getattr(c, "scorer", None), KVzapScorer) for c in caches)
    return decode_room(budget) if kvzap else 0


def check_budget(caches: list[Any], budget: int | None, tokens_seen: int) -> int:
    """Raise unless every evicting layer holds ``min(budget, tokens_seen)`` rows (on average,
    where layers share them; kvzap's, up to its decode room more); returns the rows held (``tokens_seen`` for the full arm)."""
    if budget is None:
        return tokens_seen
    expected, rows = min(budget, tokens_seen), kept_rows(caches)
    if _shares_rows(caches):
        if not expected - 1 < np.mean(rows) <= expected + _decode_room(caches, budget):
            raise RuntimeError(f"budget violated: layers hold {np.mean(rows):.2f} rows on average")
    elif set(rows) != {expected}:
        raise RuntimeError(
            f"budget violated: layers hold {sorted(set(rows))} rows, expected {expected}"
        )
    return expected


# -- calibrated filters ------------------------------------------------------------------

_DEFAULT_CACHE = Path(tempfile.gettempdir()) / "qfserve-bench-calibration"
CACHE_DIR = Path(os.environ.get("QFSERVE_BENCH_CACHE") or _DEFAULT_CACHE)
# (sequences, tokens per sequence, samples per head): the paper's / `qfserve calibrate`'s
# defaults in full mode, a few hundred tokens in quick mode.
FULL_SETTINGS = (20, 2048, 3000)
QUICK_SETTINGS = (3, 128, 300)


def text_files(text: str, seed: int = 0) -> list[Path]:
    """Training-split stdlib files of calibration text ``A`` or ``B`` (disjoint halves)."""
    if text not in ("A", "B"):
        raise ValueError(f"text must be 'A' or 'B', got {text!r}")
    files = list(split_files("train"))
    shuffled = [files[i] for i in np.random.default_rng(seed).permutation(len(files))]
    return shuffled[0::2] if text == "A" else shuffled[1::2]


def capture(
    model: Any,
    tokenizer: Any,
    identity: dict[str, Any],
    *,
    text: str,
    quick: bool,
    seed: int = 0,
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Sampled post-RoPE queries per layer ``(H, N, D)`` on calibration text (``quick``: a few
    hundred tokens), cached on disk."""
    n_sequences, tokens, samples = QUICK_SETTINGS if quick else FULL_SETTINGS
    tokens = min(tokens, identity.get("max_context") or tokens)
    key = f"{identity['weights_sha1']}-{text}-{n_sequences}-{tokens}-{samples}-{seed}"
    path = CACHE_DIR / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.npz"
    if path.is_file():
        data = np.load(path, allow_pickle=False)
        queries = [data[f"layer{i}"] for i in range(identity["n_layers"])]
        return queries, {"description": str(data["description"]), "tokens": int(data["tokens"])}
    files = text_files(text, seed)
    sequences, used = make_sequences(
        tokenizer, read_documents(files), n_sequences=n_sequences, tokens=tokens
    )
    total = sum(len(s) for s in sequences)
    with progress(total=total, unit="tok", desc=f"calibrating on text {text}", leave=False) as bar:
        found = capture_queries(
            model, sequences, samples_per_head=samples, seed=seed, progress=bar.update
        )
    queries = [s.queries for s in found]
    description = (
        f"text {text}: training-split stdlib *.py files (training.data.split_of == 'train'), "
        f"shuffled with seed {seed}, {'even' if text == 'A' else 'odd'} positions; "
        f"the beginnings of the first {used}; {len(sequences)} x {tokens} tokens"
    )
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    layers = {f"layer{i}": q for i, q in enumerate(queries)}
    np.savez(tmp, description=description, tokens=total, **layers)
    tmp.replace(path)
    return queries, {"description": description, "tokens": total}


def filters_for(
    model: Any,
    tokenizer: Any,
    identity: dict[str, Any],
    *,
    mode: str = "auto",
    quick: bool = False,
    seed: int = 0,
) -> tuple[np.ndarray, dict[str, Any]]:
    """The studies' calibrated filters ``(n_layers, n_kv_heads, head_dim)`` and a JSON-able
    record of where they came from: the registry's artifact (``mode`` ``auto`` when one exists,
    or ``registry``) or calibrated afresh."""
    if mode not in ("auto", "registry", "fresh"):
        raise ValueError(f"mode must be 'auto', 'registry' or 'fresh', got {mode!r}")
    model_id = identity["model_id"]
    filters = None
    if mode != "fresh":
        filters, _ = resolve_filters(model, model_id, fingerprint=identity["fingerprint"])
    if filters is not None:
        from qfserve.calibrations.registry import find, load_for_model

        n_layers, n_kv, head_dim = filters.shape
        cal = load_for_model(model_id, n_layers=n_layers, n_kv_heads=n_kv, head_dim=head_dim)
        meta = cal.metadata if cal is not None else {}
        out = np.asarray(filters, dtype=np.float32)
        record = {
            "source": "registry",
            "path": str(find(model_id)),
            "text": meta.get("text"),
            "samples_per_head": meta.get("samples_per_head"),
            "disjoint_from_eval": "unknown: check the artifact's text",
        }
    elif mode == "registry":
        raise ValueError(f"no calibration artifact for {model_id!r} (mode=registry)")
    else:
        queries, info = capture(model, tokenizer, identity, text="A", quick=quick, seed=seed)
        raw, anisotropy = compute_filters(queries, identity["n_kv_heads"])
        out = np.asarray(raw, dtype=np.float32)
        record = {
            "source": "fresh",
            "text": info["description"],
            "tokens": info["tokens"],
            "samples_per_head": int(queries[0].shape[1]),
            "disjoint_from_eval": not (set(text_files("A", seed)) & set(split_files("eval"))),
            "anisotropy": anisotropy,
        }
    return out, record


# -- teacher-forced likelihood -----------------------------------------------------------


def token_nll(logits: mx.array, targets: mx.array) -> mx.array:
    """``(B, N)`` negative log-likelihood of ``targets`` ``(B, N)`` under ``logits`` ``(B, N, V)``."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -mx.take_along_axis(logprobs, targets[..., None], axis=-1).squeeze(-1)


def full_nll(model: Any, tokens: np.ndarray) -> np.ndarray:
    """``(B, L-1)`` next-token NLL with a full cache (one forward pass over ``(B, L)``)."""
    x = mx.array(tokens.astype(np.int32))
    return np.array(token_nll(model(x[:, :-1]), x[:, 1:]))


def prefill_length(budget: int | None, calib_tokens: int | None) -> int:
    """Tokens that can go in as one block without changing what the cache stores."""
    if budget is None:
        return 1 << 30
    return budget if calib_tokens is None else min(budget, calib_tokens - 1)


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
    """Next-token NLL ``(B, L-1)`` of ``tokens`` ``(B, L)``, fed to ``caches`` in blocks of
    ``block`` tokens (``None``: one) up to ``prefill``, then one token per step.

    ``on_step(n)`` follows each step; ``after_prefill()`` the prefill (kvzip's pass: the budget
    holds from there on). Returns the NLL and the most rows any layer held; raises
    ``RuntimeError`` if that ever exceeds ``budget`` or the end falls short of it.
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
        elif after_prefill is None or e >= prefill:
            held = kept_rows(caches)
            max_rows = max(
                max_rows, math.ceil(np.mean(held)) if _shares_rows(caches) else max(held)
            )
            if max_rows > budget + _decode_room(caches, budget):
                raise RuntimeError(f"budget violated: a layer held {max_rows} rows > {budget}")
        if on_step is not None:
            on_step(e - s)
    check_budget(caches, budget, L - 1)
    return np.array(mx.concatenate(out, axis=1)), max_rows


# -- the speed studies' arms -------------------------------------------------------------


def caches_for(run: Any, arm: str | int) -> list[Any]:
    """Fresh caches of a speed arm: ``"full"``, or a budget of Q-Filters with the server's
    defaults and filters."""
    if arm == "full":
        return make_caches(run.model, CacheConfig(method="full"))
    return make_caches(
        run.model, CacheConfig(method="qfilters", budget=int(arm)), filters=run.filters
    )


def prefill(model, caches: list[Any], tokens: Sequence[int], chunk: int = 512) -> None:
    """Run ``tokens`` through the model in chunks (no sampling), filling ``caches``; where
    kvzap's layers share the rows, each chunk is shared out before the next, and the last
    as before decoding, as the server does."""
    ids = mx.array(list(tokens))
    for s in range(0, len(tokens), chunk):
        model(ids[None, s : s + chunk], cache=caches)
        share(caches, decode=s + chunk >= len(tokens))
        mx.eval([c.state for c in caches])


def kv_stats(caches: list[Any]) -> dict[str, int]:
    """Kept rows and bytes (statistics) and the bytes the cache arrays really hold."""
    from qfserve.engine.kv.stats import summarize

    s = summarize(caches)
    fields = ("tokens_seen", "tokens_kept", "kept_bytes", "full_seq_bytes")
    return {**{k: getattr(s, k) for k in fields}, "cache_nbytes": sum(c.nbytes for c in caches)}


def decode_timer(model, caches: list[Any], steps: int, *, hold: bool) -> Callable[[], float]:
    """A callable timing ``steps`` single-token decode steps, in ms a step; ``hold`` trims each
    trimmable cache by a row after each, so a full cache stays at its context length. KVzap's
    shared rows are shared out as the server's policy does between steps."""
    token, done = mx.array([[17]]), itertools.count(1)

    def run() -> float:
        tic = time.perf_counter()
        for _ in range(steps):
            logits = model(token, cache=caches)
            mx.eval(logits, [c.state for c in caches])
            share_in_decode(caches, next(done))
            if hold:
                for c in caches:
                    if c.is_trimmable():
                        c.trim(1)
        return (time.perf_counter() - tic) / steps * 1e3

    return run
