"""The physical limit: measured memory bandwidth against the bytes a decode step reads.

Bandwidth is the larger median of a ``numpy.copyto`` (2x bytes) and a float64 sum (1x) over
buffers far larger than the caches; decode at the maximum context reads every weight once
plus the kept KV (our cache's own row copies are a separate column).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from bench.arms import caches_for, decode_timer, kv_stats, prefill
from bench.data import prompt_tokens
from bench.harness import (
    MiB,
    Progress,
    interleave,
    open_run,
    parse,
    parser,
    pyplot,
    ratios,
    save_plot,
    summary,
)
from bench.report import ms, plots, ratio_cell, speed_header, table

BUDGETS = (256, 512)


def measure_bandwidth(mib: int, reps: int, progress) -> dict:
    """GB/s (1e9 bytes/s) of a copy and of a read-only pass over ``mib`` MiB buffers."""
    src = np.random.default_rng(0).random(mib * MiB // 8)  # float64; also pages the buffer in
    dst = np.empty_like(src)
    np.copyto(dst, src)
    copy, read = [], []
    for i in range(reps + 1):
        tic = time.perf_counter()
        np.copyto(dst, src)
        t_copy = time.perf_counter() - tic
        tic = time.perf_counter()
        src.sum()
        t_read = time.perf_counter() - tic
        copy_gbps, read_gbps = 2 * src.nbytes / t_copy / 1e9, src.nbytes / t_read / 1e9
        progress(f"bandwidth round {i + 1}/{reps + 1}: copy {copy_gbps:.1f} GB/s, "
                 f"read {read_gbps:.1f} GB/s")  # fmt: skip
        if i:  # the first round warms up
            copy.append(copy_gbps)
            read.append(read_gbps)
    return {
        "buffer_mib": mib,
        "copy_gbps": summary(copy),
        "read_gbps": summary(read),
        "reference_gbps": max(statistics.median(copy), statistics.median(read)),
        "method": "numpy copyto (2x bytes) and float64 sum (1x bytes), median of reps "
        "after one warm-up, single process",
    }


def plot(result, out) -> list[str]:
    rows = result["decode"]
    fig, ax = pyplot().subplots(figsize=(6.4, 3.8))
    names = [r["arm"] for r in rows]
    bars = ax.bar(names, [r["percent_of_bandwidth"] for r in rows],
                  color=["C0" if n.startswith("full") else "C2" for n in names])  # fmt: skip
    ax.bar_label(bars, [f"{r['bytes_per_token'] / MiB:.1f} MiB/tok" for r in rows], fontsize=8)
    ax.set(ylabel="% of measured bandwidth",
           title=f"Decode at context {result['settings']['context']}: bytes read / step time "
           f"vs {result['bandwidth']['reference_gbps']:.1f} GB/s")  # fmt: skip
    return [save_plot(fig, out, "bandwidth")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, reps=7, buffer_mib=(512, 64), steps=(32, 4, "decode steps per timing"))
    args = parse(p, argv)
    progress = Progress("bandwidth")  # the clock starts before the model loads
    bandwidth = measure_bandwidth(args.buffer_mib, args.reps, progress)
    reference = bandwidth["reference_gbps"]

    sm = open_run("bandwidth", args, argv)
    context = 256 if args.quick else sm.context_length
    budgets = (32, 128) if args.quick else BUDGETS
    tokens = prompt_tokens(sm, context)
    progress(f"decode at context {context}: prefilling")
    arms, caches = {}, {}
    for name, arm in [("full_a", "full"), ("full_b", "full"), *((f"b{b}", b) for b in budgets)]:
        caches[name] = caches_for(sm, arm)
        prefill(sm.model, caches[name], tokens)
        arms[name] = decode_timer(sm.model, caches[name], args.steps, hold=True)
    samples = interleave(arms, args.reps, progress=progress.rounds("decode"))

    weights = sm.describe()["weight_bytes"]
    rows = []
    for name, times in samples.items():
        kv = kv_stats(caches[name])["kept_bytes"]
        read = weights + kv
        seconds = statistics.median(times) / 1e3
        achieved = read / seconds / 1e9
        # Ours: concatenate (read + write of the kept rows) and gather (again) every step.
        moved = read + (4 * kv if name.startswith("b") else 0)
        rows.append({
            "arm": name,
            "ms_per_step": summary(times),
            "weight_bytes": weights,
            "kv_bytes_read": kv,
            "bytes_per_token": read,
            "achieved_gbps": achieved,
            "percent_of_bandwidth": 100 * achieved / reference,
            "bytes_moved_incl_cache_copies": moved,
            "percent_incl_cache_copies": 100 * moved / seconds / 1e9 / reference,
            "floor_ms_at_bandwidth": read / (reference * 1e9) * 1e3,
        })  # fmt: skip
    result = {
        "settings": {"reps": args.reps, "steps": args.steps, "context": context,
                     "budgets": list(budgets), "method": "qfilters", "n_sink": 4, "recent": 0,
                     "beyond_trained_context": context > sm.context_length},
        "bandwidth": bandwidth,
        "decode": rows,
        "ratios": ratios(samples, "full_a", [a for a in arms if a != "full_a"]),
        "caveat": "the weights (a few MiB to tens of MiB) may stay partly in the CPU's last-level "
        "cache between steps, and per-step dispatch overhead dominates a model this small; "
        "a percentage far below 100 says decode is overhead-bound, not bandwidth-bound",
    }  # fmt: skip
    result["plots"] = plot(result, args.out)
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    b = d["bandwidth"]
    lines = speed_header("The physical limit: memory bandwidth vs bytes read per token", d)
    lines += [
        f"Bandwidth ({b['method']}, {b['buffer_mib']} MiB buffers): copy "
        f"{ms(b['copy_gbps'], 1.0, 1)} GB/s, read {ms(b['read_gbps'], 1.0, 1)} GB/s; "
        f"reference {b['reference_gbps']:.1f} GB/s. Decode at context {d['settings']['context']}.",
        "",
    ]
    to_full = {r["arm"]: r for r in d["ratios"]}
    rows = [[r["arm"], ms(r["ms_per_step"]), ratio_cell(to_full[r["arm"]]) if r["arm"] in to_full else "—",
             f"{r['bytes_per_token'] / MiB:.2f}", f"{r['achieved_gbps']:.2f}",
             f"{r['percent_of_bandwidth']:.1f}", f"{r['percent_incl_cache_copies']:.1f}",
             f"{r['floor_ms_at_bandwidth']:.3f}"] for r in d["decode"]]  # fmt: skip
    lines += table(["arm", "ms/step", "ratio to full", "MiB read/token", "GB/s reached",
                    "% of bandwidth", "% incl. cache copies", "bandwidth floor ms"], rows)  # fmt: skip
    return lines + ["", f"Caveat: {d['caveat']}.", *plots(d), ""]
