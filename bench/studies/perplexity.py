"""Perplexity of streaming generation with eviction active, per budget and arm.

Sequences are fed one token per step through each arm's real caches, teacher-forced, and
scored on their second half, where every budget is full and evicting. ``gap closed`` is
``(nll_streaming - nll_arm) / (nll_streaming - nll_full)`` at the same budget (None where
streaming is not measurably worse). ``--prompt`` reads the first half in 512-token blocks.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench.arms import (
    Arm,
    add_arm_arguments,
    full_nll,
    prefill_length,
    select_arms,
    standard_arms,
    streaming_nll,
)
from bench.data import prose_windows, recall_windows, stdlib_windows
from bench.harness import (
    COLORS,
    Run,
    append_jsonl,
    log2_axis,
    open_run,
    parse,
    parser,
    progress,
    resume,
    save_plot,
    subplots,
    summary,
)
from bench.report import arm_label, arm_order, fmt, pct, plots, quality_header, spread_cell, table
from qfserve.engine.kv.kvzip import compress
from qfserve.engine.serving.config import DEFAULT_PREFILL_CHUNK

STUDY = "perplexity"
METHODS = ("qfilters", "fallback", "fallback-", "knorm")
DEFAULT_METHODS = ("qfilters", "knorm")
# --prompt: the first half is read as a server reads a prompt, in blocks of its default
# --prefill-chunk, each block evicting at once; the second half is then decoded one token per
# step. Chunks and adaptive budgets act on block evictions; fed one token per step, a chunked
# cache ranks by chunk only once (when it first fills) and an adaptive one never shares rows.
PROMPT_BLOCK = DEFAULT_PREFILL_CHUNK


def run_arm(
    study: Run, tokens: np.ndarray, arm: Arm, budget: int, bar: Any, block: int | None = None
) -> tuple[np.ndarray, dict[str, Any]]:
    """``(B, L-1)`` streaming NLL of one arm at one budget, and its budget record. With
    ``block``, the first half goes in as a prompt in blocks of that size (``--prompt``); a
    kvzip arm then compresses it with the reconstruction pass, one sequence at a time."""
    model, filters = study.model, study.filters
    config = arm.config(budget)
    calib = config.calib_tokens if arm.method == "fallback" else None
    prefill = tokens.shape[1] // 2 if block else prefill_length(budget, calib)
    rows = [tokens]
    if arm.method == "kvzip":
        if not block:
            raise ValueError("kvzip compresses a prompt: run its arms with --prompt")
        rows = [tokens[b : b + 1] for b in range(tokens.shape[0])]  # the pass is per request
    nlls, max_rows = [], 0
    for seq in rows:
        caches = arm.caches(model, budget, filters)
        after = None
        if arm.method == "kvzip":
            after = partial(compress, model, caches, seq[0, :prefill].tolist(), study.repeat)
        nll, most = streaming_nll(model, seq, caches, budget=budget, prefill=prefill, block=block,
                                  on_step=bar.update, after_prefill=after)  # fmt: skip
        nlls.append(nll)
        max_rows = max(max_rows, most)
    record = {"budget": budget, "recent": config.recent, "n_sink": config.n_sink,
              "rows_kept_at_end": budget,  # check_budget raised otherwise
              "max_rows_any_step": max_rows,
              "filter_source": arm.source(arm.caches(model, budget, filters))}  # fmt: skip
    return np.concatenate(nlls, axis=0), record


def evaluate(
    study: Run, tokens: np.ndarray, arms: list[Arm], budgets: list[int], desc: str,
    log: Path | None = None, block: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """NLL windows and budget records of every (budget, arm) on one batch of sequences.

    With ``log``, each (budget, arm) is appended to that JSONL file as it finishes and those
    already there (same data set, shape, budget and feeding) are read back instead of rerun.
    """
    L = tokens.shape[1]
    window = slice(L // 2, None)  # nll index i predicts token i + 1
    full = full_nll(study.model, tokens)[:, window]
    out: dict[str, Any] = {"full": {"nll": full}, "budgets": {b: {} for b in budgets}}
    shape = list(tokens.shape)
    same = lambda r: (r["dataset"], r["shape"], r.get("prompt_block")) == (desc, shape, block)  # noqa: E731
    done = {} if log is None else resume(log, lambda r: (r["budget"], r["arm"]), keep=same)
    evicting = [a for a in arms if a.method != "full"]
    todo = [(b, a) for b in budgets for a in evicting if (b, a.name) not in done]
    with progress(total=(L - 1) * len(todo), unit="tok", desc=desc) as bar:
        for budget, arm in ((b, a) for b in budgets for a in evicting):
            if (budget, arm.name) in done:
                rec = done[(budget, arm.name)]
                nll, record = np.asarray(rec["nll"], dtype=np.float32), rec["record"]
            else:
                nll, record = run_arm(study, tokens, arm, budget, bar, block)
                nll = nll[:, window]
                if log is not None:
                    append_jsonl(log, {"dataset": desc, "shape": shape, "budget": budget,
                                       "arm": arm.name, "prompt_block": block, "record": record,
                                       "nll": nll})  # fmt: skip
            out["budgets"][budget][arm.name] = {"nll": nll, **record}
    return out


# Below this (nats/token) streaming is not measurably worse than the full cache: no gap.
MIN_GAP_NATS = 0.002


def gap_closed(nll_streaming: float | None, nll_arm: float, nll_full: float) -> float | None:
    """Share of streaming's gap to the full cache that an arm closes (1 = all of it).

    ``None`` when streaming did not run (``--only``) or is within ``MIN_GAP_NATS`` of the full
    cache or better (an undertrained model can do better with less context): no gap to close.
    """
    if nll_streaming is None:
        return None
    denom = nll_streaming - nll_full
    return (nll_streaming - nll_arm) / denom if denom > MIN_GAP_NATS else None


def perplexities(nll: np.ndarray) -> dict[str, Any]:
    """Pooled perplexity and NLL of ``(B, N)`` NLL windows, and each sequence's perplexity."""
    mean = float(nll.mean())
    return {"ppl": math.exp(mean), "nll": mean, "ppl_per_seq": np.exp(nll.mean(axis=1))}


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """Perplexities, per-sequence ratios to full and gap closed, from the NLL windows."""
    full = raw["full"]["nll"]
    out: dict[str, Any] = {"full": perplexities(full), "budgets": {}}
    for budget, arms in raw["budgets"].items():
        stream = float(arms["streaming/r0"]["nll"].mean()) if "streaming/r0" in arms else None
        rows = {}
        for name, r in arms.items():
            row = perplexities(r["nll"])
            row["ratio_to_full"] = summary(np.exp(r["nll"].mean(axis=1) - full.mean(axis=1)))
            row["gap_closed_vs_streaming"] = gap_closed(stream, row["nll"], out["full"]["nll"])
            rows[name] = {**row, **{k: v for k, v in r.items() if k != "nll"}}
        out["budgets"][budget] = rows
    return out


