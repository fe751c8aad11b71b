"""Are the model's queries anisotropic, and does the filter's sign hold?

Per query head on held-out queries: the mean projection on the calibrated filter over the
mean query norm, the share of queries projecting positively, the top component's energy and
drift ratio of their own uncentred SVD, and its cosine to the calibrated filter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.data import recall_windows, stdlib_windows
from bench.harness import open_run, parse, parser, progress, save_plot, subplots, summary
from bench.report import fmt, pct, plots, quality_header, spread_cell, table
from qfserve.calibrations.capture import capture_queries
from qfserve.calibrations.compute import layer_filters

STUDY = "geometry"


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
    p = parser(__doc__, calibration=True, length=(1024, 160, "tokens per held-out sequence"),
               sequences=(12, 2, "held-out sequences per kind"))  # fmt: skip
    args = parse(p, argv)
    length, n_seq, samples = args.length, args.sequences, 200 if args.quick else 3000

    study = open_run(STUDY, args, argv, calibrate=True)
    model, identity, filters, corpus = study.model, study.identity, study.filters, study.corpus
    sequences = [*stdlib_windows(corpus, length, n_seq), *recall_windows(corpus, length, n_seq)]
    total = sum(len(s) for s in sequences)
    with progress(total=total, unit="tok", desc="held-out queries") as bar:
        found = capture_queries(
            model, [s.tolist() for s in sequences], samples_per_head=samples, progress=bar.update
        )
    rows = head_rows([s.queries for s in found], filters)

    positive = [r["mean_proj_rel"] > 0 for r in rows]
    overall = {"heads": len(rows), "share_heads_positive": float(np.mean(positive)),
               "share_queries_positive": summary([r["share_positive"] for r in rows])}  # fmt: skip
    for key in ("mean_proj_rel", "top_energy", "drift_ratio", "cos_to_calibrated"):
        overall[key] = summary([r[key] for r in rows])
    print(
        f"\nheads with positive mean projection on the calibrated filter: "
        f"{sum(positive)}/{len(rows)}; median top energy {overall['top_energy']['median']:.3f}; "
        f"median drift ratio {overall['drift_ratio']['median']:.1f}x"
    )

    fig, ax = subplots(2, 2, figsize=(10, 6.4))
    x = np.arange(len(rows))
    labels = [f"L{r['layer']}h{r['head']}" for r in rows]
    for a, key, title in (
        (ax[0, 0], "mean_proj_rel", "mean query projection on filter / mean |q|"),
        (ax[0, 1], "share_positive", "share of held-out queries with q.f > 0"),
        (ax[1, 0], "top_energy", "top-component energy share"),
        (ax[1, 1], "drift_ratio", "|mean proj v1| / mean |mean proj v_i>1| (log)"),
    ):
        values = [r[key] for r in rows]
        a.bar(x, values, color=["tab:blue" if v > 0 else "tab:red" for v in values])
        a.set_title(title, fontsize=9)
        a.set_xticks(x, labels, rotation=90, fontsize=6)
        if key == "drift_ratio":
            a.set_yscale("log")
        a.axhline(0, color="black", lw=0.5)
    title = f"{identity['path']} {identity['checkpoint']}: query geometry per head (held-out)"
    save_plot(fig, args.out, STUDY, title)

    return study.save(
        {
            "data": {
                "kinds": ["stdlib eval split windows", "held-out generated kv/fact/passkey"],
                "sequences": len(sequences),
                "tokens": total,
                "length": length,
                "samples_per_head": int(found[0].queries.shape[1]),
            },
            "summary": overall,
            "heads": rows,
            "plots": [f"{STUDY}.png"],
        }
    )


def render(data: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    s = data["summary"]
    lines = quality_header("Geometry: are the queries anisotropic?", data)
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
    lines += [
        "",
        f"Held-out queries ({data['data']['tokens']:,} tokens, {data['data']['samples_per_head']}"
        " sampled per head) against the calibrated filter of their KV head. Spread is the "
        "median [q1–q3] over query heads.",
        "",
        *table(["measure", "median [q1–q3] over heads"], rows),
    ]
    anisotropy = data.get("calibration", {}).get("anisotropy")
    if anisotropy:
        headers = ["layer", "heads positive on their KV filter", "top energy (mean)",
                   "drift ratio (median)"]  # fmt: skip
        rows = [[a["layer"], pct(a["positive_share"]), fmt(a["top_energy"]),
                 fmt(a["drift_ratio"], 1)] for a in anisotropy]  # fmt: skip
        lines += ["", "On the calibration queries themselves (`qfserve.calibrations.compute`'s "
                  "per-layer summary):", "", *table(headers, rows)]  # fmt: skip
    return lines + plots(data)
