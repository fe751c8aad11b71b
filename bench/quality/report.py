"""Markdown for the ``## Quality`` part of ``bench/RESULTS.md``: one renderer per study,
``RENDERERS[<json name>](data) -> markdown lines`` (the section's opening lines are
:mod:`bench.quality.headlines`). Reads only the JSON the studies wrote; imports neither MLX
nor the studies. :mod:`bench.report` assembles the page.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.quality.markdown import arm_label, arm_order, fmt, pct, table


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
        *table(
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
            "On the calibration queries themselves (`qfserve.calibrations.compute`'s per-layer summary):",
            "",
            *table(
                [
                    "layer",
                    "heads positive on their KV filter",
                    "top energy (mean)",
                    "drift ratio (median)",
                ],
                [
                    [
                        a["layer"],
                        pct(a["positive_share"]),
                        fmt(a["top_energy"]),
                        fmt(a["drift_ratio"], 1),
                    ]
                    for a in anisotropy
                ],
            ),  # fmt: skip
        ]
    return lines + _plots(data)


def _spread(s: dict[str, Any], digits: int = 3) -> str:
    return f"{fmt(s.get('median'), digits)} [{fmt(s.get('q1'), digits)}–{fmt(s.get('q3'), digits)}]"


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
        rows = [[scorer, *(f"{fmt(res[k][scorer]['mean_rho'], 2)} "
                           f"({pct(res[k][scorer]['share_heads_positive'])})" for k in keys)]
                for scorer in res["all"]]  # fmt: skip
        lines += ["Mean ρ over KV heads (share of heads with ρ > 0), by sequence length:", ""]
        lines += table(["scorer", *[f"{n} tokens" for n in lengths], "all sequences pooled"], rows)
        lines += ["", "By data and length:", ""]
    rows = []
    for dataset, res in data["results"].items():
        for scorer, r in res.items():
            rows.append(
                [dataset, scorer, fmt(r["mean_rho"]), pct(r["share_heads_positive"]),
                 _spread(r["per_head_spread"])]
            )  # fmt: skip
    lines += table(["data", "scorer", "mean ρ", "heads ρ > 0", "per-head [q1–q3]"], rows)
    res = data["results"].get("all")
    if res:
        scorers = list(res)
        n_layers = len(res[scorers[0]]["per_head"])
        lines += ["", "Per layer (all data; each cell: ρ of KV head 0 / 1 / ...):", ""]
        lines += table(
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
                    [budget, arm_label(name), fmt(r["ppl"]), _spread(r["ratio_to_full"]),
                     pct(r["gap_closed_vs_streaming"]), r["max_rows_any_step"]]
                )  # fmt: skip
        lines += table(
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
            row = [arm_label(name), fmt(cells["-"]["accuracy"], 2) if "-" in cells else ""]
            row += [fmt(cells[str(r)]["accuracy"], 2) if str(r) in cells else "" for r in ratios]
            rows.append(row)
        lines += table(["arm", "no eviction", *[f"{r}×" for r in ratios]], rows)
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
                row.append(fmt(sum(vals) / len(vals)) if vals else "")
            rows.append(row)
        lines += [
            "",
            "Answer NLL (nats per answer token, teacher-forced through each arm's cache; lower "
            "is better; mean over documents and lengths) — graded where accuracy is at the "
            "floor:",
            "",
        ]
        lines += table(["arm", "no eviction", *[f"{r}×" for r in ratios]], rows)
    bins = data["data"]["depth_bins"]
    rows = []
    for name in names:
        cells = [c for res in data["results"].values() for c in res["arms"].get(name, {}).values()]
        if not cells:
            continue
        row = [arm_label(name)]
        for b in bins:
            vals = [c["by_depth"][b] for c in cells if c["by_depth"].get(b) is not None]
            row.append(fmt(sum(vals) / len(vals), 2) if vals else "")
        rows.append(row)
    lines += ["", "By needle depth (mean over lengths and compressions):", ""]
    lines += table(["arm", *[f"needle in {b}" for b in bins]], rows)
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
            [r["samples_per_head"], _spread(r["cos_A_n_vs_A_ref"]), fmt(r["cos_A_n_vs_A_ref"]["min"]),
             _spread(r["cos_A_n_vs_B_n"]), fmt(r["cos_A_n_vs_B_n"]["min"]),
             f"{100 * r['ppl_change_A_r0']:+.2f}% / {100 * r['ppl_change_B_r0']:+.2f}%",
             f"{100 * r['ppl_change_A_r25']:+.2f}% / {100 * r['ppl_change_B_r25']:+.2f}%"]
        )  # fmt: skip
    lines += table(
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
            row.append(fmt(sum(vals) / len(vals), 2) if vals else "")
        rows.append(row)
    lines += table(["arm", "no eviction", *[f"{r}×" for r in ratios]], rows)
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
        lines += table(["filters", *[f"{r}×" for r in ratios]], rows)
    return lines + _plots(data)


def render_traffic(data: dict[str, Any]) -> list[str]:
    lines = _header("9. Q-Filters learned from traffic", data)
    d = data["data"]
    lines += [
        "",
        "The server's own pooling (`qfserve.engine.filters.traffic`) fed held-out traffic in "
        f"{d['prefill_chunk']}-token prefill chunks until it wrote its artifact; the learned "
        "filters against the registry's calibrated ones (cosine per layer and KV head). "
        f"`chat`: {d['chat']}; `passkey`: {d['passkey']}.",
        "",
    ]
    rows = [[kind, r["prompts"], r["tokens"], r["seconds"], fmt(r["cosine_mean"]),
             fmt(r["cosine_min"]), pct(r["same_sign_share"]), r["artifact"]]
            for kind, r in data["results"].items()]  # fmt: skip
    lines += table(
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
    lines += table(["arm", *[f"turn {k}" for k in ask], "turns reused", "misses"], rows)
    return lines + _plots(data)


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "geometry": render_geometry,
    "attention": render_attention,
    "perplexity": render_perplexity,
    "retrieval": render_retrieval,
    "stability": render_stability,
    "niah": render_niah,
    "selfcal_text": render_selfcal_text,
    "multiturn_recall": render_multiturn_recall,
    "traffic": render_traffic,
}
# Studies run into a subfolder of their own (bench/run_all.sh): not listed as missing.
SUBFOLDER_STUDIES = ("selfcal_text", "traffic")
