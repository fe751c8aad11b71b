"""Latency under an open load: requests arrive by a Poisson process while others decode.

For each rate (requests per second), each arm is sent the same seeded arrival times, prompt
lengths (256 to 4,096 tokens) and, for qfserve, a mix of methods and budgets, for
``--duration`` seconds; every request is a streamed chat of ``--max-tokens`` greedy tokens
(EOS banned). Per arm and rate: p50/p95 time to first token, p50/p95 inter-token latency
(every gap between text chunks, pooled), aggregate completion tokens/s over the span from
the first arrival to the last answer, and whether the arm kept up: a queue that grows shows
as the last third's TTFTs rising well above the first third's (``ttft_drift`` > 2) or
answers still missing when the span ends plus a drain. Arms: qfserve ``--max-batch 16`` and
llama.cpp's ``llama-server -np 16`` on the same GGUF file, one after the other per rate.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np

from bench import clients, plots
from bench.data import chat_content, eos_ban
from bench.report import section, table
from bench.run import start
from bench.studies.batching.batching import MAX_BATCH, MIXES, launches, start_servers

LENGTHS = (256, 512, 1024, 2048, 4096)
QUICK_LENGTHS = (32, 64, 96)  # --quick: the tiny model's context
DRAIN_S = 120.0  # after the last arrival, the longest an arm is waited for


def arrivals(
    rate: float, duration: float, seed: int, lengths: tuple[int, ...]
) -> list[tuple[float, int, int]]:
    """(seconds after the start, prompt tokens, mix index) of each request: exponential gaps."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append((t, rng.choice(lengths), rng.randrange(len(MIXES))))


