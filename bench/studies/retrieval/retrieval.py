"""Pass-key retrieval against context length, compression and needle depth.

Greedy accuracy and teacher-forced answer NLL per arm and ratio; one shared prefill, checked on
the first document against a direct ``generate_step``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from bench import plots
from bench.arms import (
    READS_QUERIES,
    Arm,
    LayerBlock,
    add_arm_arguments,
    check_budget,
    feed_block,
    select_arms,
    standard_arms,
    streaming_nll,
)
from bench.data import first_number_is, passkey_docs
from bench.plots import COLORS, ratio_panel
from bench.report import arm_label, arm_order, fmt, section, table
from bench.run import Run, start
from bench.timing import summary
from qfserve.calibrations.kvzap.hidden import install_hidden_taps
from qfserve.engine.kv.config import DEFAULT_N_SINK, CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.kvzap import share_in_decode
from qfserve.engine.kv.kvzip import RepeatPrompt, compress
from qfserve.engine.kv.selfcal import install_query_taps

STUDY = "retrieval"
BINS = ("first third", "middle third", "last third")
RULE = "budget = round(prompt tokens / ratio), recent = budget/4"


def budget_for(prompt_len: int, ratio: int, arm: Arm) -> int | None:
    """``round(prompt_len / ratio)``, or None when it leaves no evictable row."""
    budget = round(prompt_len / ratio)
    return budget if budget > DEFAULT_N_SINK + arm.recent(budget) else None


def cells(configs: list[tuple[Arm, int | None]], prompt_len: int) -> Iterator[tuple]:
    """``(arm, ratio, its key, budget)`` of each ``(arm, ratio)`` that leaves an evictable row
    (ratio ``None``: no eviction, key ``-``)."""
    for arm, ratio in configs:
        budget = None if ratio is None else budget_for(prompt_len, ratio, arm)
        if ratio is None or budget is not None:
            yield arm, ratio, "-" if ratio is None else str(ratio), budget


def by_arm(arms: list[Arm], ratios: list[int]) -> list[tuple[Arm, int | None]]:
    """Each arm at each ratio, the full cache once."""
    return [(a, r) for a in arms for r in ([None] if a.method == "full" else ratios)]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of ``k`` successes in ``n``."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def decode(model: Any, prompt: list[int], caches: list[Any], max_tokens: int) -> list[int]:
    """Greedy tokens from ``generate_step`` with ``prompt_cache=caches`` (kvzap's shared rows
    shared out between steps, as the server does)."""
    tokens = []
    for token, _ in generate_step(
        mx.array(prompt), model, prompt_cache=caches, max_tokens=max_tokens
    ):
        tokens.append(int(token))
        share_in_decode(caches, len(tokens))
    return tokens


def prefill_block(
    model: Any,
    prompt: list[int],
    *,
    queries: bool = False,
    hidden: bool = False,
    kvzip: RepeatPrompt | None = None,
) -> list[LayerBlock]:
    """Each layer's keys and values for ``prompt[:-1]`` (one block, full cache), with
    ``queries`` its rotated queries, with ``hidden`` its input norm's output (kvzap) and with
    ``kvzip`` the reconstruction pass's row scores (budget-free: the pass runs once per
    document for every kvzip arm and ratio)."""
    n = len(prompt) - 1
    taps = install_query_taps(model) if queries or kvzip is not None else None
    norms = install_hidden_taps(model) if hidden else None
    if kvzip is not None:  # a budget above the block: the pass scores rows, evicts none
        cache = make_caches(model, CacheConfig(method="kvzip", budget=n + 1))
    else:
        cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    block = [LayerBlock(c.keys[..., :n, :], c.values[..., :n, :]) for c in cache]
    if taps is not None:
        block = [replace(b, queries=tap.take(n)) for b, tap in zip(block, taps, strict=True)]
    if norms is not None:  # taken before the reconstruction pass runs the layers again
        block = [replace(b, hidden=tap.take(n)) for b, tap in zip(block, norms, strict=True)]
    if kvzip is not None:
        compress(model, cache, prompt[:-1], kvzip)
        block = [replace(b, scores=c.token_scores) for b, c in zip(block, cache, strict=True)]
    mx.eval([b.arrays() for b in block])
    return block


def run_arm(
    study: Run, prompt: list[int], block: Any, arm: Arm, budget: int | None, max_tokens: int
) -> tuple[list[int], str]:
    """Generated tokens of one arm and its filters' source (``block=None``: prefilled the
    direct way)."""
    caches = arm.caches(study.model, budget, study.filters, surrogate=study.surrogate)
    if block is None:
        tokens = decode(study.model, prompt, caches, max_tokens)
    else:
        feed_block(caches, block)
        tokens = decode(study.model, prompt[-1:], caches, max_tokens)
    check_budget(caches, budget, len(prompt) - 1 + len(tokens))
    return tokens, arm.source(caches)


def answer_nll(
    study: Run, prompt: list[int], answer: list[int], block: Any, arm: Arm, budget: int | None
) -> float:
    """Mean NLL per answer token, teacher-forced one token per step after the prompt."""
    caches = arm.caches(study.model, budget, study.filters, surrogate=study.surrogate)
    feed_block(caches, block)
    tokens = np.array([[prompt[-1], *answer]])
    # budget=None: the rows are checked against the whole document just below.
    nll, _ = streaming_nll(study.model, tokens, caches, budget=None, prefill=1)
    check_budget(caches, budget, len(prompt) - 1 + len(answer))
    return float(nll.mean())


def answers(
    study: Run, doc: dict[str, Any], configs: list[tuple[Arm, int | None]], max_tokens: int
) -> Iterator[tuple]:
    """Each arm at each ratio on one prompt prefilled once: ``(arm, ratio, key, budget, tokens,
    filter source, right, answer NLL)``, right when the first number is ``doc["key"]``."""
    prompt, methods = doc["prompt"], {arm.method for arm, _ in configs}
    # One prefill with what the arms read: the block's queries, hidden states, kvzip's scores.
    block = prefill_block(
        study.model,
        prompt,
        queries=bool(methods & set(READS_QUERIES)),
        hidden="kvzap" in methods,
        kvzip=study.repeat if "kvzip" in methods else None,
    )
    for arm, ratio, key, budget in cells(configs, len(prompt)):
        tokens, source = run_arm(study, prompt, block, arm, budget, max_tokens)
        right = first_number_is(study.tokenizer.decode(tokens), doc["key"])
        nll = answer_nll(study, prompt, doc["answer"], block, arm, budget)
        yield arm, ratio, key, budget, tokens, source, right, nll


def measure_doc(
    study: Run, doc: dict[str, Any], configs: list[tuple[Arm, int | None]], *, first: bool
) -> dict[str, Any]:
    """Every arm at every ratio on one document (``first``: also check the shared prefill
    against a direct ``generate_step``)."""
    check: dict[str, Any] = {"arms": 0, "identical": 0, "mismatches": []}
    out: dict[str, Any] = {"bin": doc["bin"], "cells": [], "sources": {}, "check": check}
    max_tokens = doc["key_tokens"] + 2
    for arm, ratio, key, budget, tokens, source, right, nll in answers(
        study, doc, configs, max_tokens
    ):
        # kvzip's pass, and rows shared across layers, run on the shared block only
        if first and arm.method != "kvzip" and not arm.shared:
            direct, _ = run_arm(study, doc["prompt"], None, arm, budget, max_tokens)
            check["arms"] += 1
            check["identical"] += direct == tokens
            if direct != tokens:
                check["mismatches"].append(f"{arm.name}@{ratio}x")
        out["sources"][arm.name] = source
        out["cells"].append([arm.name, key, right, nll, budget])
    return out


def cell_stats(outcomes: list[tuple[bool, int, float]]) -> dict[str, Any]:
    """One arm at one ratio from its documents' ``(correct, depth bin, answer NLL)``."""
    correct, bins, nll = zip(*outcomes, strict=True)
    k, n = sum(correct), len(correct)
    by_depth = [
        [c for c, bb in zip(correct, bins, strict=True) if bb == b] for b in range(len(BINS))
    ]
    return {
        "accuracy": k / n,
        "n": n,
        "ci95": wilson(k, n),
        "answer_nll": summary(nll),
        "answer_nll_mean": float(np.mean(nll)),
        "by_depth": {
            label: float(np.mean(v)) if v else None for label, v in zip(BINS, by_depth, strict=True)
        },
    }


