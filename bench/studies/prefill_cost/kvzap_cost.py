"""KVzap's cost: a prompt prefilled with every row scored by the surrogate, against a plain
prefill and Q-Filters', then a decode step at budget against Q-Filters'. ``kvzap`` keeps each
head's budget; ``kvzap_global`` (kvzap's default) shares the rows across layers, each chunk
shared out as it is read.

Every arm runs the same prompt in the same chunks on the same attention; ``full_again`` and
``qfilters_again`` are the A/A copies. The surrogates are the model's own (the registry's).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import mlx.core as mx

from bench.arms import decode_timer, prefill
from bench.data import prompt_tokens
from bench.plots import save_plot, subplots
from bench.report import ratio_cell, section, table
from bench.run import start
from bench.surrogates import surrogate_for
from bench.timing import compare_arms
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches

PREFILL = {
    "full": "black",
    "full_again": "gray",
    "qfilters": "tab:blue",
    "kvzap": "tab:green",
    "kvzap_global": "darkgreen",
}
DECODE = {
    "qfilters": "tab:blue",
    "qfilters_again": "lightsteelblue",
    "kvzap": "tab:green",
    "kvzap_global": "darkgreen",
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start(
        "kvzap_cost",
        argv,
        __doc__,
        calibration=True,
        reps=5,
        prompt=(2048, 200, "prompt tokens"),
        budget=(512, 32),
        steps=(32, 4, "decode steps timed"),
    )
    n, budget, steps = sm.args.prompt, sm.args.budget, sm.args.steps
    model, tokens = sm.model, prompt_tokens(sm, n)
    surrogate, where = surrogate_for(
        model,
        sm.tokenizer,
        sm.identity,
        mode=sm.args.calibration,
        quick=sm.args.quick,
        seed=sm.args.seed,
    )
    filled: dict[str, list] = {}

    def caches_for(name: str) -> list[Any]:
        method, _, variant = name.partition("_")
        if method == "full":
            return make_caches(model, CacheConfig(method="full"))
        mode = "global" if variant == "global" else "per_head"
        config = CacheConfig(method=method, budget=budget, recent=budget // 4, budget_mode=mode)
        if method == "kvzap":
            return make_caches(model, config, surrogate=surrogate)
        return make_caches(model, config, filters=sm.filters)

    def prefill_seconds(name: str) -> float:
        caches = caches_for(name)
        tic = time.perf_counter()
        prefill(model, caches, tokens)
        mx.eval([c.state for c in caches])
        elapsed = time.perf_counter() - tic
        filled[name] = caches
        return elapsed

    _, prefill_s, prefill_ratios = compare_arms(
        sm, {a: partial(prefill_seconds, a) for a in PREFILL}, "prefill", "full"
    )
    filled["qfilters_again"] = caches_for("qfilters_again")
    prefill(model, filled["qfilters_again"], tokens)
    timers = {a: decode_timer(model, filled[a], steps, hold=False) for a in DECODE}
    _, decode_ms, decode_ratios = compare_arms(sm, timers, "decode", "qfilters")
    fig, axes = subplots(1, 2, figsize=(9, 3.4))
    axes[0, 0].bar(
        list(PREFILL), [prefill_s[a]["median"] for a in PREFILL], color=list(PREFILL.values())
    )
    axes[0, 0].set(ylabel="prefill seconds (median)", title=f"{n}-token prompt, budget {budget}")
    axes[0, 1].bar(
        list(DECODE), [decode_ms[a]["median"] for a in DECODE], color=list(DECODE.values())
    )
    axes[0, 1].set(ylabel="ms per decode step (median)", title="decode at budget")
    return sm.save(
        {
            "settings": {
                "prompt_tokens": n,
                "budget": budget,
                "recent": budget // 4,
                "reps": sm.args.reps,
                "decode_steps": steps,
                "surrogate": {
                    "form": surrogate.form,
                    "bytes": surrogate.nbytes,
                    "source": where["source"],
                    "spearman_median": surrogate.fidelity.get("spearman_median"),
                },
            },
            "prefill_s": prefill_s,
            "prefill_ratios": prefill_ratios,
            "decode_ms": decode_ms,
            "decode_ratios": decode_ratios,
            "plots": [save_plot(fig, sm.args.out, "kvzap_cost")],
        }
    )


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    sur = s["surrogate"]
    intro = (
        f"In process: a {s['prompt_tokens']}-token prompt, budget {s['budget']}, recent "
        f"{s['recent']}, {s['reps']} interleaved rounds; the model's {sur['form']} surrogate "
        f"({sur['bytes'] / 2**20:.1f} MiB, held-out Spearman {sur['spearman_median']}). "
        "Prefill ratios are to `full` (`full_again`: the A/A copy), the decode step "
        f"({s['decode_steps']} steps at budget) to Q-Filters' (`qfilters_again`: A/A). "
        "`kvzap` keeps each head's budget; `kvzap_global` (kvzap's default) shares the rows "
        "across layers, each prefill chunk shared out as it is read."
    )
    rows = [[r["arm"], ratio_cell(r)] for r in d["prefill_ratios"] + d["decode_ratios"]]
    return section("KVzap's cost", d, intro, table(["arm", "ratio (median [q1-q3])"], rows))
