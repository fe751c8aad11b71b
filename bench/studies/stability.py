"""How stable is the calibration across sample counts and calibration texts?

Filters from subsamples of two disjoint texts' queries: cosines per KV head, and perplexity.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from bench.arms import Arm, capture, full_nll, streaming_nll
from bench.data import stdlib_windows
from bench.harness import progress, save_plot, start, subplots, summary
from bench.report import fmt, section, spread_cell, table
from qfserve.calibrations.compute import compute_filters

STUDY = "stability"
RECENT = {"r0": 0.0, "r25": 0.25}  # recent windows as shares of the budget


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
    if arm.method == "full":
        nll = full_nll(model, tokens)
    else:
        caches = arm.caches(model, budget, filters)
        nll, _ = streaming_nll(model, tokens, caches, budget=budget, prefill=arm.block(budget))
    return math.exp(float(nll[:, tokens.shape[1] // 2 :].mean()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    study = start(STUDY, argv, __doc__, counts=([100, 300, 1000, 3000], [30, 100, 300],
                  "samples per head"), repeats=(3, 2, "subsample draws per count"),
                  budget=(128, 16), length=(512, 64, "tokens per sequence"), sequences=(4, 2))  # fmt: skip
    args = study.args  # it calibrates its own sets, on texts A and B
    counts, repeats, budget = args.counts, args.repeats, args.budget
    model, identity = study.model, study.identity
    texts = {t: capture(model, study.tokenizer, identity, text=t, quick=args.quick) for t in "AB"}
    rng = np.random.default_rng(args.seed)

    def draws(queries: list[np.ndarray], n: int) -> list[np.ndarray]:
        """Filter sets from ``repeats`` subsamples of ``n`` positions (one if ``n`` is all)."""
        times = 1 if n >= queries[0].shape[1] else repeats
        return [compute_filters(subsample(queries, n, rng), identity["n_kv_heads"])[0]
                for _ in range(times)]  # fmt: skip

    filters = {t: {n: draws(queries, n) for n in counts} for t, (queries, _) in texts.items()}
    ref, ref_name = filters["A"][counts[-1]][0], f"A_{counts[-1]}"

    def spread(pairs: Any) -> dict[str, float]:
        return summary(np.concatenate([cosines(a, b).ravel() for a, b in pairs]).tolist())

    tokens = stdlib_windows(study.corpus, args.length, args.sequences)
    sets = {f"{t}_{n}": filters[t][n][0] for n in counts for t in ("A", "B")}
    runs = [(key, name, Arm("qfilters", frac), f) for key, frac in RECENT.items()
            for name, f in sets.items()]  # fmt: skip
    runs += [("full", "full", Arm("full"), None)]
    runs += [(key, "fallback", Arm("fallback", frac), None) for key, frac in RECENT.items()]
    ppl: dict[str, dict[str, float]] = {"r0": {}, "r25": {}, "full": {}}
    for key, name, arm, arm_filters in progress(iterable=runs, desc=f"perplexity at {budget}"):
        ppl[key][name] = ppl_window(model, tokens, arm, budget, arm_filters)
    rows = []
    for n in counts:
        row = {"samples_per_head": n, "draws": len(filters["A"][n]),
               "cos_A_n_vs_A_ref": spread((f, ref) for f in filters["A"][n]),
               "cos_A_n_vs_B_n": spread(zip(filters["A"][n], filters["B"][n], strict=False))}  # fmt: skip
        for key in RECENT:
            for t in ("A", "B"):
                row[f"ppl_{t}_{key}"] = ppl[key][f"{t}_{n}"]
                row[f"ppl_change_{t}_{key}"] = ppl[key][f"{t}_{n}"] / ppl[key][ref_name] - 1
        rows.append(row)

    fig, ax = subplots(1, 2, figsize=(10, 3.6))
    for key, label, style in (("cos_A_n_vs_A_ref", f"cos(A_n, {ref_name})", "o-"),
                              ("cos_A_n_vs_B_n", "cos(A_n, B_n), disjoint texts", "s--")):  # fmt: skip
        ax[0, 0].plot(counts, [r[key]["median"] for r in rows], style, label=f"{label} (median)")
        ax[0, 0].plot(counts, [r[key]["min"] for r in rows], style, alpha=0.4, label=f"{label} (min)")  # fmt: skip
    for key, style in (("r0", "o-"), ("r25", "s--")):
        for t in ("A", "B"):
            ax[0, 1].plot(counts, [r[f"ppl_{t}_{key}"] for r in rows], style, label=f"text {t}, {key}")  # fmt: skip
        ax[0, 1].axhline(ppl[key]["fallback"], ls=":", color="tab:orange", label=f"fallback {key}")
    ax[0, 1].axhline(ppl["full"]["full"], color="black", ls="--", label="full")
    ax[0, 0].set(xscale="log", xlabel="calibration samples per head", ylabel="cosine per KV head")
    ax[0, 1].set(
        xscale="log", xlabel="calibration samples per head", ylabel=f"perplexity at budget {budget}"
    )
    ax[0, 0].legend(fontsize=7)
    ax[0, 1].legend(fontsize=6)
    save_plot(fig, args.out, STUDY, study.title("calibration stability"))

    scored = f"{args.sequences} evaluation-split stdlib windows of {args.length} tokens, second half scored"
    payload = {"reference": ref_name, "budget": budget, "data": {"perplexity": scored},
               "counts": counts, "repeats": repeats, "rows": rows,
               "cos_A_ref_vs_B_ref_per_head": cosines(ref, filters["B"][counts[-1]][0]),
               "ppl": ppl, "plots": [f"{STUDY}.png"]}  # fmt: skip
    calibration = {
        t: {"text": info["description"], "tokens": info["tokens"]} for t, (_, info) in texts.items()
    }
    return study.save(payload, calibration=calibration)


def render(data: dict[str, Any]) -> list[str]:
    cal, ppl, ref = data["calibration"], data["ppl"], data["reference"]
    intro = (f"Texts: A = {cal['A']['text']}; B = {cal['B']['text']}. Reference `{ref}`; "
             f"{data['repeats']} subsample draws per count; perplexity at budget {data['budget']} "
             f"on {data['data']['perplexity']}.")  # fmt: skip
    rows = [[r["samples_per_head"],
             *[c for k in ("cos_A_n_vs_A_ref", "cos_A_n_vs_B_n") for c in (spread_cell(r[k]), fmt(r[k]["min"]))],
             *[f"{100 * r[f'ppl_change_A_{k}']:+.2f}% / {100 * r[f'ppl_change_B_{k}']:+.2f}%" for k in RECENT]]
            for r in data["rows"]]  # fmt: skip
    headers = ["samples/head", "cos(A_n, ref)", "min", "cos(A_n, B_n)", "min",
               "Δppl A / B, recent 0", "Δppl A / B, recent b/4"]  # fmt: skip
    scale = (
        f"For scale: full cache {ppl['full']['full']:.3f}; key-SVD fallback "
        f"{ppl['r0']['fallback']:.3f} (recent 0) / {ppl['r25']['fallback']:.3f} (recent b/4); "
        f"reference {ppl['r0'][ref]:.3f} / {ppl['r25'][ref]:.3f}."
    )
    return section("Calibration stability", data, intro, table(headers, rows), scale)
