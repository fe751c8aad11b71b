"""Markdown for the ``## Quality`` part of ``bench/RESULTS.md`` (studies 1-6).

One renderer per study, ``RENDERERS[<json name>](data) -> markdown lines``, plus
:func:`headlines`, the section's opening summary. Reads only the JSON the studies wrote;
imports neither MLX nor the studies. :mod:`bench.report` assembles the page.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

STUDIES = ("geometry", "attention", "perplexity", "retrieval", "stability", "niah")
CHUNKS = (4, 8, 16)  # chunk sizes the studies may run (bench.quality.arms.Arm.chunk)
ARM_ORDER = (
    "qfilters/r0",
    "qfilters/r25",
    *(f"qfilters/r{r}/c{c}" for r in (0, 25) for c in CHUNKS),
    "qfilters/r0/ada",
    "qfilters/r25/ada",
    "fallback/r0",
    "fallback/r25",
    "fallback-/r0",
    "fallback-/r25",
    "knorm/r0",
    "knorm/r25",
    "streaming/r0",
)
ARM_NAMES = {
    "full": "full cache",
    "qfilters/r0": "Q-Filters calibrated, recent 0",
    "qfilters/r25": "Q-Filters calibrated, recent b/4",
    "fallback/r0": "key-SVD fallback, recent 0",
    "fallback/r25": "key-SVD fallback, recent b/4",
    "fallback-/r0": "key-SVD fallback sign-flipped (ablation), recent 0",
    "fallback-/r25": "key-SVD fallback sign-flipped (ablation), recent b/4",
    "knorm/r0": "K-norm, recent 0",
    "knorm/r25": "K-norm, recent b/4",
    "streaming/r0": "streaming (sinks + latest)",
    **{
        f"qfilters/r{r}/c{c}": f"Q-Filters calibrated, recent {'b/4' if r else 0}, chunks of {c}"
        for r in (0, 25)
        for c in CHUNKS
    },
    "qfilters/r0/ada": "Q-Filters calibrated, recent 0, adaptive budgets",
    "qfilters/r25/ada": "Q-Filters calibrated, recent b/4, adaptive budgets",
}
METHOD_NAMES = {  # the other arms' methods (bench.quality.arms.Arm.name's first part)
    "qfilters": "Q-Filters calibrated",
    "self": "Q-Filters self-calibrated (the prompt's own queries)",
    "traffic": "Q-Filters learned from traffic",
    "snapkv": "SnapKV",
    "tova": "TOVA",
    "fallback": "key-SVD fallback",
    "fallback-": "key-SVD fallback sign-flipped (ablation)",
    "knorm": "K-norm",
    "streaming": "streaming (sinks + latest)",
}


def arm_label(name: str) -> str:
    """A row label for any arm name ``method/rNN[/cN][/ada][/wN][/<traffic>]``."""
    if name in ARM_NAMES:
        return ARM_NAMES[name]
    method, _, rest = name.partition("/")
    parts = rest.split("/") if rest else []
    label = METHOD_NAMES.get(method, method)
    for part in parts:
        if part.startswith("r") and part[1:].isdigit():
            label += ", recent " + ("b/4" if part == "r25" else "0" if part == "r0" else part)
        elif part.startswith("c") and part[1:].isdigit():
            label += f", chunks of {part[1:]}"
        elif part == "ada":
            label += ", adaptive budgets"
        elif part.startswith("w") and part[1:].isdigit():
            label += f", {part[1:]}-token window"
        elif method == "traffic":
            label = label.replace("from traffic", f"from {part} traffic")
        else:
            label += f", {part}"
    return label


def arm_order(present: Any) -> list[str]:
    """``present`` arm names in reading order: the full cache, the standard arms, then the
    rest as they came."""
    present = list(dict.fromkeys(present))
    known = [n for n in ("full", *ARM_ORDER) if n in present]
    return known + [n for n in present if n not in known]


def _f(x: Any, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _pct(x: Any) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def _header(title: str, data: dict[str, Any]) -> list[str]:
    model = data["model"]
    cal = data.get("calibration", {})
    lines = [
        f"### {title}",
        "",
        f"`{data['command']}` — {data['when']}, {data.get('runtime_s', '?')} s. Model "
        f"`{model['path']}` at **{model['checkpoint']}** (weights sha1 "
        f"`{model['weights_sha1']}`).",
    ]
    if cal.get("source"):
        lines[-1] += (
            f" Filters: {cal['source']} calibration, {cal.get('samples_per_head')} samples per "
            f"head on {cal.get('text')}; disjoint from the evaluation text: "
            f"{cal.get('disjoint_from_eval')}."
        )
    if data.get("quick"):
        lines += ["", "**Quick (smoke-test) run: sizes too small to read anything into.**"]
    return lines


def _plots(data: dict[str, Any]) -> list[str]:
    return ["", *[f"![{p}](results/{p})" for p in data.get("plots", [])]]


def render_geometry(data: dict[str, Any]) -> list[str]:
    s = data["summary"]
    lines = _header("1. Geometry: are the queries anisotropic?", data)
    lines += [
        "",
        f"Held-out queries ({data['data']['tokens']:,} tokens, {data['data']['samples_per_head']}"
        " sampled per head) against the calibrated filter of their KV head. Spread is the "
        "median [q1–q3] over query heads.",
        "",
        *_table(
            ["measure", "median [q1–q3] over heads"],
            [
                [
                    "heads whose mean query projects positively on the filter",
                    f"{s['share_heads_positive'] * s['heads']:.0f} / {s['heads']}",
                ],
                ["share of held-out queries with q·f > 0", _spread(s["share_queries_positive"])],
                ["mean projection / mean ‖q‖", _spread(s["mean_proj_rel"])],
                ["top-component energy (own uncentred SVD)", _spread(s["top_energy"])],
                [
                    "drift ratio: \\|mean proj. on v1\\| / mean \\|mean proj. on v_i>1\\|",
                    _spread(s["drift_ratio"], 1),
                ],
                ["cosine(held-out top vector, calibrated filter)", _spread(s["cos_to_calibrated"])],
            ],
        ),  # fmt: skip
    ]
    anisotropy = data.get("calibration", {}).get("anisotropy")
    if anisotropy:
        lines += [
            "",
            "On the calibration queries themselves (`calibrations.compute`'s per-layer summary):",
            "",
            *_table(
                [
                    "layer",
                    "heads positive on their KV filter",
                    "top energy (mean)",
                    "drift ratio (median)",
                ],
                [
                    [
                        a["layer"],
                        _pct(a["positive_share"]),
                        _f(a["top_energy"]),
                        _f(a["drift_ratio"], 1),
                    ]
                    for a in anisotropy
                ],
            ),  # fmt: skip
        ]
    return lines + _plots(data)


def _spread(s: dict[str, Any], digits: int = 3) -> str:
    return f"{_f(s.get('median'), digits)} [{_f(s.get('q1'), digits)}–{_f(s.get('q3'), digits)}]"


def render_attention(data: dict[str, Any]) -> list[str]:
    lines = _header("2. Does the score predict attention?", data)
    d = data["data"]
    lengths = d["length"] if isinstance(d["length"], list) else [d["length"]]
    lines += [
        "",
        f"Spearman correlation, per KV head, between each score and the attention a key "
        f"receives from later queries (keys {d['keys']}; queries {d['queries']}), "
        f"{', '.join(map(str, lengths))}-token held-out sequences {d['sequences']}. Mean over "
        "heads, the share of heads where it is positive, and the spread of per-head values.",
        "",
    ]
    if len(lengths) > 1:  # one row per scorer, a column per length (both kinds of data)
        res = data["results"]
        keys = [f"all@{n}" for n in lengths] + ["all"]
        rows = [[scorer, *(f"{_f(res[k][scorer]['mean_rho'], 2)} "
                           f"({_pct(res[k][scorer]['share_heads_positive'])})" for k in keys)]
                for scorer in res["all"]]  # fmt: skip
        lines += ["Mean ρ over KV heads (share of heads with ρ > 0), by sequence length:", ""]
        lines += _table(["scorer", *[f"{n} tokens" for n in lengths], "all lengths"], rows)
        lines += ["", "By data and length:", ""]
    rows = []
    for dataset, res in data["results"].items():
        for scorer, r in res.items():
            rows.append(
                [dataset, scorer, _f(r["mean_rho"]), _pct(r["share_heads_positive"]),
                 _spread(r["per_head_spread"])]
            )  # fmt: skip
    lines += _table(["data", "scorer", "mean ρ", "heads ρ > 0", "per-head [q1–q3]"], rows)
    res = data["results"].get("all")
    if res:
        scorers = list(res)
        n_layers = len(res[scorers[0]]["per_head"])
        lines += ["", "Per layer (all data; each cell: ρ of KV head 0 / 1 / ...):", ""]
        lines += _table(
            ["layer", *scorers],
            [
                [layer]
                + [" / ".join(f"{v:+.2f}" for v in res[sc]["per_head"][layer]) for sc in scorers]
                for layer in range(n_layers)
            ],
        )
    return lines + _plots(data)


def render_perplexity(data: dict[str, Any]) -> list[str]:
    lines = _header("3. Streaming generation perplexity", data)
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
                    [budget, arm_label(name), _f(r["ppl"]), _spread(r["ratio_to_full"]),
                     _pct(r["gap_closed_vs_streaming"]), r["max_rows_any_step"]]
                )  # fmt: skip
        lines += _table(
            ["budget", "arm", "perplexity", "ratio to full", "gap closed vs streaming",
             "max rows"],
            rows,
        )  # fmt: skip
    return lines + _plots(data)


def render_retrieval(data: dict[str, Any]) -> list[str]:
    lines = _header("4. Pass-key retrieval", data)
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
    ratios = data["ratios"]
    names = arm_order(n for r in data["results"].values() for n in r["arms"])
    for n, res in data["results"].items():
        lines += ["", f"**{n}-token documents** ({res['docs']} docs, mean prompt "
                  f"{res['mean_prompt_tokens']:.0f} tokens)", ""]  # fmt: skip
        rows = []
        for name in names:
            cells = res["arms"].get(name)
            if not cells:
                continue
            row = [arm_label(name), _f(cells["-"]["accuracy"], 2) if "-" in cells else ""]
            row += [_f(cells[str(r)]["accuracy"], 2) if str(r) in cells else "" for r in ratios]
            rows.append(row)
        lines += _table(["arm", "no eviction", *[f"{r}×" for r in ratios]], rows)
    if any("answer_nll_mean" in c for r in data["results"].values()
           for cells in r["arms"].values() for c in cells.values()):  # fmt: skip
        rows = []
        for name in names:
            row = [arm_label(name)]
            for k in ["-", *map(str, ratios)]:
                vals = [
                    r["arms"][name][k]["answer_nll_mean"]
                    for r in data["results"].values()
                    if k in r["arms"].get(name, {})
                ]
                row.append(_f(sum(vals) / len(vals)) if vals else "")
            rows.append(row)
        lines += [
            "",
            "Answer NLL (nats per answer token, teacher-forced through each arm's cache; lower "
            "is better; mean over documents and lengths) — graded where accuracy is at the "
            "floor:",
            "",
        ]
        lines += _table(["arm", "no eviction", *[f"{r}×" for r in ratios]], rows)
    bins = data["data"]["depth_bins"]
    rows = []
    for name in names:
        cells = [c for res in data["results"].values() for c in res["arms"].get(name, {}).values()]
        if not cells:
            continue
        row = [arm_label(name)]
        for b in bins:
            vals = [c["by_depth"][b] for c in cells if c["by_depth"].get(b) is not None]
            row.append(_f(sum(vals) / len(vals), 2) if vals else "")
        rows.append(row)
    lines += ["", "By needle depth (mean over lengths and compressions):", ""]
    lines += _table(["arm", *[f"needle in {b}" for b in bins]], rows)
    return lines + _plots(data)


def render_stability(data: dict[str, Any]) -> list[str]:
    lines = _header("5. Calibration stability", data)
    cal = data["calibration"]
    lines += [
        "",
        f"Texts: A = {cal['A']['text']}; B = {cal['B']['text']}. Reference "
        f"`{data['reference']}`; {data['repeats']} subsample draws per count; perplexity "
        f"at budget {data['budget']} on {data['data']['perplexity']}.",
        "",
    ]
    rows = []
    for r in data["rows"]:
        rows.append(
            [r["samples_per_head"], _spread(r["cos_A_n_vs_A_ref"]), _f(r["cos_A_n_vs_A_ref"]["min"]),
             _spread(r["cos_A_n_vs_B_n"]), _f(r["cos_A_n_vs_B_n"]["min"]),
             f"{100 * r['ppl_change_A_r0']:+.2f}% / {100 * r['ppl_change_B_r0']:+.2f}%",
             f"{100 * r['ppl_change_A_r25']:+.2f}% / {100 * r['ppl_change_B_r25']:+.2f}%"]
        )  # fmt: skip
    lines += _table(
        ["samples/head", "cos(A_n, ref)", "min", "cos(A_n, B_n)", "min",
         "Δppl A / B, recent 0", "Δppl A / B, recent b/4"],
        rows,
    )  # fmt: skip
    ppl = data["ppl"]
    lines += [
        "",
        f"For scale: full cache {ppl['full']['full']:.3f}; key-SVD fallback "
        f"{ppl['r0']['fallback']:.3f} (recent 0) / {ppl['r25']['fallback']:.3f} (recent b/4); "
        f"reference {ppl['r0'][data['reference']]:.3f} / {ppl['r25'][data['reference']]:.3f}.",
    ]
    return lines + _plots(data)


def render_niah(data: dict[str, Any]) -> list[str]:
    lines = _header("6. Needle in a haystack, in prose", data)
    d = data["data"]
    lengths, depths, ratios = data["lengths"], data["depths"], data["ratios"]
    lines += [
        "",
        f'Haystack: {d["haystack"]}; needle: "{d["needle"]}", asked at the end; '
        f"{d['scoring']}. {d['docs_per_cell']} document(s) per depth x length "
        f"({', '.join(map(str, lengths))} tokens; depths {', '.join(f'{x:.0%}' for x in depths)}); "
        f"{data['budget_rule']}. Exact match, mean over the grid:",
        "",
    ]
    rows = []
    for name in arm_order(data["grid"]):
        by_ratio = data["grid"].get(name)
        if not by_ratio:
            continue
        row = [arm_label(name)]
        for key in ["-", *map(str, ratios)]:
            vals = [v for line in by_ratio.get(key) or [] for v in line if v is not None]
            row.append(_f(sum(vals) / len(vals), 2) if vals else "")
        rows.append(row)
    lines += _table(["arm", "no eviction", *[f"{r}×" for r in ratios]], rows)
    return lines + _plots(data)


def render_selfcal_text(data: dict[str, Any]) -> list[str]:
    from bench.quality.selfcal_text import cell_texts

    lines = _header("7. Whose queries calibrate a prompt's filters?", data)
    d, ratios = data["data"], data["ratios"]
    lines += [
        "",
        f"The self-calibration recipe fed different queries, on {d['documents']} "
        f"({', '.join(map(str, data['lengths']))} tokens): `own` is the document's own prompt "
        f"(the server's `self` caches, fed the prompt as one block), `other` {d['other_text']}, `calibrated` the registry's "
        f"artifact; {data['budget_rule']} (streaming: none). Each cell: accuracy ({d['scoring']}) "
        f"/ {d['needle_rows_kept']}.",
    ]
    for filler, res in data["results"].items():
        cos = res["cosine_to_calibrated"]
        full = res["arms"]["full"]["-"]["accuracy"]
        lines += [
            "",
            f"**{filler} filler** (full cache {full:.2f}; mean cosine to the calibrated filters: "
            f"own {cos['own']:.3f}, other {cos['other']:.3f}):",
            "",
        ]
        rows = [[name, *cell_texts(cells, ratios)] for name, cells in res["arms"].items()
                if name != "full"]  # fmt: skip
        lines += _table(["filters", *[f"{r}×" for r in ratios]], rows)
    return lines + _plots(data)


def render_traffic(data: dict[str, Any]) -> list[str]:
    lines = _header("9. Q-Filters learned from traffic", data)
    d = data["data"]
    lines += [
        "",
        "The server's own pooling (`engine.traffic`) fed held-out traffic in "
        f"{d['prefill_chunk']}-token prefill chunks until it wrote its artifact; the learned "
        "filters against the registry's calibrated ones (cosine per layer and KV head). "
        f"`chat`: {d['chat']}; `passkey`: {d['passkey']}.",
        "",
    ]
    rows = [[kind, r["prompts"], r["tokens"], r["seconds"], _f(r["cosine_mean"]),
             _f(r["cosine_min"]), _pct(r["same_sign_share"]), r["artifact"]]
            for kind, r in data["results"].items()]  # fmt: skip
    lines += _table(
        ["traffic", "prompts", "tokens", "s", "mean cosine", "min cosine", "same sign",
         "artifact"],
        rows,
    )  # fmt: skip
    return lines + _plots(data)


def render_multiturn_recall(data: dict[str, Any]) -> list[str]:
    lines = _header("8. A pass key from turn 1, asked turns later", data)
    st, ask = data["settings"], data["settings"]["ask"]
    lines += [
        "",
        f"{st['conversations']} conversation(s) of {st['turns']} turns ({st['turn_tokens']} prose "
        f"tokens each, greedy answers of up to {st['max_tokens']} tokens); the key asked at turns "
        f"{', '.join(map(str, ask))}; recent {st['recent']}. Reuse: one set of caches for the "
        f"whole chat; fresh: {st['fresh']}. Each cell: accuracy / the key's mean NLL as the "
        "answer (nats per token, teacher-forced).",
        "",
    ]
    rows = [[name, *[f"{data['accuracy'][name][str(k)]:.2f} / {data['key_nll'][name][str(k)]:.2f}"
                     for k in ask], data["reuse_hits"][name], data["reuse_misses"][name]]
            for name in data["accuracy"]]  # fmt: skip
    lines += _table(["arm", *[f"turn {k}" for k in ask], "turns reused", "misses"], rows)
    return lines + _plots(data)


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "geometry": render_geometry,
    "attention": render_attention,
    "perplexity": render_perplexity,
    "retrieval": render_retrieval,
    "stability": render_stability,
    "niah": render_niah,
    "selfcal_text": render_selfcal_text,
    "traffic": render_traffic,
    "multiturn_recall": render_multiturn_recall,
}
# Studies run into a subfolder of their own (bench/run_all.sh): not listed as missing.
SUBFOLDER_STUDIES = ("selfcal_text", "traffic")


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
                f"{k} {v['mean_rho']:+.2f} ({_pct(v['share_heads_positive'])})"
                for k, v in r.items()
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
                        f" (gap closed {_pct(arms[n]['gap_closed_vs_streaming'])})"
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
        for name in names[1:] if names[:1] == ["full"] else names:
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
