"""Pass-key retrieval against context length, compression and needle depth.

Held-out pass-key documents with the needle spread over three depth bins; each arm keeps
``prompt tokens / ratio`` rows and decodes greedily (right when the first number is the key),
and reports the answer's teacher-forced NLL as a graded signal. The prompt block is prefilled
once and handed to each arm's caches; the first document is also run the direct way and the
two must agree token for token.
"""

from __future__ import annotations

import math
import re
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from bench.arms import (
    READS_QUERIES,
    Arm,
    add_arm_arguments,
    add_traffic_argument,
    check_budget,
    feed_block,
    select_arms,
    standard_arms,
    streaming_nll,
)
from bench.data import passkey_docs
from bench.harness import (
    Run,
    append_jsonl,
    color,
    open_run,
    parse,
    parser,
    progress,
    resume,
    save_plot,
    subplots,
    summary,
)
from bench.report import arm_label, arm_order, fmt, plots, quality_header, table
from qfserve.engine.kv.config import DEFAULT_N_SINK, CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.kvzip import RepeatPrompt, compress
from qfserve.engine.kv.selfcal import install_query_taps

STUDY = "retrieval"
BINS = ("first third", "middle third", "last third")


def budget_for(prompt_len: int, ratio: int, arm: Arm) -> int | None:
    """``round(prompt_len / ratio)``, or None when it leaves no evictable row."""
    budget = round(prompt_len / ratio)
    return budget if budget > DEFAULT_N_SINK + arm.recent(budget) else None


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of ``k`` successes in ``n``."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def decode(model: Any, prompt: list[int], caches: list[Any], max_tokens: int) -> list[int]:
    """Greedy tokens from ``generate_step`` with ``prompt_cache=caches``."""
    steps = generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=max_tokens)
    return [int(token) for token, _ in steps]


def first_number_is(text: str, key: str) -> bool:
    """Whether the first number in ``text`` is ``key``: how the needle studies score."""
    found = re.search(r"\d+", text)
    return bool(found and found.group() == key)


def prefill_block(
    model: Any, prompt: list[int], *, queries: bool = False, kvzip: RepeatPrompt | None = None
) -> list[tuple[mx.array, ...]]:
    """Keys and values every layer stores for ``prompt[:-1]`` (one block, full cache), with
    ``queries`` the block's rotated queries (for self-calibrated arms), and with ``kvzip``
    the queries and the reconstruction pass's scores of every row (they do not depend on
    the budget, so the pass runs once per document for every kvzip arm and ratio)."""
    n = len(prompt) - 1
    taps = install_query_taps(model) if queries or kvzip is not None else None
    if kvzip is not None:  # a budget above the block: the pass scores rows, evicts none
        cache = make_caches(model, CacheConfig(method="kvzip", budget=n + 1))
    else:
        cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    kv: list[tuple[mx.array, ...]] = [(c.keys[..., :n, :], c.values[..., :n, :]) for c in cache]
    if taps is not None:
        kv = [(*layer, tap.take(n)) for layer, tap in zip(kv, taps, strict=True)]
    if kvzip is not None:
        compress(model, cache, prompt[:-1], kvzip)
        kv = [(*layer, c.token_scores) for layer, c in zip(kv, cache, strict=True)]
    mx.eval(kv)
    return kv


def shared_block(study: Run, prompt: list[int], arms: Any) -> list[tuple[mx.array, ...]]:
    """:func:`prefill_block` with what ``arms`` read: the block's queries, kvzip's scores."""
    methods = {arm.method for arm in arms}
    return prefill_block(study.model, prompt, queries=bool(methods & set(READS_QUERIES)),
                         kvzip=study.repeat if "kvzip" in methods else None)  # fmt: skip


def run_arm(
    study: Run, prompt: list[int], block: Any, arm: Arm, budget: int | None, max_tokens: int
) -> tuple[list[int], str]:
    """Generated tokens of one arm and where its filters came from (``block=None``:
    prefilled the direct way)."""
    caches = arm.caches(study.model, budget, study.filters)
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
    caches = arm.caches(study.model, budget, study.filters)
    feed_block(caches, block)
    tokens = np.array([[prompt[-1], *answer]])
    # budget=None: the rows are checked against the whole document just below.
    nll, _ = streaming_nll(study.model, tokens, caches, budget=None, prefill=1)
    check_budget(caches, budget, len(prompt) - 1 + len(answer))
    return float(nll.mean())


