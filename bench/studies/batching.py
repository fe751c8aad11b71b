"""Continuous batching: aggregate decode tokens/s and TTFT under 1-16 concurrent streams.

qfserve batching (``--max-batch 16``), qfserve one at a time (``--max-batch 1``) and
``mlx_lm.server``, each sent bursts of ``c`` streamed requests (ours mixing methods and
budgets; EOS banned). Aggregate tok/s spans the first first token to the last end; steady
tok/s only the span where every stream decodes. Ratios to one-at-a-time; ``batched_b`` = A/A.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np

from bench.data import chat_content, eos_ban
from bench.harness import (
    StreamTiming,
    interleave,
    log2_axis,
    open_run,
    parse,
    parser,
    pyplot,
    ratios,
    save_plot,
    stream_chat,
    summaries,
    summary,
)
from bench.report import plots, speed_header, table
from bench.studies.multiturn import start_servers

ARMS = ("serial", "batched_a", "theirs", "batched_b")
COLUMNS = {  # what each burst measures, and its column in the table
    "tokens_per_s": "decode tok/s",
    "steady_tokens_per_s": "steady tok/s",
    "e2e_tokens_per_s": "e2e tok/s",
    "ttft_p50_s": "TTFT p50 s",
    "ttft_p99_s": "TTFT p99 s",
}
METRICS = (*COLUMNS, "wall_s")
MIXES = (  # what qfserve's streams ask for, in turn
    {"kv_method": "qfilters", "qfilters_budget": 512},
    {"kv_method": "full"},
    {"kv_method": "knorm", "qfilters_budget": 256, "qfilters_recent": 64},
    {"kv_method": "streaming", "qfilters_budget": 256},
)


def steady_rate(streams: list[tuple[float, StreamTiming]]) -> float | None:
    """Text chunks per second, all streams together, while every one of them is decoding
    (None when no such span exists: one stream ended before another began)."""
    times = [[sent + t for t in timing.chunk_times] for sent, timing in streams]
    lo, hi = max(ts[0] for ts in times), min(ts[-1] for ts in times)
    if hi <= lo:
        return None
    return sum(sum(lo < t <= hi for t in ts) for ts in times) / (hi - lo)


def plot(result: dict[str, Any], out: Any) -> list[str]:
    rows = result["rows"]
    fig, (a1, a2) = pyplot().subplots(1, 2, figsize=(10, 3.8))
    for n in sorted({r["prompt_tokens"] for r in rows}):
        mine = [r for r in rows if r["prompt_tokens"] == n]
        x = [r["streams"] for r in mine]
        for arm in ARMS:
            label = f"{arm}, prompt {n}"
            a1.plot(x, [r["tokens_per_s"][arm]["median"] for r in mine], "o-", label=label)
            a2.plot(x, [r["ttft_p99_s"][arm]["median"] for r in mine], "o-", label=label)
    a1.set(title="aggregate decode tokens/s", xlabel="concurrent streams")
    a2.set(title="TTFT p99 (s)", xlabel="concurrent streams", yscale="log")
    for ax in (a1, a2):
        log2_axis(ax, sorted({r["streams"] for r in rows}))
        ax.legend(fontsize=8)
    return [save_plot(fig, out, "batching")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, reps=1, max_tokens=(64, 8), streams=([1, 4, 8, 16], [1, 2, 4]),
               prompts=([256, 2048], [32, 96]))  # fmt: skip
    args = parse(p, argv)
    max_tokens, counts, lengths = args.max_tokens, args.streams, args.prompts
    sm = open_run("batching", args, argv)
    bias = eos_ban(sm)
    seq = itertools.count()

    def burst(client: httpx.Client, url: str, name: str, n: int, c: int):
        ours = name != "theirs"

        def one(i: int) -> tuple[float, StreamTiming]:
            nonce = f"[{next(seq):05d}-{name[:6]}] "
            body = {
                "model": sm.loaded.name if ours else str(sm.folder),
                "messages": [{"role": "user", "content": chat_content(sm, n, nonce)}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "logit_bias": bias,
                **(MIXES[i % len(MIXES)] if ours else {}),
            }
            sent = time.perf_counter()
            return sent, stream_chat(client, url, body)

        def run() -> dict:
            tic = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                streams = list(pool.map(one, range(c)))
            wall = time.perf_counter() - tic
            first = min(sent + t.ttft for sent, t in streams)
            last = max(sent + t.total for sent, t in streams)
            ttfts = [t.ttft for _, t in streams]
            return {
                "wall_s": wall,
                "tokens_per_s": sum(t.completion_tokens - 1 for _, t in streams) / (last - first),
                "steady_tokens_per_s": steady_rate(streams),
                "e2e_tokens_per_s": sum(t.completion_tokens for _, t in streams) / wall,
                "ttft_p50_s": float(np.percentile(ttfts, 50)),
                "ttft_p99_s": float(np.percentile(ttfts, 99)),
            }

        return run

    def speedup(rows: list[dict], n: int, key: str = "tokens_per_s") -> dict[int, float] | None:
        """Batched tokens/s at each stream count over one stream, at prompt ``n``."""
        mine = {r["streams"]: r[key]["batched_a"]["median"] for r in rows
                if r["prompt_tokens"] == n and r[key]["batched_a"]}  # fmt: skip
        return None if 1 not in mine else {c: v / mine[1] for c, v in mine.items()}

    def write(rows: list[dict], complete: bool) -> dict[str, Any]:
        """The results so far: written after every row, so a stopped run keeps its rows."""
        settings = {
            "reps": args.reps, "max_tokens": max_tokens, "streams": counts, "prompts": lengths,
            "mixes_ours": list(MIXES), "temperature": 0, "eos_banned": True,
            "serial": "qfserve --max-batch 1", "batched": "qfserve --max-batch 16",
            "theirs": "python -m mlx_lm.server (its defaults: batched decoding, full KVCache)",
        }  # fmt: skip
        result = {
            "complete": complete,
            "settings": settings,
            "rows": rows,
            "speedup_over_one_stream": {n: speedup(rows, n) for n in lengths},
            "steady_speedup_over_one_stream": {
                n: speedup(rows, n, "steady_tokens_per_s") for n in lengths
            },
        }
        result["plots"] = plot(result, args.out)
        return sm.save(result, echo=complete)

    rows = []
    with contextlib.ExitStack() as stack:
        sm.log("starting qfserve (--max-batch 1 and 16) and mlx_lm.server")
        procs = start_servers(stack, sm.folder, {
            "serial": ("qfserve", "--max-batch", "1", "--max-queue", "64"),
            "batched": ("qfserve", "--max-batch", "16", "--max-queue", "64"),
            "theirs": ("mlx_lm",),
        })  # fmt: skip
        client = stack.enter_context(httpx.Client(limits=httpx.Limits(max_connections=64)))
        urls = {"serial": procs["serial"].url, "batched_a": procs["batched"].url,
                "theirs": procs["theirs"].url, "batched_b": procs["batched"].url}  # fmt: skip
        for n, c in itertools.product(lengths, counts):
            arms = {a: burst(client, urls[a], a, n, c) for a in ARMS}
            label = f"prompt {n}, {c} streams"
            runs = interleave(  # one warm-up round, before the first burst only
                arms, args.reps, warmup=int(not rows), progress=sm.log.rounds(label)
            )
            row: dict = {"prompt_tokens": n, "streams": c}
            for key in METRICS:
                values = {a: [r[key] for r in v] for a, v in runs.items()}
                if any(x is None for v in values.values() for x in v):  # no steady span
                    row[key] = {a: None if None in v else summary(v) for a, v in values.items()}
                    continue
                row[key] = summaries(values)
                row[f"{key}_ratios"] = ratios(values, "serial", ARMS[1:])
            rows.append(row)
            write(rows, complete=False)
            sm.log(f"{label}: " + ", ".join(
                f"{a} {row['tokens_per_s'][a]['median']:.1f} tok/s" for a in ARMS))  # fmt: skip

    return write(rows, complete=True)


def render(d: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    s = d["settings"]
    lines = speed_header("Continuous batching: concurrent streams", d)
    lines += [
        f"Streamed chat requests of one prompt length sent at once, greedy, {s['max_tokens']} "
        f"tokens (EOS banned); ours mix methods and budgets. Arms: {s['serial']} (serial), "
        f"{s['batched']} (batched_a, and batched_b as the A/A copy), {s['theirs']} (theirs). "
        "Decode tokens/s is aggregate: tokens after each stream's first, over the span from "
        "the first first token to the last stream's end; steady tokens/s counts only the "
        "span in which every stream is decoding (from the last first token to the first end).",
        "",
    ]
    rows = [
        [r["prompt_tokens"], r["streams"], a, *(_median(r, key, a) for key in COLUMNS)]
        for r in d["rows"]
        for a in r["tokens_per_s"]
    ]
    lines += table(["prompt", "streams", "arm", *COLUMNS.values()], rows)
    for key, what in (
        ("speedup_over_one_stream", "decode"),
        ("steady_speedup_over_one_stream", "steady decode"),
    ):
        for n, sp in (d.get(key) or {}).items():
            if sp:
                lines += ["", f"Prompt {n}: batched {what} tokens/s over one stream: " + ", ".join(
                    f"{c} streams {v:.2f}×" for c, v in sp.items())]  # fmt: skip
    return lines + [*plots(d), ""]


def _median(row: dict[str, Any], key: str, arm: str) -> str:
    """A cell: the median of ``key`` for ``arm`` ('' where there is none: no steady span, or
    older results without the steady rate)."""
    stats = (row.get(key) or {}).get(arm)
    return "" if stats is None else f"{stats['median']:.2f}"
