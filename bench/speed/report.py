"""Markdown for the ``## Speed and memory`` part of ``bench/RESULTS.md``, one renderer per
study, read from ``bench/results/<study>.json``. :mod:`bench.report` assembles the page."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.speed.markdown import MiB, _header, _ms, _plots, _r, _table
from bench.speed.serving_report import (
    batch_step,
    batching,
    multiturn,
    refine_step,
    selfcal_prefill,
)


def decode(d: dict[str, Any]) -> list[str]:
    budgets = d["settings"]["budgets"]
    lines = _header("6. Decode step time, eviction overhead and memory against context", d)
    lines.append(
        f"ms per decode step, median [IQR] over {d['settings']['reps']} interleaved repetitions "
        f"of {d['settings']['steps']} steps; ratios are medians of paired per-round ratios to "
        "the first full arm (A/A = the second full arm: the noise floor). Q-Filters, "
        f"n_sink 4, recent 0, filters: {d['model']['filter_source']}. Contexts run one after "
        "another, so absolute ms across rows also track the machine's load at the time; "
        "compare within a row."
    )
    lines.append("")
    rows = []
    for r in d["sweep"]:
        ms, rr = r["ms_per_step"], {x["arm"]: x for x in r["ratios"]}
        label = str(r["context"]) + (
            " (beyond trained context)" if r["beyond_trained_context"] else ""
        )
        rows.append(
            [label, _ms(ms["full_a"]), _r(rr["full_b"])]
            + [
                f"{ms[f'b{b}']['median']:.2f} ({_r(rr[f'b{b}'])})"
                + ("" if r["evicting"][f"b{b}"] else " no eviction yet")
                for b in budgets
            ]
        )
    lines += _table(
        ["context", "full ms", "A/A", *(f"budget {b}: ms (ratio to full)" for b in budgets)], rows
    )
    lines += [
        "",
        "Eviction overhead at equal size: our cache at budget B holding B rows (one "
        "evicted per step) against mlx-lm's `KVCache` holding B rows.",
        "",
    ]
    lines += _table(
        ["B", "KVCache ms", "ours ms", "A/A", "ours / KVCache"],
        [
            [
                o["budget"],
                _ms(o["ms_per_step"]["kvcache_a"]),
                _ms(o["ms_per_step"]["ours"]),
                _r(o["ratios"][0]),
                _r(o["ratios"][1]),
            ]
            for o in d["overhead"]
        ],
    )
    lines += [
        "",
        "Memory, MiB: kept KV (keys + values, all layers), what the cache arrays hold "
        "(mlx-lm's `KVCache` preallocates in steps of 256; ours also holds scores), "
        "MLX's peak above what was live before the arm during prefill (512-token chunks) and "
        "during decode, and how much the process's RSS grew for the arm (an upper bound: the "
        "allocator may keep freed pages)."
        + (
            f" KV bytes per token of this model (full cache): {d['kv_bytes_per_token']:,.0f}."
            if "kv_bytes_per_token" in d
            else ""
        ),
        "",
    ]
    rss = all("rss_growth_bytes" in m for m in d["memory"])
    lines += _table(
        ["context", "arm", "kept KV", "cache arrays", "prefill peak", "decode peak"]
        + (["RSS growth"] if rss else []),
        [
            [
                m["context"],
                m["arm"],
                f"{m['kept_bytes'] / MiB:.2f}",
                f"{m['cache_nbytes'] / MiB:.2f}",
                f"{m['prefill_peak_bytes'] / MiB:.1f}",
                f"{m['decode_peak_bytes'] / MiB:.2f}",
            ]
            + ([f"{m['rss_growth_bytes'] / MiB:.1f}"] if rss else [])
            for m in d["memory"]
        ],
    )
    return lines + _plots(d)


def ttft(d: dict[str, Any]) -> list[str]:
    budgets = d["settings"]["budgets"]
    lines = _header("7. Time to first token, eviction vs full", d)
    lines.append(
        f"Timed: {d['settings']['timed']} (prefill step {d['settings']['prefill_step_size']}). "
        f"ms, median [IQR] over {d['settings']['reps']} interleaved repetitions; ratios to full."
    )
    lines.append("")
    rows = []
    for r in d["rows"]:
        t, rr = r["ttft_s"], {x["arm"]: x for x in r["ratios"]}
        label = str(r["prompt_tokens"]) + (
            " (beyond trained context)" if r["beyond_trained_context"] else ""
        )
        by = r.get("measured_by", {"command": d["command"], "when": d["when"][:10]})
        rows.append(
            [label, _ms(t["full_a"], 1e3, 1), _r(rr["full_b"])]
            + [f"{t[f'b{b}']['median'] * 1e3:.1f} ({_r(rr[f'b{b}'])})" for b in budgets]
            + [f"`{by['command']}`, {by['when']}"]
        )
    lines += _table(
        ["prompt tokens", "full ms", "A/A", *(f"budget {b}: ms (ratio)" for b in budgets),
         "measured by"],
        rows,
    )  # fmt: skip
    return lines + _plots(d)


def server_overhead(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    lines = _header("8. Server overhead: streamed HTTP vs the worker vs in-process", d)
    lines.append(
        f"{s['max_tokens']} tokens generated (EOS banned), Q-Filters budget {s['budget']}, "
        f"greedy; {s['reps']} interleaved rounds. `in_process`: encode + `make_caches` + "
        "`stream_generate` in the bench process; `worker`: the engine's `Worker` (queue, model "
        "thread, event loop) in process; `http`: `qfserve` over loopback. TTFT = first non-empty "
        "text; ITL = (end − first) / (tokens − 1)."
    )
    lines.append("")
    for r in d["rows"]:
        lines += [f"Prompt {r['prompt_tokens']} tokens:", ""]
        lines += _table(
            ["arm", "TTFT ms", "ITL ms"],
            [[k, _ms(r["ttft_s"][k], 1e3, 1), _ms(r["itl_s"][k], 1e3, 2)] for k in r["ttft_s"]],
        )
        lines.append("")
        lines += _table(
            ["ratio", "TTFT", "ITL"],
            [
                [f"{t['arm']} / {t['reference']}", _r(t), _r(i)]
                for t, i in zip(r["ttft_ratios"], r["itl_ratios"], strict=True)
            ],
        )
        lines.append("")
    return lines + _plots(d)


def vs_mlx_lm(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    lines = _header("9. Against mlx-lm's own server", d)
    lines.append(
        f"Same model folder and prompts, streamed `/v1/chat/completions`, greedy, "
        f"{s['max_tokens']} tokens (EOS banned), {s['reps']} interleaved rounds; theirs: {s['theirs']}; "
        f"ours with Q-Filters at budget {s['budget']}. Ratios to `theirs_a` (`theirs_b` = A/A)."
    )
    lines.append("")
    rows = []
    for r in d["rows"]:
        tr = {x["arm"]: x for x in r["ttft_ratios"]}
        sr = {x["arm"]: x for x in r["tps_ratios"]}
        for a in r["ttft_s"]:
            rows.append(
                [
                    r["prompt_tokens"],
                    a,
                    _ms(r["ttft_s"][a], 1e3, 1),
                    _ms(r["decode_tps"][a], 1.0, 0),
                    "—" if a == "theirs_a" else _r(tr[a]),
                    "—" if a == "theirs_a" else _r(sr[a]),
                ]
            )
    lines += _table(["prompt", "arm", "TTFT ms", "decode tok/s", "TTFT ratio", "tok/s ratio"], rows)
    return lines + _plots(d)


def bandwidth(d: dict[str, Any]) -> list[str]:
    b = d["bandwidth"]
    lines = _header("10. The physical limit: memory bandwidth vs bytes read per token", d)
    lines.append(
        f"Bandwidth ({b['method']}, {b['buffer_mib']} MiB buffers): copy "
        f"{_ms(b['copy_gbps'], 1.0, 1)} GB/s, read {_ms(b['read_gbps'], 1.0, 1)} GB/s; "
        f"reference {b['reference_gbps']:.1f} GB/s. Decode at context {d['settings']['context']}."
    )
    lines.append("")
    ratios = {r["arm"]: r for r in d["ratios"]}
    lines += _table(
        [
            "arm",
            "ms/step",
            "ratio to full",
            "MiB read/token",
            "GB/s reached",
            "% of bandwidth",
            "% incl. cache copies",
            "bandwidth floor ms",
        ],
        [
            [
                r["arm"],
                _ms(r["ms_per_step"]),
                "—" if r["arm"] == "full_a" else _r(ratios[r["arm"]]),
                f"{r['bytes_per_token'] / MiB:.2f}",
                f"{r['achieved_gbps']:.2f}",
                f"{r['percent_of_bandwidth']:.1f}",
                f"{r['percent_incl_cache_copies']:.1f}",
                f"{r['floor_ms_at_bandwidth']:.3f}",
            ]
            for r in d["decode"]
        ],
    )
    lines += ["", f"Caveat: {d['caveat']}."]
    return lines + _plots(d)


def structured(d: dict[str, Any]) -> list[str]:
    r, aa = d["ratios"]["schema/free"], d["ratios"]["free_again/free (A/A)"]
    lines = _header("11. Structured output: what a JSON-schema constraint costs per token", d)
    lines += [
        f"Greedy decode, {d['reps']} interleaved repetitions of {d['steps']} tokens, "
        f"served grammar engine {d['grammar_engine']}.",
        "",
        *_table(
            ["arm", "ms/token median [q1–q3]"],
            [[arm, _ms(s, digits=1)] for arm, s in d["ms_per_token"].items()],
        ),
        "",
        f"llguidance (served) schema/free = **{r['median']:.3f}** [{r['q1']:.3f}–"
        f"{r['q3']:.3f}] (A/A {aa['median']:.3f})"
        + (
            f"; outlines-core schema/free = {d['ratios']['schema_outlines/free']['median']:.3f}"
            if "schema_outlines/free" in d["ratios"]
            else ""
        )
        + ". Time inside the grammar processor per token: "
        + ", ".join(
            f"{lib} {v['median']:.2f} ms"
            for lib, v in d.get("processor_ms_per_token_by_library", {}).items()
        )
        + ".",
        "",
    ]
    return lines


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "decode": decode,
    "ttft": ttft,
    "server_overhead": server_overhead,
    "vs_mlx_lm": vs_mlx_lm,
    "bandwidth": bandwidth,
    "structured": structured,
    "batching": batching,
    "multiturn": multiturn,
    "batch_step": batch_step,
    "selfcal_prefill": selfcal_prefill,
    "refine_step": refine_step,
}


def _find(rows: list[dict[str, Any]], arm: str) -> dict[str, Any]:
    return next(r for r in rows if r["arm"] == arm)


def _worse(row: dict[str, Any], aa: dict[str, Any]) -> bool:
    return row["q1"] > max(aa["q3"], 1.0)


def where_eviction_loses(results: dict[str, dict[str, Any]]) -> list[str]:
    """Time ratios of an eviction arm that sit above the noise floor, study by study."""
    out = []
    if "decode" in results:
        d = results["decode"]
        for r in d["sweep"]:
            aa = _find(r["ratios"], "full_b")
            out += [
                f"decode at {r['context']}, {x['arm']} {_r(x)}"
                for x in r["ratios"][1:]
                if _worse(x, aa)
            ]
        for o in d["overhead"]:
            if _worse(o["ratios"][1], o["ratios"][0]):
                out.append(f"equal-size decode at B={o['budget']} {_r(o['ratios'][1])}")
        for m in d["memory"]:
            full = next(
                f for f in d["memory"] if f["context"] == m["context"] and f["arm"] == "full"
            )
            if m["arm"] != "full" and m["decode_peak_bytes"] > full["decode_peak_bytes"]:
                out.append(
                    f"decode peak memory at {m['context']}, {m['arm']} "
                    f"{m['decode_peak_bytes'] / MiB:.1f} vs full "
                    f"{full['decode_peak_bytes'] / MiB:.1f} MiB"
                )
    if "ttft" in results:
        for r in results["ttft"]["rows"]:
            out += [
                f"TTFT at {r['prompt_tokens']}, {x['arm']} {_r(x)}"
                for x in r["ratios"][1:]
                if _worse(x, r["ratios"][0])
            ]
    return out


def headline(results: dict[str, dict[str, Any]]) -> list[str]:
    """The ratios worth quoting, each beside its A/A noise floor (paired medians [IQR])."""
    out = []
    if "decode" in results:
        d = results["decode"]
        top = max(
            (r for r in d["sweep"] if not r["beyond_trained_context"]), key=lambda r: r["context"]
        )
        parts = ", ".join(
            f"budget {b}: {_r(_find(top['ratios'], f'b{b}'))}" for b in d["settings"]["budgets"]
        )
        out.append(
            f"- Decode step at the trained maximum context ({top['context']}), "
            f"eviction / full: {parts}; A/A {_r(_find(top['ratios'], 'full_b'))}."
        )
        for o in d["overhead"]:
            out.append(
                f"- Eviction overhead at equal size B={o['budget']} (ours / `KVCache`): "
                f"{_r(o['ratios'][1])}; A/A {_r(o['ratios'][0])}."
            )
        full = max((m for m in d["memory"] if m["arm"] == "full"), key=lambda m: m["context"])
        kept = {m["arm"]: m for m in d["memory"] if m["context"] == full["context"]}
        out.append(
            f"- Kept KV at context {full['context']}: full {full['kept_bytes'] / MiB:.2f} MiB; "
            + ", ".join(
                f"{a} {m['kept_bytes'] / MiB:.2f} MiB "
                f"({full['kept_bytes'] / m['kept_bytes']:.0f}x less)"
                for a, m in kept.items()
                if a != "full"
            )
            + "."
        )
    if "ttft" in results:
        for r in results["ttft"]["rows"]:
            parts = ", ".join(f"{x['arm']}: {_r(x)}" for x in r["ratios"][1:])
            out.append(
                f"- TTFT at {r['prompt_tokens']} prompt tokens"
                + (" (beyond trained context)" if r["beyond_trained_context"] else "")
                + f", eviction / full: {parts}; A/A {_r(r['ratios'][0])}."
            )
    if "server_overhead" in results:
        for r in results["server_overhead"]["rows"]:
            t = {(x["arm"], x["reference"]): x for x in r["ttft_ratios"]}
            i = {(x["arm"], x["reference"]): x for x in r["itl_ratios"]}
            k, w = ("http_a", "in_process_a"), ("worker", "in_process_a")
            aa, bb = ("in_process_b", "in_process_a"), ("http_b", "http_a")
            out.append(
                f"- Serving overhead at a {r['prompt_tokens']}-token prompt, HTTP / in-process: "
                f"TTFT {_r(t[k])}, inter-token latency {_r(i[k])} (worker / in-process: "
                f"{_r(t[w])}, {_r(i[w])}); A/A in-process {_r(t[aa])} / {_r(i[aa])}, "
                f"HTTP {_r(t[bb])} / {_r(i[bb])}."
            )
    if "vs_mlx_lm" in results:
        for r in results["vs_mlx_lm"]["rows"]:
            tr = {x["arm"]: x for x in r["ttft_ratios"]}
            sr = {x["arm"]: x for x in r["tps_ratios"]}
            out.append(
                f"- vs `mlx_lm.server` at a {r['prompt_tokens']}-token prompt: ours full "
                f"TTFT {_r(tr['ours_full'])}, tok/s {_r(sr['ours_full'])}; ours with "
                f"Q-Filters TTFT {_r(tr['ours_qfilters'])}, tok/s {_r(sr['ours_qfilters'])}; "
                f"A/A TTFT {_r(tr['theirs_b'])}, tok/s {_r(sr['theirs_b'])}."
            )
    if "bandwidth" in results:
        d = results["bandwidth"]
        parts = ", ".join(f"{r['arm']} {r['percent_of_bandwidth']:.1f}%" for r in d["decode"])
        out.append(
            f"- Share of measured bandwidth ({d['bandwidth']['reference_gbps']:.1f} GB/s) "
            f"reached in decode at context {d['settings']['context']}: {parts}."
        )
    losses = where_eviction_loses(results)
    if losses:
        out.append(
            "- Where eviction loses (its ratio's lower quartile above both 1 and the A/A upper "
            "quartile): " + "; ".join(losses) + "."
        )
    return (
        [
            "**Headline ratios measured** (below 1 is faster for time ratios, above 1 is faster "
            "for tok/s ratios):",
            "",
            *out,
            "",
        ]
        if out
        else []
    )


def render_speed_section(
    results: dict[str, dict[str, Any]], title: str = "Speed and memory", *, missing: bool = True
) -> list[str]:
    """One speed section: a subsection per study whose JSON exists (``missing``: a line for
    each that does not)."""
    if not results and not missing:
        return []
    lines = [
        f"## {title}",
        "",
        "Studies 6–11 (`bench/speed/`). Each row compares arms run in the same process, "
        "interleaved, with an A/A row for the noise floor; ratios are medians of per-round ratios "
        "with their interquartile range.",
        "",
        *headline(results),
    ]
    for name, render in RENDERERS.items():
        if name in results:
            lines += render(results[name])
        elif missing:
            lines += [f"*{name}: no results yet (`python -m bench.speed.{name}`).*", ""]
    return lines


def load_results(directory: Path) -> dict[str, dict[str, Any]]:
    import json

    return {
        name: json.loads((directory / f"{name}.json").read_text())
        for name in RENDERERS
        if (directory / f"{name}.json").exists()
    }
