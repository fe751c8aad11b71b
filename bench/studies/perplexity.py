"""Perplexity of streaming generation with eviction active, per budget and arm.

Teacher-forced one token per step through each arm's caches, scored on the second half;
``--prompt`` reads the first half in 512-token blocks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np

from bench import plots
from bench.arms import Arm, add_arm_arguments, full_nll, select_arms, standard_arms, streaming_nll
from bench.data import prose_windows, recall_windows, stdlib_windows
from bench.report import arm_label, arm_order, fmt, pct, section, spread_cell, table
from bench.resume import measured, resume
from bench.run import Run, start
from bench.timing import summary
from qfserve.engine.kv import kvzap
from qfserve.engine.kv.kvzip import compress
from qfserve.engine.serving.config import DEFAULT_PREFILL_CHUNK

STUDY = "perplexity"
METHODS = ("qfilters", "fallback", "fallback-", "knorm")
# --prompt reads the first half as a server reads a prompt, in blocks of its default
# --prefill-chunk that each evict at once (where kvzip's pass runs at the prompt's end).
PROMPT_BLOCK = DEFAULT_PREFILL_CHUNK
MIN_GAP_NATS = 0.002  # below this (nats/token) streaming is not measurably worse than full
# The columns of its table per data set on the results page.
HEADERS = ["budget", "arm", "perplexity", "ratio to full", "gap closed vs streaming", "max rows"]
KINDS = {
    "stdlib": "evaluation-split stdlib windows, evenly spaced",
    "prose": "running English prose: stdlib docstring paragraphs (bench prose), windows "
    "from evenly spaced paragraphs",
    "recall": "held-out generated kv / fact / pass-key documents (eval seeds)",
}


def _decode_share(caches: list[Any], steps: Iterator[int], _tokens: int) -> None:
    kvzap.share_in_decode(caches, next(steps))


def run_arm(
    study: Run, tokens: np.ndarray, arm: Arm, budget: int, block: int | None = None
) -> tuple[np.ndarray, dict[str, Any]]:
    """``(B, L-1)`` streaming NLL of one arm at one budget, and its budget record. With
    ``block`` the first half is a prompt read in blocks, which a kvzip arm compresses with
    its reconstruction pass. kvzip and kvzap arms run one sequence at a time (a tap offers a
    scorer only a batch of one's queries or hidden states)."""
    model, filters = study.model, study.filters
    config = arm.config(budget)
    prefill = tokens.shape[1] // 2 if block else arm.block(budget)
    rows = [tokens]
    if arm.method == "kvzip" and not block:
        raise ValueError("kvzip compresses a prompt: run its arms with --prompt")
    if arm.method in ("kvzip", "kvzap"):  # kvzip's pass, kvzap's hidden tap: one request each
        rows = [tokens[b : b + 1] for b in range(tokens.shape[0])]
    nlls, max_rows = [], 0
    for seq in rows:
        caches = arm.caches(model, budget, filters, surrogate=study.surrogate)
        after = None
        on_step = None
        if arm.method == "kvzip":
            after = partial(compress, model, caches, seq[0, :prefill].tolist(), study.repeat)
        elif arm.method == "kvzap" and arm.shared:  # as the server's policy: decode shares too
            after = partial(kvzap.share, caches, decode=True)
            on_step = partial(_decode_share, caches, itertools.count(1))
        nll, most = streaming_nll(
            model,
            seq,
            caches,
            budget=budget,
            prefill=prefill,
            block=block,
            after_prefill=after,
            on_step=on_step,
        )
        nlls.append(nll)
        max_rows = max(max_rows, most)
    record = {
        "budget": budget,
        "recent": config.recent,
        "n_sink": config.n_sink,
        "rows_kept_at_end": budget,  # check_budget raised otherwise
        "max_rows_any_step": max_rows,
        "filter_source": arm.source(arm.caches(model, budget, filters, surrogate=study.surrogate)),
    }
    return np.concatenate(nlls, axis=0), record


def evaluate(
    study: Run,
    tokens: np.ndarray,
    arms: list[Arm],
    budgets: list[int],
    desc: str,
    log: Any,
    block: int | None,
) -> dict[str, Any]:
    """Perplexities, ratios to full and gap closed of every (budget, arm) on one batch; with
    ``log``, each (budget, arm) is read back from it (same data, shape and feeding) or added."""
    L, shape = tokens.shape[1], list(tokens.shape)
    full = full_nll(study.model, tokens)[:, L // 2 :]  # nll index i predicts token i + 1
    same = lambda r: (r["dataset"], r["shape"], r.get("prompt_block")) == (desc, shape, block)  # noqa: E731
    done = {} if log is None else resume(log, lambda r: (r["budget"], r["arm"]), keep=same)
    by_name = {a.name: a for a in arms if a.method != "full"}

    def measure(budget: int, name: str) -> dict[str, Any]:
        nll, record = run_arm(study, tokens, by_name[name], budget, block)
        return {
            "dataset": desc,
            "shape": shape,
            "budget": budget,
            "arm": name,
            "prompt_block": block,
            "record": record,
            "nll": nll[:, L // 2 :],
        }

    records = measured(log, done, [(b, n) for b in budgets for n in by_name], measure, desc)
    nlls = {(r["budget"], r["arm"]): np.asarray(r["nll"], dtype=np.float32) for r in records}
    out: dict[str, Any] = {"full": perplexities(full, full), "budgets": {b: {} for b in budgets}}
    for rec in records:
        budget, stream = rec["budget"], nlls.get((rec["budget"], "streaming/r0"))
        row = perplexities(nlls[(budget, rec["arm"])], full)
        stream_nll = None if stream is None else float(stream.mean())
        row["gap_closed_vs_streaming"] = gap_closed(stream_nll, row["nll"], out["full"]["nll"])
        out["budgets"][budget][rec["arm"]] = {**row, **rec["record"]}
    return out


def perplexities(nll: np.ndarray, full: np.ndarray) -> dict[str, Any]:
    """Pooled perplexity and NLL of ``(B, N)`` NLL windows, each sequence's perplexity and
    (but for the full cache's own) its ratio to the full cache's."""
    mean = float(nll.mean())
    out = {"ppl": math.exp(mean), "nll": mean, "ppl_per_seq": np.exp(nll.mean(axis=1))}
    if nll is not full:
        out["ratio_to_full"] = summary(np.exp(nll.mean(axis=1) - full.mean(axis=1)))
    return out


def gap_closed(nll_streaming: float | None, nll_arm: float, nll_full: float) -> float | None:
    """Share of streaming's gap to the full cache that an arm closes (1 = all of it); None
    when streaming did not run or is within ``MIN_GAP_NATS`` of the full cache or better."""
    if nll_streaming is None:
        return None
    denom = nll_streaming - nll_full
    return (nll_streaming - nll_arm) / denom if denom > MIN_GAP_NATS else None


def plot(results: dict[str, Any], study: Run) -> list[str]:
    """One figure per data set: perplexity against budget, a panel per recent window."""
    names, styles = [], ["o-", "s--", "^:", "v-.", "D--", "x:"]
    recent = lambda name: int(name.split("/")[1][1:])  # noqa: E731  "kvzip/r25/global" -> 25
    for dataset, res in results.items():
        budgets = sorted(res["budgets"])
        names_run = sorted(res["budgets"][budgets[0]])
        fracs = sorted({recent(n) for n in names_run if not n.startswith("streaming")})
        fig, ax = plots.subplots(1, len(fracs), figsize=(5 * len(fracs), 3.8), sharey=True)
        for a, frac in zip(ax[0], fracs, strict=True):
            a.axhline(res["full"]["ppl"], color="black", ls="--", label="full")
            shown = [n for n in names_run if n.startswith("streaming") or recent(n) == frac]
            for i, name in enumerate(shown):
                a.plot(
                    budgets,
                    [res["budgets"][b][name]["ppl"] for b in budgets],
                    styles[i % len(styles)],
                    color=plots.COLORS[name.split("/")[0].rstrip("-")],
                    label=arm_label(name),
                )
            plots.log2_axis(a, budgets, logy=True)
            a.set_xlabel("budget (rows per layer and KV head)")
            a.set_title(f"recent = {'0' if frac == 0 else f'{frac}% of the budget'}", fontsize=9)
        ax[0, 0].set_ylabel("perplexity (2nd half of each sequence)")
        ax[0, 0].legend(fontsize=7)
        title = f"streaming perplexity, {dataset}"
        names.append(plots.save_plot(fig, study.args.out, f"{STUDY}_{dataset}", study.title(title)))
    return names


def main(argv: list[str] | None = None) -> dict[str, Any]:
    prompt = {
        "action": "store_true",
        "help": f"read the first half as a prompt, in "
        f"{PROMPT_BLOCK}-token blocks that evict at once, then decode the second half",
    }
    study = start(
        STUDY,
        argv,
        __doc__,
        calibration=True,
        options=[add_arm_arguments],
        flags={"--prompt": prompt},
        length=(2048, 96, "tokens per sequence"),
        sequences=(4, 2, "sequences per data set"),
        budgets=([256, 512, 1024], [16, 32]),
        datasets=(["stdlib", "prose"], ["stdlib", "prose"], "stdlib, recall or prose"),
        recent_fracs=([0.25], [0.0, 0.25], "recent windows as fractions of the budget"),
        methods=(
            ["qfilters", "knorm"],
            list(METHODS),
            f"evicting arms beside streaming (of {', '.join(METHODS)})",
        ),
    )
    args = study.args
    length, n_seq = args.length, args.sequences
    budgets = [b for b in args.budgets if b <= length // 2]
    if not budgets:
        raise ValueError(f"budgets must be <= length/2 = {length // 2}, got {args.budgets}")
    make = {
        "stdlib": lambda: stdlib_windows(study.corpus, length, n_seq),
        "recall": lambda: recall_windows(study.corpus, length, n_seq),
        "prose": lambda: prose_windows(study.tokenizer, length, n_seq),
    }
    arms = [
        a
        for a in standard_arms(tuple(args.recent_fracs))
        if a.method in ("full", "streaming") or a.name.split("/")[0] in args.methods
    ]
    arms = select_arms(arms, args)
    log = None if args.quick else args.out / f"{STUDY}.jsonl"
    block = PROMPT_BLOCK if args.prompt else None
    batches = {dataset: make[dataset]() for dataset in args.datasets}
    results = {
        dataset: evaluate(study, tokens, arms, budgets, dataset, log, block)
        for dataset, tokens in batches.items()
    }
    if args.prompt:
        prefill = (
            f"the first half, as a prompt in {PROMPT_BLOCK}-token blocks that each evict "
            "at once (--prompt)"
        )
    else:
        prefill = (
            "the first min(budget, calib_tokens - 1) tokens (fallback) or budget tokens "
            "(others) go in as one block: identical stored rows"
        )
    full_arm = (
        "one forward pass over each sequence (what a full cache decodes, up to float rounding)"
    )
    data = {
        "length": length,
        "scored": f"tokens {length // 2 + 1} .. {length - 1} (second half)",
        "batches": {k: list(v.shape) for k, v in batches.items()},
        "full_arm": full_arm,
        "prefill": prefill,
        "kinds": KINDS,
    }
    return study.save(
        {
            "data": data,
            "budgets": budgets,
            "arms": [a.name for a in arms],
            "results": results,
            "plots": plot(results, study),
        }
    )


def render(data: dict[str, Any]) -> list[str]:
    d = data["data"]
    intro = (
        f"Teacher-forced, one token per step through the real caches; scored on {d['scored']} "
        f"of {d['length']}-token sequences; batches {d['batches']}. Ratio = per-sequence "
        "perplexity / full cache, median [q1–q3]. Gap closed = (NLL streaming − NLL arm) / (NLL "
        "streaming − NLL full) at the same budget; – where streaming is not worse than the full "
        "cache (no gap to close). Every arm held exactly `budget` rows per layer and KV head "
        "(checked at every step)."
    )
    blocks: list[str | list[str]] = [intro]
    for dataset, res in data["results"].items():
        rows = [
            [
                budget,
                arm_label(name),
                fmt(r["ppl"]),
                spread_cell(r["ratio_to_full"]),
                pct(r["gap_closed_vs_streaming"]),
                r["max_rows_any_step"],
            ]
            for budget, arms in res["budgets"].items()
            for name in arm_order(arms)
            for r in [arms[name]]
        ]
        blocks += [f"**{dataset}** (full cache: {res['full']['ppl']:.3f})", table(HEADERS, rows)]
    return section("Streaming generation perplexity", data, *blocks)
