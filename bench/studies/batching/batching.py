"""Continuous batching: aggregate decode tokens/s and TTFT under 1-16 concurrent streams,
qfserve batching against qfserve one request at a time, llama.cpp's ``llama-server`` on the
same GGUF file (continuous batching, ``-np`` our ``--max-batch``; where it is built:
``bench/reference/llama_cpp_tools.sh``). Older runs had ``mlx_lm.server`` as ``theirs``; the
comparison with mlx-lm is settled (``bench/ARCHIVE.md``)."""

from __future__ import annotations

import contextlib
import itertools
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench import clients, plots, timing
from bench.data import chat_content, eos_ban
from bench.report import section, table
from bench.run import start
from qfserve import testing as servers

MAX_BATCH = 16  # qfserve's --max-batch and llama-server's -np
COLUMNS = {  # what each burst measures, and its column in the table
    "tokens_per_s": "decode tok/s",
    "steady_tokens_per_s": "steady tok/s",
    "e2e_tokens_per_s": "e2e tok/s",
    "ttft_p50_s": "TTFT p50 s",
    "ttft_p99_s": "TTFT p99 s",
}
MIXES = (  # what qfserve's streams ask for, in turn
    {"kv_method": "qfilters", "qfilters_budget": 512},
    {"kv_method": "full"},
    {"kv_method": "knorm", "qfilters_budget": 256, "qfilters_recent": 64},
    {"kv_method": "streaming", "qfilters_budget": 256},
)
NONCES = itertools.count()


def steady_rate(streams: list[tuple[float, clients.StreamTiming]]) -> float | None:
    """Text chunks per second, all streams together, while every one of them is decoding
    (None when no such span exists: one stream ended before another began)."""
    times = [[sent + t for t in timing.chunk_times] for sent, timing in streams]
    lo, hi = max(ts[0] for ts in times), min(ts[-1] for ts in times)
    if hi <= lo:
        return None
    return sum(sum(lo < t <= hi for t in ts) for ts in times) / (hi - lo)


def burst(sm: Any, client: httpx.Client, url: str, name: str, n: int, c: int, model: str):
    """An arm sending ``c`` streams of about ``n`` prompt tokens at once to ``url``."""
    ours = name in ("serial", "batched_a", "batched_b")

    def one(i: int) -> tuple[float, clients.StreamTiming]:
        content = chat_content(sm, n, f"[{next(NONCES):05d}-{name[:6]}] ")
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": sm.args.max_tokens,
            "temperature": 0,
            "logit_bias": eos_ban(sm),
            **(MIXES[i % len(MIXES)] if ours else {}),
        }
        return time.perf_counter(), clients.stream_chat(client, url, body)

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


