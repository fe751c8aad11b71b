"""Study 1, geometry: are the model's queries anisotropic, and does the filter's sign hold?

Q-Filters rests on two observations about each head's post-RoPE queries (paper §3): their
cloud has drifted away from the origin along one direction (so the mean query projects
positively on the filter), and that direction carries most of the energy. We sample held-out
queries (evaluation-split stdlib windows and held-out generated documents) and measure, per
query head:

* ``mean_proj_rel``: the mean held-out query's projection on the calibrated filter of its KV
  head, over the mean query norm; the head is sign-correct when it is positive, and
  ``share_positive`` is the share of individual queries that project positively;
* ``top_energy`` and ``drift_ratio`` of the held-out queries' own uncentred SVD, from
  :func:`qfserve.calibrations.compute.layer_filters` (first component's energy share, and its
  |mean projection| over the mean of the other components');
* ``cos_to_calibrated``: cosine between that held-out filter and the calibrated one.

Run: ``python -m bench.quality.geometry [--quick]``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

from bench.cli import parse, parser
from bench.harness import print_table
from bench.quality import plots
from bench.quality.common import (
    progress,
    run,
    spread,
)
from bench.quality.data import recall_windows, stdlib_windows
from bench.quality.study import add_data_arguments, open_study
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
            own, summary = layer_filters(q[h : h + 1], 1)
            proj = q[h] @ f  # (N,)
            rows.append(
                {
                    "layer": layer,
                    "head": h,
                    "kv_head": h // group,
                    "mean_proj_rel": float(proj.mean() / np.linalg.norm(q[h], axis=-1).mean()),
                    "share_positive": float((proj > 0).mean()),
                    "top_energy": summary["top_energy"],
                    "drift_ratio": summary["drift_ratio"],
                    "cos_to_calibrated": float(own[0] @ f),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], calibration=True)
    add_data_arguments(p)
    args = parse(p, argv)
    length = args.length or (160 if args.quick else 1024)
    n_seq = args.sequences or (2 if args.quick else 12)
    samples = 200 if args.quick else 3000

    study = open_study(STUDY, args, argv)
    model, identity, filters, corpus = study.model, study.identity, study.filters, study.corpus
    sequences = [*stdlib_windows(corpus, length, n_seq), *recall_windows(corpus, length, n_seq)]
    total = sum(len(s) for s in sequences)
    with progress(total=total, unit="tok", desc="held-out queries") as bar:
        found = capture_queries(
            model, [s.tolist() for s in sequences], samples_per_head=samples, progress=bar.update
        )
    rows = head_rows([s.queries for s in found], filters)

    positive = [r["mean_proj_rel"] > 0 for r in rows]
    summary = {
        "heads": len(rows),
        "share_heads_positive": float(np.mean(positive)),
        "share_queries_positive": spread([r["share_positive"] for r in rows]),
        "mean_proj_rel": spread([r["mean_proj_rel"] for r in rows]),
        "top_energy": spread([r["top_energy"] for r in rows]),
        "drift_ratio": spread([r["drift_ratio"] for r in rows]),
        "cos_to_calibrated": spread([r["cos_to_calibrated"] for r in rows]),
    }
    print_table(
        ["layer", "head", "kv", "mean proj", "share q>0", "top energy", "drift ratio", "cos"],
        [
            [
                r["layer"],
                r["head"],
                r["kv_head"],
                r["mean_proj_rel"],
                r["share_positive"],
                r["top_energy"],
                r["drift_ratio"],
                r["cos_to_calibrated"],
            ]
            for r in rows
        ],
        title=f"per query head, held-out queries ({identity['checkpoint']})",
    )
    print(
        f"\nheads with positive mean projection on the calibrated filter: "
        f"{sum(positive)}/{len(rows)}; median top energy {summary['top_energy']['median']:.3f}; "
        f"median drift ratio {summary['drift_ratio']['median']:.1f}x"
    )

    fig, ax = plots.subplots(2, 2, figsize=(10, 6.4))
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
    plots.save(
        fig,
        args.out,
        STUDY,
        f"{identity['path']} {identity['checkpoint']}: query geometry per head (held-out)",
    )

    return study.save(
        {
            "data": {
                "kinds": ["stdlib eval split windows", "held-out generated kv/fact/passkey"],
                "sequences": len(sequences),
                "tokens": total,
                "length": length,
                "samples_per_head": int(found[0].queries.shape[1]),
            },
            "summary": summary,
            "heads": rows,
            "plots": [f"{STUDY}.png"],
        }
    )


if __name__ == "__main__":
    sys.exit(run(main))
