"""Does each scorer's score predict the attention a key will receive?

Spearman's rho per (layer, KV head) between the attention keys ``n_sink .. L/2`` get from later
queries (full cache) and each engine scorer's score; several ``--lengths``: ``<data>@<length>``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from bench.arms import add_traffic_argument
from bench.data import recall_windows, stdlib_windows
from bench.plots import color, save_plot, subplots
from bench.report import fmt, pct, section, spread_cell, table
from bench.resume import progress
from bench.run import start
from bench.timing import summary
from qfserve.calibrations.capture import QueryCapture
from qfserve.calibrations.model_info import attention_modules
from qfserve.engine.kv.config import DEFAULT_CALIB_TOKENS, DEFAULT_N_SINK
from qfserve.engine.kv.query_aware import SnapKVScorer
from qfserve.engine.kv.scorers import KeySVDScorer, KNormScorer, QFilterScorer, RecencyScorer
from qfserve.engine.kv.selfcal import QueryTap, filters_from_moments

STUDY = "attention"
SCORERS = ("qfilters", "self", "fallback+", "fallback-", "knorm", "snapkv", "snapkv/w8", "recency")
SNAPKV_WINDOWS = {"snapkv": 32, "snapkv/w8": 8}


def rankdata(a: np.ndarray) -> np.ndarray:
    """Ranks ``0..n-1`` with ties averaged (as ``scipy.stats.rankdata`` minus one)."""
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(len(a), dtype=np.float64)
    ranks[order] = np.arange(len(a))
    _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
    return (np.bincount(inverse, weights=ranks) / counts)[inverse]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = rankdata(a), rankdata(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


def received_attention(queries: np.ndarray, keys: np.ndarray, scale: float) -> np.ndarray:
    """``(KV, L)`` attention each key gets from queries ``L/2 .. L-1`` and the group's heads
    (post-RoPE ``queries`` ``(H, L, D)`` in position order, ``keys`` ``(KV, L, D)``)."""
    H, L, _ = queries.shape
    kv = keys.shape[0]
    group = H // kv
    later = np.arange(L // 2, L)
    # matmul, not einsum: a BLAS call per head (an 8k-token sequence is 9 x 4k x 8k logits).
    logits = (queries[:, later] @ keys[np.arange(H) // group].transpose(0, 2, 1)) * scale
    logits[:, np.arange(len(later))[:, None] < (np.arange(L)[None, :] - later[0])] = -np.inf
    logits -= logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits)
    weights /= weights.sum(axis=-1, keepdims=True)  # (H, |later|, L)
    return weights.mean(axis=1).reshape(kv, group, L).mean(axis=1)


def self_filters(queries: mx.array, n_kv_heads: int) -> mx.array:
    """The self-calibrated ``(KV, D)`` filters of one layer from its queries ``(H, N, D)``."""
    q = queries.astype(mx.float32)
    return filters_from_moments(q.swapaxes(-1, -2) @ q, q.sum(axis=1), n_kv_heads)


def snapkv_scores(queries: np.ndarray, keys: mx.array, scale: float, window: int) -> mx.array:
    """SnapKV's ``(1, KV, L)`` scores had the first half of the sequence been the prompt
    (``queries`` ``(H, L, D)``; keys past the half score 0: only the first half is ranked)."""
    half = keys.shape[2] // 2
    tap = QueryTap(scale)
    tap.queries = mx.array(queries[None, :, :half].astype(np.float32))
    scored = SnapKVScorer(tap, scale=scale, window=window).score(keys[:, :, :half], 0)
    return mx.concatenate([scored, mx.zeros((1, keys.shape[1], keys.shape[2] - half))], axis=2)


def scores_for(
    keys: mx.array, queries: np.ndarray, scale: float, filters: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Every scorer's ``(KV, L)`` scores for one layer's keys ``(1, KV, L, D)``: a Q-Filter
    scorer per entry of ``filters`` (this layer's), then the filter-free ones."""
    out = {name: QFilterScorer(mx.array(f)).score(keys, 0) for name, f in filters.items()}
    out["knorm"] = KNormScorer().score(keys, 0)
    out["recency"] = RecencyScorer().score(keys, 0)
    for name, window in SNAPKV_WINDOWS.items():
        out[name] = snapkv_scores(queries, keys, scale, window)
    for sign, name in ((1, "fallback+"), (-1, "fallback-")):
        scorer = KeySVDScorer(DEFAULT_CALIB_TOKENS, sign=sign)
        scorer.observe(keys[:, :, :DEFAULT_CALIB_TOKENS], DEFAULT_CALIB_TOKENS)
        out[name] = scorer.score(keys, 0)
    return {k: np.array(v[0]) for k, v in out.items()}


