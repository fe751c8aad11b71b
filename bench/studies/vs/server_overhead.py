"""What serving adds: a streamed chat request in process (plain mlx-lm generation, the
floor), through the engine's in-process ``Worker``, and through ``qfserve`` over loopback HTTP."""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any

import httpx
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from bench import clients, timing
from bench.arms import make_caches
from bench.data import chat_content, eos_ban
from bench.report import ms, ratio_cell, section, table
from bench.run import start
from bench.studies.vs.vs_mlx_lm import distinct, per_arm, speed_plot
from qfserve import testing as servers
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.serving.config import DEFAULT_PREFILL_CHUNK
from qfserve.engine.text.prompts import encode_prompt
from qfserve.engine.text.requests import Delta, GenerationRequest, SamplingParams

# (arm, reference): the A/A pairs, then what the worker, HTTP and both add
PAIRS = (
    ("in_process_b", "in_process_a"),
    ("http_b", "http_a"),
    ("worker", "in_process_a"),
    ("http_a", "worker"),
    ("http_a", "in_process_a"),
)
PANELS = (("ttft_s", 1e3, "TTFT ms"), ("itl_s", 1e3, "inter-token latency ms"))  # key, scale, title


def style(arm: str) -> dict[str, Any]:
    """A bar's colour by what it goes through, the A/A copies paler."""
    color = {"in_": "C0", "wor": "C2", "htt": "C1"}[arm[:3]]
    return {"color": color, "alpha": 0.6 if arm.endswith("_b") else 1.0}


def in_process(sm, request: GenerationRequest):
    """A callable generating like the worker does, timed the way the HTTP client is."""

    def run() -> clients.StreamTiming:
        tic = time.perf_counter()
        prompt, n = encode_prompt(sm.loaded, request)
        caches = make_caches(sm.model, request.cache, filters=sm.filters)
        processors = make_logits_processors(dict(request.sampling.logit_bias))
        ttft, chunks = None, 0
        for gen in stream_generate(
            sm.model,
            sm.tokenizer,
            prompt,
            max_tokens=n,
            sampler=make_sampler(0.0, top_p=1.0),
            logits_processors=processors,
            prompt_cache=caches,
            prefill_step_size=DEFAULT_PREFILL_CHUNK,
        ):
            if gen.text:
                chunks += 1
                ttft = ttft or time.perf_counter() - tic
        total = time.perf_counter() - tic
        return clients.StreamTiming(
            ttft or total, total, gen.generation_tokens, len(prompt), chunks
        )

    return run


