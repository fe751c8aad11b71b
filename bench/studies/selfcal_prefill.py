"""Self-calibration's prefill cost: a prompt's own Q-Filters against a plain prefill.

A prompt prefilled in 512-token chunks into Q-Filters caches, interleaved: ``calibrated`` (no
query taps), ``self`` (taps accumulate each head's Gram matrix until the first eviction),
``fallback`` (key-SVD) and ``calibrated_again`` (A/A); ratios to ``calibrated``.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from bench.arms import prefill
from bench.data import prompt_tokens
from bench.harness import interleave, open_run, parse, parser, pyplot, ratios, save_plot, summaries
from bench.report import plots, speed_header, table
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.selfcal import install_query_taps, remove_query_taps

ARMS = ("calibrated", "self", "fallback", "calibrated_again")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, reps=3, prompt=(4096, 256, "prompt tokens"), budget=(512, 32))
    args = parse(p, argv)
    n, budget = args.prompt, args.budget
    sm = open_run("selfcal_prefill", args, argv)
    model, tokens = sm.model, prompt_tokens(sm, n)
    config = CacheConfig(method="qfilters", budget=budget, recent=budget // 4)
    sources: dict[str, str] = {}

    def prefill_seconds(name: str) -> float:
        tapped = name == "self"
        if tapped:
            install_query_taps(model)
        else:
            remove_query_taps(model)
        filters = sm.filters if name.startswith("calibrated") else None
        caches = make_caches(model, config, filters=filters, self_calibrate=tapped)
        tic = time.perf_counter()
        prefill(model, caches, tokens)
        elapsed = time.perf_counter() - tic
        sources[name] = caches[0].scorer.source
        return elapsed

    arms = {a: partial(prefill_seconds, a) for a in ARMS}
    runs = interleave(arms, args.reps, progress=sm.log.rounds("prefill"))
    remove_query_taps(model)
    prefill_s = summaries(runs)
    settings = {"prompt_tokens": n, "prefill_chunk": 512, "budget": budget, "recent": budget // 4,
                "reps": args.reps, "filter_sources": sources}  # fmt: skip
    result = {
        "study": "selfcal_prefill",
        "settings": settings,
        "prefill_s": prefill_s,
        "tokens_per_s": {a: n / s["median"] for a, s in prefill_s.items()},
        "ratios": ratios(runs, "calibrated", ARMS[1:]),
    }
    fig, ax = pyplot().subplots(figsize=(5, 3.4))
    ax.bar(ARMS, [prefill_s[a]["median"] for a in ARMS],
           color=["tab:blue", "tab:purple", "tab:orange", "tab:blue"])  # fmt: skip
    ax.set(ylabel="prefill seconds (median)", title=f"{n}-token prompt, budget {budget}")
    ax.tick_params(axis="x", labelsize=8)
    result["plots"] = [save_plot(fig, args.out, "selfcal_prefill")]
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    s = d["settings"]
    lines = speed_header("Self-calibration: its cost on a prefill", d)
    lines += [
        f"In process: a {s['prompt_tokens']}-token prompt prefilled in {s['prefill_chunk']}-token "
        f"chunks into Q-Filters caches (budget {s['budget']}, recent {s['recent']}), "
        f"{s['reps']} interleaved rounds. `self` computes its filters from the prompt's own "
        "queries (qfserve.engine.kv.selfcal); `calibrated` uses the registry's, with no query taps; "
        "`calibrated_again` is the A/A copy. Ratios are to `calibrated`.",
        "",
    ]
    seconds = {a: f"{v['median']:.2f}" for a, v in d["prefill_s"].items()}
    rows = [["calibrated", seconds["calibrated"], "1.00", ""]]
    rows += [
        [r["arm"], seconds[r["arm"]], f"{r['median']:.3f}", f"{r['min']:.3f}-{r['max']:.3f}"]
        for r in d["ratios"]
    ]
    lines += table(["arm", "prefill s", "ratio", "range"], rows)
    return lines + [*plots(d), ""]
