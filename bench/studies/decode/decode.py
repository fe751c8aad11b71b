"""Decode ms/step against context: a full cache (twice, A/A) against Q-Filters at each budget;
our cache at budget B evicting a row per step against mlx-lm's ``KVCache`` of B rows; and each
arm's kept bytes, MLX peak memory (prefill in 512-token chunks, then decode) and RSS growth."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from bench import clients, plots, timing
from bench.arms import caches_for, decode_timer, kv_stats, prefill
from bench.cli import MiB
from bench.data import prompt_tokens
from bench.report import by_arm, ms, ratio_cell, section, table
from bench.run import start


def copy_full(model: Any, caches: list[Any]) -> list[Any]:
    """A fresh full cache holding the same rows (new arrays: nothing shared)."""
    out = make_prompt_cache(model)
    for dst, src in zip(out, caches, strict=True):
        n = src.offset
        dst.update_and_fetch(mx.array(src.keys[..., :n, :]), mx.array(src.values[..., :n, :]))
    mx.eval([c.state for c in out])
    return out


def build_arm(sm: Any, arm: str | int, tokens: list[int], steps: int) -> tuple[list[Any], dict]:
    """Prefill one arm's caches as the server would; its memory figures on the way."""
    mx.clear_cache()
    base, rss0 = mx.get_active_memory(), clients.rss_bytes()
    mx.reset_peak_memory()
    caches = caches_for(sm, arm)
    prefill(sm.model, caches, tokens)
    prefill_peak = mx.get_peak_memory() - base
    mx.reset_peak_memory()
    decode_timer(sm.model, caches, steps, hold=True)()  # also the arm's warm-up
    decode_peak = mx.get_peak_memory() - base
    mx.clear_cache()
    rss = clients.rss_bytes() - rss0
    return caches, {
        **kv_stats(caches),
        "prefill_peak_bytes": prefill_peak,
        "decode_peak_bytes": decode_peak,
        "rss_growth_bytes": rss,
    }


def sweep(sm: Any, contexts: list[int], budgets: list[int], steps: int) -> tuple[list, list]:
    rows, memory = [], []
    for context in contexts:
        tokens = prompt_tokens(sm, context)
        arms = {}
        for name, arm in [("full_a", "full"), *((f"b{b}", b) for b in budgets)]:
            sm.log(f"context {context}: prefilling {name}")
            caches, mem = build_arm(sm, arm, tokens, steps)
            memory.append({"context": context, "arm": "full" if arm == "full" else name, **mem})
            arms[name] = decode_timer(sm.model, caches, steps, hold=True)
            if arm == "full":
                arms["full_b"] = decode_timer(
                    sm.model, copy_full(sm.model, caches), steps, hold=True
                )
        _, stats, ratios = timing.compare_arms(sm, arms, f"context {context}", "full_a")
        # The first decode step takes a cache at its budget over it: from then on it evicts.
        rows.append(
            {
                "context": context,
                "beyond_trained_context": context > sm.context_length,
                "ms_per_step": stats,
                "ratios": ratios,
                "evicting": {f"b{b}": context >= b for b in budgets},
            }
        )
    return rows, memory


def overhead(sm: Any, budgets: list[int], steps: int) -> list[dict]:
    rows = []
    for b in budgets:
        sm.log(f"equal size {b}: prefilling")
        tokens = prompt_tokens(sm, 2 * b)
        arms = {}
        for name in ("kvcache_a", "kvcache_b", "ours"):
            ours = name == "ours"  # 2B tokens: every decode step evicts one row
            caches = caches_for(sm, b) if ours else make_prompt_cache(sm.model)
            prefill(sm.model, caches, tokens if ours else tokens[:b])
            arms[name] = decode_timer(sm.model, caches, steps, hold=not ours)
        _, stats, ratios = timing.compare_arms(sm, arms, f"equal size {b}", "kvcache_a")
        rows.append({"budget": b, "ms_per_step": stats, "ratios": ratios})
    return rows


