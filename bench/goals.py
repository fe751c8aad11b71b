"""The goals the default model's evidence is read against, each beside what was measured
(read from ``bench/results/smollm2/*.json``); a goal is met only when every number it names is."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = tuple[str, str, str]  # goal, measured, verdict
Judge = Callable[[Path], tuple[str, "bool | str"]]  # measured, met (or a verdict of its own)

# Each goal as the page states it, in the page's order; its judge is the function of that name.
STATEMENTS = {
    "retrieval": "Pass-key retrieval at 4k-8k: Q-Filters ≥ 95% / 90% / 80% at 8× / 16× / 32×, above K-norm and streaming at every compression",
    "niah": "Needle in prose (paper: 99% at 32× on 8B models): Q-Filters at 8×-32×",
    "perplexity": "Perplexity at budgets 256-1,024 with a recent window: Q-Filters closes ≥ 50% of the streaming-to-full gap (paper: up to 65% less perplexity drop than StreamingLLM)",
    "decode": "Decode at 8k: budget 512 ≥ 2× faster per step than the full cache; peak memory flat in context with eviction",
    "vs_llama_cpp": "Against llama.cpp's server on the same GGUF: TTFT with Q-Filters ≤ 1× at every length, with the full cache ≤ 1.5× at 8k; Q-Filters (512) decode tokens/s ≥ 1× at 8k, ≥ 0.75× at 4k, ≥ 0.5× at 256 tokens",
    "vs_llama_cpp_q4_k_m": "The same file as Q4_K_M (llama-quantize --allow-requantize), against llama.cpp's llama-server: Q-Filters (512) decode tokens/s ≥ 1× at 4k and ≥ 0.8× at 256 tokens; TTFT ≤ 1× at 2k and 8k",
    "memory": "Resident memory after a 2k-token request, same GGUF and context as `llama-server -c 8192 -np 1`: ≤ 1.6× theirs and ≤ the file + the KV held + 350 MB, at Q4_1, at Q4_K_M and on a 1.1B-parameter Q4_K_M file",
    "batching": "Continuous batching: aggregate decode tokens/s at 8 streams ≥ 3× one stream's "
    "and ≥ 1.2× llama-server's on the same file; 16 streams not below 8",
}
GOALS: list[Callable[[Path], Row]] = []


class NotRun(Exception):
    """What a goal reads has not run; the message says what is missing."""


def load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def has_results(folder: Path) -> bool:
    return folder.is_dir() and any(folder.glob("*.json"))


def by_arm(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["arm"]: r for r in rows}


def medians(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each arm's median in a study's ratio rows."""
    return {r["arm"]: r["median"] for r in rows}


def _by_length(rows: list[dict[str, Any]]) -> tuple[dict[int, dict[str, float]], ...]:
    """Per prompt length of a ``vs`` study's rows: each arm's TTFT and tokens/s ratio."""
    return tuple(
        {r["prompt_tokens"]: medians(r[key]) for r in rows} for key in ("ttft_ratios", "tps_ratios")
    )


def grid_mean(niah: dict[str, Any], arm: str, key: str) -> float | None:
    """The needle study's exact match of ``arm`` at ``key`` (a ratio or ``-``) over its grid."""
    vals = [v for row in niah["grid"].get(arm, {}).get(key) or [] for v in row if v is not None]
    return sum(vals) / len(vals) if vals else None


def _need(folder: Path, name: str) -> dict[str, Any]:
    data = load(folder / f"{name}.json")
    if not data:
        raise NotRun("not run yet")
    return data


def _goal(judge: Judge) -> Callable[[Path], Row]:
    """Register ``judge`` as the goal of its name: a row of its statement, measure and verdict."""

    @functools.wraps(judge)
    def row(folder: Path) -> Row:
        try:
            measured, ok = judge(folder)
        except NotRun as e:
            return STATEMENTS[judge.__name__], str(e), "not run"
        verdict = ok if isinstance(ok, str) else "**met**" if ok else "**not met**"
        return STATEMENTS[judge.__name__], measured, verdict

    GOALS.append(row)
    return row


