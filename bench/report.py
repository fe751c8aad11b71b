"""Render ``bench/results/<model>/*.json`` into ``bench/RESULTS.md`` and the README's headline
table (``python -m bench.report``): the goals, then per folder of :data:`MODELS` a quality and
a speed section, each its headlines and then every registered study's ``render``."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from bench.cli import RESULTS_DIR, MiB
from bench.goals import by_arm, grid_mean, has_results, load, medians, render_goals
from bench.studies import STUDIES, owner

PAGE = Path(__file__).resolve().parent / "RESULTS.md"
README = PAGE.parents[1] / "README.md"

SMOL = "SmolLM2-135M-Instruct"
# Results folders under bench/results and their section titles; the first lists the studies
# that have not run.
MODELS = {
    "smollm2": f"{SMOL} (the default model)",
    "gemma-3-270m": "Gemma 3 270M (Q4_K_M; five sliding-window layers of every six)",
    "gemma-3-270m/kvzap": "Gemma 3 270M: KVzap with its shipped surrogates (rows shared across the 3 global layers) beside Q-Filters and KVzip at 4x",
    "gemma-3-270m/32k": "Gemma 3 270M at 32,768 tokens (its context): KV bytes kept at 4x and 8x on the global layers, sliding windows counted",
    "smollm2/kvzip": f"{SMOL}: KVzip (context reconstruction) per head, across a layer's heads and with rows shared across layers, beside Q-Filters, K-norm, SnapKV and streaming (kvzip_reuse and kvzip_parity: bench/README.md)",
    "smollm2/kvzap": f"{SMOL}: KVzap (each row scored by the model's learned surrogate) beside KVzip with rows shared across layers and calibrated Q-Filters, 1k-4k tokens",
    "smollm2/kvzap/perplexity": f"{SMOL}: a long generation at budget 256 (1,024 tokens scored after 1,024, one token a step) with KVzap's learned scores beside calibrated Q-Filters and streaming",
    "smollm2/kvzip/passkey": f"{SMOL}: the pass key at 1k-4k tokens with KVzip per head and across a layer's heads, beside Q-Filters, K-norm, SnapKV and streaming (6 documents a length)",
    "smollm2/kvzip/perplexity": f"{SMOL}: perplexity of the second half after the first half is read as a prompt and compressed by kvzip across a layer's heads, beside Q-Filters, K-norm and streaming",
    "smollm2/batching_16": f"{SMOL}: continuous batching up to 16 streams (256-token prompts), after the packed batch's in-place joins and leaves, chunks of 8 by default",
    "smollm2/niah_served": f"{SMOL}: the needle through the server with default settings",
    "smollm2/avx2": f"{SMOL} on a CPU with AVX2 and no AVX-512 (AMD Zen 3, 2 cores; the sections above ran on AVX-512), after the native kernels took the CPU's own vector width and AVX2 got the integer products",
    "qfserve-tiny": "qfserve-tiny (the bundled 6-layer test model: what CI's smoke runs use; kept where it still says something)",
}


# -- markdown building blocks -------------------------------------------------------------

ARM_ORDER = (
    *(f"qfilters/r{r}" for r in (0, 25)),
    *(f"{m}/r{r}" for m in ("fallback", "fallback-", "knorm") for r in (0, 25)),
    "streaming/r0",
)
ARM_NAMES = {"full": "full cache", "streaming/r0": "streaming (sinks + latest)"}

METHOD_NAMES = {  # the other arms' methods (the first part of bench.arms.Arm.name)
    "qfilters": "Q-Filters calibrated",
    "snapkv": "SnapKV",
    "tova": "TOVA",
    "kvzap": "KVzap (learned surrogate)",
    "fallback": "key-SVD fallback",
    "fallback-": "key-SVD fallback sign-flipped (ablation)",
    "knorm": "K-norm",
    "streaming": "streaming (sinks + latest)",
}


def arm_label(name: str) -> str:
    """A row label for any arm name ``method/rNN[/ada][/global]``."""
    if name in ARM_NAMES:
        return ARM_NAMES[name]
    method, _, rest = name.partition("/")
    label = METHOD_NAMES.get(method, method)
    for part in rest.split("/") if rest else []:
        kind, n = part[:1], part[1:]
        if kind == "r" and n.isdigit():
            label += ", recent " + {25: "b/4", 0: "0"}.get(int(n), f"{int(n)}% of b")
        elif part == "ada":
            label += ", adaptive budgets"
        else:
            label += f", {part}"
    return label


def arm_order(present: Any) -> list[str]:
    """``present`` arm names in reading order: full, the standard arms, the rest as they came."""
    present = list(dict.fromkeys(present))
    known = [n for n in ("full", *ARM_ORDER) if n in present]
    return known + [n for n in present if n not in known]


def fmt(x: Any, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def pct(x: Any) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def ratio_table(first: str, ratios: list[int], rows: dict[str, Any], cell: Any) -> list[str]:
    """A table with a row per entry of ``rows`` and a column per ratio: ``cell(value, ratio)``."""
    return table(
        [first, *[f"{r}×" for r in ratios]],
        [[name, *(cell(by, r) for r in ratios)] for name, by in rows.items()],
    )


def accuracy_table(ratios: list[int], rows: dict[str, Any]) -> list[str]:
    """:func:`ratio_table` of accuracies by ratio, an arm without eviction (``-``) in every
    column."""
    return ratio_table("arm", ratios, rows, lambda by, r: fmt(by.get(str(r), by.get("-")), 2))


def section(title: str, data: dict[str, Any], *blocks: str | list[str]) -> list[str]:
    """A study's section of the page: its heading (the run, then a quality study's model and
    filters or a speed study's machine), ``blocks`` (a line or a list of lines each) a blank
    line apart, then its plots (a speed study's followed by a blank line)."""
    quality = owner(data["benchmark"]).section == "quality"
    run = f"`{data['command']}` — {data['when']}, {data.get('runtime_s', '?')} s"
    if quality:
        model, cal = data["model"], data.get("calibration") or {}
        run += (
            f". Model `{model['path']}` at **{model['checkpoint']}** (weights sha1 "
            f"`{model['weights_sha1']}`)."
        )
        if cal.get("source"):
            run += (
                f" Filters: {cal['source']} calibration, {cal.get('samples_per_head')} samples "
                f"per head on {cal.get('text')}; disjoint from the evaluation text: "
                f"{cal.get('disjoint_from_eval')}."
            )
        if zap := cal.get("kvzap"):
            run += (
                f" KVzap surrogates: {zap['source']} ({zap['form']}, held-out Spearman "
                f"{fmt(zap.get('spearman_median'), 2)}); disjoint from the evaluation text: "
                f"{zap.get('disjoint_from_eval')}."
            )
        notes = []
        quick = "**Quick (smoke-test) run: sizes too small to read anything into.**"
    else:
        m = data["machine"]
        run += (
            f"; {m['processor']}, {m.get('cpu_count', '?')} cores, {m['device']}, MLX "
            f"{m['mlx']}, load average {m.get('load_average', '?')}. {m['blas']}."
        )
        notes = [f"*Machine note: {m['notes']}.*"] if m.get("notes") else []
        quick = "*Quick (CI-sized) run: not a measurement.*"
    lines = [f"### {title}", "", run]
    for block in [*notes, *[quick] * bool(data.get("quick")), *blocks]:
        lines += ["", *([block] if isinstance(block, str) else block)]
    plots = ["", *[f"![{p}](results/{p})" for p in data.get("plots", [])]]
    if quality:
        return lines + plots
    return [*lines, *plots, ""] if "plots" in data else lines


def spread_cell(s: dict[str, Any], digits: int = 3) -> str:
    return f"{fmt(s.get('median'), digits)} [{fmt(s.get('q1'), digits)}–{fmt(s.get('q3'), digits)}]"


def ms(s: dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
    return f"{s['median'] * scale:.{digits}f} [{s['q1'] * scale:.{digits}f}–{s['q3'] * scale:.{digits}f}]"


def ratio_cell(row: dict[str, Any]) -> str:
    """A paired-ratio row as ``median [q1-q3]``."""
    return f"{row['median']:.3f} [{row['q1']:.2f}–{row['q3']:.2f}]"


# -- section headlines -------------------------------------------------------------------

QUALITY_HEADLINES = ("perplexity", "retrieval", "niah")
QUALITY_INTRO = (
    "Held-out data only: evaluation-split standard-library files and generated documents from the "
    "training package's evaluation seeds; calibration on training-split files. Budgets are matched "
    "in rows (sinks and recent rows included) and every arm is checked to keep exactly that many. "
    "Quality figures are deterministic for given data, so there is no timing noise to interleave "
    "against: all arms of a study see the same sequences in one run, and the spreads shown are "
    "over sequences, heads or calibration draws."
)
SPEED_INTRO = (
    "Speed studies (`python -m bench --list`). Each row compares arms run in the same process, "
    "interleaved, with an A/A row for the noise floor; ratios are medians of per-round ratios "
    "with their interquartile range."
)


def _pooled(results: dict[str, Any], arm: str, key: str) -> float | None:
    """The retrieval study's mean of ``key`` for ``arm`` over lengths and compressions."""
    vals = [c[key] for v in results.values() for c in v["arms"].get(arm, {}).values() if key in c]
    return sum(vals) / len(vals) if vals else None


def quality_headlines(results_dir: Path) -> list[str]:
    """The section's opening lines: model checkpoint(s) and the headline numbers."""
    data = {n: d for n in QUALITY_HEADLINES if (d := load(results_dir / f"{n}.json")) is not None}
    if not data:
        return []
    # Weights decide whether studies are comparable; an older file's checkpoint label may differ.
    models = {(d["model"]["path"], d["model"]["weights_sha1"]) for d in data.values()}
    lines = [QUALITY_INTRO, ""]
    if len(models) > 1:
        lines += [f"**Warning: the studies ran on different weights: {sorted(models)}.**", ""]
    else:
        ((path, sha),) = models
        # The newest study's label (older results files may lack the model's name).
        checkpoint = max(data.values(), key=lambda d: d.get("when", ""))["model"]["checkpoint"]
        lines += [
            f"All studies: `{path}` at **{checkpoint}**, weights sha1 `{sha}`. The numbers "
            "describe these weights only: after changing them, rerun the same commands.",
            "",
        ]
    lines += ["Headlines (all from the tables below):", ""]
    for dataset, d in data.get("perplexity", {}).get("results", {}).items():
        b = "128" if "128" in d["budgets"] else next(iter(d["budgets"]))
        arms = d["budgets"][b]
        gap = {n: f" (gap closed {pct(a['gap_closed_vs_streaming'])})" for n, a in arms.items()}
        gap["streaming/r0"] = ""
        cells = [f"{n} {arms[n]['ppl']:.2f}{gap[n]}" for n in arm_order(arms) if n != "full"]
        full = d["full"]["ppl"]
        lines.append(f"- Perplexity ({dataset}, budget {b}; full {full:.2f}): {', '.join(cells)}.")
    if "retrieval" in data:
        res = data["retrieval"]["results"]
        full = [v["arms"]["full"]["-"]["accuracy"] for v in res.values() if "full" in v["arms"]]
        names = arm_order(n for v in res.values() for n in v["arms"])
        acc = {
            n: a for n in names if n != "full" and (a := _pooled(res, n, "accuracy")) is not None
        }
        nll = {n: a for n in names if (a := _pooled(res, n, "answer_nll_mean")) is not None}
        lines.append(
            f"- Pass-key accuracy, mean over lengths and compressions (full cache "
            f"{sum(full) / max(1, len(full)):.2f}): "
            + ", ".join(f"{k} {v:.2f}" for k, v in acc.items())
            + "."
        )
        if nll:
            lines.append(
                "- Pass-key answer NLL (nats/token, mean over lengths and compressions; lower is "
                "better): " + ", ".join(f"{k} {v:.3f}" for k, v in nll.items()) + "."
            )
    return lines


def _worse(row: dict[str, Any], aa: dict[str, Any]) -> bool:
    return row["q1"] > max(aa["q3"], 1.0)


def _losses(label: str, ratios: list[dict[str, Any]]) -> list[str]:
    """The arms of ``ratios`` (the first: the A/A row) that are :func:`_worse` than it."""
    return [f"{label}, {x['arm']} {ratio_cell(x)}" for x in ratios[1:] if _worse(x, ratios[0])]


def where_eviction_loses(results: dict[str, dict[str, Any]]) -> list[str]:
    """Time ratios of an eviction arm that sit above the noise floor, study by study."""
    out = []
    if d := results.get("decode"):
        for r in d["sweep"]:
            out += _losses(f"decode at {r['context']}", r["ratios"])
        out += [
            f"equal-size decode at B={o['budget']} {ratio_cell(o['ratios'][1])}"
            for o in d["overhead"]
            if _worse(o["ratios"][1], o["ratios"][0])
        ]
        full = {m["context"]: m["decode_peak_bytes"] for m in d["memory"] if m["arm"] == "full"}
        out += [
            f"decode peak memory at {m['context']}, {m['arm']} "
            f"{m['decode_peak_bytes'] / MiB:.1f} vs full {full[m['context']] / MiB:.1f} MiB"
            for m in d["memory"]
            if m["arm"] != "full" and m["decode_peak_bytes"] > full[m["context"]]
        ]
    for r in results.get("ttft", {}).get("rows", []):
        out += _losses(f"TTFT at {r['prompt_tokens']}", r["ratios"])
    return out


def speed_headlines(results: dict[str, dict[str, Any]]) -> list[str]:
    """The ratios worth quoting, each beside its A/A noise floor (paired medians [IQR])."""
    out = []
    if d := results.get("decode"):
        inside = [r for r in d["sweep"] if not r["beyond_trained_context"]]
        top = max(inside, key=lambda r: r["context"])
        ratios, budgets = by_arm(top["ratios"]), d["settings"]["budgets"]
        parts = ", ".join(f"budget {b}: {ratio_cell(ratios[f'b{b}'])}" for b in budgets)
        out.append(
            f"- Decode step at the trained maximum context ({top['context']}), "
            f"eviction / full: {parts}; A/A {ratio_cell(ratios['full_b'])}."
        )
        out += [
            f"- Eviction overhead at equal size B={o['budget']} (ours / `KVCache`): "
            f"{ratio_cell(o['ratios'][1])}; A/A {ratio_cell(o['ratios'][0])}."
            for o in d["overhead"]
        ]
        full = max((m for m in d["memory"] if m["arm"] == "full"), key=lambda m: m["context"])
        kept = [m for m in d["memory"] if m["context"] == full["context"] and m["arm"] != "full"]
        kb = full["kept_bytes"]
        cuts = ", ".join(
            f"{m['arm']} {m['kept_bytes'] / MiB:.2f} MiB ({kb / m['kept_bytes']:.0f}x less)"
            for m in by_arm(kept).values()
        )
        out.append(f"- Kept KV at context {full['context']}: full {kb / MiB:.2f} MiB; {cuts}.")
    for r in results.get("ttft", {}).get("rows", []):
        parts = ", ".join(f"{x['arm']}: {ratio_cell(x)}" for x in r["ratios"][1:])
        out.append(
            f"- TTFT at {r['prompt_tokens']} prompt tokens"
            + (" (beyond trained context)" if r["beyond_trained_context"] else "")
            + f", eviction / full: {parts}; A/A {ratio_cell(r['ratios'][0])}."
        )
    if losses := where_eviction_loses(results):
        out.append(
            "- Where eviction loses (its ratio's lower quartile above both 1 and the A/A upper "
            "quartile): " + "; ".join(losses) + "."
        )
    head = (
        "**Headline ratios measured** (below 1 is faster for time ratios, above 1 is faster "
        "for tok/s ratios):"
    )
    return [head, "", *out, ""] if out else []


# -- the page ----------------------------------------------------------------------------


def render_study(file: str, data: dict[str, Any]) -> list[str]:
    """The section of the page for ``<file>.json``, by its mode's ``render`` (none: no lines)."""
    render = getattr(owner(file).module(file), "render", None)
    return [] if render is None else render(data)


def render_section(folder: Path, section: str, title: str, *, missing: bool) -> list[str]:
    """A model's ``quality`` or ``speed`` section: headlines, then every registered study of
    it in the registry's order (``missing``: a line for each that has not run here)."""
    studies = [s for s in STUDIES.values() if s.section == section]
    files = [(s, f) for s in studies for f in s.files]
    results = {f: d for _, f in files if (d := load(folder / f"{f}.json")) is not None}
    if section == "quality" and (results or missing):
        lines = [f"## {title}", "", *quality_headlines(folder), ""]
    elif section != "quality" and (results or missing):
        lines = [f"## {title}", "", SPEED_INTRO, "", *speed_headlines(results)]
    else:
        return []
    for s, f in files:
        if f in results:
            lines += render_study(f, results[f]) + [""] * (section == "quality")
        elif missing and not s.elsewhere(f) and hasattr(s.module(f), "render"):
            command = " ".join(["python -m bench", s.name, *s.mode(f)])
            lines += [f"*{f}: no results yet (`{command}`).*", ""]
    return lines


def render_model(folder: Path, title: str, *, missing: bool) -> list[str]:
    """A results folder's quality and speed sections, plots linked into the folder."""
    if not has_results(folder):
        return []
    lines = render_section(folder, "quality", f"{title}: quality", missing=missing)
    lines += render_section(folder, "speed", f"{title}: speed and memory", missing=missing)
    relative = folder.relative_to(PAGE.parent) if folder.is_relative_to(PAGE.parent) else folder
    # Renderers link plots as results/<file>; point them at this folder.
    return [line.replace("](results/", f"]({relative}/") for line in lines]


def render(results_dir: Path = RESULTS_DIR) -> str:
    """The whole of ``bench/RESULTS.md``."""
    lines = [
        "# qfserve benchmark results",
        "",
        f"Rendered by `python -m bench.report` on {time.strftime('%Y-%m-%d')} from "
        "`bench/results/<model>/*.json`; each section names the command and date of its run. "
        "Settled studies, kept as text: [ARCHIVE.md](ARCHIVE.md).",
        "",
        *render_goals(results_dir / next(iter(MODELS))),
    ]
    for i, (folder, title) in enumerate(MODELS.items()):
        lines += render_model(results_dir / folder, title, missing=i == 0)
    return "\n".join(lines).rstrip() + "\n"


# -- the README's headline table ------------------------------------------------------------

BEGIN, END = "<!-- bench.report: headline results -->", "<!-- end of bench.report's table -->"


def _slashed(values: list[float | None]) -> str:
    return " / ".join("–" if v is None else f"{v:.2f}" for v in values)


def _times(ratios: list[int]) -> str:
    return " / ".join(f"{r}x" for r in ratios)


def _span(lengths: list[int]) -> str:
    return f"{lengths[0] // 1024}k-{lengths[-1] // 1024}k tokens"


def readme_headlines(results_dir: Path = RESULTS_DIR) -> list[str]:
    """The README's results table: KVzip on the needle in prose, against kvpress and its price;
    then what a user who changes nothing gets: the needle through the server with default
    settings, the speed against llama.cpp's server, and the OpenBLAS the install brings."""
    folder, rows = results_dir / "smollm2", []
    if niah := load(folder / "kvzip" / "niah.json"):
        ratios, lengths = niah["ratios"], niah["lengths"]
        docs = len(lengths) * len(niah["depths"]) * niah["data"]["docs_per_cell"]
        kvzip, qf = (
            _slashed([grid_mean(niah, a, str(r)) for r in ratios])
            for a in ("kvzip/r25/global", "qfilters/r25")
        )
        what = f"needle in prose, {_span(lengths)} ({docs} documents), at {_times(ratios)}"
        result = (
            f"KVzip (`kv_method: kvzip`) {kvzip} against the full cache's "
            f"{grid_mean(niah, 'full', '-'):.2f}; calibrated Q-Filters {qf}"
        )
        rows.append([what, result])
    if parity := load(folder / "kvzip" / "kvzip_parity.json"):
        acc, ratios = parity["accuracy"], parity["ratios"]
        ours, theirs = (
            _slashed([acc[a][str(r)] for r in ratios]) for a in ("ours/global", "kvpress/global")
        )
        docs = parity["data"]["documents"]
        what = (
            f"KVzip against NVIDIA kvpress's `KVzipPress`, {docs} chat documents, {_times(ratios)}"
        )
        rows.append([what, f"ours {ours}, kvpress {theirs}"])
    if cost := load(folder / "kvzip" / "kvzip_cost.json"):
        pre = medians(cost["prefill_ratios"])
        step = by_arm(cost["decode_ratios"])["kvzip"]
        step_text = "unchanged" if step["q1"] <= 1 <= step["q3"] else f"{step['median']:.2f}x"
        result = (
            f"prefill plus the reconstruction pass {pre['kvzip']:.2f}x a plain prefill at "
            f"{cost['settings']['prompt_tokens'] // 1024}k tokens (goal 2.5x, "
            f"{'met' if pre['kvzip'] <= 2.5 else 'not met'})"
        )
        if (floor := pre.get("floor")) is not None:
            result += (
                f", where reading the pass's tokens on as a plain prompt, the least an exact "
                f"pass costs, takes {floor:.2f}x"
            )
        result += f"; decode step {step_text}"
        if (mlx := pre.get("full_mlx")) is not None:
            result += (
                f"; both on the blocked CPU attention, which makes the plain prefill {mlx:.2f}x "
                "faster than MLX's own"
            )
        rows.append(["KVzip's price", result])
    if served := load(folder / "niah_served" / "niah_served.json"):
        acc, lengths = served["accuracy"], served["lengths"]
        auto, full, small = (
            _slashed([acc[a].get(str(n), {}).get("accuracy") for n in lengths])
            for a in ("auto", "full", "auto-small")
        )
        what = (
            f"needle through the server with default settings, {_span(lengths)} "
            f"({served['docs']} documents each)"
        )
        result = (
            f"`--budget auto` {auto} against the full cache's {full}; on a `--max-kv-bytes` of "
            f"{served['small_tokens']:,} tokens {small}"
        )
        if "kvzip-small" in acc:
            squeezed = _slashed(
                [acc["kvzip-small"].get(str(n), {}).get("accuracy") for n in lengths]
            )
            result += (
                f", and {squeezed} with `kv_method: kvzip` at {served['small_kvzip_budget']} rows "
                "there, compressed as the prompt is read"
            )
        rows.append([what, result])
    for sub, label in (("", "the same GGUF"), ("q4_k_m", "the same model as Q4_K_M")):
        if llama := load(folder / sub / "vs_llama_cpp.json"):
            rows.append(_against_llama(llama, label))
    if memory := load(folder / "memory.json"):
        cells = [
            f"{r['file'].removesuffix('.gguf')} {r['ours_rss'] / MiB:,.0f} MiB against "
            f"{r['theirs_rss'] / MiB:,.0f} ({r['ratio']:.2f}x)"
            for r in memory["rows"]
            if r["when"] == 2048
        ]
        what = "resident memory after a 2k-token request, against `llama-server -c 8192 -np 1`"
        rows.append([what, "; ".join(cells)])
    if blas := load(folder / "blas" / "blas.json"):
        (pa, pb), (da, db) = (
            [by_arm(blas[k])[a]["median"] for a in ("pip_a", "pip_b")]
            for k in ("prefill_ratios", "decode_ratios")
        )
        what = "OpenBLAS from PyPI against the system's (prefill / decode throughput)"
        rows.append([what, f"{pa:.2f}x / {da:.2f}x (A/A {pb:.2f}x / {db:.2f}x)"])
    return table(["what", "result"], rows) if rows else []


def _against_llama(llama: dict[str, Any], label: str) -> list[str]:
    """A headline row of a ``vs --against llama-cpp`` run: TTFT and decode ratios per prompt length."""
    rows_by = sorted(llama["rows"], key=lambda r: r["prompt_tokens"])
    arms = ("ours_full", "ours_qfilters")
    ttft, tps = (
        {arm: _slashed([medians(r[key])[arm] for r in rows_by]) for arm in arms}
        for key in ("ttft_ratios", "tps_ratios")
    )
    sizes = " / ".join(f"{r['prompt_tokens']:,}" for r in rows_by)
    what = f"against llama.cpp's server on {label}, prompts of {sizes} tokens"
    result = (
        f"first token {ttft['ours_qfilters']}x llama.cpp's time with Q-Filters 512, "
        f"{ttft['ours_full']}x with the full cache; decode tokens/s {tps['ours_qfilters']}x "
        f"with Q-Filters 512, {tps['ours_full']}x with the full cache"
    )
    return [what, result]


def write_readme(readme: Path = README, results_dir: Path = RESULTS_DIR) -> bool:
    """Put :func:`readme_headlines` between the README's :data:`BEGIN` and :data:`END`;
    returns whether it has them."""
    text = readme.read_text()
    found = re.search(f"{re.escape(BEGIN)}\n.*?{re.escape(END)}", text, flags=re.S)
    if found:
        block = "\n".join([BEGIN, *readme_headlines(results_dir), END])
        readme.write_text(text[: found.start()] + block + text[found.end() :])
    return bool(found)


def main() -> None:
    PAGE.write_text(render())
    print(f"wrote {PAGE}")
    if write_readme():
        print(f"wrote the headline table of {README}")


if __name__ == "__main__":
    main()