def measure_doc(
    study: Run, doc: dict[str, Any], configs: list[tuple[Arm, int | None]], *, first: bool
) -> dict[str, Any]:
    """Every arm at every ratio on one document (``first``: also check the shared prefill
    against a direct ``generate_step``)."""
    prompt, max_tokens = doc["prompt"], doc["key_tokens"] + 2
    block = shared_block(study, prompt, [arm for arm, _ in configs])
    cells: list[list[Any]] = []
    sources: dict[str, str] = {}
    check: dict[str, Any] = {"arms": 0, "identical": 0, "mismatches": []}
    for arm, ratio in configs:
        budget = None if ratio is None else budget_for(len(prompt), ratio, arm)
        if ratio is not None and budget is None:
            continue
        tokens, sources[arm.name] = run_arm(study, prompt, block, arm, budget, max_tokens)
        nll = answer_nll(study, prompt, doc["answer"], block, arm, budget)
        if first and arm.method != "kvzip":  # kvzip's pass runs on the shared block only
            direct, _ = run_arm(study, prompt, None, arm, budget, max_tokens)
            check["arms"] += 1
            check["identical"] += direct == tokens
            if direct != tokens:
                check["mismatches"].append(f"{arm.name}@{ratio}x")
        correct = first_number_is(study.tokenizer.decode(tokens), doc["key"])
        cells.append([arm.name, "-" if ratio is None else str(ratio), correct, nll, budget])
    return {"bin": doc["bin"], "cells": cells, "sources": sources, "check": check}


def cell_stats(outcomes: list[tuple[bool, int, float]]) -> dict[str, Any]:
    """One arm at one ratio from its documents' ``(correct, depth bin, answer NLL)``."""
    correct, bins, nll = zip(*outcomes, strict=True)
    k, n = sum(correct), len(correct)
    by_bin = [[c for c, bb in zip(correct, bins, strict=True) if bb == b] for b in range(len(BINS))]
    by_depth = {
        label: float(np.mean(v)) if v else None for label, v in zip(BINS, by_bin, strict=True)
    }
    return {"accuracy": k / n, "n": n, "ci95": wilson(k, n), "answer_nll": summary(nll),
            "answer_nll_mean": float(np.mean(nll)), "by_depth": by_depth}  # fmt: skip


def ratio_row(name: str, results: Any, metric: str, keys: list[str], digits: int) -> list[str]:
    """An arm's row of a table by ratio: per key, ``metric`` averaged over ``results`` (one
    per length; '' where it did not run)."""
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


