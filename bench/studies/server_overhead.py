"""What serving adds: a streamed chat request over HTTP, through the worker, and in process.

The same prompt and caches as plain mlx-lm generation (the floor), through an in-process
:class:`~qfserve.engine.serving.worker.Worker`, and through ``qfserve`` over loopback HTTP;
EOS banned, reuse off, arms interleaved with A/A copies of in-process and HTTP.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from bench.arms import make_caches
from bench.data import chat_content, eos_ban
from bench.harness import (
    StreamTiming,
    errorbars,
    interleave,
    open_run,
    parse,
    parser,
    pyplot,
    ratio_row,
    save_plot,
    stream_chat,
    summaries,
)
from bench.report import ms, plots, ratio_cell, speed_header, table
from qfserve import testing as servers
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.serving.config import DEFAULT_PREFILL_CHUNK, EngineConfig
from qfserve.engine.serving.worker import Worker
from qfserve.engine.text.prompts import encode_prompt
from qfserve.engine.text.requests import Delta, Failed, Finished, GenerationRequest, SamplingParams

ARMS = ("in_process_a", "worker", "http_a", "in_process_b", "http_b")
PAIRS = (
    ("in_process_b", "in_process_a"),
    ("http_b", "http_a"),
    ("worker", "in_process_a"),
    ("http_a", "worker"),
    ("http_a", "in_process_a"),
)


def make_request(content: str, max_tokens: int, config: CacheConfig, bias: dict):
    return GenerationRequest(
        kind="chat",
        sampling=SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            logit_bias=tuple((int(k), v) for k, v in bias.items()),
        ),
        cache=config,
        messages=({"role": "user", "content": content},),
        reuse=False,  # every round sends the same prompt: a kept cache would answer it
    )


def in_process(sm, request: GenerationRequest):
    """A callable generating like the worker does, timed the way the HTTP client is."""
    config = request.cache

    def run() -> StreamTiming:
        tic = time.perf_counter()
        prompt, n = encode_prompt(sm.loaded, request)
        caches = make_caches(
            sm.loaded.model, config, filters=sm.filters if config.method == "qfilters" else None
        )
        sampler = make_sampler(0.0, top_p=1.0)
        processors = make_logits_processors(dict(request.sampling.logit_bias))
        ttft, chunks, last = None, 0, None
        for gen in stream_generate(
            sm.loaded.model,
            sm.loaded.tokenizer,
            prompt,
            max_tokens=n,
            sampler=sampler,
            logits_processors=processors,
            prompt_cache=caches,
            prefill_step_size=DEFAULT_PREFILL_CHUNK,
        ):
            if gen.text:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - tic
            last = gen
        total = time.perf_counter() - tic
        return StreamTiming(
            ttft=ttft or total,
            total=total,
            completion_tokens=last.generation_tokens,
            prompt_tokens=len(prompt),
            chunks=chunks,
        )

    return run


def through_worker(worker: Worker, loop: asyncio.AbstractEventLoop, request: GenerationRequest):
    """A callable submitting ``request`` to the in-process worker and timing its events."""

    async def one() -> StreamTiming:
        tic = time.perf_counter()
        job = worker.submit(request, loop)
        ttft, chunks = None, 0
        while True:
            event = await job.next_event()
            if isinstance(event, Delta) and event.text:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - tic
            elif isinstance(event, Finished):
                total = time.perf_counter() - tic
                return StreamTiming(
                    ttft=ttft or total,
                    total=total,
                    completion_tokens=event.completion_tokens,
                    prompt_tokens=event.prompt_tokens,
                    chunks=chunks,
                    kv_cache=event.kv_cache,
                )
            elif isinstance(event, Failed):
                raise RuntimeError(f"worker: {event.kind}: {event.message}")

    return lambda: loop.run_until_complete(one())


def start_worker(sm) -> Worker:
    worker = Worker(EngineConfig(model=str(sm.folder)), loader=lambda _ref: sm.loaded)
    worker.start()
    deadline = time.monotonic() + 60
    while not worker.ready:
        if worker.status not in ("loading", "ready") or time.monotonic() > deadline:
            raise RuntimeError(f"in-process worker not ready: {worker.status} {worker.error}")
        time.sleep(0.05)
    return worker


def plot(result, out) -> list[str]:
    plt = pyplot()
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.16
    colors = {"in_": "C0", "wor": "C2", "htt": "C1"}
    for ax, key, title in (
        (axes[0], "ttft_s", "TTFT ms"),
        (axes[1], "itl_s", "inter-token latency ms"),
    ):
        for i, arm in enumerate(ARMS):
            x = [j + (i - 2) * width for j in range(len(rows))]
            med, err = errorbars([r[key][arm] for r in rows])
            ax.bar(
                x,
                [m * 1e3 for m in med],
                width,
                yerr=[[e * 1e3 for e in s] for s in err],
                capsize=3,
                color=colors[arm[:3]],
                alpha=1.0 if not arm.endswith("_b") else 0.6,
                label=arm,
            )
        ax.set_xticks(range(len(rows)), [f"prompt {r['prompt_tokens']}" for r in rows])
        ax.set(title=title + " (median, IQR)")
        ax.legend(fontsize=8)
    fig.suptitle(f"HTTP vs worker vs in-process, {result['settings']['max_tokens']} tokens")
    return [save_plot(fig, out, "server_overhead")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, reps=7, prompts=([256, 1000], [64], "prompt tokens"), max_tokens=(64, 8),
               budget=(512, 32, "Q-Filters budget"))  # fmt: skip
    args = parse(p, argv)
    reps, prompts, max_tokens, budget = args.reps, args.prompts, args.max_tokens, args.budget
    sm = open_run("server_overhead", args, argv)
    progress = sm.log
    config = CacheConfig(method="qfilters", budget=budget)
    bias = eos_ban(sm)
    progress(f"starting qfserve on {sm.folder.name} and an in-process worker")
    worker = start_worker(sm)
    loop = asyncio.new_event_loop()
    rows = []
    try:
        with servers.serve("qfserve", model=sm.folder) as (url,), httpx.Client() as client:
            progress(f"serving at {url}; {reps} reps, prompts {prompts}, {max_tokens} tokens")
            for n in prompts:
                content = chat_content(sm, n)
                request = make_request(content, max_tokens, config, bias)
                body = {
                    "model": sm.loaded.name,
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "logit_bias": bias,
                    "kv_method": "qfilters",
                    "qfilters_budget": budget,
                    "qfilters_reuse": False,
                }
                local = in_process(sm, request)
                remote = lambda body=body: stream_chat(client, url, body)  # noqa: E731
                arms = {
                    "in_process_a": local,
                    "worker": through_worker(worker, loop, request),
                    "http_a": remote,
                    "in_process_b": local,
                    "http_b": remote,
                }
                runs = interleave(arms, reps, progress=progress.rounds(f"prompt {n}"))
                ttft = {k: [t.ttft for t in v] for k, v in runs.items()}
                itl = {k: [t.itl for t in v] for k, v in runs.items()}
                rows.append(
                    {
                        "prompt_tokens": runs["in_process_a"][0].prompt_tokens,
                        "completion_tokens": {
                            k: sorted({t.completion_tokens for t in v}) for k, v in runs.items()
                        },
                        "prompt_tokens_seen": {
                            k: sorted({t.prompt_tokens for t in v}) for k, v in runs.items()
                        },
                        "ttft_s": summaries(ttft),
                        "itl_s": summaries(itl),
                        "ttft_ratios": [ratio_row(ttft, a, b) for a, b in PAIRS],
                        "itl_ratios": [ratio_row(itl, a, b) for a, b in PAIRS],
                        "kv_cache_http": runs["http_a"][-1].kv_cache,
                    }
                )
    finally:
        worker.stop()
        loop.close()
    result = {
        "settings": {
            "reps": reps,
            "max_tokens": max_tokens,
            "method": "qfilters",
            "budget": budget,
            "n_sink": 4,
            "recent": 0,
            "temperature": 0,
            "eos_banned": True,
            "client": "httpx streaming, SSE parsed on the client",
            "host": servers.HOST,
        },
        "rows": rows,
    }
    result["plots"] = plot(result, args.out)
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    s = d["settings"]
    lines = speed_header("Server overhead: streamed HTTP vs the worker vs in-process", d)
    lines.append(
        f"{s['max_tokens']} tokens generated (EOS banned), Q-Filters budget {s['budget']}, "
        f"greedy; {s['reps']} interleaved rounds. `in_process`: encode + `make_caches` + "
        "`stream_generate` in the bench process; `worker`: the engine's `Worker` (queue, model "
        "thread, event loop) in process; `http`: `qfserve` over loopback. TTFT = first non-empty "
        "text; ITL = (end − first) / (tokens − 1)."
    )
    lines.append("")
    for r in d["rows"]:
        lines += [f"Prompt {r['prompt_tokens']} tokens:", ""]
        lines += table(
            ["arm", "TTFT ms", "ITL ms"],
            [[k, ms(r["ttft_s"][k], 1e3, 1), ms(r["itl_s"][k], 1e3, 2)] for k in r["ttft_s"]],
        )
        lines.append("")
        lines += table(
            ["ratio", "TTFT", "ITL"],
            [
                [f"{t['arm']} / {t['reference']}", ratio_cell(t), ratio_cell(i)]
                for t, i in zip(r["ttft_ratios"], r["itl_ratios"], strict=True)
            ],
        )
        lines.append("")
    return lines + [*plots(d), ""]
