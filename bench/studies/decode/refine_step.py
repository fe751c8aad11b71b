"""The decode step of chunked and head-adaptive Q-Filters against plain ones, same budget:
each arm prefilled with 2B tokens, so every step evicts one row (checked)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from bench.arms import decode_timer, prefill
from bench.data import prompt_tokens
from bench.plots import grouped_bars, save_plot, subplots
from bench.report import by_arm, section, table
from bench.run import start
from bench.timing import compare_arms
from qfserve.engine.filters.artifact import resolve_calibration
from qfserve.engine.kv.attention import install_head_masks
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches

REFERENCE = "plain_a"


def evicting_timer(model, caches: list[Any], steps: int):
    """:func:`bench.arms.decode_timer` that also checks every step evicted one row per layer."""
    timed = decode_timer(model, caches, steps, hold=False)

    def run() -> float:
        before = [c.evictions for c in caches]
        ms = timed()
        grew = {c.evictions - b for c, b in zip(caches, before, strict=True)}
        if grew != {steps}:
            raise RuntimeError(f"expected {steps} evictions per layer per timing, got {grew}")
        return ms

    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start(
        "refine_step",
        argv,
        __doc__,
        reps=9,
        budgets=([256, 512], [32, 64]),
        chunk=(8, 4, "chunk size"),
        steps=(16, 4, "decode steps per timing"),
    )
    budgets, chunk, steps = sm.args.budgets, sm.args.chunk, sm.args.steps
    if chunk < 2 or steps < 1 or min(budgets) <= chunk:
        raise SystemExit("need --chunk >= 2, --steps >= 1 and every budget above the chunk")
    model = sm.model
    filters, scale, source = resolve_calibration(
        model, sm.identity["model_id"], fingerprint=sm.identity["fingerprint"]
    )
    if filters is None or scale is None:
        raise SystemExit(
            f"{sm.loaded.name}: adaptive budgets need a calibration with query "
            f"scales (format version 2); found {source}"
        )
    install_head_masks(model)
    # Arm name: its chunk and budget mode; the two plain arms are the A/A pair.
    arms_spec = {
        "plain_a": (1, "per_head"),
        f"c{chunk}": (chunk, "per_head"),
        "adaptive": (1, "adaptive"),
        f"c{chunk}_adaptive": (chunk, "adaptive"),
        "plain_b": (1, "per_head"),
    }
    rows = []
    for budget in budgets:
        tokens = prompt_tokens(sm, 2 * budget)
        arms, held = {}, {}
        for name, (c, mode) in arms_spec.items():
            sm.log(f"budget {budget}: prefilling {name}")
            config = CacheConfig(
                method="qfilters", budget=budget, recent=budget // 4, chunk=c, budget_mode=mode
            )
            caches = make_caches(model, config, filters=filters, query_scale=scale)
            prefill(model, caches, tokens)
            arms[name] = evicting_timer(model, caches, steps)
            arms[name]()  # warm-up: from its first step on, every step evicts
            # Rows per layer and KV head: stored (the padded width attention reads) and kept;
            # in the slot layout every head has one free slot, which holds no token.
            stored = max(c.keys.shape[2] - (c.free is not None) for c in caches)
            longest = [
                int(c.valid.sum(axis=-1).max()) - (c.free is not None)
                for c in caches
                if c.valid is not None
            ]
            held[name] = {"stored_rows": stored, "longest_head_rows": max(longest, default=stored)}
        _, stats, ratios = compare_arms(sm, arms, f"budget {budget}", REFERENCE)
        rows.append({"budget": budget, "ms_per_step": stats, "rows": held, "ratios": ratios})
        del arms, caches
        mx.clear_cache()
    result = {
        "settings": {
            "budgets": budgets,
            "chunk": chunk,
            "steps": steps,
            "reps": sm.args.reps,
            "prompt": "2 x budget tokens of the standard-library corpus",
            "recent": "budget / 4",
            "n_sink": 4,
            "reference": REFERENCE,
            "prefill_chunk": 512,
        },
        "rows": rows,
    }
    fig, [[ax]] = subplots(figsize=(6.4, 3.8))
    grouped_bars(
        ax,
        [f"b{r['budget']}" for r in rows],
        [by_arm(r["ratios"]) for r in rows],
        "decode step / plain Q-Filters (median, IQR)",
    )
    ax.axhline(1.0, color="grey", ls=":")
    ax.set(ylabel="ratio")
    result["plots"] = [save_plot(fig, sm.args.out, "refine_step")]
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"In process: every arm prefilled with {s['prompt']}, so each step evicts one row; "
        f"recent {s['recent']}, {s['steps']} steps per timing, {s['reps']} interleaved rounds. "
        f"Ratios are to plain Q-Filters (`{s['reference']}`); `plain_b` is the A/A copy."
    )
    ref, rows = s["reference"], []
    for r in d["rows"]:
        step = r["ms_per_step"]
        stored = {arm: held["stored_rows"] for arm, held in r["rows"].items()}
        rows.append([r["budget"], ref, stored[ref], f"{step[ref]['median']:.1f}", "1.00", ""])
        rows += [
            [
                "",
                x["arm"],
                stored[x["arm"]],
                f"{step[x['arm']]['median']:.1f}",
                f"{x['median']:.3f}",
                f"{x['q1']:.2f}-{x['q3']:.2f}",
            ]
            for x in r["ratios"]
        ]
    headers = ["budget", "arm", "rows stored", "ms/step", "ratio", "IQR"]
    note = (
        "Rows stored: per layer and KV head, the width attention reads (adaptive budgets pad "
        "every head to the longest)."
    )
    title = "Chunks and adaptive budgets: the decode step at equal size"
    return section(title, d, intro, table(headers, rows), note)
