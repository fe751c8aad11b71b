"""KVzip's cost: a prompt prefilled and reconstructed, against a plain prefill, then decode.

In process, 512-token prefill chunks. Arms interleaved: ``full`` (the reference),
``qfilters`` (evicting as it reads), ``kvzip`` (kept whole, then the reconstruction pass and
the eviction), ``full_again`` (A/A) and ``full_mlx`` (the full cache on MLX's own attention
instead of the blocked CPU attention every other arm runs, ``--attention mlx``); then the
decode step at budget, kvzip over qfilters.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import mlx.core as mx

from bench.arms import decode_timer, prefill
from bench.data import prompt_tokens
from bench.harness import interleave, open_run, parse, parser, pyplot, ratios, save_plot, summaries
from bench.report import ms, plots, ratio_cell, speed_header, table
from qfserve.engine.kv.attention import set_blocked
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.kvzip import compress

ARMS = ("full", "qfilters", "kvzip", "full_again", "full_mlx")
EVICTING = ("qfilters", "kvzip")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, reps=3, prompt=(2048, 200, "prompt tokens"), budget=(256, 32),
               steps=(32, 4, "decode steps timed"))  # fmt: skip
    args = parse(p, argv)
    n, budget, steps = args.prompt, args.budget, args.steps
    sm = open_run("kvzip_cost", args, argv)
    model, tokens, repeat = sm.model, prompt_tokens(sm, n), sm.repeat
    configs = {
        "full": CacheConfig(method="full"),
        "qfilters": CacheConfig(method="qfilters", budget=budget, recent=budget // 4),
        "kvzip": CacheConfig(method="kvzip", budget=budget, recent=budget // 4),
    }
    peaks: dict[str, int] = {}
    filled: dict[str, list] = {}

    def prefill_seconds(name: str) -> float:
        config = configs[name.removesuffix("_again").removesuffix("_mlx")]
        caches = make_caches(model, config, filters=None if config.method == "full" else sm.filters)
        mx.reset_peak_memory()
        set_blocked(not name.endswith("_mlx"))
        tic = time.perf_counter()
        try:
            prefill(model, caches, tokens)
            if config.method == "kvzip":
                compress(model, caches, tokens, repeat)
        finally:
            set_blocked(True)
        elapsed = time.perf_counter() - tic
        peaks[name] = mx.get_peak_memory()
        filled[name] = caches
        return elapsed

    arms = {a: partial(prefill_seconds, a) for a in ARMS}
    runs = interleave(arms, args.reps, progress=sm.log.rounds("prefill"))
    kept = {a: filled[a][0].size() for a in EVICTING}
    timers = {a: decode_timer(model, filled[a], steps, hold=False) for a in EVICTING}
    steps_ms = interleave(timers, args.reps, progress=sm.log.rounds("decode"))
    settings = {"prompt_tokens": n, "prefill_chunk": 512, "budget": budget, "recent": budget // 4,
                "reps": args.reps, "decode_steps": steps, "kept_rows_after_prefill": kept}  # fmt: skip
    result = {
        "settings": settings,
        "prefill_s": summaries(runs),
        "prefill_ratios": ratios(runs, "full", ARMS[1:]),
        "peak_memory_bytes": peaks,
        "decode_ms": summaries(steps_ms),
        "decode_ratios": ratios(steps_ms, "qfilters", ["kvzip"]),
    }
    fig, ax = pyplot().subplots(1, 2, figsize=(9, 3.4))
    ax[0].bar(ARMS, [result["prefill_s"][a]["median"] for a in ARMS],
              color=["black", "tab:blue", "darkgoldenrod", "black", "gray"])  # fmt: skip
    ax[0].set(ylabel="prefill seconds (median)", title=f"{n}-token prompt, budget {budget}")
    ax[1].bar(EVICTING, [result["decode_ms"][a]["median"] for a in EVICTING],
              color=["tab:blue", "darkgoldenrod"])  # fmt: skip
    ax[1].set(ylabel="ms per decode step (median)", title="decode at budget")
    result["plots"] = [save_plot(fig, args.out, "kvzip_cost")]
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    s = d["settings"]
    lines = speed_header("KVzip's cost: the reconstruction pass against a plain prefill", d)
    lines += [
        f"In process: a {s['prompt_tokens']}-token prompt prefilled in {s['prefill_chunk']}-token "
        f"chunks; budget {s['budget']}, recent {s['recent']}, {s['reps']} interleaved rounds. "
        "Prefill ratios are to `full` (`full_again`: the A/A copy; `full_mlx`: the full cache "
        "on MLX's own attention, every other arm on the blocked CPU attention); the decode step "
        f"({s['decode_steps']} steps at budget) is kvzip's over Q-Filters'.",
        "",
    ]
    by_arm = {r["arm"]: r for r in d["prefill_ratios"]}
    lines += table(["arm", "prefill s", "ratio to full", "peak MiB"], [
        [a, f"{v['median']:.2f}", "1.00" if a == "full" else ratio_cell(by_arm[a]),
         f"{d['peak_memory_bytes'][a] / 2**20:,.0f}"] for a, v in d["prefill_s"].items()])  # fmt: skip
    decode = ", ".join(f"{a} {ms(v)} ms" for a, v in d["decode_ms"].items())
    lines += ["", f"Decode step at budget: {decode}; kvzip / qfilters "
              f"{ratio_cell(d['decode_ratios'][0])}."]  # fmt: skip
    return [*lines, *plots(d), ""]