def plot_metric(a: Any, res: dict[str, Any], arms: list[Arm], ratios: list[int], key: str) -> None:
    """One panel: ``key`` against compression per arm, the full cache as a dashed line."""
    full = res["arms"].get("full", {}).get("-")
    if full is not None:
        a.axhline(full[key], color="black", ls="--", label="full")
    for arm in arms:
        cells = res["arms"].get(arm.name, {})
        xs = [r for r in ratios if str(r) in cells]
        if arm.method == "full" or not xs:
            continue
        a.plot(xs, [cells[str(r)][key] for r in xs], marker="o" if arm.recent_frac == 0 else "s",
               linestyle=":" if arm.sign < 0 else "-" if arm.recent_frac == 0 else "--",
               color=color(arm.method, arm.traffic), label=arm_label(arm.name))  # fmt: skip
    a.set_xscale("log", base=2)
    a.set_xticks(ratios, [f"{r}x" for r in ratios])
    a.set_xlabel("compression (prompt / budget)")
    if key == "accuracy":
        a.set_ylim(-0.05, 1.05)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, calibration=True, lengths=([256, 512, 1024, 2048], [320], "document "
               "tokens"), ratios=([2, 4, 8, 16, 32], [2, 8]), per_bin=(5, 1, "documents per depth "
               "bin"), recent_fracs=([0.0, 0.25], [0.0, 0.25], "recent windows as fractions of "
               "the budget"))  # fmt: skip
    p.add_argument("--filler", default="classic", choices=("classic", "prose", "code"))
    p.add_argument("--no-prefill-check", action="store_true", help="skip running the first "
                   "document's arms the direct way (at 8k tokens a prefill per arm and ratio)")  # fmt: skip
    add_arm_arguments(p)
    add_traffic_argument(p)
    args = parse(p, argv)
    study = open_run(STUDY, args, argv, calibrate=True)
    identity, corpus, ratios = study.identity, study.corpus, args.ratios
    lengths = [n for n in args.lengths if n <= (identity["max_context"] or n)]
    arms = select_arms(standard_arms(tuple(args.recent_fracs)), args)
    configs = [(a, None) for a in arms if a.method == "full"]
    configs += [(a, r) for r in ratios for a in arms if a.method != "full"]
    docs = {n: passkey_docs(corpus, n, args.per_bin, len(BINS), filler_kind=args.filler)
            for n in lengths}  # fmt: skip
    # A rerun with the same arms, ratios, filler (and learned filters) skips the documents
    # already in the log.
    signature: dict[str, Any] = {"arms": [a.name for a in arms], "ratios": ratios,
                                 "filler": args.filler}  # fmt: skip
    learned = study.calibration.get("traffic_artifacts") or {}
    if learned:
        signature["learned"] = {k: v["sha1"] for k, v in sorted(learned.items())}
    log = args.out / f"{STUDY}.jsonl"
    done = resume(log, lambda r: (r["length"], r["index"]), fresh=args.quick,
                  keep=lambda r: r["signature"] == signature)  # fmt: skip
    with progress(total=sum(len(d) for d in docs.values()), desc="documents") as bar:
        for n in lengths:
            for i, doc in enumerate(docs[n]):
                if (n, i) not in done:
                    first = i == 0 and n == lengths[0] and not args.no_prefill_check
                    rec = measure_doc(study, doc, configs, first=first)
                    rec.update(length=n, index=i, signature=signature)
                    append_jsonl(log, rec)
                    done[(n, i)] = rec
                bar.update(1)
    # hits[length][arm name][ratio or "-"] = list of (correct, bin, nll)
    hits: dict[int, dict[str, dict[str, list]]] = {n: {} for n in lengths}
    budgets: dict[int, dict[str, list[int]]] = {n: {} for n in lengths}
    check: dict[str, Any] = {"arms": 0, "identical": 0, "mismatches": []}
    sources: dict[str, set[str]] = {}  # arm -> filter sources its caches reported
    for (n, i), rec in sorted(done.items()):
        if n not in hits or i >= len(docs[n]):
            continue
        for name, key, correct, nll, budget in rec["cells"]:
            hits[n].setdefault(name, {}).setdefault(key, []).append((correct, rec["bin"], nll))
            if budget is not None:
                budgets[n].setdefault(key, []).append(budget)
        for name, source in rec.get("sources", {}).items():  # older records have none
            sources.setdefault(name, set()).add(source)
        for k, v in rec.get("check", {}).items():  # counts add up, mismatches join
            check[k] += v
    results = {str(n): {"docs": len(docs[n]),
                        "mean_prompt_tokens": float(np.mean([len(d["prompt"]) for d in docs[n]])),
                        "depths": [round(d["depth"], 3) for d in docs[n]],
                        "budget_by_ratio": {k: sorted(set(v)) for k, v in budgets[n].items()},
                        "arms": {name: {k: cell_stats(o) for k, o in by_ratio.items()}
                                 for name, by_ratio in hits[n].items()}}
               for n in lengths}  # fmt: skip
    print(f"shared-prefill check: {check['identical']}/{check['arms']} arms identical to direct "
          "generate_step")  # fmt: skip

    fig, ax = subplots(2, len(lengths), figsize=(3.6 * len(lengths), 6.4), sharey="row")
    for col, n in enumerate(lengths):
        plot_metric(ax[0, col], results[str(n)], arms, ratios, "accuracy")
        plot_metric(ax[1, col], results[str(n)], arms, ratios, "answer_nll_mean")
        ax[0, col].set_title(f"{n}-token documents", fontsize=9)
    ax[0, 0].set_ylabel("pass-key accuracy")
    ax[1, 0].set_ylabel("answer NLL (nats/token)")
    ax[0, 0].legend(fontsize=6)
    title = f"{identity['path']} {identity['checkpoint']}: pass-key retrieval"
    save_plot(fig, args.out, STUDY, title)
    fig, ax = subplots(1, 1, figsize=(7, 3.4))
    names = [arm.name for arm in arms]
    x, width = np.arange(len(names)), 0.8 / len(BINS)
    means = [[m or 0.0 for m in depth_means(results, name)] for name in names]
    for b, label in enumerate(BINS):
        ax[0, 0].bar(x + b * width, [m[b] for m in means], width, label=f"needle in {label}")
    ax[0, 0].set_xticks(x + width, names, rotation=30, fontsize=7)
    ax[0, 0].set_ylabel("accuracy (mean over lengths, ratios)")
    ax[0, 0].legend(fontsize=7)
    save_plot(fig, args.out, f"{STUDY}_depth", "pass-key accuracy by needle depth")

    data = {"generator": "training.data.passkey_eval_set (eval seeds, eval-split filler)",
            "filler": args.filler, "docs_per_depth_bin": args.per_bin, "depth_bins": list(BINS),
            "scoring": "first number in the greedy continuation equals the key"}  # fmt: skip
    rule = ("budget = round(prompt tokens / ratio); every arm the same; skipped when it leaves "
            "no evictable row (n_sink + recent >= budget)")  # fmt: skip
    return study.save({"data": data, "lengths": lengths, "ratios": ratios,
                       "arms": [a.name for a in arms], "budget_rule": rule,
                       "shared_prefill_check": check,
                       "prefill_check_skipped": args.no_prefill_check,
                       "filter_sources": {name: sorted(v) for name, v in sources.items()},
                       "results": results,
                       "plots": [f"{STUDY}.png", f"{STUDY}_depth.png"]})  # fmt: skip