def length_results(docs: list[dict[str, Any]], records: list[dict[str, Any]]) -> dict[str, Any]:
    """One length's figures from its documents and their records."""
    hits: dict[str, dict[str, list]] = {}  # arm name -> ratio or "-" -> (correct, bin, nll)
    budgets: dict[str, list[int]] = {}
    for rec in records:
        for name, key, correct, nll, budget in rec["cells"]:
            hits.setdefault(name, {}).setdefault(key, []).append((correct, rec["bin"], nll))
            if budget is not None:
                budgets.setdefault(key, []).append(budget)
    return {
        "docs": len(docs),
        "mean_prompt_tokens": float(np.mean([len(d["prompt"]) for d in docs])),
        "depths": [round(d["depth"], 3) for d in docs],
        "budget_by_ratio": {k: sorted(set(v)) for k, v in budgets.items()},
        "arms": {
            name: {k: cell_stats(o) for k, o in by_ratio.items()} for name, by_ratio in hits.items()
        },
    }


def ratio_row(name: str, results: Any, metric: str, keys: list[str], digits: int) -> list[str]:
    """An arm's row by ratio: ``metric`` averaged over ``results`` (one per length)."""
    row = [arm_label(name)]
    for k in keys:
        vals = [r["arms"][name][k][metric] for r in results if k in r["arms"].get(name, {})]
        row.append(fmt(sum(vals) / len(vals), digits) if vals else "")
    return row