def write(sm: Any, rows: list[dict], arms: tuple[str, ...], complete: bool) -> dict[str, Any]:
    """The results so far: written after every row, so a stopped run keeps its rows."""
    a = sm.args

    def speedup(n: int, key: str) -> dict[int, float] | None:
        """Batched tokens/s at each stream count over one stream, at prompt ``n``."""
        mine = {
            r["streams"]: r[key]["batched_a"]["median"]
            for r in rows
            if r["prompt_tokens"] == n and r[key]["batched_a"]
        }
        return None if 1 not in mine else {c: v / mine[1] for c, v in mine.items()}

    def against(n: int, key: str) -> dict[int, float] | None:
        """Batched tokens/s over llama-server's at each stream count, at prompt ``n``."""
        if "llama" not in arms:
            return None
        return {
            r["streams"]: r[key]["batched_a"]["median"] / r[key]["llama"]["median"]
            for r in rows
            if r["prompt_tokens"] == n and r[key]["batched_a"] and r[key]["llama"]
        }

    result = {
        "complete": complete,
        "settings": {
            "reps": a.reps,
            "max_tokens": a.max_tokens,
            "streams": a.streams,
            "prompts": a.prompts,
            "arms": list(arms),
            "mixes_ours": list(MIXES),
            "temperature": 0,
            "eos_banned": True,
            "serial": "qfserve --max-batch 1",
            "batched": f"qfserve --max-batch {MAX_BATCH}",
            "llama": f"llama.cpp's llama-server -np {MAX_BATCH} -c {MAX_BATCH} x (prompt + "
            "tokens), continuous batching, on the same GGUF file",
        },
        "rows": rows,
        "speedup_over_one_stream": {n: speedup(n, "tokens_per_s") for n in a.prompts},
        "steady_speedup_over_one_stream": {n: speedup(n, "steady_tokens_per_s") for n in a.prompts},
        "over_llama": {n: against(n, "tokens_per_s") for n in a.prompts},
        "steady_over_llama": {n: against(n, "steady_tokens_per_s") for n in a.prompts},
    }
    fig, axes = plots.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, title in zip(
        axes[0],
        ("tokens_per_s", "ttft_p99_s"),
        ("aggregate decode tokens/s", "TTFT p99 (s)"),
        strict=True,
    ):
        for n, arm in itertools.product(sorted({r["prompt_tokens"] for r in rows}), arms):
            mine = [r for r in rows if r["prompt_tokens"] == n]
            ax.plot(
                [r["streams"] for r in mine],
                [r[key][arm]["median"] for r in mine],
                "o-",
                label=f"{arm}, prompt {n}",
            )
        yscale = "log" if "ttft" in key else "linear"
        ax.set(title=title, xlabel="concurrent streams", yscale=yscale)
        plots.log2_axis(ax, sorted({r["streams"] for r in rows}))
        ax.legend(fontsize=8)
    result["plots"] = [plots.save_plot(fig, a.out, "batching")]
    return sm.save(result, echo=complete)


def launches(
    sm: Any, *, slot: int, serial: bool = True
) -> tuple[dict[str, tuple[str, ...]], Path | None]:
    """The servers a run starts (qfserve batched, and one at a time with ``serial``;
    llama-server with ``slot`` tokens a sequence where it is built and the model is a GGUF
    file) and the GGUF file llama-server serves."""
    ours = ("--max-queue", "64")
    found: dict[str, tuple[str, ...]] = {
        "batched": ("qfserve", "--max-batch", str(MAX_BATCH), *ours)
    }
    if serial:
        found = {"serial": ("qfserve", "--max-batch", "1", *ours), **found}
    try:
        gguf = servers.gguf_of(sm.args.model)
    except ValueError as no_file:
        gguf = None
        sm.log(f"no llama arm: {no_file}")
    if gguf is not None and servers.llama_tool("llama-server") is None:
        gguf = None
        sm.log("no llama arm: llama-server is not built (bench/reference/llama_cpp_tools.sh)")
    if gguf is not None:
        found["llama"] = ("llama_server", "-np", str(MAX_BATCH), "-c", str(MAX_BATCH * slot))
    return found, gguf