def render(data: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    lines = quality_header("Pass-key retrieval", data)
    check = data["shared_prefill_check"]
    full_acc = [r["arms"]["full"]["-"]["accuracy"] for r in data["results"].values()
                if "full" in r["arms"]]  # fmt: skip
    if full_acc and max(full_acc) == 0:
        lines += [
            "",
            "**The model does not retrieve the key even with a full cache, so accuracy cannot "
            "separate the arms at this checkpoint; read the answer NLL below instead.**",
        ]
    lines += [
        "",
        f"Greedy pass-key accuracy on held-out documents ({data['data']['generator']}, "
        f"{data['data']['filler']} filler), {data['data']['docs_per_depth_bin']} per needle "
        f"depth bin ({', '.join(data['data']['depth_bins'])}). Budget = prompt tokens / "
        f"compression, the same for every arm. Shared-prefill check: {check['identical']}/"
        f"{check['arms']} arms generated the same tokens as a direct `generate_step`.",
    ]
    ratios, results = data["ratios"], data["results"]
    names = arm_order(n for r in results.values() for n in r["arms"])
    keys, headers = ["-", *map(str, ratios)], ["arm", "no eviction", *[f"{r}×" for r in ratios]]
    for n, res in results.items():
        lines += ["", f"**{n}-token documents** ({res['docs']} docs, mean prompt "
                  f"{res['mean_prompt_tokens']:.0f} tokens)", ""]  # fmt: skip
        rows = [
            ratio_row(name, [res], "accuracy", keys, 2) for name in names if res["arms"].get(name)
        ]
        lines += table(headers, rows)
    if any("answer_nll_mean" in c for r in results.values()
           for cells in r["arms"].values() for c in cells.values()):  # fmt: skip
        rows = [ratio_row(name, results.values(), "answer_nll_mean", keys, 3) for name in names]
        lines += ["", "Answer NLL (nats per answer token, teacher-forced through each arm's cache; "
                  "lower is better; mean over documents and lengths) — graded where accuracy is at "
                  "the floor:", "", *table(headers, rows)]  # fmt: skip
    bins = data["data"]["depth_bins"]
    ran = [name for name in names if any(r["arms"].get(name) for r in results.values())]
    means = {name: depth_means(results, name, bins) for name in ran}
    rows = [[arm_label(name), *("" if m is None else fmt(m, 2) for m in by_bin)]
            for name, by_bin in means.items()]  # fmt: skip
    lines += ["", "By needle depth (mean over lengths and compressions):", ""]
    lines += table(["arm", *[f"needle in {b}" for b in bins]], rows)
    return lines + plots(data)