def depth_means(results: dict[str, Any], name: str, bins: Any = BINS) -> list[float | None]:
    """An arm's accuracy per needle-depth bin, mean over lengths and compressions."""
    cells = [c for res in results.values() for c in res["arms"].get(name, {}).values()]
    means = []
    for b in bins:
        vals = [c["by_depth"][b] for c in cells if c["by_depth"].get(b) is not None]
        means.append(sum(vals) / len(vals) if vals else None)
    return means


def arm_style(arm: Arm) -> dict[str, Any]:
    """An arm's line: its method's colour, squares and dashes with a recent window."""
    return {
        "marker": "o" if arm.recent_frac == 0 else "s",
        "color": COLORS[arm.method],
        "linestyle": ":" if arm.sign < 0 else "-" if arm.recent_frac == 0 else "--",
        "label": arm_label(arm.name),
    }


def plot(
    results: dict[str, Any], arms: list[Arm], ratios: list[int], out: Path, title: str
) -> None:
    """Accuracy and answer NLL against compression a column per length; accuracy by depth."""
    styles = {a.name: arm_style(a) for a in arms}
    fig, ax = plots.subplots(2, len(results), figsize=(3.6 * len(results), 6.4), sharey="row")
    for col, (n, res) in enumerate(results.items()):
        for row, key in enumerate(("accuracy", "answer_nll_mean")):
            series = {name: {k: c[key] for k, c in by.items()} for name, by in res["arms"].items()}
            ratio_panel(ax[row, col], series, ratios, styles.__getitem__)
            ax[row, col].set_xlabel("compression (prompt / budget)")
        ax[0, col].set_ylim(-0.05, 1.05)
        ax[0, col].set_title(f"{n}-token documents", fontsize=9)
    ax[0, 0].set_ylabel("pass-key accuracy")
    ax[1, 0].set_ylabel("answer NLL (nats/token)")
    ax[0, 0].legend(fontsize=6)
    plots.save_plot(fig, out, STUDY, title)
    fig, [[ax]] = plots.subplots(figsize=(7, 3.4))
    names = [a.name for a in arms]
    means = [dict(zip(BINS, depth_means(results, name), strict=True)) for name in names]
    plots.grouped_bars(
        ax, names, [{f"needle in {b}": m or 0.0 for b, m in by.items()} for by in means], ""
    )
    ax.set_xticks(range(len(names)), names, rotation=30, fontsize=7)
    ax.set_ylabel("accuracy (mean over lengths, ratios)")
    plots.save_plot(fig, out, f"{STUDY}_depth", "pass-key accuracy by needle depth")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    study = start(
        STUDY,
        argv,
        __doc__,
        calibration=True,
        options=[add_arm_arguments],
        lengths=([256, 512, 1024, 2048], [320], "document tokens"),
        ratios=([2, 4, 8, 16, 32], [2, 8]),
        per_bin=(5, 1, "documents per depth bin"),
        recent_fracs=([0.0, 0.25], [0.0, 0.25], "recent windows as fractions of the budget"),
        flags={
            "--filler": {"default": "classic", "choices": ("classic", "prose", "code")},
            "--no-prefill-check": {
                "action": "store_true",
                "help": "skip running the first "
                "document's arms the direct way (at 8k tokens a prefill per arm and ratio)",
            },
        },
    )
    args, identity, ratios = study.args, study.identity, study.args.ratios
    lengths = [n for n in args.lengths if n <= (identity["max_context"] or n)]
    arms = select_arms(standard_arms(tuple(args.recent_fracs)), args)
    configs = [(a, None) for a in arms if a.method == "full"]
    configs += [(a, r) for r in ratios for a in arms if a.method != "full"]
    docs = {
        n: passkey_docs(study.corpus, n, args.per_bin, len(BINS), filler_kind=args.filler)
        for n in lengths
    }
    # Logged documents are read back for the same arms, ratios and filler.
    signature = {"arms": [a.name for a in arms], "ratios": ratios, "filler": args.filler}

    def measure(n: int, i: int) -> dict[str, Any]:
        first = i == 0 and n == lengths[0] and not args.no_prefill_check
        rec = measure_doc(study, docs[n][i], configs, first=first)
        return {**rec, "length": n, "index": i, "signature": signature}

    todo = [(n, i) for n in lengths for i in range(len(docs[n]))]
    same = lambda r: r["signature"] == signature  # noqa: E731
    records = study.logged(("length", "index"), todo, measure, "documents", keep=same)
    check: dict[str, Any] = {"arms": 0, "identical": 0, "mismatches": []}
    sources: dict[str, set[str]] = {}  # arm -> filter sources its caches reported
    for rec in records:
        for name, source in rec.get("sources", {}).items():  # older records have none
            sources.setdefault(name, set()).add(source)
        for k, v in rec.get("check", {}).items():  # counts add up, mismatches join
            check[k] += v
    results = {
        str(n): length_results(docs[n], [r for r in records if r["length"] == n]) for n in lengths
    }
    plot(results, arms, ratios, args.out, study.title("pass-key retrieval"))
    data = {
        "generator": "training.data.passkey_eval_set (eval seeds, eval-split filler)",
        "filler": args.filler,
        "docs_per_depth_bin": args.per_bin,
        "depth_bins": list(BINS),
        "scoring": "first number in the greedy continuation equals the key",
    }
    rule = (
        "budget = round(prompt tokens / ratio); every arm the same; skipped when it leaves "
        "no evictable row (n_sink + recent >= budget)"
    )
    return study.save(
        {
            "data": data,
            "lengths": lengths,
            "ratios": ratios,
            "arms": [a.name for a in arms],
            "budget_rule": rule,
            "shared_prefill_check": check,
            "prefill_check_skipped": args.no_prefill_check,
            "filter_sources": {name: sorted(v) for name, v in sources.items()},
            "results": results,
            "plots": [f"{STUDY}.png", f"{STUDY}_depth.png"],
        }
    )


