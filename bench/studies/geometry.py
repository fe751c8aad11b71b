"""Are the model's queries anisotropic, and does the filter's sign hold?

Per query head, on held-out queries: projection on the calibrated filter, and own-SVD energy,
drift and cosine to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.data import recall_windows, stdlib_windows
from bench.harness import progress, save_plot, start, subplots, summary
from bench.report import fmt, pct, section, spread_cell, table
from qfserve.calibrations.capture import capture_queries
from qfserve.calibrations.compute import layer_filters

STUDY = "geometry"
PANELS = {
    "mean_proj_rel": "mean query projection on filter / mean |q|",
    "share_positive": "share of held-out queries with q.f > 0",
    "top_energy": "top-component energy share",
    "drift_ratio": "|mean proj v1| / mean |mean proj v_i>1| (log)",
}


def head_rows(queries: Sequence[np.ndarray], filters: np.ndarray) -> list[dict]:
    """One row per (layer, query head): see the module docstring."""
    rows = []
    n_kv = filters.shape[1]
    for layer, q in enumerate(queries):  # q: (H, N, D)
        group = q.shape[0] // n_kv
        for h in range(q.shape[0]):
            f = filters[layer, h // group]
            own, stats = layer_filters(q[h : h + 1], 1)
            proj = q[h] @ f  # (N,)
            rel = proj.mean() / np.linalg.norm(q[h], axis=-1).mean()
            rows.append({"layer": layer, "head": h, "kv_head": h // group,
                         "mean_proj_rel": float(rel), "share_positive": float((proj > 0).mean()),
                         "top_energy": stats["top_energy"], "drift_ratio": stats["drift_ratio"],
                         "cos_to_calibrated": float(own[0] @ f)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    study = start(STUDY, argv, __doc__, calibration=True, length=(1024, 160, "tokens per "
                  "held-out sequence"), sequences=(12, 2, "held-out sequences per kind"))  # fmt: skip
    args = study.args
    length, n_seq, samples = args.length, args.sequences, 200 if args.quick else 3000
    model, filters, corpus = study.model, study.filters, study.corpus
    sequences = [*stdlib_windows(corpus, length, n_seq), *recall_windows(corpus, length, n_seq)]
    total = sum(len(s) for s in sequences)
    with progress(total=total, unit="tok", desc="held-out queries") as bar:
        found = capture_queries(
            model, [s.tolist() for s in sequences], samples_per_head=samples, progress=bar.update
        )
    rows = head_rows([s.queries for s in found], filters)

    overall = {"heads": len(rows), "share_heads_positive": float(np.mean([r["mean_proj_rel"] > 0 for r in rows])),
               "share_queries_positive": summary([r["share_positive"] for r in rows])}  # fmt: skip
    for key in ("mean_proj_rel", "top_energy", "drift_ratio", "cos_to_calibrated"):
        overall[key] = summary([r[key] for r in rows])

    fig, ax = subplots(2, 2, figsize=(10, 6.4))
    x, labels = np.arange(len(rows)), [f"L{r['layer']}h{r['head']}" for r in rows]
    for a, (key, title) in zip(ax.flat, PANELS.items(), strict=True):
        values = [r[key] for r in rows]
        a.bar(x, values, color=["tab:blue" if v > 0 else "tab:red" for v in values])
        a.set_title(title, fontsize=9)
        a.set_xticks(x, labels, rotation=90, fontsize=6)
        a.set_yscale("log" if key == "drift_ratio" else "linear")
        a.axhline(0, color="black", lw=0.5)
    save_plot(fig, args.out, STUDY, study.title("query geometry per head (held-out)"))
    data = {"kinds": ["stdlib eval split windows", "held-out generated kv/fact/passkey"],
            "sequences": len(sequences), "tokens": total, "length": length,
            "samples_per_head": int(found[0].queries.shape[1])}  # fmt: skip
    return study.save({"data": data, "summary": overall, "heads": rows, "plots": [f"{STUDY}.png"]})


def render(data: dict[str, Any]) -> list[str]:
    s, d = data["summary"], data["data"]
    spreads = (
        ("share of held-out queries with q·f > 0", "share_queries_positive", 3),
        ("mean projection / mean ‖q‖", "mean_proj_rel", 3),
        ("top-component energy (own uncentred SVD)", "top_energy", 3),
        ("drift ratio: \\|mean proj. on v1\\| / mean \\|mean proj. on v_i>1\\|", "drift_ratio", 1),
        ("cosine(held-out top vector, calibrated filter)", "cos_to_calibrated", 3),
    )
    heads = f"{s['share_heads_positive'] * s['heads']:.0f} / {s['heads']}"
    rows = [["heads whose mean query projects positively on the filter", heads]]
    rows += [[label, spread_cell(s[key], digits)] for label, key, digits in spreads]
    intro = (
        f"Held-out queries ({d['tokens']:,} tokens, {d['samples_per_head']} sampled per "
        "head) against the calibrated filter of their KV head. Spread is the median "
        "[q1–q3] over query heads."
    )
    blocks = [intro, table(["measure", "median [q1–q3] over heads"], rows)]
    if anisotropy := data.get("calibration", {}).get("anisotropy"):
        headers = ["layer", "heads positive on their KV filter", "top energy (mean)",
                   "drift ratio (median)"]  # fmt: skip
        rows = [
            [a["layer"], pct(a["positive_share"]), fmt(a["top_energy"]), fmt(a["drift_ratio"], 1)]
            for a in anisotropy
        ]
        blocks += ["On the calibration queries themselves (`qfserve.calibrations.compute`'s "
                   "per-layer summary):", table(headers, rows)]  # fmt: skip
    return section("Geometry: are the queries anisotropic?", data, *blocks)
