"""The opening lines of a model's quality section: which weights, and the headline numbers
of each study present, all read from the studies' JSON (:mod:`bench.report` places them)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.quality.markdown import arm_order, pct

STUDIES = ("geometry", "attention", "perplexity", "retrieval", "stability", "niah")


def headlines(results_dir: Path) -> list[str]:
    """The section's opening lines: model checkpoint(s) and the headline numbers."""
    data = {}
    for name in STUDIES:
        path = results_dir / f"{name}.json"
        if path.is_file():
            data[name] = json.loads(path.read_text())
    if not data:
        return []
    # Weights decide whether studies are comparable; the checkpoint label of an older
    # results file may differ for the same weights.
    models = {(d["model"]["path"], d["model"]["weights_sha1"]) for d in data.values()}
    lines = [
        "Held-out data only: evaluation-split standard-library files and generated documents "
        "from the training package's evaluation seeds; calibration on training-split files. "
        "Budgets are matched in rows (sinks and recent rows included) and every arm is checked "
        "to keep exactly that many. Quality figures are deterministic for given data, so there is "
        "no timing noise to interleave against: all arms of a study see the same sequences in "
        "one run, and the spreads shown are over sequences, heads or calibration draws.",
        "",
    ]
    if len(models) > 1:
        lines += [f"**Warning: the studies ran on different weights: {sorted(models)}.**", ""]
    else:
        (path, sha), *_ = models
        # The newest study's label (older results files may lack the model's name).
        checkpoint = max(data.values(), key=lambda d: d.get("when", ""))["model"]["checkpoint"]
        lines += [
            f"All studies: `{path}` at **{checkpoint}**, weights sha1 `{sha}`. "
            "The numbers describe these weights only: after changing them, rerun the same "
            "commands.",
            "",
        ]
    lines += ["Headlines (all from the tables below):", ""]
    if "geometry" in data:
        s = data["geometry"]["summary"]
        lines.append(
            f"- Geometry: {s['share_heads_positive'] * s['heads']:.0f}/{s['heads']} query heads "
            f"have a positive mean held-out projection on their filter; median top-component "
            f"energy {s['top_energy']['median']:.2f}, median drift ratio "
            f"{s['drift_ratio']['median']:.0f}×."
        )
    if "attention" in data:
        r = data["attention"]["results"]["all"]
        lines.append(
            "- Score vs attention (mean Spearman ρ over KV heads, share of heads positive): "
            + "; ".join(
                f"{k} {v['mean_rho']:+.2f} ({pct(v['share_heads_positive'])})" for k, v in r.items()
            )
            + "."
        )
    if "perplexity" in data:
        res = data["perplexity"]["results"]
        for dataset, d in res.items():
            budgets = list(d["budgets"])
            b = "128" if "128" in budgets else budgets[0]
            arms = d["budgets"][b]
            lines.append(
                f"- Perplexity ({dataset}, budget {b}; full {d['full']['ppl']:.2f}): "
                + ", ".join(
                    f"{n} {arms[n]['ppl']:.2f}"
                    + (
                        f" (gap closed {pct(arms[n]['gap_closed_vs_streaming'])})"
                        if n != "streaming/r0"
                        else ""
                    )
                    for n in arm_order(arms)
                    if n != "full"
                )
                + "."
            )
    if "retrieval" in data:
        res = data["retrieval"]["results"]
        full = [v["arms"]["full"]["-"]["accuracy"] for v in res.values() if "full" in v["arms"]]
        names = arm_order(n for v in res.values() for n in v["arms"])
        acc = {}
        for name in [n for n in names if n != "full"]:
            vals = [c["accuracy"] for v in res.values() for c in v["arms"].get(name, {}).values()]
            if vals:
                acc[name] = sum(vals) / len(vals)
        lines.append(
            f"- Pass-key accuracy, mean over lengths and compressions (full cache "
            f"{sum(full) / max(1, len(full)):.2f}): "
            + ", ".join(f"{k} {v:.2f}" for k, v in acc.items())
            + "."
        )
        nll = {}
        for name in names:
            vals = [
                c["answer_nll_mean"]
                for v in res.values()
                for c in v["arms"].get(name, {}).values()
                if "answer_nll_mean" in c
            ]
            if vals:
                nll[name] = sum(vals) / len(vals)
        if nll:
            lines.append(
                "- Pass-key answer NLL (nats/token, mean over lengths and compressions; lower is "
                "better): " + ", ".join(f"{k} {v:.3f}" for k, v in nll.items()) + "."
            )
    if "stability" in data:
        rows = data["stability"]["rows"]
        first, last = rows[0], rows[-1]
        lines.append(
            f"- Calibration stability: median per-head cosine between calibrations on disjoint "
            f"texts {first['cos_A_n_vs_B_n']['median']:.3f} at {first['samples_per_head']} "
            f"samples/head, {last['cos_A_n_vs_B_n']['median']:.3f} at "
            f"{last['samples_per_head']}; perplexity change at budget "
            f"{data['stability']['budget']} with {first['samples_per_head']} samples "
            f"{100 * first['ppl_change_A_r0']:+.1f}% (recent 0)."
        )
    return lines