def plot(result: dict[str, Any], out: Any) -> list[str]:
    budgets, ctx = result["settings"]["budgets"], [r["context"] for r in result["sweep"]]
    labels = {"full_a": "full", **{f"b{b}": f"Q-Filters budget {b}" for b in budgets}}
    series = {v: [r["ms_per_step"][k] for r in result["sweep"]] for k, v in labels.items()}
    names = [
        plots.context_plot(
            out,
            "decode_ms",
            ctx,
            series,
            result["settings"]["max_context"],
            xlabel="context (tokens)",
            title="Decode step time vs context",
            ylabel="ms / decode step (median, IQR)",
        )
    ]
    fig, axes = plots.subplots(1, 3, figsize=(14, 4))
    panels = {  # title: the memory rows' fields it plots (the larger one)
        "Kept KV bytes (all layers)": ["kept_bytes"],
        "MLX peak above weights (prefill or decode)": ["prefill_peak_bytes", "decode_peak_bytes"],
        "Process RSS growth for the arm": ["rss_growth_bytes"],
    }
    for a, (title, keys) in zip(axes[0], panels.items(), strict=True):
        for arm in ("full", *(f"b{b}" for b in budgets)):
            rows = [m for m in result["memory"] if m["arm"] == arm]
            a.plot(
                [m["context"] for m in rows],
                [max(0, *(m[k] for k in keys)) / MiB for m in rows],
                marker="o",
                label=arm,
            )
        a.set(xlabel="context (tokens)", ylabel="MiB", title=title)
        plots.log2_axis(a, ctx)
        a.legend()
    return [*names, plots.save_plot(fig, out, "decode_memory")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start(
        "decode",
        argv,
        __doc__,
        reps=5,
        steps=(16, 4, "decode steps per timing"),
        contexts=(
            None,
            [128, 256],
            "context tokens (default: 1,024 doubling to the trained length)",
        ),
        budgets=([128, 256, 512, 1024], [64, 128]),
    )
    args = sm.args
    top = sm.context_length  # 1,024 doubling below the trained length, then that length
    contexts = args.contexts or [*(c for c in (1024 << k for k in range(32)) if c < top), top]
    sm.log(f"model {sm.loaded.name}, contexts {contexts}, budgets {args.budgets}, reps {args.reps}")
    rows, memory = sweep(sm, contexts, args.budgets, args.steps)
    full = next(m for m in memory if m["arm"] == "full")
    result = {
        "settings": {
            "max_context": sm.identity["max_context"],
            "reps": args.reps,
            "steps": args.steps,
            "budgets": args.budgets,
            "n_sink": 4,
            "recent": 0,
            "method": "qfilters",
            "prefill_chunk": 512,
        },
        "kv_bytes_per_token": full["kept_bytes"] / full["tokens_kept"],
        "sweep": rows,
        "overhead": overhead(sm, args.budgets, args.steps),
        "memory": memory,
    }
    result["plots"] = plot(result, args.out)
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    s, budgets = d["settings"], d["settings"]["budgets"]
    intro = (
        f"ms per decode step, median [IQR] over {s['reps']} interleaved repetitions of "
        f"{s['steps']} steps; ratios are medians of paired per-round ratios to the first full "
        "arm (A/A = the second full arm: the noise floor). Q-Filters, n_sink 4, recent 0, "
        f"filters: {d['model']['filter_source']}. Contexts run one after another, so absolute ms "
        "across rows also track the machine's load at the time; compare within a row."
    )
    rows = []
    for r in d["sweep"]:
        step, rr = r["ms_per_step"], by_arm(r["ratios"])
        beyond = " (beyond trained context)" if r["beyond_trained_context"] else ""
        rows.append(
            [
                f"{r['context']}{beyond}",
                ms(step["full_a"]),
                ratio_cell(rr["full_b"]),
                *(
                    f"{step[f'b{b}']['median']:.2f} ({ratio_cell(rr[f'b{b}'])})"
                    + ("" if r["evicting"][f"b{b}"] else " no eviction yet")
                    for b in budgets
                ),
            ]
        )
    sweep = table(
        ["context", "full ms", "A/A", *(f"budget {b}: ms (ratio to full)" for b in budgets)], rows
    )
    overhead = (
        "Eviction overhead at equal size: our cache at budget B holding B rows (one evicted per "
        "step) against mlx-lm's `KVCache` holding B rows."
    )
    rows = [
        [
            o["budget"],
            ms(o["ms_per_step"]["kvcache_a"]),
            ms(o["ms_per_step"]["ours"]),
            ratio_cell(o["ratios"][0]),
            ratio_cell(o["ratios"][1]),
        ]
        for o in d["overhead"]
    ]
    equal = table(["B", "KVCache ms", "ours ms", "A/A", "ours / KVCache"], rows)
    per_token = d.get("kv_bytes_per_token")  # older results have neither it nor RSS growth
    memory = (
        "Memory, MiB: kept KV (keys + values, all layers), what the cache arrays hold "
        "(mlx-lm's `KVCache` preallocates in steps of 256; ours also holds scores), "
        "MLX's peak above what was live before the arm during prefill (512-token chunks) "
        "and during decode, and how much the process's RSS grew for the arm (an upper "
        "bound: the allocator may keep freed pages)."
    )
    if per_token is not None:
        memory += f" KV bytes per token of this model (full cache): {per_token:,.0f}."
    rss = all("rss_growth_bytes" in m for m in d["memory"])
    rows = [
        [
            m["context"],
            m["arm"],
            f"{m['kept_bytes'] / MiB:.2f}",
            f"{m['cache_nbytes'] / MiB:.2f}",
            f"{m['prefill_peak_bytes'] / MiB:.1f}",
            f"{m['decode_peak_bytes'] / MiB:.2f}",
            *([f"{m['rss_growth_bytes'] / MiB:.1f}"] if rss else []),
        ]
        for m in d["memory"]
    ]
    headers = ["context", "arm", "kept KV", "cache arrays", "prefill peak", "decode peak"]
    kept = table([*headers, *(["RSS growth"] if rss else [])], rows)
    title = "Decode step time, eviction overhead and memory against context"
    return section(title, d, intro, sweep, overhead, equal, memory, kept)
