"""KVzip's cost: a prompt prefilled and reconstructed, against a plain prefill, then decode.

``full_mlx`` runs the full cache on MLX's own attention, every other arm the blocked CPU one.
``floor`` is the least any exact pass can cost: the prompt prefilled, then the tokens the pass
feeds read on as a plain prompt over the full cache (no scores, nothing dropped).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import mlx.core as mx

from bench.arms import decode_timer, prefill
from bench.data import prompt_tokens
from bench.plots import save_plot, subplots
from bench.report import by_arm, ms, ratio_cell, section, table
from bench.run import start
from bench.timing import compare_arms
from qfserve.engine.kv.attention import set_blocked
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.kvzip import DEFAULT_CHUNK, compress

ARMS = {
    "full": "black",
    "qfilters": "tab:blue",
    "kvzip": "darkgoldenrod",
    "floor": "tan",
    "full_again": "black",
    "full_mlx": "gray",
}
EVICTING = ("qfilters", "kvzip")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start(
        "kvzip_cost",
        argv,
        __doc__,
        reps=3,
        prompt=(2048, 200, "prompt tokens"),
        budget=(256, 32),
        steps=(32, 4, "decode steps timed"),
    )
    n, budget, steps = sm.args.prompt, sm.args.budget, sm.args.steps
    model, tokens = sm.model, prompt_tokens(sm, n)
    peaks: dict[str, int] = {}
    filled: dict[str, list] = {}
    configs = {m: CacheConfig(method=m, budget=budget, recent=budget // 4) for m in EVICTING}
    fed = [i for _, _, ids in sm.repeat.chunks(tokens, DEFAULT_CHUNK) for i in ids]

    def prefill_seconds(name: str) -> float:
        config = configs.get(name, CacheConfig(method="full"))
        caches = make_caches(model, config, filters=sm.filters if config.evicts else None)
        mx.reset_peak_memory()
        set_blocked(name != "full_mlx")
        tic = time.perf_counter()
        try:
            prefill(model, caches, tokens)
            if config.method == "kvzip":
                compress(model, caches, tokens, sm.repeat)
            elif name == "floor":
                prefill(model, caches, fed)
        finally:
            set_blocked(True)
        elapsed = time.perf_counter() - tic
        peaks[name], filled[name] = mx.get_peak_memory(), caches
        return elapsed

    _, prefill_s, prefill_ratios = compare_arms(
        sm, {a: partial(prefill_seconds, a) for a in ARMS}, "prefill", "full"
    )
    kept = {a: filled[a][0].size() for a in EVICTING}
    timers = {a: decode_timer(model, filled[a], steps, hold=False) for a in EVICTING}
    _, decode_ms, decode_ratios = compare_arms(sm, timers, "decode", "qfilters")
    settings = {
        "prompt_tokens": n,
        "prefill_chunk": 512,
        "budget": budget,
        "recent": budget // 4,
        "pass_tokens": len(fed),
        "reconstruction_chunk": DEFAULT_CHUNK,
        "reps": sm.args.reps,
        "decode_steps": steps,
        "kept_rows_after_prefill": kept,
    }
    fig, axes = subplots(1, 2, figsize=(9, 3.4))
    axes[0, 0].bar(list(ARMS), [prefill_s[a]["median"] for a in ARMS], color=list(ARMS.values()))
    axes[0, 0].set(ylabel="prefill seconds (median)", title=f"{n}-token prompt, budget {budget}")
    axes[0, 1].bar(
        EVICTING, [decode_ms[a]["median"] for a in EVICTING], color=[ARMS[a] for a in EVICTING]
    )
    axes[0, 1].set(ylabel="ms per decode step (median)", title="decode at budget")
    return sm.save(
        {
            "settings": settings,
            "prefill_s": prefill_s,
            "prefill_ratios": prefill_ratios,
            "peak_memory_bytes": peaks,
            "decode_ms": decode_ms,
            "decode_ratios": decode_ratios,
            "plots": [save_plot(fig, sm.args.out, "kvzip_cost")],
        }
    )


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"In process: a {s['prompt_tokens']}-token prompt prefilled in {s['prefill_chunk']}-token "
        f"chunks; budget {s['budget']}, recent {s['recent']}, {s['reps']} interleaved rounds. "
        "Prefill ratios are to `full` (`full_again`: the A/A copy; `full_mlx`: the full cache "
        "on MLX's own attention, every other arm on the blocked CPU attention; `floor`: the "
        f"prompt, then the {s.get('pass_tokens', '?')} tokens the pass feeds read on as a plain "
        "prompt over the full cache, the least an exact pass can cost); the decode step "
        f"({s['decode_steps']} steps at budget) is kvzip's over Q-Filters'."
    )
    ratios = by_arm(d["prefill_ratios"])
    rows = [
        [
            a,
            f"{v['median']:.2f}",
            "1.00" if a == "full" else ratio_cell(ratios[a]),
            f"{d['peak_memory_bytes'][a] / 2**20:,.0f}",
        ]
        for a, v in d["prefill_s"].items()
    ]
    decode = ", ".join(f"{a} {ms(v)} ms" for a, v in d["decode_ms"].items())
    step = f"Decode step at budget: {decode}; kvzip / qfilters {ratio_cell(d['decode_ratios'][0])}."
    title = "KVzip's cost: the reconstruction pass against a plain prefill"
    return section(
        title, d, intro, table(["arm", "prefill s", "ratio to full", "peak MiB"], rows), step
    )
