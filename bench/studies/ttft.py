"""Time to first token with eviction against a full cache.

One request as the engine runs it (``make_caches``, then ``generate_step`` to the first
token), arms interleaved: full (twice, A/A), Q-Filters at each budget, and the full cache on
MLX's own attention (``full_mlx``, ``--attention mlx``) where every other arm runs the blocked
CPU attention (:mod:`qfserve.engine.kv.blocked`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from bench.arms import caches_for, kv_stats
from bench.data import prompt_tokens
from bench.harness import (
    command_line,
    errorbars,
    interleave,
    log2_axis,
    machine,
    open_run,
    parse,
    parser,
    pyplot,
    ratios,
    save_plot,
    summaries,
)
from bench.report import ms, plots, ratio_cell, speed_header, table
from qfserve.engine.kv.attention import set_blocked


def ttft_timer(sm, arm, tokens: list[int], kept: dict, blocked: bool):
    """A callable returning seconds to the first token of one fresh request."""
    prompt = mx.array(tokens)
    greedy = make_sampler(0.0)

    def run() -> float:
        set_blocked(blocked)
        try:
            tic = time.perf_counter()
            caches = caches_for(sm, arm)
            gen = generate_step(prompt, sm.model, max_tokens=1, sampler=greedy, prompt_cache=caches)
            next(gen)  # yields y.item(): the token is evaluated
            seconds = time.perf_counter() - tic
            gen.close()
        finally:
            set_blocked(True)
        kept.update(kv_stats(caches))
        return seconds

    return run


# What must match for an earlier run's rows to sit beside this one's: not the load, nor the
# platform string (it names the VM's kernel build); each row's ratios are its own run's.
SAME_MACHINE = ("processor", "mlx", "device", "blas", "cpu_count")


def earlier_rows(path, result: dict, measured: set[int]) -> list[dict]:
    """Rows of other prompt lengths from an earlier run on the same weights with the same
    settings, kept beside this run's (a long prompt can be added without rerunning the
    short ones); each row says which command measured it."""
    if result["quick"] or not path.is_file():
        return []
    now = machine()
    old = json.loads(path.read_text())
    same = (
        not old.get("quick")
        and old.get("settings") == result["settings"]
        and old["model"].get("weights_sha1") == result["model"].get("weights_sha1")
        and old["model"].get("path") == result["model"].get("path")
        and all(old["machine"].get(k) == now.get(k) for k in SAME_MACHINE)
    )
    if not same:
        return []
    kept = [r for r in old["rows"] if r["prompt_tokens"] not in measured]
    for r in kept:
        r.setdefault("measured_by", {"command": old["command"], "when": old["when"][:10]})
    return kept


def plot(result, out) -> list[str]:
    rows = result["rows"]
    x = [r["prompt_tokens"] for r in rows]
    fig, ax = pyplot().subplots(figsize=(6.4, 4))
    for arm in ("full_a", *(f"b{b}" for b in result["settings"]["budgets"])):
        med, err = errorbars([r["ttft_s"][arm] for r in rows])
        ax.errorbar(x, [m * 1e3 for m in med], yerr=[[e * 1e3 for e in side] for side in err],
                    marker="o", capsize=3, label="full" if arm == "full_a" else f"Q-Filters {arm}")  # fmt: skip
    trained = result["model"]["max_context"]
    ax.axvline(trained, color="grey", ls=":", label=f"trained context {trained}")
    ax.set(xlabel="prompt tokens", ylabel="TTFT ms (median, IQR)", title="Time to first token")
    log2_axis(ax, x, logy=True)
    ax.legend()
    return [save_plot(fig, out, "ttft")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, reps=5, prompts=([1024, 2048, 4096], [64, 256], "prompt tokens"),
               budgets=([256, 512], [32, 128], "Q-Filters budgets"))  # fmt: skip
    args = parse(p, argv)
    sm = open_run("ttft", args, argv)
    sm.log(f"model {sm.loaded.name}, prompts {args.prompts}, budgets {args.budgets}, "
           f"reps {args.reps}")  # fmt: skip
    # (arm, cache, blocked attention): full twice (A/A), each budget, full on MLX's attention
    specs = [("full_a", "full", True), ("full_b", "full", True),
             *((f"b{b}", b, True) for b in args.budgets), ("full_mlx", "full", False)]  # fmt: skip
    rows = []
    for n in args.prompts:
        tokens = prompt_tokens(sm, n)
        kept: dict[str, dict] = {name: {} for name, _, _ in specs}
        arms = {name: ttft_timer(sm, arm, tokens, kept[name], blocked)
                for name, arm, blocked in specs}  # fmt: skip
        samples = interleave(arms, args.reps, progress=sm.log.rounds(f"prompt {n}"))
        rows.append({"prompt_tokens": n, "beyond_trained_context": n > sm.context_length,
                     "ttft_s": summaries(samples),
                     "ratios": ratios(samples, "full_a", [a for a in arms if a != "full_a"]),
                     "kv_after_prefill": kept})  # fmt: skip
    result = {
        "command": command_line("ttft", argv),  # earlier_rows compares these with older runs
        "quick": args.quick,
        "model": sm.describe(),
        "settings": {"reps": args.reps, "budgets": list(args.budgets), "method": "qfilters",
                     "n_sink": 4, "recent": 0, "prefill_step_size": 2048, "sampler": "greedy",
                     "timed": "make_caches + generate_step until the first token is yielded",
                     "attention": "blocked CPU attention; full_mlx: MLX's own"},
        "rows": rows,
    }  # fmt: skip
    for row in rows:
        row["measured_by"] = {"command": result["command"], "when": time.strftime("%Y-%m-%d")}
    rows += earlier_rows(args.out / "ttft.json", result, {r["prompt_tokens"] for r in rows})
    rows.sort(key=lambda r: r["prompt_tokens"])
    result["plots"] = plot(result, args.out)
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    s, budgets = d["settings"], d["settings"]["budgets"]
    lines = speed_header("Time to first token, eviction vs full", d)
    lines += [
        f"Timed: {s['timed']} (prefill step {s['prefill_step_size']}). "
        f"ms, median [IQR] over {s['reps']} interleaved repetitions; ratios to full.",
        "",
    ]

    def cell(t: dict[str, Any], rr: dict[str, Any], arm: str) -> str:
        return f"{t[arm]['median'] * 1e3:.1f} ({ratio_cell(rr[arm])})"

    rows = []
    for r in d["rows"]:
        t, rr = r["ttft_s"], {x["arm"]: x for x in r["ratios"]}
        beyond = " (beyond trained context)" if r["beyond_trained_context"] else ""
        by = r.get("measured_by", {"command": d["command"], "when": d["when"][:10]})
        rows.append([f"{r['prompt_tokens']}{beyond}", ms(t["full_a"], 1e3, 1), ratio_cell(rr["full_b"]),
                     *(cell(t, rr, f"b{b}") for b in budgets),
                     cell(t, rr, "full_mlx") if "full_mlx" in t else "not run",  # an older run's
                     f"`{by['command']}`, {by['when']}"])  # fmt: skip
    lines += table(
        ["prompt tokens", "full ms", "A/A", *(f"budget {b}: ms (ratio)" for b in budgets),
         "full, MLX's attention: ms (ratio)", "measured by"],
        rows,
    )  # fmt: skip
    return lines + [*plots(d), ""]