def run_arm(sm: Any, url: str, arm: str, model: str, plan: list[tuple[float, int, int]]) -> dict:
    """Send ``plan`` to ``url``; the figures of what came back."""
    results: list[tuple[float, clients.StreamTiming | None]] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def one(i: int, at: float, n: int, mix: int) -> None:
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": chat_content(sm, n, f"[{arm}{i:04d}] ")}],
            "max_tokens": sm.args.max_tokens,
            "temperature": 0,
            "logit_bias": eos_ban(sm),
            **(MIXES[mix] if arm == "ours" else {}),
        }
        try:
            with httpx.Client(timeout=DRAIN_S + sm.args.duration) as client:
                timing: clients.StreamTiming | None = clients.stream_chat(client, url, body)
        except (RuntimeError, httpx.HTTPError):
            timing = None
        with lock:
            results.append((at, timing))

    with ThreadPoolExecutor(max(1, len(plan))) as pool:
        for i, (at, n, mix) in enumerate(plan):
            pool.submit(one, i, at, n, mix)
    span = time.perf_counter() - t0
    done = [(at, t) for at, t in results if t is not None]
    ttfts = [t.ttft for _, t in sorted(done, key=lambda x: x[0])]
    gaps = [b - a for _, t in done for a, b in zip(t.chunk_times, t.chunk_times[1:], strict=False)]
    third = max(1, len(ttfts) // 3)
    drift = (
        float(np.median(ttfts[-third:]) / max(1e-9, np.median(ttfts[:third]))) if ttfts else None
    )
    return {
        "sent": len(plan),
        "answered": len(done),
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p95_s": _pct(ttfts, 95),
        "itl_p50_s": _pct(gaps, 50),
        "itl_p95_s": _pct(gaps, 95),
        "tokens_per_s": sum(t.completion_tokens for _, t in done) / span if done else 0.0,
        "span_s": span,
        "ttft_drift": drift,
        "kept_up": bool(len(done) == len(plan) and drift is not None and drift <= 2.0),
    }


def join_stall(sm: Any, url: str, arm: str, model: str, lengths: tuple[int, ...]) -> dict:
    """8 streams decoding, then a prompt of the longest length joins: the longest gap the
    8 see between text chunks while it is read, against their median gap before it, and the
    time one prefill chunk of 512 tokens takes alone (what the scheduler bounds a stall by)."""
    longest, chunk = max(lengths), min(512, max(lengths) // 4)

    def body(n: int, tokens: int, tag: str) -> dict[str, Any]:
        content = chat_content(sm, n, f"[{arm}-{tag}] ")
        return {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": tokens,
            "temperature": 0,
            "logit_bias": eos_ban(sm),
        }

    with httpx.Client(timeout=600) as client:
        alone = clients.stream_chat(client, url, body(chunk, 2, "chunk")).ttft
    t0 = time.perf_counter()
    joined: dict[str, float] = {}

    def stream(i: int) -> tuple[float, clients.StreamTiming]:
        began = time.perf_counter() - t0
        with httpx.Client(timeout=600) as c:
            return began, clients.stream_chat(c, url, body(32, 4 * sm.args.max_tokens, f"s{i}"))

    def joiner() -> None:
        time.sleep(3.0)
        joined["sent"] = time.perf_counter() - t0
        with httpx.Client(timeout=600) as c:
            ttft = clients.stream_chat(c, url, body(longest, 2, "join")).ttft
        joined["first"] = joined["sent"] + ttft

    with ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(stream, i) for i in range(8)]
        pool.submit(joiner).result()
        streams = [f.result() for f in futures]
    before, during = [], []
    for began, timing in streams:
        times = [began + t for t in timing.chunk_times]
        for a, b in zip(times, times[1:], strict=False):
            if b <= joined["sent"]:
                before.append(b - a)
            elif a < joined["first"]:
                during.append(b - a)
    return {
        "join_tokens": longest,
        "chunk_tokens": chunk,
        "chunk_alone_s": alone,
        "median_gap_before_s": float(np.median(before)) if before else None,
        "max_gap_during_s": max(during) if during else None,
        "joiner_ttft_s": joined["first"] - joined["sent"],
    }


def _pct(values: list[float], q: int) -> float | None:
    return float(np.percentile(values, q)) if values else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start(
        "open_load",
        argv,
        __doc__,
        reps=1,
        max_tokens=(64, 8),
        rates=([0.05, 0.1, 0.2], [0.5], "requests per second"),
        duration=(180.0, 12.0, "seconds of arrivals per rate and arm"),
    )
    args = sm.args
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        slot = max(lengths) + args.max_tokens + 64
        started, gguf = launches(sm, slot=slot, serial=False)
        procs = start_servers(stack, sm.folder, started, gguf)
        arms = {"ours": procs["batched"].url}
        if "llama" in procs:
            arms["llama"] = procs["llama"].url
        names = {"ours": sm.loaded.name, "llama": str(gguf)}
        joins = {}
        for arm, url in arms.items():
            joins[arm] = join_stall(sm, url, arm, names[arm], lengths)
            sm.log(f"a {max(lengths)}-token prompt joining 8 streams of {arm}: {joins[arm]}")
        for rate in args.rates:
            plan = arrivals(rate, args.duration, int(rate * 1000), lengths)
            row: dict[str, Any] = {"rate": rate, "requests": len(plan)}
            for arm, url in arms.items():
                sm.log(f"rate {rate}/s: {arm}, {len(plan)} requests over {args.duration:.0f} s")
                row[arm] = run_arm(sm, url, arm, names[arm], plan)
                sm.log(f"  {arm}: {_line(row[arm])}")
            rows.append(row)
            write(sm, rows, joins, list(arms), lengths, complete=False)
    return write(sm, rows, joins, list(arms), lengths, complete=True)


def _line(r: dict[str, Any]) -> str:
    def f(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}"

    return (
        f"{r['answered']}/{r['sent']} answered, TTFT p50 {f(r['ttft_p50_s'])} p95 "
        f"{f(r['ttft_p95_s'])} s, ITL p50 {f(r['itl_p50_s'])} p95 {f(r['itl_p95_s'])} s, "
        f"{r['tokens_per_s']:.1f} tok/s, drift {f(r['ttft_drift'])}"
    )


def write(
    sm: Any,
    rows: list[dict],
    joins: dict[str, dict],
    arms: list[str],
    lengths: tuple[int, ...],
    complete: bool,
) -> dict[str, Any]:
    a = sm.args
    result: dict[str, Any] = {
        "complete": complete,
        "settings": {
            "rates": a.rates,
            "duration_s": a.duration,
            "max_tokens": a.max_tokens,
            "lengths": list(lengths),
            "arms": arms,
            "mixes_ours": list(MIXES),
            "ours": f"qfserve --max-batch {MAX_BATCH}",
            "llama": f"llama.cpp's llama-server -np {MAX_BATCH} on the same GGUF file",
        },
        "rows": rows,
        "join": joins,
    }
    fig, axes = plots.subplots(1, 3, figsize=(14, 3.8))
    for ax, key, title in zip(
        axes[0],
        ("ttft_p95_s", "itl_p95_s", "tokens_per_s"),
        ("TTFT p95 (s)", "inter-token p95 (s)", "tokens/s"),
        strict=True,
    ):
        for arm in arms:
            ax.plot(
                [r["rate"] for r in rows], [r[arm][key] or np.nan for r in rows], "o-", label=arm
            )
        ax.set(title=title, xlabel="requests per second")
        ax.legend(fontsize=8)
    result["plots"] = [plots.save_plot(fig, a.out, "open_load")]
    return sm.save(result, echo=complete)


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"Poisson arrivals at each rate for {s['duration_s']:.0f} s, prompts of "
        f"{', '.join(map(str, s['lengths']))} tokens drawn uniformly, {s['max_tokens']} greedy "
        f"tokens each (EOS banned), the same arrivals for each arm; ours mix methods and "
        f"budgets. Arms: {s['ours']} (ours), {s['llama']} (llama). ITL: every gap between text "
        "chunks, pooled. Drift: median TTFT of the last third of arrivals over the first "
        "third's; kept up: every request answered and drift ≤ 2."
    )

    def f(x: float | None, digits: int = 2) -> str:
        return "" if x is None else f"{x:.{digits}f}"

    rows = [
        [
            r["rate"],
            arm,
            f"{r[arm]['answered']}/{r[arm]['sent']}",
            f(r[arm]["ttft_p50_s"]),
            f(r[arm]["ttft_p95_s"]),
            f(r[arm]["itl_p50_s"], 3),
            f(r[arm]["itl_p95_s"], 3),
            f(r[arm]["tokens_per_s"], 1),
            f(r[arm]["ttft_drift"]),
            "yes" if r[arm]["kept_up"] else "no",
        ]
        for r in d["rows"]
        for arm in s["arms"]
    ]
    headers = ["rate /s", "arm", "answered", "TTFT p50 s", "TTFT p95 s", "ITL p50 s"]
    headers += ["ITL p95 s", "tok/s", "drift", "kept up"]
    joins = [
        f"A {j['join_tokens']}-token prompt joining 8 decoding streams ({arm}): their longest "
        f"gap while it was read {f(j['max_gap_during_s'])} s (median gap before "
        f"{f(j['median_gap_before_s'], 3)} s); one {j['chunk_tokens']}-token prefill alone "
        f"{f(j['chunk_alone_s'])} s; the newcomer's first token after {f(j['joiner_ttft_s'])} s."
        for arm, j in d.get("join", {}).items()
    ]
    title = "Open load: Poisson arrivals against llama-server"
    return section(title, d, intro, table(headers, rows), *joins)
