"""The physical limit: measured memory bandwidth against the bytes a decode step reads
(every weight once plus the kept KV; our cache's own row copies are a separate column)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from bench import cli, plots, resume, timing
from bench.arms import caches_for, decode_timer, kv_stats, prefill
from bench.cli import MiB
from bench.data import prompt_tokens
from bench.report import ms, ratio_cell, section, table
from bench.run import open_run


def measure_bandwidth(mib: int, reps: int, log: resume.Progress) -> dict:
    """GB/s (1e9 bytes/s) of a copy and of a read-only pass over ``mib`` MiB buffers."""
    src = np.random.default_rng(0).random(mib * MiB // 8)  # float64; also pages the buffer in
    dst = np.empty_like(src)
    np.copyto(dst, src)

    def gbps(fn: Any, nbytes: int) -> Any:
        def run() -> float:
            tic = time.perf_counter()
            fn()
            return nbytes / (time.perf_counter() - tic) / 1e9

        return run

    arms = {
        "copy": gbps(lambda: np.copyto(dst, src), 2 * src.nbytes),
        "read": gbps(src.sum, src.nbytes),
    }
    samples = timing.interleave(arms, reps, progress=log.rounds("bandwidth"))
    copy, read = samples["copy"], samples["read"]
    return {
        "buffer_mib": mib,
        "copy_gbps": timing.summary(copy),
        "read_gbps": timing.summary(read),
        "reference_gbps": max(statistics.median(copy), statistics.median(read)),
        "method": "numpy copyto (2x bytes) and float64 sum (1x bytes), median of reps "
        "after one warm-up, single process",
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = cli.parser(
        __doc__,
        file="bandwidth",
        reps=7,
        buffer_mib=(512, 64),
        steps=(32, 4, "decode steps per timing"),
    )
    args = cli.parse(p, argv)
    progress = resume.Progress("bandwidth")  # the clock starts before the model loads
    bandwidth = measure_bandwidth(args.buffer_mib, args.reps, progress)
    reference = bandwidth["reference_gbps"]
    sm = open_run("bandwidth", args, argv)
    context = 256 if args.quick else sm.context_length
    budgets = (32, 128) if args.quick else (256, 512)
    tokens = prompt_tokens(sm, context)
    progress(f"decode at context {context}: prefilling")
    arms, kv = {}, {}
    for name, arm in [("full_a", "full"), ("full_b", "full"), *((f"b{b}", b) for b in budgets)]:
        caches = caches_for(sm, arm)
        prefill(sm.model, caches, tokens)
        arms[name] = decode_timer(sm.model, caches, args.steps, hold=True)
        kv[name] = kv_stats(caches)["kept_bytes"]
    samples, _, ratios = timing.compare_arms(sm, arms, "decode", "full_a")
    weights, rows = sm.describe()["weight_bytes"], []
    for name, times in samples.items():
        read = weights + kv[name]
        seconds = statistics.median(times) / 1e3
        achieved = read / seconds / 1e9
        # Ours: concatenate (read + write of the kept rows) and gather (again) every step.
        moved = read + (4 * kv[name] if name.startswith("b") else 0)
        rows.append(
            {
                "arm": name,
                "ms_per_step": timing.summary(times),
                "weight_bytes": weights,
                "kv_bytes_read": kv[name],
                "bytes_per_token": read,
                "achieved_gbps": achieved,
                "percent_of_bandwidth": 100 * achieved / reference,
                "bytes_moved_incl_cache_copies": moved,
                "percent_incl_cache_copies": 100 * moved / seconds / 1e9 / reference,
                "floor_ms_at_bandwidth": read / (reference * 1e9) * 1e3,
            }
        )
    result = {
        "settings": {
            "reps": args.reps,
            "steps": args.steps,
            "context": context,
            "budgets": list(budgets),
            "method": "qfilters",
            "n_sink": 4,
            "recent": 0,
            "beyond_trained_context": context > sm.context_length,
        },
        "bandwidth": bandwidth,
        "decode": rows,
        "ratios": ratios,
        "caveat": "the weights (a few MiB to tens of MiB) may stay partly in the CPU's last-level "
        "cache between steps, and per-step dispatch overhead dominates a model this small; "
        "a percentage far below 100 says decode is overhead-bound, not bandwidth-bound",
    }
    fig, [[ax]] = plots.subplots(figsize=(6.4, 3.8))
    bars = ax.bar(
        [r["arm"] for r in rows],
        [r["percent_of_bandwidth"] for r in rows],
        color=["C0" if r["arm"].startswith("full") else "C2" for r in rows],
    )
    ax.bar_label(bars, [f"{r['bytes_per_token'] / MiB:.1f} MiB/tok" for r in rows], fontsize=8)
    ax.set(
        ylabel="% of measured bandwidth",
        title=f"Decode at context {context}: bytes read / step time vs {reference:.1f} GB/s",
    )
    result["plots"] = [plots.save_plot(fig, args.out, "bandwidth")]
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    b = d["bandwidth"]
    intro = (
        f"Bandwidth ({b['method']}, {b['buffer_mib']} MiB buffers): copy "
        f"{ms(b['copy_gbps'], 1.0, 1)} GB/s, read {ms(b['read_gbps'], 1.0, 1)} GB/s; "
        f"reference {b['reference_gbps']:.1f} GB/s. Decode at context {d['settings']['context']}."
    )
    to_full = {r["arm"]: ratio_cell(r) for r in d["ratios"]}
    rows = [
        [
            r["arm"],
            ms(r["ms_per_step"]),
            to_full.get(r["arm"], "—"),
            f"{r['bytes_per_token'] / MiB:.2f}",
            f"{r['achieved_gbps']:.2f}",
            f"{r['percent_of_bandwidth']:.1f}",
            f"{r['percent_incl_cache_copies']:.1f}",
            f"{r['floor_ms_at_bandwidth']:.3f}",
        ]
        for r in d["decode"]
    ]
    headers = [
        "arm",
        "ms/step",
        "ratio to full",
        "MiB read/token",
        "GB/s reached",
        "% of bandwidth",
        "% incl. cache copies",
        "bandwidth floor ms",
    ]
    title = "The physical limit: memory bandwidth vs bytes read per token"
    return section(title, d, intro, table(headers, rows), f"Caveat: {d['caveat']}.")
