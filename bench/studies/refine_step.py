"""The decode step of chunked and head-adaptive Q-Filters against plain ones, same budget.

Every arm is prefilled with ``2B`` tokens so each step evicts one row (checked); plain
Q-Filters run twice, first and last in each round (A/A). Adaptive caches store padded to the
longest head, so their step pays for the padding; the rows stored are recorded.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from bench.arms import decode_timer, prefill
from bench.data import prompt_tokens
from bench.harness import (
    errorbars,
    interleave,
    open_run,
    parse,
    parser,
    pyplot,
    ratios,
    save_plot,
    summaries,
)
from bench.report import plots, speed_header, table
from qfserve.engine.filters.artifact import resolve_calibration
from qfserve.engine.kv.attention import install_head_masks
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches

REFERENCE = "plain_a"


def arm_configs(budget: int, chunk: int) -> dict[str, CacheConfig]:
    """Arm name -> cache settings; the two plain arms are the A/A pair."""
    base: dict[str, Any] = {"method": "qfilters", "budget": budget, "recent": budget // 4}
    return {
        "plain_a": CacheConfig(**base),
        f"c{chunk}": CacheConfig(**base, chunk=chunk),
        "adaptive": CacheConfig(**base, budget_mode="adaptive"),
        f"c{chunk}_adaptive": CacheConfig(**base, chunk=chunk, budget_mode="adaptive"),
        "plain_b": CacheConfig(**base),
    }


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


def rows_held(caches: list[Any]) -> dict[str, float]:
    """Rows per layer and KV head: stored (the padded width attention reads) and kept."""
    # In the slot layout every head has one free slot, which holds no token.
    stored = max(c.keys.shape[2] - (c.free is not None) for c in caches)
    longest = [int(c.valid.sum(axis=-1).max()) - (c.free is not None)
               for c in caches if c.valid is not None]  # fmt: skip
    return {"stored_rows": stored, "longest_head_rows": max(longest, default=stored)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, reps=9, budgets=([256, 512], [32, 64]), chunk=(8, 4, "chunk size"),
               steps=(16, 4, "decode steps per timing"))  # fmt: skip
    args = parse(p, argv)
    budgets, chunk, steps = args.budgets, args.chunk, args.steps
    if chunk < 2 or steps < 1 or min(budgets) <= chunk:
        raise SystemExit("need --chunk >= 2, --steps >= 1 and every budget above the chunk")
    sm = open_run("refine_step", args, argv)
    model = sm.model
    filters, scale, source = resolve_calibration(
        model, sm.identity["model_id"], fingerprint=sm.identity["fingerprint"]
    )
    if filters is None or scale is None:
        raise SystemExit(
            f"{sm.loaded.name}: adaptive budgets need a calibration with query scales "
            f"(format version 2); found {source}"
        )
    install_head_masks(model)
    rows = []
    for budget in budgets:
        tokens = prompt_tokens(sm, 2 * budget)
        arms, held = {}, {}
        for name, config in arm_configs(budget, chunk).items():
            sm.log(f"budget {budget}: prefilling {name}")
            caches = make_caches(model, config, filters=filters, query_scale=scale)
            prefill(model, caches, tokens)
            arms[name] = evicting_timer(model, caches, steps)
            arms[name]()  # warm-up: from its first step on, every step evicts
            held[name] = rows_held(caches)
        samples = interleave(arms, args.reps, progress=sm.log.rounds(f"budget {budget}"))
        rows.append({"budget": budget, "ms_per_step": summaries(samples), "rows": held,
                     "ratios": ratios(samples, REFERENCE, [k for k in arms if k != REFERENCE])})  # fmt: skip
        del arms, caches
        mx.clear_cache()

    result = {
        "study": "refine_step",
        "settings": {"budgets": budgets, "chunk": chunk, "steps": steps, "reps": args.reps,
                     "prompt": "2 x budget tokens of the standard-library corpus",
                     "recent": "budget / 4", "n_sink": 4, "reference": REFERENCE,
                     "prefill_chunk": 512},
        "rows": rows,
    }  # fmt: skip
    result["plots"] = [plot(rows, args.out)]
    return sm.save(result)


def plot(rows: list[dict[str, Any]], out: Any) -> str:
    fig, ax = pyplot().subplots(figsize=(6.4, 3.8))
    names = [r["arm"] for r in rows[0]["ratios"]]
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        med, err = errorbars([next(x for x in r["ratios"] if x["arm"] == name) for r in rows])
        ax.bar([j + i * width for j in range(len(rows))], med, width, yerr=err, capsize=3,
               label=name)  # fmt: skip
    ax.axhline(1.0, color="grey", ls=":")
    centres = [j + 0.4 - width / 2 for j in range(len(rows))]
    ax.set_xticks(centres, [f"b{r['budget']}" for r in rows])
    ax.set(title="decode step / plain Q-Filters (median, IQR)", ylabel="ratio")
    ax.legend(fontsize=8)
    return save_plot(fig, out, "refine_step")


def render(d: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    s = d["settings"]
    lines = speed_header("Chunks and adaptive budgets: the decode step at equal size", d)
    lines += [
        f"In process: every arm prefilled with {s['prompt']}, so each step evicts one row; "
        f"recent {s['recent']}, {s['steps']} steps per timing, {s['reps']} interleaved rounds. "
        f"Ratios are to plain Q-Filters (`{s['reference']}`); `plain_b` is the A/A copy.",
        "",
    ]
    ref = s["reference"]
    rows = []
    for r in d["rows"]:
        step = r["ms_per_step"]
        stored = {arm: held["stored_rows"] for arm, held in r["rows"].items()}
        rows.append([r["budget"], ref, stored[ref], f"{step[ref]['median']:.1f}", "1.00", ""])
        rows += [["", x["arm"], stored[x["arm"]], f"{step[x['arm']]['median']:.1f}",
                  f"{x['median']:.3f}", f"{x['q1']:.2f}-{x['q3']:.2f}"] for x in r["ratios"]]  # fmt: skip
    lines += table(["budget", "arm", "rows stored", "ms/step", "ratio", "IQR"], rows)
    lines += [
        "",
        "Rows stored: per layer and KV head, the width attention reads (adaptive budgets pad "
        "every head to the longest).",
    ]
    return lines + [*plots(d), ""]