def _accuracy(data: dict[str, Any], lengths: list[str], arm: str, ratio: int) -> float | None:
    """Pass-key accuracy of ``arm`` at ``ratio``, pooled over ``lengths`` (documents)."""
    hits = n = 0
    for length in lengths:
        cell = data["results"].get(length, {}).get("arms", {}).get(arm, {}).get(str(ratio))
        if cell:
            hits += cell["accuracy"] * cell["n"]
            n += cell["n"]
    return hits / n if n else None


@_goal
def retrieval(folder: Path) -> tuple[str, bool]:
    data = load(folder / "retrieval.json")
    lengths = [n for n in ("4096", "8192") if data and n in data["results"]]
    if not data or not lengths:
        raise NotRun("not run at 4k-8k yet")
    targets, parts, ok = {8: 0.95, 16: 0.90, 32: 0.80}, [], True
    arms = ("qfilters/r25", "knorm/r25", "streaming/r0")
    for ratio in data["ratios"]:
        q, k, s = (_accuracy(data, lengths, a, ratio) for a in arms)
        if q is None or k is None or s is None:
            continue
        ok &= q > k and q > s and q >= targets.get(ratio, 0.0)
        parts.append(f"{ratio}×: {q:.2f} (K-norm {k:.2f}, streaming {s:.2f})")
    return "Q-Filters " + "; ".join(parts), ok


@_goal
def niah(folder: Path) -> tuple[str, str]:
    data = _need(folder, "niah")
    full = grid_mean(data, "full", "-")
    parts = [f"full cache {full:.2f}" if full is not None else "full cache not run"]
    for ratio in (8, 16, 32):
        if (q := grid_mean(data, "qfilters/r25", str(ratio))) is not None:
            parts.append(f"{ratio}×: {q:.2f}")
    lengths = ", ".join(f"{n // 1024}k" for n in data["lengths"])
    return f"exact match over {lengths}: " + "; ".join(parts), "reported (no target)"


@_goal
def perplexity(folder: Path) -> tuple[str, bool]:
    parts, ok = [], True
    for dataset, res in _need(folder, "perplexity")["results"].items():
        for budget, arms in res["budgets"].items():
            if int(budget) < 256 or "qfilters/r25" not in arms:
                continue
            gap = arms["qfilters/r25"].get("gap_closed_vs_streaming")
            ok &= gap is None or gap >= 0.5
            parts.append(
                f"{dataset} {budget}: " + ("no gap to close" if gap is None else f"{gap:.0%}")
            )
    if not parts:
        raise NotRun("no budget ≥ 256 in the run")
    return "gap closed: " + "; ".join(parts), ok


@_goal
def decode(folder: Path) -> tuple[str, bool]:
    data = _need(folder, "decode")
    top = max(data["sweep"], key=lambda r: r["context"])
    ratios = by_arm(top["ratios"])
    if "b512" not in ratios:
        raise NotRun("budget 512 not in the run")
    speedup = 1 / ratios["b512"]["median"]

    def growth(arm: str) -> float:
        mine = [m for m in data["memory"] if m["arm"] == arm]
        peaks = [max(m["prefill_peak_bytes"], m["decode_peak_bytes"]) for m in mine]
        return max(peaks) / min(peaks)

    return (
        f"at {top['context']}: {speedup:.2f}× (A/A {ratios['full_b']['median']:.3f}); "
        f"budget-512 peak memory grows {growth('b512'):.2f}× from {data['sweep'][0]['context']} "
        f"to {top['context']} tokens (full cache {growth('full'):.2f}×)",
        speedup >= 2 and growth("b512") < 1.5,
    )


@_goal
def vs_llama_cpp(folder: Path) -> tuple[str, bool]:
    ttft, tps = _by_length(_need(folder, "vs_llama_cpp")["rows"])
    short, longest = min(tps), max(tps)
    mid = min(tps, key=lambda n: abs(n - 4096))
    evicting = [ttft[n]["ours_qfilters"] for n in ttft]
    aa = [tps[n]["theirs_b"] for n in tps]
    return (
        f"TTFT with Q-Filters {min(evicting):.2f}-{max(evicting):.2f}×, full at {longest} "
        f"tokens {ttft[longest]['ours_full']:.2f}×; Q-Filters tokens/s "
        f"{tps[longest]['ours_qfilters']:.2f}× at {longest}, {tps[mid]['ours_qfilters']:.2f}× at "
        f"{mid}, {tps[short]['ours_qfilters']:.2f}× at {short} (A/A "
        f"{min(aa):.2f}-{max(aa):.2f}×)",
        max(evicting) <= 1
        and ttft[longest]["ours_full"] <= 1.5
        and tps[longest]["ours_qfilters"] >= 1
        and tps[mid]["ours_qfilters"] >= 0.75
        and tps[short]["ours_qfilters"] >= 0.5,
    )