def sequence_correlations(
    model: Any, tokens: np.ndarray, filters: Any, scorers: tuple[str, ...]
) -> np.ndarray:
    """``(n_scorers, n_layers, n_kv)`` Spearman correlations on one sequence."""
    L = len(tokens)
    cache = make_prompt_cache(model)
    with QueryCapture(model, samples_per_head=L) as capture:
        model(mx.array(tokens.astype(np.int32))[None], cache=cache)
        samples = capture.samples()
    attns = attention_modules(model)
    keys_of = np.arange(DEFAULT_N_SINK, L // 2)
    n_kv = filters.shape[1]
    out = np.zeros((len(scorers), len(attns), n_kv))
    for layer, (attn, sample, c) in enumerate(zip(attns, samples, cache, strict=True)):
        queries = sample.queries[:, np.argsort(sample.positions)]  # (H, L, D)
        keys = c.keys[:, :, :L].astype(mx.float32)  # (1, KV, L, D)
        scale = float(attn.scale)
        received = received_attention(queries, np.array(keys[0]), scale)
        own = self_filters(mx.array(queries[:, : L // 2]), n_kv)  # the first half's queries
        by_filter = {
            "qfilters": filters[layer],
            "self": own,
            **{f"traffic/{k}": v[layer] for k, v in filters.learned.items()},
        }
        scores = scores_for(keys, queries, scale, by_filter)
        for s, name in enumerate(scorers):
            for k in range(n_kv):
                out[s, layer, k] = spearman(scores[name][k, keys_of], received[k, keys_of])
    return out


def head_stats(rho: np.ndarray) -> dict[str, Any]:
    """One scorer's figures from its ``(S, n_layers, n_kv)`` correlations: over heads (each
    the mean over sequences), and the share of (sequence, head) cells positive."""
    head_mean = np.nanmean(rho, axis=0)
    per_head = head_mean.ravel()
    return {
        "mean_rho": float(np.nanmean(per_head)),
        "share_heads_positive": float(np.mean(per_head > 0)),
        "share_cells_positive": float(np.mean(rho > 0)),
        "per_head_spread": summary(per_head.tolist()),
        "per_head": head_mean.tolist(),  # [layer][kv_head]
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    study = start(
        STUDY,
        argv,
        __doc__,
        calibration=True,
        options=[add_traffic_argument],
        length=(1024, 160, "tokens per sequence"),
        sequences=(12, 1, "held-out sequences per kind"),
        flags={"--lengths": {"type": int, "nargs": "+", "help": "several in one run"}},
    )
    args = study.args
    lengths, n_seq = args.lengths or [args.length], args.sequences
    model, filters, corpus = study.model, study.filters, study.corpus
    scorers = SCORERS[:2] + tuple(f"traffic/{k}" for k in filters.learned) + SCORERS[2:]
    datasets = {}
    for length in lengths:
        n = n_seq if len(lengths) == 1 else max(2, round(n_seq * 1024 / length))
        tag = "" if len(lengths) == 1 else f"@{length}"
        datasets[f"stdlib{tag}"] = stdlib_windows(corpus, length, n)
        datasets[f"recall{tag}"] = recall_windows(corpus, length, n)
    rho = {}  # (S, n_scorers, n_layers, n_kv) per data set
    for name, seqs in datasets.items():
        bar = progress(iterable=seqs, desc=name)
        rho[name] = np.stack([sequence_correlations(model, t, filters, scorers) for t in bar])
    if len(lengths) > 1:
        for n in lengths:
            rho[f"all@{n}"] = np.concatenate([rho[f"stdlib@{n}"], rho[f"recall@{n}"]])
    rho["all"] = np.concatenate([v for k, v in rho.items() if not k.startswith("all")])
    results = {
        name: {scorer: head_stats(r[:, s]) for s, scorer in enumerate(scorers)}
        for name, r in rho.items()
    }

    fig, ax = subplots(1, 2, figsize=(11, 3.8))
    pooled = results["all"]
    for s, scorer in enumerate(scorers):
        per_head = np.ravel(pooled[scorer]["per_head"])
        jitter = np.linspace(-0.15, 0.15, len(per_head))
        ax[0, 0].scatter(s + jitter, per_head, s=12, color=color(*scorer.split("/")), alpha=0.8)
        ax[0, 0].hlines(pooled[scorer]["mean_rho"], s - 0.3, s + 0.3, color="black")
    ax[0, 0].axhline(0, color="grey", lw=0.5)
    ax[0, 0].set_xticks(range(len(scorers)), scorers, rotation=30, fontsize=7)
    ax[0, 0].set_ylabel("Spearman rho (per KV head, mean over sequences)")
    n_layers, n_kv = filters.shape[:2]
    im = ax[0, 1].imshow(
        pooled[scorers[0]]["per_head"], cmap="RdBu", vmin=-1, vmax=1, aspect="auto"
    )
    ax[0, 1].set(xlabel="KV head", ylabel="layer", xticks=range(n_kv), yticks=range(n_layers))
    ax[0, 1].set_title("calibrated Q-Filters, rho per head", fontsize=9)
    fig.colorbar(im, ax=ax[0, 1])
    save_plot(fig, args.out, STUDY, study.title("does the score predict attention?"))

    data = {
        "length": lengths[0] if len(lengths) == 1 else lengths,
        "sequences": {k: len(v) for k, v in datasets.items()},
        "keys": f"positions {DEFAULT_N_SINK} .. L/2-1",
        "queries": "positions L/2 .. L-1, all query heads of the KV group",
        "fallback_calib_tokens": DEFAULT_CALIB_TOKENS,
        "snapkv_windows": SNAPKV_WINDOWS,
    }
    return study.save(
        {"data": data, "scorers": list(scorers), "results": results, "plots": [f"{STUDY}.png"]}
    )


def render(data: dict[str, Any]) -> list[str]:
    d, results = data["data"], data["results"]
    lengths = d["length"] if isinstance(d["length"], list) else [d["length"]]
    intro = (
        f"Spearman correlation, per KV head, between each score and the attention a key "
        f"receives from later queries (keys {d['keys']}; queries {d['queries']}), "
        f"{', '.join(map(str, lengths))}-token held-out sequences {d['sequences']}. Mean over "
        "heads, the share of heads where it is positive, and the spread of per-head values."
    )
    blocks: list[str | list[str]] = [intro]
    if len(lengths) > 1:  # one row per scorer, a column per length (both kinds of data)
        keys = [f"all@{n}" for n in lengths] + ["all"]
        rows = [
            [
                scorer,
                *(
                    f"{fmt(results[k][scorer]['mean_rho'], 2)} "
                    f"({pct(results[k][scorer]['share_heads_positive'])})"
                    for k in keys
                ),
            ]
            for scorer in results["all"]
        ]
        blocks += [
            "Mean ρ over KV heads (share of heads with ρ > 0), by sequence length:",
            table(["scorer", *[f"{n} tokens" for n in lengths], "all sequences pooled"], rows),
            "By data and length:",
        ]
    rows = [
        [
            dataset,
            scorer,
            fmt(r["mean_rho"]),
            pct(r["share_heads_positive"]),
            spread_cell(r["per_head_spread"]),
        ]
        for dataset, res in results.items()
        for scorer, r in res.items()
    ]
    blocks.append(table(["data", "scorer", "mean ρ", "heads ρ > 0", "per-head [q1–q3]"], rows))
    if res := results.get("all"):
        per_layer = zip(*(r["per_head"] for r in res.values()), strict=True)
        cell = lambda heads: " / ".join(f"{v:+.2f}" for v in heads)  # noqa: E731
        rows = [[layer, *map(cell, by_scorer)] for layer, by_scorer in enumerate(per_layer)]
        blocks += ["Per layer (all data; each cell: ρ of KV head 0 / 1 / ...):"]
        blocks.append(table(["layer", *res], rows))
    return section("Does the score predict attention?", data, *blocks)