def through_worker(worker: Any, loop: asyncio.AbstractEventLoop, request: GenerationRequest):
    """A callable submitting ``request`` to the in-process worker and timing its events."""

    async def one() -> clients.StreamTiming:
        tic = time.perf_counter()
        ttft, chunks = None, 0
        async for event in clients.worker_events(worker, request):
            if isinstance(event, Delta) and event.text:
                chunks += 1
                ttft = ttft or time.perf_counter() - tic
        total = time.perf_counter() - tic
        counts = (event.completion_tokens, event.prompt_tokens)  # the last event: Finished
        return clients.StreamTiming(ttft or total, total, *counts, chunks, event.kv_cache)

    return lambda: loop.run_until_complete(one())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start(
        "server_overhead",
        argv,
        __doc__,
        reps=7,
        max_tokens=(64, 8),
        prompts=([256, 1000], [64], "prompt tokens"),
        budget=(512, 32, "Q-Filters budget"),
    )
    args = sm.args
    bias = eos_ban(sm)
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0,
        logit_bias=tuple((int(k), v) for k, v in bias.items()),
    )
    sm.log(f"starting qfserve on {sm.folder.name} and an in-process worker")
    worker = clients.start_worker(sm, model=str(sm.folder))
    loop = asyncio.new_event_loop()
    rows = []
    try:
        with servers.serve("qfserve", model=sm.folder) as (url,), httpx.Client() as client:
            sm.log(
                f"serving at {url}; {args.reps} reps, prompts {args.prompts}, "
                f"{args.max_tokens} tokens"
            )
            for n in args.prompts:
                messages = [{"role": "user", "content": chat_content(sm, n)}]
                # Reuse off: every round sends the same prompt, and a kept cache would answer it.
                request = GenerationRequest(
                    kind="chat",
                    sampling=sampling,
                    reuse=False,
                    messages=tuple(messages),
                    cache=CacheConfig(method="qfilters", budget=args.budget),
                )
                body = {
                    "model": sm.loaded.name,
                    "messages": messages,
                    "logit_bias": bias,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "kv_method": "qfilters",
                    "qfilters_budget": args.budget,
                    "qfilters_reuse": False,
                }
                local = in_process(sm, request)
                remote = partial(clients.stream_chat, client, url, body)
                arms = {
                    "in_process_a": local,
                    "worker": through_worker(worker, loop, request),
                    "http_a": remote,
                    "in_process_b": local,
                    "http_b": remote,
                }
                runs = timing.interleave(arms, args.reps, progress=sm.log.rounds(f"prompt {n}"))
                ttft, itl = per_arm(runs, "ttft"), per_arm(runs, "itl")
                rows.append(
                    {
                        "prompt_tokens": runs["in_process_a"][0].prompt_tokens,
                        "completion_tokens": distinct(runs, "completion_tokens"),
                        "prompt_tokens_seen": distinct(runs, "prompt_tokens"),
                        "ttft_s": timing.summaries(ttft),
                        "itl_s": timing.summaries(itl),
                        "ttft_ratios": [timing.ratio_row(ttft, a, b) for a, b in PAIRS],
                        "itl_ratios": [timing.ratio_row(itl, a, b) for a, b in PAIRS],
                        "kv_cache_http": runs["http_a"][-1].kv_cache,
                    }
                )
    finally:
        worker.stop()
        loop.close()
    result = {
        "settings": {
            "reps": args.reps,
            "max_tokens": args.max_tokens,
            "method": "qfilters",
            "budget": args.budget,
            "n_sink": 4,
            "recent": 0,
            "temperature": 0,
            "eos_banned": True,
            "client": "httpx streaming, SSE parsed on the client",
            "host": servers.HOST,
        },
        "rows": rows,
    }
    title = f"HTTP vs worker vs in-process, {args.max_tokens} tokens"
    result["plots"] = speed_plot(result, args.out, "server_overhead", PANELS, style, title)
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"{s['max_tokens']} tokens generated (EOS banned), Q-Filters budget {s['budget']}, "
        f"greedy; {s['reps']} interleaved rounds. `in_process`: encode + `make_caches` + "
        "`stream_generate` in the bench process; `worker`: the engine's `Worker` (queue, model "
        "thread, event loop) in process; `http`: `qfserve` over loopback. TTFT = first non-empty "
        "text; ITL = (end − first) / (tokens − 1)."
    )
    blocks: list[str | list[str]] = [intro]
    for r in d["rows"]:
        times = [[k, ms(r["ttft_s"][k], 1e3, 1), ms(r["itl_s"][k], 1e3, 2)] for k in r["ttft_s"]]
        pairs = [
            [f"{t['arm']} / {t['reference']}", ratio_cell(t), ratio_cell(i)]
            for t, i in zip(r["ttft_ratios"], r["itl_ratios"], strict=True)
        ]
        blocks.append(f"Prompt {r['prompt_tokens']} tokens:")
        blocks += [
            table(["arm", "TTFT ms", "ITL ms"], times),
            table(["ratio", "TTFT", "ITL"], pairs),
        ]
    title = "Server overhead: streamed HTTP vs the worker vs in-process"
    return section(title, d, *blocks, [])  # [], a blank line before the plots
