"""Self-calibration's prefill cost: a prompt's own Q-Filters (query taps accumulating each
head's Gram matrix until the first eviction) against calibrated ones and the key-SVD fallback."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from bench.arms import prefill
from bench.data import prompt_tokens
from bench.plots import save_plot, subplots
from bench.report import section, table
from bench.run import start
from bench.timing import compare_arms
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.selfcal import install_query_taps, remove_query_taps

ARMS = {
    "calibrated": "tab:blue",
    "self": "tab:purple",
    "fallback": "tab:orange",
    "calibrated_again": "tab:blue",
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start(
        "selfcal_prefill",
        argv,
        __doc__,
        reps=3,
        prompt=(4096, 256, "prompt tokens"),
        budget=(512, 32),
    )
    n, budget = sm.args.prompt, sm.args.budget
    model, tokens = sm.model, prompt_tokens(sm, n)
    config = CacheConfig(method="qfilters", budget=budget, recent=budget // 4)
    sources: dict[str, str] = {}

    def prefill_seconds(name: str) -> float:
        (install_query_taps if name == "self" else remove_query_taps)(model)
        filters = sm.filters if name.startswith("calibrated") else None
        caches = make_caches(model, config, filters=filters, self_calibrate=name == "self")
        tic = time.perf_counter()
        prefill(model, caches, tokens)
        elapsed = time.perf_counter() - tic
        sources[name] = caches[0].scorer.source
        return elapsed

    _, prefill_s, ratios = compare_arms(
        sm, {a: partial(prefill_seconds, a) for a in ARMS}, "prefill", "calibrated"
    )
    remove_query_taps(model)
    settings = {
        "prompt_tokens": n,
        "prefill_chunk": 512,
        "budget": budget,
        "recent": budget // 4,
        "reps": sm.args.reps,
        "filter_sources": sources,
    }
    fig, [[ax]] = subplots(figsize=(5, 3.4))
    ax.bar(list(ARMS), [prefill_s[a]["median"] for a in ARMS], color=list(ARMS.values()))
    ax.set(ylabel="prefill seconds (median)", title=f"{n}-token prompt, budget {budget}")
    ax.tick_params(axis="x", labelsize=8)
    return sm.save(
        {
            "settings": settings,
            "prefill_s": prefill_s,
            "tokens_per_s": {a: n / s["median"] for a, s in prefill_s.items()},
            "ratios": ratios,
            "plots": [save_plot(fig, sm.args.out, "selfcal_prefill")],
        }
    )


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"In process: a {s['prompt_tokens']}-token prompt prefilled in {s['prefill_chunk']}-token "
        f"chunks into Q-Filters caches (budget {s['budget']}, recent {s['recent']}), "
        f"{s['reps']} interleaved rounds. `self` computes its filters from the prompt's own "
        "queries (qfserve.engine.kv.selfcal); `calibrated` uses the registry's, with no query taps; "
        "`calibrated_again` is the A/A copy. Ratios are to `calibrated`."
    )
    seconds = {a: f"{v['median']:.2f}" for a, v in d["prefill_s"].items()}
    rows = [["calibrated", seconds["calibrated"], "1.00", ""]]
    rows += [
        [r["arm"], seconds[r["arm"]], f"{r['median']:.3f}", f"{r['min']:.3f}-{r['max']:.3f}"]
        for r in d["ratios"]
    ]
    headers = ["arm", "prefill s", "ratio", "range"]
    return section("Self-calibration: its cost on a prefill", d, intro, table(headers, rows))