def recent_of(name: str) -> int:
    """An arm name's recent share in percent: ``"qfilters/r25/c4"`` -> 25."""
    return int(name.split("/")[1][1:])


def plot(results: dict[str, Any], identity: dict[str, Any], out_dir: Any) -> list[str]:
    """One figure per data set: perplexity against budget, a panel per recent window."""
    names = []
    styles = ["o-", "s--", "^:", "v-.", "D--", "x:"]
    for dataset, res in results.items():
        budgets = sorted(res["budgets"])
        names_run = sorted(res["budgets"][budgets[0]])
        fracs = sorted({recent_of(n) for n in names_run if not n.startswith("streaming")})
        fig, ax = subplots(1, len(fracs), figsize=(5 * len(fracs), 3.8), sharey=True)
        for col, frac in enumerate(fracs):
            a = ax[0, col]
            a.axhline(res["full"]["ppl"], color="black", ls="--", label="full")
            shown = [n for n in names_run if n.startswith("streaming") or recent_of(n) == frac]
            for i, name in enumerate(shown):
                ppl = [res["budgets"][b][name]["ppl"] for b in budgets]
                colour = COLORS[name.split("/")[0].rstrip("-")]
                a.plot(budgets, ppl, styles[i % len(styles)], color=colour, label=arm_label(name))
            log2_axis(a, budgets, logy=True)
            a.set_xlabel("budget (rows per layer and KV head)")
            a.set_title(f"recent = {'0' if frac == 0 else 'budget/4'}", fontsize=9)
            if col == 0:
                a.set_ylabel("perplexity (2nd half of each sequence)")
                a.legend(fontsize=7)
        title = f"{identity['path']} {identity['checkpoint']}: streaming perplexity, {dataset}"
        names.append(save_plot(fig, out_dir, f"{STUDY}_{dataset}", title))
    return names


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, calibration=True, length=(2048, 96, "tokens per sequence"),
               sequences=(4, 2, "sequences per data set"), budgets=([256, 512, 1024], [16, 32]),
               datasets=(["stdlib", "prose"], ["stdlib", "prose"], "stdlib, recall or prose"),
               recent_fracs=([0.25], [0.0, 0.25], "recent windows as fractions of the budget"),
               methods=(list(DEFAULT_METHODS), list(METHODS), "evicting arms beside streaming "
                        f"(of {', '.join(METHODS)})"))  # fmt: skip
    p.add_argument("--prompt", action="store_true", help=f"read the first half as a prompt, in "
                   f"{PROMPT_BLOCK}-token blocks that evict at once, then decode the second half")  # fmt: skip
    add_arm_arguments(p)
    args = parse(p, argv)
    length, n_seq = args.length, args.sequences
    budgets = [b for b in args.budgets if b <= length // 2]
    if not budgets:
        raise ValueError(f"budgets must be <= length/2 = {length // 2}, got {args.budgets}")
    study = open_run(STUDY, args, argv, calibrate=True)
    identity, corpus = study.identity, study.corpus
    make = {
        "stdlib": lambda: stdlib_windows(corpus, length, n_seq),
        "recall": lambda: recall_windows(corpus, length, n_seq),
        "prose": lambda: prose_windows(study.tokenizer, length, n_seq),
    }
    arms = [a for a in standard_arms(tuple(args.recent_fracs))
            if a.method in ("full", "streaming") or a.name.split("/")[0] in args.methods]  # fmt: skip
    arms = select_arms(arms, args)
    log = None if args.quick else args.out / f"{STUDY}.jsonl"
    results, shapes = {}, {}
    block = PROMPT_BLOCK if args.prompt else None
    for dataset in args.datasets:
        tokens = make[dataset]()
        shapes[dataset] = list(tokens.shape)
        raw = evaluate(study, tokens, arms, budgets, dataset, log, block)
        results[dataset] = summarise(raw)

    if args.prompt:
        prefill = (f"the first half, as a prompt in {PROMPT_BLOCK}-token blocks that each evict "
                   "at once (--prompt)")  # fmt: skip
    else:
        prefill = ("the first min(budget, calib_tokens - 1) tokens (fallback) or budget tokens "
                   "(others) go in as one block: identical stored rows")  # fmt: skip
    kinds = {
        "stdlib": "evaluation-split stdlib windows, evenly spaced",
        "prose": "running English prose: stdlib docstring paragraphs (bench prose), windows "
        "from evenly spaced paragraphs",
        "recall": "held-out generated kv / fact / pass-key documents (eval seeds)",
    }
    full_arm = (
        "one forward pass over each sequence (what a full cache decodes, up to float rounding)"
    )
    data = {"length": length, "scored": f"tokens {length // 2 + 1} .. {length - 1} (second half)",
            "batches": shapes, "full_arm": full_arm, "prefill": prefill, "kinds": kinds}  # fmt: skip
    return study.save({"data": data, "budgets": budgets, "arms": [a.name for a in arms],
                       "results": results, "plots": plot(results, identity, args.out)})  # fmt: skip


def render(data: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    lines = quality_header("Streaming generation perplexity", data)
    d = data["data"]
    lines += [
        "",
        f"Teacher-forced, one token per step through the real caches; scored on {d['scored']}"
        f" of {d['length']}-token sequences; batches {d['batches']}. Ratio = per-sequence "
        "perplexity / full cache, median [q1–q3]. Gap closed = (NLL streaming − NLL arm) / "
        "(NLL streaming − NLL full) at the same budget; – where streaming is not worse than the "
        "full cache (no gap to close). Every arm held exactly `budget` rows "
        "per layer and KV head (checked at every step).",
    ]
    for dataset, res in data["results"].items():
        full = res["full"]["ppl"]
        lines += ["", f"**{dataset}** (full cache: {full:.3f})", ""]
        rows = []
        for budget, arms in res["budgets"].items():
            for name in arm_order(arms):
                r = arms[name]
                rows.append(
                    [budget, arm_label(name), fmt(r["ppl"]), spread_cell(r["ratio_to_full"]),
                     pct(r["gap_closed_vs_streaming"]), r["max_rows_any_step"]]
                )  # fmt: skip
        lines += table(["budget", "arm", "perplexity", "ratio to full",
                        "gap closed vs streaming", "max rows"], rows)  # fmt: skip
    return lines + plots(data)