def start_servers(
    stack: contextlib.ExitStack, folder: Path, launched: dict[str, tuple[str, ...]], gguf: Any
) -> dict[str, servers.ServerProcess]:
    """Each server of :func:`launches` (``(kind, *flags)``, qfserve logging warnings only) on
    ``folder``, llama-server on ``gguf``, ready; ``stack`` stops them all as it closes."""
    logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    procs: dict[str, servers.ServerProcess] = {}
    stack.callback(lambda: servers.stop_all(list(procs.values()), 10))
    for name, (kind, *flags) in launched.items():
        quiet = {"log_level": "warning"} if kind == "qfserve" else {}
        model = gguf if name == "llama" else folder
        procs[name] = servers.launch(kind, model, *flags, log=logs / f"{name}.log", **quiet)
    for proc in procs.values():
        servers.wait_ready(proc, 180)
    return procs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start(
        "batching",
        argv,
        __doc__,
        reps=1,
        max_tokens=(64, 8),
        streams=([1, 4, 8, 16], [1, 2, 4]),
        prompts=([256, 2048], [32, 96]),
    )
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        slot = max(sm.args.prompts) + sm.args.max_tokens + 64
        started, gguf = launches(sm, slot=slot)
        sm.log(f"starting {', '.join(started)}")
        procs = start_servers(stack, sm.folder, started, gguf)
        client = stack.enter_context(httpx.Client(limits=httpx.Limits(max_connections=64)))
        arms = ("serial", "batched_a", *(["llama"] if "llama" in procs else []), "batched_b")
        urls = {a: procs[a.removesuffix("_a").removesuffix("_b")].url for a in arms}
        names = {a: str(sm.folder) for a in arms} | {"llama": str(gguf)}
        names |= {a: sm.loaded.name for a in ("serial", "batched_a", "batched_b")}
        for n, c in itertools.product(sm.args.prompts, sm.args.streams):
            bursts = {a: burst(sm, client, urls[a], a, n, c, names[a]) for a in arms}
            label = f"prompt {n}, {c} streams"
            runs = timing.interleave(  # one warm-up round, before the first burst only
                bursts, sm.args.reps, warmup=int(not rows), progress=sm.log.rounds(label)
            )
            row: dict = {"prompt_tokens": n, "streams": c}
            for key in (*COLUMNS, "wall_s"):
                values = {a: [r[key] for r in v] for a, v in runs.items()}
                row[key] = {a: None if None in v else timing.summary(v) for a, v in values.items()}
                if None not in row[key].values():  # else: an arm had no steady span
                    row[f"{key}_ratios"] = timing.ratios(values, "serial", arms[1:])
            rows.append(row)
            write(sm, rows, arms, complete=False)
            speeds = ", ".join(f"{a} {row['tokens_per_s'][a]['median']:.1f} tok/s" for a in arms)
            sm.log(f"{label}: {speeds}")
    return write(sm, rows, arms, complete=True)


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    arms = s.get("arms", list(d["rows"][0]["tokens_per_s"]) if d["rows"] else [])
    intro = (
        f"Streamed chat requests of one prompt length sent at once, greedy, {s['max_tokens']} "
        f"tokens (EOS banned); ours mix methods and budgets. Arms: {s['serial']} (serial), "
        f"{s['batched']} (batched_a, and batched_b as the A/A copy)"
        + "".join(f", {s[a]} ({a})" for a in ("llama", "theirs") if a in arms and a in s)
        + ". "
        "Decode tokens/s is aggregate: tokens after each stream's first, over the span from "
        "the first first token to the last stream's end; steady tokens/s counts only the "
        "span in which every stream is decoding (from the last first token to the first end)."
    )

    def median(row: dict[str, Any], key: str, arm: str) -> str:
        """'' where there is none: no steady span, or older results without the steady rate."""
        stats = (row.get(key) or {}).get(arm)
        return "" if stats is None else f"{stats['median']:.2f}"

    rows = [
        [r["prompt_tokens"], r["streams"], a, *(median(r, k, a) for k in COLUMNS)]
        for r in d["rows"]
        for a in r["tokens_per_s"]
    ]
    blocks: list[str | list[str]] = [
        intro,
        table(["prompt", "streams", "arm", *COLUMNS.values()], rows),
    ]
    for key, what in (
        ("speedup_over_one_stream", "decode tokens/s over one stream"),
        ("steady_speedup_over_one_stream", "steady decode tokens/s over one stream"),
        ("over_llama", "decode tokens/s over llama-server's"),
        ("steady_over_llama", "steady decode tokens/s over llama-server's"),
    ):
        blocks += [
            f"Prompt {n}: batched {what}: "
            + ", ".join(f"{c} streams {v:.2f}×" for c, v in sp.items())
            for n, sp in (d.get(key) or {}).items()
            if sp
        ]
    return section("Continuous batching: concurrent streams", d, *blocks)
