"""How stable is the calibration across sample counts and calibration texts?

Queries captured once from two disjoint training-split texts (A, B); filters from uniform
subsamples of 100-3,000 positions per head: cosine per KV head to A's largest and between A
and B, and streaming perplexity at a small budget with each filter set.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from bench.arms import (
    FULL_SETTINGS,
    QUICK_SETTINGS,
    Arm,
    capture,
    full_nll,
    prefill_length,
    streaming_nll,
)
from bench.data import stdlib_windows
from bench.harness import open_run, parse, parser, progress, save_plot, subplots, summary
from bench.report import fmt, plots, quality_header, spread_cell, table
from qfserve.calibrations.compute import compute_filters

STUDY = "stability"
FRACS = (0.0, 0.25)  # recent windows as shares of the budget: "r0" and "r25"


def subsample(queries: list[np.ndarray], n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``n`` of each layer's sampled positions, uniformly without replacement (all heads of a
    layer share the positions, as in capture)."""
    return [q[:, np.sort(rng.choice(q.shape[1], size=min(n, q.shape[1]), replace=False))]
            for q in queries]  # fmt: skip


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per (layer, KV head) cosine of two unit filter sets ``(n_layers, n_kv, D)``."""
    return np.einsum("lkd,lkd->lk", a.astype(np.float64), b.astype(np.float64))


def ppl_window(model: Any, tokens: np.ndarray, arm: Arm, budget: int, filters: Any) -> float:
    """Pooled perplexity on the second half of each sequence, streaming at ``budget``."""
    L = tokens.shape[1]
    if arm.method == "full":
        nll = full_nll(model, tokens)
    else:
        caches = arm.caches(model, budget, filters)
        calib = arm.config(budget).calib_tokens if arm.method == "fallback" else None
        nll, _ = streaming_nll(
            model, tokens, caches, budget=budget, prefill=prefill_length(budget, calib)
        )
    return math.exp(float(nll[:, L // 2 :].mean()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, calibration=True, counts=([100, 300, 1000, 3000], [30, 100, 300],
               "samples per head"), repeats=(3, 2, "subsample draws per count"), budget=(128, 16),
               length=(512, 64, "tokens per sequence"), sequences=(4, 2))  # fmt: skip
    args = parse(p, argv)
    settings = QUICK_SETTINGS if args.quick else FULL_SETTINGS
    counts, repeats, budget = args.counts, args.repeats, args.budget
    length, n_seq = args.length, args.sequences

    study = open_run(STUDY, args, argv)  # it calibrates its own sets
    model, identity = study.model, study.identity
    texts = {t: capture(model, study.tokenizer, identity, text=t, settings=settings)
             for t in ("A", "B")}  # fmt: skip
    rng = np.random.default_rng(args.seed)

    def draws(queries: list[np.ndarray], n: int) -> list[np.ndarray]:
        """Filter sets ``(n_layers, n_kv, D)`` from ``repeats`` subsamples of ``n`` positions
        (one when ``n`` takes them all)."""
        times = 1 if n >= queries[0].shape[1] else repeats
        return [compute_filters(subsample(queries, n, rng), identity["n_kv_heads"])[0]
                for _ in range(times)]  # fmt: skip

    filters = {t: {n: draws(queries, n) for n in counts} for t, (queries, _) in texts.items()}
    ref = filters["A"][counts[-1]][0]

    def spread(pairs: Any) -> dict[str, float]:
        return summary(np.concatenate([cosines(a, b).ravel() for a, b in pairs]).tolist())

    rows = [{"samples_per_head": n, "draws": len(filters["A"][n]),
             "cos_A_n_vs_A_ref": spread((f, ref) for f in filters["A"][n]),
             "cos_A_n_vs_B_n": spread(zip(filters["A"][n], filters["B"][n], strict=False))}
            for n in counts]  # fmt: skip

    tokens = stdlib_windows(study.corpus, length, n_seq)
    sets = {f"{t}_{n}": filters[t][n][0] for n in counts for t in ("A", "B")}
    runs = [(f"r{round(frac * 100)}", name, Arm("qfilters", frac), sets[name])
            for frac in FRACS for name in sets]  # fmt: skip
    runs += [("full", "full", Arm("full"), None)]
    runs += [(f"r{round(frac * 100)}", "fallback", Arm("fallback", frac), None) for frac in FRACS]
    ppl: dict[str, dict[str, float]] = {"r0": {}, "r25": {}, "full": {}}
    bar = progress(iterable=runs, desc=f"perplexity at budget {budget}")
    for key, name, arm, arm_filters in bar:
        ppl[key][name] = ppl_window(model, tokens, arm, budget, arm_filters)
    ref_name = f"A_{counts[-1]}"
    for row in rows:
        n = row["samples_per_head"]
        for key in ("r0", "r25"):
            for t in ("A", "B"):
                row[f"ppl_{t}_{key}"] = ppl[key][f"{t}_{n}"]
                row[f"ppl_change_{t}_{key}"] = ppl[key][f"{t}_{n}"] / ppl[key][ref_name] - 1

    print(
        f"context: full {ppl['full']['full']:.3f}; fallback r0 {ppl['r0']['fallback']:.3f}, "
        f"r25 {ppl['r25']['fallback']:.3f}; {ref_name} r0 {ppl['r0'][ref_name]:.3f}, "
        f"r25 {ppl['r25'][ref_name]:.3f}"
    )

    fig, ax = subplots(1, 2, figsize=(10, 3.6))
    a = ax[0, 0]
    for key, label, style in (
        ("cos_A_n_vs_A_ref", f"cos(A_n, {ref_name})", "o-"),
        ("cos_A_n_vs_B_n", "cos(A_n, B_n), disjoint texts", "s--"),
    ):
        med = [r[key]["median"] for r in rows]
        lo = [r[key]["min"] for r in rows]
        a.plot(counts, med, style, label=f"{label} (median)")
        a.plot(counts, lo, style, alpha=0.4, label=f"{label} (min)")
    a.set_xscale("log")
    a.set_xlabel("calibration samples per head")
    a.set_ylabel("cosine per KV head")
    a.legend(fontsize=7)
    a = ax[0, 1]
    for key, style in (("r0", "o-"), ("r25", "s--")):
        for t in ("A", "B"):
            a.plot(counts, [r[f"ppl_{t}_{key}"] for r in rows], style, label=f"text {t}, {key}")
        a.axhline(ppl[key]["fallback"], ls=":", color="tab:orange", label=f"fallback {key}")
    a.axhline(ppl["full"]["full"], color="black", ls="--", label="full")
    a.set_xscale("log")
    a.set_xlabel("calibration samples per head")
    a.set_ylabel(f"perplexity at budget {budget}")
    a.legend(fontsize=6)
    title = f"{identity['path']} {identity['checkpoint']}: calibration stability"
    save_plot(fig, args.out, STUDY, title)

    scored = f"{n_seq} evaluation-split stdlib windows of {length} tokens, second half scored"
    payload = {"reference": ref_name, "budget": budget, "data": {"perplexity": scored},
               "counts": counts, "repeats": repeats, "rows": rows,
               "cos_A_ref_vs_B_ref_per_head": cosines(ref, filters["B"][counts[-1]][0]),
               "ppl": ppl, "plots": [f"{STUDY}.png"]}  # fmt: skip
    calibration = {t: {"text": info["description"], "tokens": info["tokens"]}
                   for t, (_, info) in texts.items()}  # fmt: skip
    return study.save(payload, calibration=calibration)


def render(data: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    lines = quality_header("Calibration stability", data)
    cal = data["calibration"]
    lines += [
        "",
        f"Texts: A = {cal['A']['text']}; B = {cal['B']['text']}. Reference "
        f"`{data['reference']}`; {data['repeats']} subsample draws per count; perplexity "
        f"at budget {data['budget']} on {data['data']['perplexity']}.",
        "",
    ]

    def cells(r: dict[str, Any]) -> list[Any]:
        cos = [cell for k in ("cos_A_n_vs_A_ref", "cos_A_n_vs_B_n")
               for cell in (spread_cell(r[k]), fmt(r[k]["min"]))]  # fmt: skip
        ppl = [f"{100 * r[f'ppl_change_A_{k}']:+.2f}% / {100 * r[f'ppl_change_B_{k}']:+.2f}%"
               for k in ("r0", "r25")]  # fmt: skip
        return [r["samples_per_head"], *cos, *ppl]

    lines += table(["samples/head", "cos(A_n, ref)", "min", "cos(A_n, B_n)", "min",
                    "Δppl A / B, recent 0", "Δppl A / B, recent b/4"],
                   [cells(r) for r in data["rows"]])  # fmt: skip
    ppl = data["ppl"]
    lines += [
        "",
        f"For scale: full cache {ppl['full']['full']:.3f}; key-SVD fallback "
        f"{ppl['r0']['fallback']:.3f} (recent 0) / {ppl['r25']['fallback']:.3f} (recent b/4); "
        f"reference {ppl['r0'][data['reference']]:.3f} / {ppl['r25'][data['reference']]:.3f}.",
    ]
    return lines + plots(data)
