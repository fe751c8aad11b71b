"""Time to first token with eviction against a full cache, as the engine runs a request
(``make_caches``, then ``generate_step``); ``full_mlx``: the full cache on MLX's attention."""

from __future__ import annotations

import json
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from bench import cli, plots, timing
from bench.arms import caches_for, kv_stats
from bench.data import prompt_tokens
from bench.report import by_arm, ms, ratio_cell, section, table
from bench.run import machine, start
from qfserve.engine.kv.attention import set_blocked

# What must match for an earlier run's rows to sit beside this one's: not the load, nor the
# platform string (it names the VM's kernel build); each row's ratios are its own run's.
SAME_MACHINE = ("processor", "mlx", "device", "blas", "cpu_count")


def ttft_timer(sm, arm, tokens: list[int], kept: dict, blocked: bool):
    """A callable returning seconds to the first token of one fresh request."""

    def run() -> float:
        set_blocked(blocked)
        try:
            tic = time.perf_counter()
            caches = caches_for(sm, arm)
            gen = generate_step(
                mx.array(tokens),
                sm.model,
                max_tokens=1,
                sampler=make_sampler(0.0),
                prompt_cache=caches,
            )
            next(gen)  # yields y.item(): the token is evaluated
            seconds = time.perf_counter() - tic
            gen.close()
        finally:
            set_blocked(True)
        kept.update(kv_stats(caches))
        return seconds

    return run


def earlier_rows(path, result: dict, measured: set[int]) -> list[dict]:
    """Rows of other prompt lengths from an earlier run on the same weights, settings and
    machine, kept beside this run's, each saying which command measured it."""
    if result["quick"] or not path.is_file():
        return []
    now, old = machine(), json.loads(path.read_text())
    same = (
        not old.get("quick")
        and old.get("settings") == result["settings"]
        and all(old["model"].get(k) == result["model"].get(k) for k in ("weights_sha1", "path"))
        and all(old["machine"].get(k) == now.get(k) for k in SAME_MACHINE)
    )
    kept = [r for r in old["rows"] if r["prompt_tokens"] not in measured] if same else []
    for r in kept:
        r.setdefault("measured_by", {"command": old["command"], "when": old["when"][:10]})
    return kept


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start(
        "ttft",
        argv,
        __doc__,
        reps=5,
        prompts=([1024, 2048, 4096], [64, 256], "prompt tokens"),
        budgets=([256, 512], [32, 128], "Q-Filters budgets"),
    )
    args = sm.args
    sm.log(
        f"model {sm.loaded.name}, prompts {args.prompts}, budgets {args.budgets}, reps {args.reps}"
    )
    # (arm, cache, blocked attention): full twice (A/A), each budget, full on MLX's attention
    specs = [
        ("full_a", "full", True),
        ("full_b", "full", True),
        *((f"b{b}", b, True) for b in args.budgets),
        ("full_mlx", "full", False),
    ]
    rows = []
    for n in args.prompts:
        tokens = prompt_tokens(sm, n)
        kept: dict[str, dict] = {name: {} for name, _, _ in specs}
        arms = {
            name: ttft_timer(sm, arm, tokens, kept[name], blocked) for name, arm, blocked in specs
        }
        _, stats, ratios = timing.compare_arms(sm, arms, f"prompt {n}", "full_a")
        rows.append(
            {
                "prompt_tokens": n,
                "beyond_trained_context": n > sm.context_length,
                "ttft_s": stats,
                "ratios": ratios,
                "kv_after_prefill": kept,
            }
        )
    result = {
        "command": cli.command_line("ttft", argv),  # earlier_rows compares these with older runs
        "quick": args.quick,
        "model": sm.describe(),
        "settings": {
            "reps": args.reps,
            "budgets": list(args.budgets),
            "method": "qfilters",
            "n_sink": 4,
            "recent": 0,
            "prefill_step_size": 2048,
            "sampler": "greedy",
            "timed": "make_caches + generate_step until the first token is yielded",
            "attention": "blocked CPU attention; full_mlx: MLX's own",
        },
        "rows": rows,
    }
    for row in rows:
        row["measured_by"] = {"command": result["command"], "when": time.strftime("%Y-%m-%d")}
    rows += earlier_rows(args.out / "ttft.json", result, {r["prompt_tokens"] for r in rows})
    rows.sort(key=lambda r: r["prompt_tokens"])
    labels = {"full_a": "full", **{f"b{b}": f"Q-Filters b{b}" for b in args.budgets}}
    series = {v: [r["ttft_s"][k] for r in rows] for k, v in labels.items()}
    x, trained = [r["prompt_tokens"] for r in rows], sm.identity["max_context"]
    result["plots"] = [
        plots.context_plot(
            args.out,
            "ttft",
            x,
            series,
            trained,
            1e3,
            logy=True,
            xlabel="prompt tokens",
            ylabel="TTFT ms (median, IQR)",
            title="Time to first token",
        )
    ]
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    s, budgets = d["settings"], d["settings"]["budgets"]
    intro = (
        f"Timed: {s['timed']} (prefill step {s['prefill_step_size']}). "
        f"ms, median [IQR] over {s['reps']} interleaved repetitions; ratios to full."
    )

    def cell(t: dict[str, Any], rr: dict[str, Any], arm: str) -> str:
        return f"{t[arm]['median'] * 1e3:.1f} ({ratio_cell(rr[arm])})"

    rows = []
    for r in d["rows"]:
        t, rr = r["ttft_s"], by_arm(r["ratios"])
        beyond = " (beyond trained context)" if r["beyond_trained_context"] else ""
        by = r.get("measured_by", {"command": d["command"], "when": d["when"][:10]})
        rows.append(
            [
                f"{r['prompt_tokens']}{beyond}",
                ms(t["full_a"], 1e3, 1),
                ratio_cell(rr["full_b"]),
                *(cell(t, rr, f"b{b}") for b in budgets),
                cell(t, rr, "full_mlx") if "full_mlx" in t else "not run",  # an older run's
                f"`{by['command']}`, {by['when']}",
            ]
        )
    headers = ["prompt tokens", "full ms", "A/A", *(f"budget {b}: ms (ratio)" for b in budgets)]
    headers += ["full, MLX's attention: ms (ratio)", "measured by"]
    return section("Time to first token, eviction vs full", d, intro, table(headers, rows))
