"""Study 3: perplexity of streaming generation with eviction active, per budget and arm.

Held-out sequences of ``L`` tokens (evaluation-split stdlib windows, and held-out generated
recall documents) are fed one token per step through each arm's real caches
(:mod:`bench.quality.teacher`), teacher-forced, at budgets 64 / 128 / 256 / 512 (those with
``budget <= L/2``). Perplexity is scored on the second half of each sequence, where every
budget is full and evicting, so budgets are comparable. Arms: full cache, calibrated
Q-Filters, key-SVD fallback and K-norm, each with ``recent = 0`` and ``recent = budget/4``,
and streaming (sinks + latest rows, for which a recent window changes nothing).

``gap closed vs streaming`` is ``(nll_streaming - nll_arm) / (nll_streaming - nll_full)`` on
the pooled mean NLL at the same budget: 100% matches the full cache, 0% is no better than
keeping the latest rows, negative is worse. It is left out (``None``) where streaming is not
worse than the full cache by at least 0.002 nats/token: there is no gap to close. Every arm is checked to hold exactly ``budget``
rows per layer and KV head at the end and never more at any step.

Run: ``python -m bench.quality.perplexity [--quick] [--budgets 64 128 256 512]``.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from bench.cli import parse, parser
from bench.harness import print_table
from bench.quality import plots
from bench.quality.arms import LABELS, Arm, standard_arms
from bench.quality.common import (
    progress,
    run,
    spread,
)
from bench.quality.data import recall_windows, stdlib_windows
from bench.quality.study import open_study
from bench.quality.teacher import full_nll, prefill_length, streaming_nll

STUDY = "perplexity"


def run_arm(
    model: Any,
    tokens: np.ndarray,
    arm: Arm,
    budget: int,
    filters: np.ndarray,
    bar: Any = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """``(B, L-1)`` streaming NLL of one arm at one budget, and its budget record."""
    caches = arm.caches(model, budget, filters)
    config = arm.config(budget)
    calib = config.calib_tokens if arm.method == "fallback" else None
    nll, max_rows = streaming_nll(
        model,
        tokens,
        caches,
        budget=budget,
        prefill=prefill_length(budget, calib),
        on_step=None if bar is None else bar.update,
    )
    record = {
        "budget": budget,
        "recent": config.recent,
        "n_sink": config.n_sink,
        "rows_kept_at_end": budget,  # check_budget raised otherwise
        "max_rows_any_step": max_rows,
        "filter_source": arm.source(caches),
    }
    return nll, record


def evaluate(
    model: Any,
    tokens: np.ndarray,
    arms: list[Arm],
    budgets: list[int],
    filters: np.ndarray,
    desc: str,
) -> dict[str, Any]:
    """NLL windows and budget records of every (budget, arm) on one batch of sequences."""
    L = tokens.shape[1]
    window = slice(L // 2, None)  # nll index i predicts token i + 1
    full = full_nll(model, tokens)[:, window]
    out: dict[str, Any] = {"full": {"nll": full}, "budgets": {}}
    evicting = [a for a in arms if a.method != "full"]
    with progress(total=(L - 1) * len(evicting) * len(budgets), unit="tok", desc=desc) as bar:
        for budget in budgets:
            out["budgets"][budget] = {}
            for arm in evicting:
                nll, record = run_arm(model, tokens, arm, budget, filters, bar)
                out["budgets"][budget][arm.name] = {"nll": nll[:, window], **record}
    return out


# Below this (nats/token) streaming is not measurably worse than the full cache: no gap.
MIN_GAP_NATS = 0.002


def gap_closed(nll_streaming: float, nll_arm: float, nll_full: float) -> float | None:
    """Share of streaming's gap to the full cache that an arm closes (1 = all of it).

    ``None`` when streaming is within ``MIN_GAP_NATS`` of the full cache or better than it
    (an undertrained model can do better with less context), where the ratio means nothing.
    """
    denom = nll_streaming - nll_full
    return (nll_streaming - nll_arm) / denom if denom > MIN_GAP_NATS else None


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """Perplexities, per-sequence ratios to full and gap closed, from the NLL windows."""
    full = raw["full"]["nll"]
    full_mean = float(full.mean())
    full_seq = full.mean(axis=1)
    out: dict[str, Any] = {
        "full": {"ppl": math.exp(full_mean), "nll": full_mean, "ppl_per_seq": np.exp(full_seq)},
        "budgets": {},
    }
    for budget, arms in raw["budgets"].items():
        stream = float(arms["streaming/r0"]["nll"].mean())
        rows = {}
        for name, r in arms.items():
            nll = float(r["nll"].mean())
            seq = r["nll"].mean(axis=1)
            rows[name] = {
                "ppl": math.exp(nll),
                "nll": nll,
                "ppl_per_seq": np.exp(seq),
                "ratio_to_full": spread(np.exp(seq - full_seq).tolist()),
                "gap_closed_vs_streaming": gap_closed(stream, nll, full_mean),
                **{k: v for k, v in r.items() if k != "nll"},
            }
        out["budgets"][budget] = rows
    return out


def plot(results: dict[str, Any], identity: dict[str, Any], out_dir: Any) -> list[str]:
    names = []
    for dataset, res in results.items():
        budgets = sorted(res["budgets"])
        fig, ax = plots.subplots(1, 2, figsize=(10, 3.8), sharey=True)
        for col, frac in enumerate((0, 25)):
            a = ax[0, col]
            a.axhline(res["full"]["ppl"], color="black", ls="--", label="full")
            for method in ("qfilters", "fallback", "knorm", "streaming"):
                name = f"{method}/r{0 if method == 'streaming' else frac}"
                ppl = [res["budgets"][b][name]["ppl"] for b in budgets]
                a.plot(budgets, ppl, "o-", color=plots.COLORS[method], label=LABELS[method])
            a.set_xscale("log", base=2)
            a.set_yscale("log")
            a.set_xticks(budgets, [str(b) for b in budgets])
            a.set_xlabel("budget (rows per layer and KV head)")
            a.set_title(f"recent = {'0' if frac == 0 else 'budget/4'}", fontsize=9)
            if col == 0:
                a.set_ylabel("perplexity (2nd half of each sequence)")
                a.legend(fontsize=7)
        name = f"{STUDY}_{dataset}"
        plots.save(
            fig,
            out_dir,
            name,
            f"{identity['path']} {identity['checkpoint']}: streaming perplexity, {dataset}",
        )
        names.append(f"{name}.png")
    return names


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], calibration=True)
    p.add_argument("--length", type=int, default=None, help="tokens per sequence")
    p.add_argument("--sequences", type=int, default=None, help="sequences per data set")
    p.add_argument("--budgets", type=int, nargs="+", default=None)
    p.add_argument("--datasets", nargs="+", choices=("stdlib", "recall"), default=None)
    args = parse(p, argv)
    length = args.length or (96 if args.quick else 1024)
    n_seq = args.sequences or (2 if args.quick else 8)
    budgets = [b for b in (args.budgets or ((16, 32) if args.quick else (64, 128, 256, 512)))]
    budgets = [b for b in budgets if b <= length // 2]
    datasets = args.datasets or (["stdlib"] if args.quick else ["stdlib", "recall"])
    if not budgets:
        raise ValueError(f"budgets must be <= length/2 = {length // 2}, got {args.budgets}")

    study = open_study(STUDY, args, argv)
    model, identity, filters, corpus = study.model, study.identity, study.filters, study.corpus
    make = {"stdlib": stdlib_windows, "recall": recall_windows}
    arms = standard_arms()
    results, shapes = {}, {}
    for dataset in datasets:
        tokens = make[dataset](corpus, length, n_seq)
        shapes[dataset] = list(tokens.shape)
        raw = evaluate(model, tokens, arms, budgets, filters, desc=dataset)
        results[dataset] = summarise(raw)

    table = []
    for dataset, res in results.items():
        table.append([dataset, "-", "full", res["full"]["ppl"], 1.0, "", "", ""])
        for budget, rows in res["budgets"].items():
            for name, r in rows.items():
                gap = r["gap_closed_vs_streaming"]
                table.append(
                    [dataset, budget, name, r["ppl"], r["ratio_to_full"]["median"],
                     r["ratio_to_full"]["q1"], r["ratio_to_full"]["q3"],
                     "n/a" if gap is None else f"{100 * gap:.0f}%"]
                )  # fmt: skip
    print_table(
        ["data", "budget", "arm", "ppl", "ratio med", "q1", "q3", "gap closed vs streaming"],
        table,
        title=f"streaming perplexity, 2nd half of {length}-token sequences "
        f"({identity['checkpoint']})",
    )
    names = plot(results, identity, args.out)
    return study.save(
        {
            "data": {
                "length": length,
                "scored": f"tokens {length // 2 + 1} .. {length - 1} (second half)",
                "batches": shapes,
                "full_arm": "one forward pass over each sequence (what a full cache decodes, "
                "up to float rounding)",
                "prefill": "the first min(budget, calib_tokens - 1) tokens (fallback) or "
                "budget tokens (others) go in as one block: identical stored rows",
                "kinds": {
                    "stdlib": "evaluation-split stdlib windows, evenly spaced",
                    "recall": "held-out generated kv / fact / pass-key documents (eval seeds)",
                },
            },
            "budgets": budgets,
            "arms": [a.name for a in arms],
            "results": results,
            "plots": names,
        }
    )


if __name__ == "__main__":
    sys.exit(run(main))