@_goal
def vs_llama_cpp_q4_k_m(folder: Path) -> tuple[str, bool]:
    ttft, tps = _by_length(_need(folder / "q4_k_m", "vs_llama_cpp")["rows"])
    short, mid = min(tps), min(tps, key=lambda n: abs(n - 4096))
    long_ = [n for n in tps if n >= 2048]
    aa = [tps[n]["theirs_b"] for n in tps]
    return (
        f"Q-Filters tokens/s {tps[mid]['ours_qfilters']:.2f}× at {mid}, "
        f"{tps[short]['ours_qfilters']:.2f}× at {short}; TTFT with Q-Filters "
        + ", ".join(f"{ttft[n]['ours_qfilters']:.2f}× at {n}" for n in sorted(long_))
        + f" (A/A {min(aa):.2f}-{max(aa):.2f}×)",
        tps[mid]["ours_qfilters"] >= 1
        and tps[short]["ours_qfilters"] >= 0.8
        and all(ttft[n]["ours_qfilters"] <= 1 for n in long_),
    )


@_goal
def memory(folder: Path) -> tuple[str, bool]:
    rows = [r for r in _need(folder, "memory")["rows"] if r["when"] == 2048]
    if not rows:
        raise NotRun("no 2,048-token request in the run")
    parts = [
        f"{r['file'].removesuffix('.gguf')}: {r['ours_rss'] / 2**20:,.0f} MiB, "
        f"{r['ratio']:.2f}× theirs, bound {r['bound'] / 2**20:,.0f} MiB"
        for r in rows
    ]
    return "; ".join(parts), all(r["meets_ratio"] and r["meets_bound"] for r in rows)


@_goal
def batching(folder: Path) -> tuple[str, bool]:
    data = load(folder / "batching.json")
    if not data or not data["rows"]:
        raise NotRun("not run yet")
    if "llama" not in data["settings"].get("arms", ()):
        raise NotRun("the latest run has no llama-server arm (bench/reference/llama_cpp_tools.sh)")
    parts, ok = [], True
    for n, speedups in sorted(data["speedup_over_one_stream"].items(), key=lambda kv: int(kv[0])):
        over = (data.get("over_llama") or {}).get(n) or {}
        steady = (data.get("steady_speedup_over_one_stream") or {}).get(n) or {}
        steady_llama = (data.get("steady_over_llama") or {}).get(n) or {}
        if not speedups or "8" not in speedups or "8" not in over:
            ok = False
            continue
        rows = [r for r in data["rows"] if r["prompt_tokens"] == int(n)]
        at = {r["streams"]: r["tokens_per_s"]["batched_a"]["median"] for r in rows}
        sixteen = at[16] >= at[8] if 16 in at else None
        parts.append(
            f"prompt {n}: 8 streams {speedups['8']:.2f}× one stream, {over['8']:.2f}× "
            f"llama-server's (while all decode: {steady.get('8', float('nan')):.2f}×, "
            f"{steady_llama.get('8', float('nan')):.2f}×)"
            + ("" if sixteen is None else f"; 16 streams {at[16] / at[8]:.2f}× 8's")
        )
        ok &= speedups["8"] >= 3 and over["8"] >= 1.2 and sixteen is not False
    return "; ".join(parts) or "no 8-stream row", ok


def render_goals(folder: Path) -> list[str]:
    """``## Goals`` as a markdown table (empty when the folder has no results)."""
    if not has_results(folder):
        return []
    return [
        "## Goals on the default model, against what was measured",
        "",
        "Read from the JSON files below when this page was rendered.",
        "",
        "| goal | measured | verdict |",
        "|---|---|---|",
        *(f"| {g} | {m} | {v} |" for g, m, v in (goal(folder) for goal in GOALS)),
        "",
    ]