def render(data: dict[str, Any]) -> list[str]:
    check, d, ratios, results = (
        data["shared_prefill_check"],
        data["data"],
        data["ratios"],
        data["results"],
    )
    full_acc = [r["arms"]["full"]["-"]["accuracy"] for r in results.values() if "full" in r["arms"]]
    blocks: list[str | list[str]] = []
    if full_acc and max(full_acc) == 0:
        blocks.append(
            "**The model does not retrieve the key even with a full cache, so accuracy cannot "
            "separate the arms at this checkpoint; read the answer NLL below instead.**"
        )
    blocks.append(
        f"Greedy pass-key accuracy on held-out documents ({d['generator']}, {d['filler']} "
        f"filler), {d['docs_per_depth_bin']} per needle depth bin ({', '.join(d['depth_bins'])})."
        " Budget = prompt tokens / compression, the same for every arm. Shared-prefill check: "
        f"{check['identical']}/{check['arms']} arms generated the same tokens as a direct "
        "`generate_step`."
    )
    names = arm_order(n for r in results.values() for n in r["arms"])
    keys, headers = ["-", *map(str, ratios)], ["arm", "no eviction", *[f"{r}×" for r in ratios]]
    for n, res in results.items():
        blocks.append(
            f"**{n}-token documents** ({res['docs']} docs, mean prompt "
            f"{res['mean_prompt_tokens']:.0f} tokens)"
        )
        blocks.append(
            table(
                headers,
                [
                    ratio_row(name, [res], "accuracy", keys, 2)
                    for name in names
                    if res["arms"].get(name)
                ],
            )
        )
    if any(
        "answer_nll_mean" in c
        for r in results.values()
        for cells in r["arms"].values()
        for c in cells.values()
    ):
        rows = [ratio_row(name, results.values(), "answer_nll_mean", keys, 3) for name in names]
        blocks += [
            "Answer NLL (nats per answer token, teacher-forced through each arm's cache; "
            "lower is better; mean over documents and lengths) — graded where accuracy is "
            "at the floor:",
            table(headers, rows),
        ]
    bins = d["depth_bins"]
    rows = [
        [
            arm_label(name),
            *("" if m is None else fmt(m, 2) for m in depth_means(results, name, bins)),
        ]
        for name in names
        if any(r["arms"].get(name) for r in results.values())
    ]
    blocks += ["By needle depth (mean over lengths and compressions):"]
    blocks.append(table(["arm", *[f"needle in {b}" for b in bins]], rows))
    return section("Pass-key retrieval", data, *blocks)
